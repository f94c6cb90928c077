"""The pytest plugin: hardware markers skip with a reason, --require-hardware turns that into failure."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from qcheck import hardware
from tests.helpers import INNER

MARKED = """
import pytest

@pytest.mark.fp8_gpu
def test_native_fp8():
    assert True

def test_plain():
    assert True
"""


@pytest.fixture
def marked(pytester):
    pytester.makepyfile(MARKED)
    return pytester


@pytest.mark.skipif(hardware.missing("fp8_gpu") is None, reason="this host has an fp8 GPU")
def test_missing_hardware_skips_with_a_reason_naming_it(marked):
    result = marked.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    # At the test's own line, naming its marker: not a line of the plugin.
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_missing_hardware_skips_with_a_reason_naming_it.py:3: "
                                 "@pytest.mark.fp8_gpu: needs a GPU with native fp8 matmuls*this host has cpu:*"])


@pytest.mark.skipif(hardware.missing("fp8_gpu") is None, reason="this host has an fp8 GPU")
def test_require_hardware_turns_the_skip_into_a_failure(marked):
    result = marked.runpytest("--require-hardware", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)  # it fails in setup, before the test body runs
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*--require-hardware: @pytest.mark.fp8_gpu: needs a GPU with native fp8 matmuls*"])


@pytest.mark.skipif(hardware.missing("fp8_gpu") is None, reason="this host has an fp8 GPU")
def test_require_hardware_naming_other_markers_still_skips_this_one(marked):
    result = marked.runpytest("--require-hardware=gpu,blackwell", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    result = marked.runpytest("--require-hardware=gpu,fp8_gpu", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)


def test_require_hardware_rejects_an_unknown_marker_or_a_swallowed_path(marked):
    result = marked.runpytest("--require-hardware", "test_marked.py", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--require-hardware: unknown marker 'test_marked.py'; known markers: gpu, tpu, "
                                 "fp8_gpu, blackwell (a test path right after the flag*"])


def test_markers_are_registered(pytester):
    result = pytester.runpytest("--markers")
    assert result.ret == 0
    for name in hardware.MARKERS:
        result.stdout.fnmatch_lines([f"@pytest.mark.{name}: needs *"])


def test_unknown_invariant_marker_is_a_usage_error(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.qcheck_invariant("bitwise")
        def test_x(qcheck_case):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret != 0
    output = result.stdout.str() + result.stderr.str()
    from qcheck.suite.invariants import INVARIANTS

    known = ", ".join(inv.name for inv in INVARIANTS)
    assert f"unknown qcheck_invariant 'bitwise'; known invariants: {known}" in output


def test_unknown_hardware_marker_name_is_rejected():
    with pytest.raises(ValueError, match="unknown hardware marker 'h100'; known markers: gpu, tpu"):
        hardware.missing("h100")


class FakeGpu:
    def __init__(self, compute_capability: str | None = None, device_kind: str = "NVIDIA H200"):
        self.platform, self.compute_capability, self.device_kind = "gpu", compute_capability, device_kind


@pytest.mark.parametrize("gpus, expected", [
    ([], set()),
    ([FakeGpu("8.0", "NVIDIA A100")], set()),  # Ampere: no fp8 tensor cores
    ([FakeGpu("8.9", "NVIDIA L4")], {"float8_e4m3fn", "float8_e5m2"}),
    ([FakeGpu("9.0")], {"float8_e4m3fn", "float8_e5m2"}),
    ([FakeGpu(None, "AMD Instinct MI300X")], {"float8_e4m3fnuz", "float8_e5m2fnuz"}),
])
def test_native_fp8_types_follow_the_gpu_vendor(monkeypatch, gpus, expected):
    monkeypatch.setattr(hardware, "_devices", lambda platform: gpus if platform == "gpu" else [])
    hardware.fp8_gemm_dtypes.cache_clear()
    hardware.missing.cache_clear()
    try:
        assert hardware.fp8_gemm_dtypes() == expected
        assert (hardware.missing("fp8_gpu") is None) == bool(expected)  # the fp8_gpu marker follows them
    finally:
        hardware.fp8_gemm_dtypes.cache_clear()
        hardware.missing.cache_clear()


def test_pytest_fixtures_describes_the_plugins_fixtures(pytester):
    result = pytester.runpytest("--fixtures", "-p", "no:cacheprovider")
    for name in ("qcheck_case", "qcheck_layer", "qcheck_golden", "qcheck_recipes", "qcheck_env", "qcheck_paths"):
        result.stdout.fnmatch_lines([f"{name}*", "*"])
    result.stdout.fnmatch_lines(["*parametrizes a test that asks*"])


def test_the_plugin_names_the_golden_variable_the_golden_module_reads():
    from qcheck.suite import golden, plugin

    assert plugin.GOLDEN_ENV == golden.ENV


def test_a_user_test_over_the_case_table_gets_readable_ids(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.qcheck_invariant("state")
        def test_mine(qcheck_case):
            assert qcheck_case.recipe in ("fp8", "nanoo_fp8")
        """
    )
    result = pytester.runpytest("--collect-only", "-q", *INNER, "--qcheck-recipe=fp8")
    result.stdout.fnmatch_lines(["*test_mine[[]fp8-mixtral-dense[]]", "*test_mine[[]fp8-gemma-sparse[]]"])
    assert "nanoo_fp8" not in result.stdout.str()


