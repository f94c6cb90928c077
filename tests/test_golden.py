"""Golden cases: the suite's own cases, the file format, and every way a golden file can be bad.

The drift and hand-edit twins live in test_catalogue.py with the other bugs.
"""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from qcheck.suite import golden
from tests.helpers import INNER, Terminal

CASE = golden.GoldenCase("int8", "mixtral", "dense")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("golden")
    assert golden.write_case(CASE, root, overwrite=False).endswith(": new")
    return root


@pytest.fixture
def root(written, tmp_path) -> Path:
    """A private copy of a golden directory holding CASE, as qcheck wrote it."""
    shutil.copytree(written, tmp_path / "golden")
    return tmp_path / "golden"


def edit(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record, indent=1))


def redigest(record) -> None:
    record["digest"] = golden.digest(record)


# -- the format -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.int8, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
                                   ml_dtypes.float8_e5m2, ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu])
def test_arrays_round_trip_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5, 7)).astype(np.float32)
    a = np.abs(a) + 0.5 if dtype is ml_dtypes.float8_e8m0fnu else a
    a = a.astype(dtype)
    back = golden.decode_array(json.loads(json.dumps(golden.encode_array(a))), "x")
    assert back.dtype == a.dtype and back.shape == a.shape and back.tobytes() == a.tobytes()


def test_a_written_case_reads_back_and_matches(root):
    stored = golden.read_case(CASE, root)
    assert set(stored.codes) == {"lhs", "lhs.int8", "rhs", "rhs.int8"}  # what the site fed its matmul
    assert stored.codes["lhs"].dtype == np.float32 and stored.codes["lhs.int8"].dtype == np.int8
    assert stored.record["provenance"]["seed"] == 0 and stored.record["provenance"]["backend"] == "cpu"
    golden.assert_case_matches(CASE, root)


def test_a_case_pins_a_sample_of_every_gradient_leaf_with_its_norm(root):
    stored = golden.read_case(CASE, root)
    summary = stored.record["grads_summary"]
    assert sorted(stored.grads) == sorted(summary) == ["gate", "wi_0", "wi_1", "wo"]
    assert summary["gate"]["stride"] == 1 and stored.grads["gate"].shape == (256,)  # small leaves whole
    assert summary["wi_0"]["shape"] == [8, 32, 64] and stored.grads["wi_0"].shape == (golden.GRAD_SAMPLE,)


def test_the_dropping_variant_has_its_own_file_and_a_recipe_that_cannot_train_there_records_no_gradients():
    drop = golden.GoldenCase("mxfp8", "mixtral", "dense", dropping=True)
    assert drop.id == "mxfp8-mixtral-dense-drop" and drop.file(Path("g")) == Path("g/mxfp8/mixtral-dense-drop.json")
    assert drop in golden.golden_cases(("mxfp8",))
    values = golden.measure(drop)  # mxfp8's 32-blocks do not tile the 16 tokens per expert of its weight gradients
    assert values["grads"] == {} and values["entry_params"] == {} and values["output"].shape == (2, 32, 32)


def test_add_refuses_to_overwrite_and_update_leaves_an_unchanged_file_alone(root):
    path = CASE.file(root)
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match=r"mixtral-dense.json exists; rewrite it with `qcheck golden update int8"):
        golden.write_case(CASE, root, overwrite=False)
    assert golden.write_case(CASE, root, overwrite=True).endswith(": unchanged")
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind


def test_update_rewrites_a_changed_file_and_says_what_changed(root):
    path = CASE.file(root)

    def shift(record):
        record["rel_norm"] += 0.01
        redigest(record)

    edit(path, shift)
    line = golden.write_case(CASE, root, overwrite=True)
    assert ": changed: rel_norm: got" in line
    golden.assert_case_matches(CASE, root)


def _written_under(root: Path, form: str, shift: float = 0.0) -> None:
    """CASE's main file as a toolchain computing its divisions in ``form`` would have left it (its rel_norm moved by
    ``shift``: the values that toolchain gave)."""
    def change(record):
        record["provenance"]["xla_form"] = form
        record["rel_norm"] += shift
        redigest(record)

    edit(CASE.file(root), change)


def _other_form() -> str:
    from qcheck.suite._toolchain import division_form

    return next(f for f in ("all by reciprocal", "constant by reciprocal") if f != division_form())


