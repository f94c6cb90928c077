"""Golden cases: the suite's own cases, the file format, and every way a golden file can be bad.

The drift and hand-edit twins live in test_catalogue.py with the other bugs.
"""

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from qcheck import golden
from tests.helpers import INNER

CASE = golden.GoldenCase("int8", "mixtral", "dense")


def test_golden_case(qcheck_golden, request):
    """Parametrized from the golden directory: one item per registered recipe × model × path."""
    outcome = qcheck_golden()
    assert outcome == "match" or request.config.getoption("--update-golden")


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
    record["digest"] = golden._digest(record)


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
    assert set(stored.codes) == {"lhs", "lhs.scale.slice", "rhs", "rhs.scale.slice"}
    assert stored.codes["lhs"].dtype == np.int8
    assert stored.record["provenance"]["seed"] == 0 and stored.record["provenance"]["backend"] == "cpu"
    golden.check_case(CASE, root)


def test_add_refuses_to_overwrite_and_update_leaves_an_unchanged_file_alone(root):
    path = CASE.file(root)
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match=r"mixtral-dense.json exists; rewrite it with `python -m qcheck golden update int8"):
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
    golden.check_case(CASE, root)


def test_a_missing_case_fails_with_the_command_that_creates_it(tmp_path):
    with pytest.raises(AssertionError, match=r"no file .*; create the recipe's cases with:\n  "
                       r"python -m qcheck golden add int8 --golden-dir "):
        golden.check_case(CASE, tmp_path)


def test_add_command_names_the_recipe_module_and_the_directory(monkeypatch):
    from qcheck.recipes import _registry

    monkeypatch.setitem(_registry._SOURCE, "int8", "/tmp/my_recipes.py")
    assert golden.add_command("int8", Path("golden")) == "python -m qcheck golden add int8 --recipes /tmp/my_recipes.py"
    assert golden.add_command("int8", Path("/x/golden")).endswith("--golden-dir /x/golden")


# -- bad files: each named, with what is wrong ---------------------------------------


def _truncate(path):
    path.write_bytes(path.read_bytes()[:4000])


def _garbage(path):
    path.write_bytes(b"\x00\xff" * 10)


def _schema(path):
    edit(path, lambda r: (r.__setitem__("schema", "qcheck.golden/0"), redigest(r)))


def _missing_key(path):
    edit(path, lambda r: (r.pop("entry_params"), redigest(r)))


def _short_bits(path):
    edit(path, lambda r: (r["codes"]["rhs"]["bits"].pop(), redigest(r)))


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
        (_schema, r"has schema 'qcheck.golden/0', expected 'qcheck.golden/1'"),
        (_missing_key, "is missing keys: entry_params"),
        (_short_bits, r"codes\['rhs'\]: bits hold 992 bytes, but shape \(32, 32\) of int8 needs 1024 \(truncated\?\)"),
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
        golden.check_case(CASE, root)
    assert str(path) in str(info.value)


def test_a_stray_file_is_reported_not_ignored(root):
    (root / "int8" / "llama-dense.json").write_text("{}")
    _, strays = golden.collect(root)
    assert [e.path.name for e in strays] == ["llama-dense.json"]
    assert "is not named after a case" in str(strays[0])


def test_a_case_for_an_unregistered_recipe_is_collected_and_fails(root):
    shutil.copytree(root / "int8", root / "ghost")
    found, _ = golden.collect(root)
    ghost = [c for c in found if c.recipe == "ghost"]
    assert [c.id for c in ghost] == ["ghost-mixtral-dense"]
    with pytest.raises(AssertionError, match="recipe 'ghost', which is not registered .*--qcheck-recipes"):
        golden.check_case(ghost[0], root)


def test_checking_never_writes(root):
    # The suite without --update-golden only reads: every file's bytes and mtime survive a failing check too.
    path = CASE.file(root)
    edit(path, lambda r: (r.__setitem__("rel_norm", 0.5), redigest(r)))
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    with pytest.raises(AssertionError, match="rel_norm: got"):
        golden.check_case(CASE, root)
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


# -- the commands ---------------------------------------------------------------------

REPO = Path(__file__).parent.parent


def test_pytest_update_golden_writes_then_the_suite_checks(pytester, tmp_path):
    root = tmp_path / "golden"
    args = [*INNER, f"--golden-dir={root}", "-k", "int8-mixtral-dense",
            str(REPO / "tests" / "test_golden.py::test_golden_case")]
    missing = pytester.inline_run(*args)
    assert missing.ret != 0  # no case yet: the failure names the command
    assert "python -m qcheck golden add int8 --golden-dir" in str(missing.getfailures()[0].longrepr)
    written = pytester.runpytest_inprocess("--update-golden", *args)
    assert written.ret == 0
    written.stdout.fnmatch_lines(["*qcheck golden update*", "*int8/mixtral-dense.json: new", "1 new, 0 changed*"])
    before = CASE.file(root).read_bytes()
    assert pytester.inline_run(*args).ret == 0
    assert CASE.file(root).read_bytes() == before


def test_cli_add_refuses_existing_cases_and_check_reports_a_bad_one(root, capsys):
    from qcheck.__main__ import main

    assert main(["golden", "add", "int8", "--golden-dir", str(root)]) == 1
    assert "golden files exist, nothing written" in capsys.readouterr().err
    assert main(["golden", "add", "fp9", "--golden-dir", str(root)]) == 2
    assert "unknown recipe 'fp9'" in capsys.readouterr().err
    _truncate(CASE.file(root))
    assert main(["golden", "check", "int8", "--golden-dir", str(root)]) == 1
    captured = capsys.readouterr()
    assert "FAIL int8-mixtral-dense" in captured.out and "is not valid JSON" in captured.err