def test_a_users_session_keeps_its_own_settings_when_qcheck_is_installed_from_a_checkout(tmp_path):
    # An editable install: the suite's modules are collected from this checkout, and pytest loads its root
    # conftest.py with them, late. It must neither break the session (pytest refuses `pytest_plugins` in a
    # conftest that is not at the rootdir) nor apply qcheck's own strict settings to the user's process.
    import qcheck

    checkout = Path(__file__).resolve().parents[1]
    if Path(qcheck.__file__).resolve().parents[1] != checkout or not (checkout / "conftest.py").exists():
        pytest.skip("qcheck is not installed from this checkout (a wheel holds no conftest.py)")
    (tmp_path / "my_recipes.py").write_text(
        'import qcheck\nqcheck.register_recipe(qcheck.Recipe("my_e5m2", lhs="e5m2_current", rhs="e5m2_current"))\n')
    (tmp_path / "test_mine.py").write_text(
        "import jax\n\ndef test_mine():\n    assert jax.config.jax_numpy_rank_promotion == 'allow'\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_mine",
                           "--qcheck-recipes=my_recipes.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"1 passed, \d+ deselected", done.stdout), done.stdout[-2000:]


def _blocks(keys: list) -> list:
    """``keys`` with each run of equal neighbours collapsed: contiguous groups appear once each."""
    return [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]


def test_the_suites_items_come_case_by_case_and_a_variants_cases_together(pytester):
    # pytest-xdist hands each worker runs of consecutive items: in this order one worker builds a case's
    # programs for all of its invariants, and a variant's unquantized twin once for its recipes.
    pytester.makepyfile(
        """
        def test_first():
            pass

        def test_last():
            pass
        """
    )
    result = pytester.runpytest("--collect-only", "-q", *INNER, "--qcheck-recipe=fp8", "--qcheck-recipe=nanoo_fp8")
    ids = [line for line in result.stdout.lines if "::" in line]
    assert ids[0].endswith("::test_first") and ids[1].endswith("::test_last")  # the user's own items keep places
    suite = [re.search(r"::(\w+)\[(\w+)-(.*)\]$", line) for line in ids if "[" in line]
    suite = [m.groups() for m in suite if m]
    cases = [(recipe, variant) for _, recipe, variant in suite]
    variants = [variant for _, _, variant in suite]
    assert len(_blocks(cases)) == len(set(cases)) and len(_blocks(variants)) == len(set(variants)), ids
    # The control: within a case the test functions change, so pytest's own order (function by function over
    # every case) would have split each case up.
    assert len(_blocks([function for function, _, _ in suite])) > len(set(function for function, _, _ in suite))


@pytest.mark.parametrize(
    "flags, scheduler",
    [(("--qcheck-recipe=fp8",), "WorkStealingScheduling"),
     # The controls: a --dist the user chose stands, and a run without the suite keeps pytest-xdist's default.
     (("--qcheck-recipe=fp8", "--dist=load"), "LoadScheduling"),
     ((), "LoadScheduling")],
)
def test_the_suites_run_on_workers_steals_work_unless_the_user_chose_a_dist(pytester, flags, scheduler):
    # worksteal keeps each worker on contiguous cases (order_by_case) where load splits later cases between them.
    pytester.makepyfile("def test_mine():\n    pass\n")
    result = pytester.runpytest("-n", "1", "-v", *INNER, "-k", "test_nothing_is_named_so", *flags)
    result.stdout.fnmatch_lines([f"scheduling tests via {scheduler}"])