def test_another_toolchains_values_are_recorded_beside_the_file_and_held_there(root):
    # Should-pass: the main file was written where XLA computed the divisions in another form, and its values
    # differ from this toolchain's; an update records this toolchain's beside it and leaves the main file alone.
    from qcheck.suite._toolchain import division_form

    _written_under(root, _other_form(), shift=0.01)
    before = CASE.file(root).read_bytes()
    beside = CASE.form_file(root, division_form())
    assert golden.write_case(CASE, root, overwrite=True) == f"{beside}: new"
    assert CASE.file(root).read_bytes() == before and beside.exists()
    golden.assert_case_matches(CASE, root)
    assert golden.collect(root, ("int8",)).strays == []  # the form's file is the case's, not a stray


def test_a_toolchain_that_moved_is_named_where_its_values_are_not_recorded(root):
    # Should-fail beside the test above: no file for this toolchain's form, so the main one holds it and fails,
    # naming the parts of the toolchain that moved, not the recipe.
    from qcheck.suite._toolchain import division_form

    other = _other_form()
    _written_under(root, other, shift=0.01)
    with pytest.raises(AssertionError, match=rf"(?s)rel_norm: got .*the toolchain moved since the file was written "
                                             rf"\(XLA's divisions {other} -> {division_form()}\): if the recipe did "
                                             r"not change, this is the toolchain's doing; `qcheck golden update int8"):
        golden.assert_case_matches(CASE, root)


def test_on_the_toolchain_that_wrote_the_file_a_failure_says_the_recipe_moved(root):
    _written_under(root, _other_form(), shift=0.01)
    from qcheck.suite._toolchain import division_form

    _written_under(root, division_form())  # the same form: only the values moved
    with pytest.raises(AssertionError, match=r"(?s)rel_norm: got .*the toolchain is the one the file was written "
                                             r"with: the recipe's numerics moved"):
        golden.assert_case_matches(CASE, root)


def test_values_that_match_the_main_file_need_no_file_of_their_own(root):
    _written_under(root, _other_form())
    assert golden.write_case(CASE, root, overwrite=True).endswith(": unchanged (this toolchain's values match it)")
    assert [p.name for p in CASE.file(root).parent.iterdir()] == [CASE.file(root).name]


def test_an_update_never_pins_nan(root, monkeypatch):
    from qcheck.suite.golden import write

    real = write.measure
    monkeypatch.setattr(write, "measure", lambda case: {**real(case), "output": real(case)["output"] * np.nan})
    before = CASE.file(root).read_bytes()
    line = golden.write_case(CASE, root, overwrite=True)
    assert line.endswith(": refused: its output or gradients are not finite, and a golden case never pins NaN")
    assert CASE.file(root).read_bytes() == before


def test_a_toolchain_of_a_form_the_referee_does_not_know_is_refused(root, monkeypatch):
    from qcheck.suite import _toolchain

    _written_under(root, "all by reciprocal", shift=0.01)
    monkeypatch.setattr(_toolchain, "division_form", lambda: "unknown")
    line = golden.write_case(CASE, root, overwrite=True)
    assert line.endswith(": refused: XLA computes its divisions in a form the referee does not know (qcheck "
                         "--version), so no file of this toolchain's values is written"), line
    assert [p.name for p in CASE.file(root).parent.iterdir()] == [CASE.file(root).name]


def test_a_file_of_an_unknown_form_is_a_stray(root):
    shutil.copy(CASE.file(root), CASE.file(root).with_name("mixtral-dense@by-magic.json"))
    assert [e.path.name for e in golden.collect(root, ("int8",)).strays] == ["mixtral-dense@by-magic.json"]


def test_a_missing_case_fails_with_the_command_that_creates_it(tmp_path):
    with pytest.raises(AssertionError, match=r"^assert_case_matches: golden case int8-mixtral-dense has no file .*; "
                       r"create the recipe's cases with:\n  "
                       r"qcheck golden add int8 --golden-dir "):
        golden.assert_case_matches(CASE, tmp_path)


def test_add_command_names_the_recipe_module_and_the_directory(monkeypatch):
    monkeypatch.setattr(golden.store, "recipe_source", lambda name: "/tmp/my_recipes.py" if name == "int8" else None)
    assert golden.add_command("int8", Path("golden")) == "qcheck golden add int8 --recipes /tmp/my_recipes.py"
    assert golden.add_command("int8", Path("/x/golden")).endswith("--golden-dir /x/golden")


# -- bad files: each named, with what is wrong ---------------------------------------


def _truncate(path):
    path.write_bytes(path.read_bytes()[:4000])


def _garbage(path):
    path.write_bytes(b"\x00\xff" * 10)


