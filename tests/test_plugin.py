"""The pytest plugin: hardware markers skip with a reason, --require-hardware turns that into failure."""

import pytest

from qcheck import hardware

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
    result.stdout.fnmatch_lines(["*needs a GPU with native fp8 matmuls*this host has cpu:*"])


@pytest.mark.skipif(hardware.missing("fp8_gpu") is None, reason="this host has an fp8 GPU")
def test_require_hardware_turns_the_skip_into_a_failure(marked):
    result = marked.runpytest("--require-hardware", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)  # it fails in setup, before the test body runs
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*--require-hardware: needs a GPU with native fp8 matmuls*"])


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
    assert "unknown qcheck_invariant 'bitwise'; known invariants: sites, exact, tracks, state, rng" in output


def test_unknown_hardware_marker_name_is_rejected():
    with pytest.raises(ValueError, match="unknown hardware marker 'h100'; known markers: gpu, tpu"):
        hardware._has("h100")