def _schema(path):
    # A file of the schema before gradients and dropping cases: told to update, not to hand-edit.
    edit(path, lambda r: (r.__setitem__("schema", "qcheck.golden/1"), redigest(r)))


def _missing_key(path):
    edit(path, lambda r: (r.pop("entry_params"), redigest(r)))


def _short_bits(path):
    edit(path, lambda r: (r["codes"]["rhs.int8"]["bits"].pop(), redigest(r)))


def _unknown_dtype(path):
    edit(path, lambda r: (r["output"].__setitem__("dtype", "float7"), redigest(r)))


def _string_rel_norm(path):
    edit(path, lambda r: (r.__setitem__("rel_norm", "0.01"), redigest(r)))


def _case_not_an_object(path):
    edit(path, lambda r: (r.__setitem__("case", ["int8"]), redigest(r)))


def _wrong_case(path):
    edit(path, lambda r: (r["case"].__setitem__("model", "gemma"), redigest(r)))


@pytest.mark.parametrize(
    "spoil, message",
    [
        (_truncate, r"is not valid JSON \(truncated or corrupted\?\)"),
        (_garbage, "cannot be read|is not valid JSON"),
        (lambda p: p.write_text(""), "is empty"),
        (lambda p: p.write_text("[1, 2]"), "holds a JSON list"),
        (_schema, r"has schema 'qcheck.golden/1', expected 'qcheck.golden/2'; rewrite it with `qcheck golden update "
                  r"int8 --golden-dir "),
        (_missing_key, "is missing keys: entry_params"),
        (_short_bits, r"codes\['rhs\.int8'\]: bits hold 992 bytes, but shape \(32, 32\) of int8 needs 1024 \(truncated\?\)"),
        (_unknown_dtype, "output: unknown dtype 'float7'"),
        (_wrong_case, "holds case .*'gemma'.* but its name says"),
        (_string_rel_norm, "has a str under 'rel_norm', where the schema wants a number"),
        (_case_not_an_object, "has a list under 'case', where the schema wants an object"),
    ],
    ids=["truncated", "binary-garbage", "empty", "not-an-object", "wrong-schema", "missing-key", "short-bits",
         "unknown-dtype", "wrong-case", "string-rel-norm", "case-not-an-object"],
)
def test_a_bad_golden_file_is_named_with_what_is_wrong(root, spoil, message):
    path = CASE.file(root)
    spoil(path)
    with pytest.raises(golden.GoldenFileError, match=message) as info:
        golden.assert_case_matches(CASE, root)
    assert str(info.value).startswith(f"assert_case_matches: golden file {path}: ")


def test_a_stray_file_is_reported_not_checked(root):
    (root / "int8" / "llama-dense.json").write_text("{}")
    found = golden.collect(root)
    assert [e.path.name for e in found.strays] == ["llama-dense.json"]
    assert "is not named after a case" in str(found.strays[0])


def test_a_case_of_a_recipe_this_run_did_not_load_is_reported_not_checked(root):
    shutil.copytree(root / "int8", root / "ghost")
    found = golden.collect(root)
    assert found.unloaded == [(root / "ghost" / "mixtral-dense.json", "ghost")]
    assert "ghost" not in {c.recipe for c, _ in found.cases}
    ghost = golden.GoldenCase("ghost", "mixtral", "dense")
    with pytest.raises(AssertionError, match="^assert_case_matches: golden case ghost-mixtral-dense .* is for recipe "
                       "'ghost', which is not registered .*--qcheck-recipes"):
        golden.assert_case_matches(ghost, root)


def test_qcheck_recipes_cases_ship_in_the_package_and_user_recipes_use_the_users_directory(tmp_path):
    assert golden.root_for("fp8", tmp_path) == golden.builtin_root()
    assert golden.root_for("int8", tmp_path) == golden.builtin_root()
    assert golden.builtin_root().name in ("golden", "_golden")  # the repository's, or the wheel's copy
    assert {c.id for c, r in golden.collect(tmp_path).cases if r == golden.builtin_root()} >= {
        "none-mixtral-dense", "fp8-gemma-sparse", "mxfp8-mixtral-sparse"}


def test_a_missing_builtin_case_says_the_install_is_incomplete_not_to_record_it():
    # A case the package's directory does not hold: int8's sparse layer has no token-dropping variant.
    absent = golden.GoldenCase("int8", "mixtral", "sparse", dropping=True)
    assert not absent.file(golden.builtin_root()).exists()
    with pytest.raises(AssertionError, match="^assert_case_matches: golden case .* ships with qcheck, so this "
                       "installation is incomplete; reinstall"):
        golden.assert_case_matches(absent, golden.builtin_root())


def test_builtin_cases_are_written_only_from_qcheck_s_checkout(tmp_path):
    assert golden.writable_here("fp8", REPO)
    assert not golden.writable_here("fp8", tmp_path)
    assert golden.writable_here("anything_a_user_registers", tmp_path) is True


def test_checking_never_writes(root):
    # The suite without --update-golden only reads: every file's bytes and mtime survive a failing check too.
    path = CASE.file(root)
    edit(path, lambda r: (r.__setitem__("rel_norm", 0.5), redigest(r)))
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    with pytest.raises(AssertionError, match=r"(?s)^assert_case_matches: golden case int8-mixtral-dense does not match "
                       r".*rel_norm: got"):
        golden.assert_case_matches(CASE, root)
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


# -- the commands, on a user's recipe (qcheck's own recipes' cases ship with qcheck) ----

REPO = Path(__file__).parent.parent
PROBE_MODULE = 'import qcheck\nqcheck.register_recipe(qcheck.Recipe("probe_int8", lhs="int8", rhs="int8"))\n'
PROBE_FILES = ["gemma-dense.json", "gemma-sparse.json", "mixtral-dense-drop.json", "mixtral-dense.json",
               "mixtral-sparse.json"]


@pytest.fixture(scope="module")
def probe_module(tmp_path_factory):
    """A user's recipe module, imported as --recipes would; unregistered again after the module's tests."""
    from qcheck.recipes import import_recipes, registered

    module = tmp_path_factory.mktemp("project") / "my_recipes.py"
    module.write_text(PROBE_MODULE)
    with registered():
        import_recipes(str(module))
        yield module


@pytest.fixture(scope="module")
def probe_written(probe_module, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe-golden")
    lines = golden.write_cases(golden.golden_cases(("probe_int8",)), root, overwrite=False)
    assert [line.rsplit(": ", 1)[1] for line in lines] == ["new"] * 5
    return root


@pytest.fixture
def probe_root(probe_written, tmp_path) -> Path:
    shutil.copytree(probe_written, tmp_path / "golden")
    return tmp_path / "golden"


def test_cli_add_writes_every_case_then_refuses_and_check_reports_a_bad_one(probe_module, probe_root, capsys,
                                                                             monkeypatch):
    from qcheck.suite.cli import main

    assert sorted(p.name for p in (probe_root / "probe_int8").iterdir()) == PROBE_FILES
    args = ["--recipes", str(probe_module), "--golden-dir", str(probe_root)]
    assert main(["golden", "add", "probe_int8", *args]) == 1
    assert "golden files exist, nothing written" in capsys.readouterr().err
    assert main(["golden", "add", "fp9", *args]) == 2
    assert "unknown recipe 'fp9'" in capsys.readouterr().err
    _truncate(probe_root / "probe_int8" / "gemma-sparse.json")
    monkeypatch.setattr(sys, "stderr", terminal := Terminal())
    assert main(["golden", "check", *args]) == 1  # the module's recipes by default: not the built-ins
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["ok   probe_int8-mixtral-dense", "ok   probe_int8-mixtral-dense-drop",
                                         "ok   probe_int8-mixtral-sparse", "ok   probe_int8-gemma-dense",
                                         "FAIL probe_int8-gemma-sparse"]
    assert "is not valid JSON" in terminal.getvalue()
    # Progress on the terminal, each case's line cleared before its verdict is printed.
    shown = [line for line in terminal.getvalue().split("\r\033[K") if line.startswith("qcheck: ")]
    assert re.fullmatch(r"qcheck: 4/5 cases, \d+ s: running probe_int8-gemma-sparse", shown[-2]), shown
    assert re.fullmatch(r"qcheck: 5/5 cases, \d+ s: done probe_int8-gemma-sparse", shown[-1]), shown


def fail_the_nth_write(monkeypatch, n: int, error: OSError) -> list:
    """Golden files written after this fail at the ``n``-th write, as a full disk would; returns the paths tried.

    At the rename that puts a written file in place (every golden file is written so, and only golden files end
    in .json here): os.replace, patched while the test runs.
    """
    real, calls = os.replace, []

    def replace(src, dst, *args, **kwargs):
        if Path(dst).suffix == ".json":
            calls.append(Path(dst))
            if len(calls) == n:
                raise error
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_add_writes_all_of_a_recipes_cases_or_none(probe_module, tmp_path, monkeypatch):
    root = tmp_path / "golden"
    real = os.replace
    calls = fail_the_nth_write(monkeypatch, 3, OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        golden.write_cases(golden.golden_cases(("probe_int8",)), root, overwrite=False)
    assert len(calls) == 3 and list((root / "probe_int8").iterdir()) == []  # the two written are gone again
    monkeypatch.setattr(os, "replace", real)
    golden.write_cases(golden.golden_cases(("probe_int8",)), root, overwrite=False)  # a rerun is not refused
    assert sorted(p.name for p in (root / "probe_int8").iterdir()) == PROBE_FILES


def test_update_that_fails_midway_restores_what_it_had_rewritten(probe_module, probe_root, monkeypatch):
    files = sorted((probe_root / "probe_int8").iterdir())
    for path in files:
        edit(path, lambda r: (r.__setitem__("rel_norm", r["rel_norm"] + 0.5), redigest(r)))
    before = {p: p.read_bytes() for p in files}
    fail_the_nth_write(monkeypatch, 2, OSError(5, "Input/output error"))
    with pytest.raises(OSError):
        golden.write_cases(golden.golden_cases(("probe_int8",)), probe_root, overwrite=True)
    assert {p: p.read_bytes() for p in files} == before


def test_cli_refuses_a_golden_dir_it_cannot_write_in_one_line(probe_module, tmp_path, capsys, monkeypatch):
    from qcheck.suite.cli import main

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main(["golden", "add", "probe_int8", "--recipes", str(probe_module),
                 "--golden-dir", str(blocked / "golden")]) == 2
    assert capsys.readouterr().err == f"qcheck: error: golden directory {blocked / 'golden'}: {blocked} is not a directory\n"
    # Read-only: CI runs as root, whom permission bits do not stop, so the access check is what is asked.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert main(["golden", "add", "probe_int8", "--recipes", str(probe_module),
                 "--golden-dir", str(tmp_path / "ro")]) == 2
    assert capsys.readouterr().err == (f"qcheck: error: golden directory {tmp_path / 'ro'} is not writable "
                                       f"({tmp_path}: permission denied)\n")


def test_cli_refuses_to_rewrite_qcheck_s_own_cases_outside_its_checkout(tmp_path, capsys, monkeypatch):
    from qcheck.suite.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["golden", "update", "fp8"]) == 2
    assert "fp8 is one of qcheck's own recipes: its golden cases ship with qcheck" in capsys.readouterr().err


def test_pytest_update_golden_writes_then_the_suite_checks(probe_module, pytester, tmp_path):
    root = tmp_path / "golden"
    args = [*INNER, f"--qcheck-recipes={probe_module}", f"--golden-dir={root}",
            "-k", "test_golden_case and probe_int8-mixtral-dense"]
    no_dir = pytester.runpytest_inprocess(*args)
    assert no_dir.ret == pytest.ExitCode.USAGE_ERROR
    no_dir.stderr.fnmatch_lines([f"ERROR: golden directory {root} (--golden-dir) does not exist"])
    root.mkdir()
    missing = pytester.inline_run(*args)
    assert missing.ret != 0  # no case yet: the failure names the command
    assert f"qcheck golden add probe_int8 --recipes {probe_module} --golden-dir" in str(
        missing.getfailures()[0].longrepr)
    written = pytester.runpytest_inprocess("--update-golden", *args)
    assert written.ret == 0
    written.stdout.fnmatch_lines(["*qcheck golden update*", "*probe_int8/mixtral-dense-drop.json: new",
                                  "*probe_int8/mixtral-dense.json: new", "2 new, 0 changed*"])
    path = root / "probe_int8" / "mixtral-dense.json"
    before = path.read_bytes()
    assert pytester.inline_run(*args).ret == 0
    assert path.read_bytes() == before


def test_pytest_update_golden_that_writes_nothing_fails(probe_module, pytester, tmp_path, monkeypatch):
    # The twin of the test above: an update is checked against what it wrote, so one that says "new" and wrote
    # nothing fails instead of passing because --update-golden was set.
    root = tmp_path / "golden"
    root.mkdir()
    monkeypatch.setattr(golden, "write_case", lambda case, root, *, overwrite: f"{case.file(root)}: new")
    result = pytester.inline_run("--update-golden", *INNER, f"--qcheck-recipes={probe_module}", f"--golden-dir={root}",
                                 "-k", "test_golden_case and probe_int8-mixtral-dense")
    failures = result.getfailures()
    assert result.ret != 0 and len(failures) == 2  # mixtral-dense and mixtral-dense-drop
    assert all("has no file" in str(f.longrepr) for f in failures)
    assert not any(root.iterdir())
