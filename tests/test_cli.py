"""``python -m qcheck``: the matrix the seeds tabulate by hand."""

import dataclasses
import io
import json
import re
import subprocess
import sys

import pytest

from qcheck import get_recipe
from qcheck.suite import invariants
from qcheck.suite.cli import main
from qcheck.suite.progress import Progress
from tests.helpers import Terminal



def cells(header: str, line: str) -> dict[str, str]:
    """A table row by column name: the columns are left-aligned under the header's words."""
    starts = [m.start() for m in re.finditer(r"\S+", header)] + [None]
    return {header[a:b].strip(): line[a:b].strip() for a, b in zip(starts, starts[1:])}


def test_matrix_prints_every_case_of_a_recipe_and_passes(capsys, monkeypatch):
    # The same layers the invariant tests use, so this costs little beyond them.
    monkeypatch.setattr(sys, "stderr", terminal := Terminal())
    assert main(["--recipe", "nanoo_fp8", "--model", "mixtral", "--path", "sparse", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    # Progress on the terminal, rewritten in place and cleared; none of it in the table.
    shown = [line for line in terminal.getvalue().split("\r\033[K") if line]
    assert re.fullmatch(r"qcheck: 0/1 cases, \d+ s: running nanoo_fp8-mixtral-sparse", shown[0]), shown
    assert re.fullmatch(r"qcheck: 1/1 cases, \d+ s: done nanoo_fp8-mixtral-sparse", shown[-1]), shown
    assert terminal.getvalue().endswith("\r\033[K") and "\033" not in out
    header = out.splitlines()[0]
    assert header.split() == ["recipe", "model", "path", *(inv.name for inv in invariants.INVARIANTS)]
    (row,) = [cells(header, line) for line in out.splitlines() if line.startswith("nanoo_fp8")]
    assert row.pop("path") == "sparse" and float(row.pop("tracks").removeprefix("pass ")) < 0.22
    assert 0 < float(row.pop("grads").removeprefix("pass ")) < get_recipe("nanoo_fp8").expect.max_grad_rel_norm
    assert row == {"recipe": "nanoo_fp8", "model": "mixtral", "sites": "pass", "coverage": "pass 3", "exact": "pass",
                   "backward": "pass", "edges": "pass 5", "state": "pass", "train": "pass", "rng": "-",
                   "sharded": "pass 0.0000", "referee": "-", "golden": "pass"}
    assert "all 1 cases pass" in out


def test_matrix_json_has_each_cell_with_its_figure(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", terminal := Terminal())
    assert main(["matrix", "--recipe", "int8", "--model", "mixtral", "--path", "dense", "--json", "--jobs", "1"]) == 0
    assert terminal.getvalue() == ""  # no progress under --json, even on a terminal
    cells = json.loads(capsys.readouterr().out)
    assert set(cells) == {"int8-mixtral-dense", "int8-mixtral-dense-drop"}
    assert cells["int8-mixtral-dense"]["exact"]["status"] == "pass"  # int8 declares its formats
    assert 0 < cells["int8-mixtral-dense"]["tracks"]["figure"] < 0.22


def test_unknown_names_exit_2_listing_the_valid_ones(capsys):
    assert main(["--recipe", "fp4"]) == 2
    assert "unknown recipe 'fp4'; registered recipes: none, int8" in capsys.readouterr().err
    assert main(["--model", "llama"]) == 2
    assert "unknown model 'llama'; valid models: mixtral, gemma" in capsys.readouterr().err


LONG_FAILURE = ("int8-gemma-sparse site 'wo': wrong fp8 flavour: the site computes the float8_e4m3fn reference, "
                "not the float8_e4m3fnuz one the recipe declares (max |diff| 0.0312 over 4096 values)\n"
                "  fix: qcheck golden add int8 --recipes /tmp/my_recipes.py")


def _break_tracks(monkeypatch, text: str) -> None:
    from qcheck.suite import invariants

    def broken(case):
        raise AssertionError(text)

    patched = tuple(
        invariants.Invariant(i.name, i.applies, broken if i.name == "tracks" else i.run)
        for i in invariants.INVARIANTS
    )
    monkeypatch.setattr(invariants, "INVARIANTS", patched)


def test_a_failing_cell_fails_the_matrix_and_is_shown_in_full_below_the_table(capsys, monkeypatch):
    _break_tracks(monkeypatch, LONG_FAILURE)
    assert main(["--recipe", "int8", "--model", "gemma", "--path", "sparse", "--jobs", "1"]) == 1  # patched here
    captured = capsys.readouterr()
    header = captured.out.splitlines()[0]
    (row,) = [cells(header, line) for line in captured.out.splitlines() if line.startswith("int8")]
    assert row["tracks"] == "FAIL [1]" and [v for v in row.values() if v.startswith("FAIL")] == ["FAIL [1]"]
    below = captured.out.split("[1] int8-gemma-sparse tracks:\n", 1)[1]
    assert "    AssertionError: " + LONG_FAILURE.splitlines()[0] in below  # not cut at any width
    assert "      fix: qcheck golden add int8 --recipes /tmp/my_recipes.py" in below  # nor at the first line
    assert "1 cases failed: int8-gemma-sparse" in captured.err


def test_json_holds_each_failure_in_full(capsys, monkeypatch):
    _break_tracks(monkeypatch, LONG_FAILURE)
    assert main(["--recipe", "int8", "--model", "gemma", "--path", "sparse", "--jobs", "1", "--json"]) == 1
    cells = json.loads(capsys.readouterr().out)
    assert cells["int8-gemma-sparse"]["tracks"] == {"status": "fail", "detail": "AssertionError: " + LONG_FAILURE,
                                                    "figure": None}


def test_version_names_qcheck_and_the_toolchain_it_runs_on():
    import jax

    from qcheck.suite._toolchain import division_form

    done = subprocess.run([sys.executable, "-m", "qcheck", "--version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(rf"qcheck \S+ on jax {re.escape(jax.__version__)}, jaxlib \S+, flax \S+, ml_dtypes \S+, "
                        rf"numpy \S+; backend cpu; XLA divisions {division_form()} \(jitted\)\n", done.stdout), done.stdout


def test_help_explains_the_columns_and_cells():
    done = subprocess.run([sys.executable, "-m", "qcheck", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    from qcheck.suite.invariants import INVARIANTS

    for name in (inv.name for inv in INVARIANTS):  # every column the matrix can show
        assert f"\n  {name} " in done.stdout
    for cell in ('"not supported [n]"', '"known defect [n]"', '"FAIL [n]": note or failure n is'):
        assert cell in " ".join(done.stdout.split())


BROKEN_MODULES = [
    ("raises.py", "import qcheck\nx = 1 / 0\n", r"--recipes \S*raises.py: ZeroDivisionError: division by zero "
                                                  r"\(\S*raises.py, line 2\)"),
    ("syntax.py", "def f(:\n", r"--recipes \S*syntax.py: SyntaxError: invalid syntax \(\S*syntax.py, line 1\)"),
    ("missing.py", None, r"--recipes \S*missing.py: .*no such file"),
]


@pytest.mark.parametrize("name, text, message", BROKEN_MODULES, ids=[b[0] for b in BROKEN_MODULES])
def test_a_broken_recipe_module_is_one_line_naming_it(tmp_path, capsys, name, text, message):
    if text is not None:
        (tmp_path / name).write_text(text)
    assert main(["--recipes", str(tmp_path / name), "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.fullmatch("qcheck: error: " + message + "\n", err), err


def test_recipes_given_a_recipe_name_says_to_use_recipe(capsys):
    assert main(["--recipes", "fp8"]) == 2
    assert capsys.readouterr().err == ("qcheck: error: --recipes takes a module (a dotted name or a .py path); "
                                       "'fp8' is a recipe: select it with --recipe fp8\n")


def test_a_missing_golden_dir_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    for argv in (["--recipe", "int8", "--golden-dir", str(missing)], ["golden", "check", "--golden-dir", str(missing)]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"qcheck: error: golden directory {missing} (--golden-dir) does not exist\n"


def test_jobs_must_be_a_positive_number_or_auto(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--jobs", "0"])
    assert exit_.value.code == 2 and "--jobs takes a positive integer or 'auto', got '0'" in capsys.readouterr().err


def test_dense_sparse_rows_report_a_failure(capsys, monkeypatch):
    from qcheck.suite import cli
    from qcheck.suite import invariants

    def broken(case):
        raise AssertionError(f"none-{case.variant.model}: dense and sparse differ by up to 0.5")

    monkeypatch.setattr(invariants, "PATHS", dataclasses.replace(invariants.PATHS, run=broken))
    assert cli.paths_agree_failures(("gemma",)) == ["none-gemma", "none-gemma-drop"]
    assert "dense == sparse  none-gemma         FAIL none-gemma: dense and sparse differ" in capsys.readouterr().out


def test_progress_stays_quiet_where_stderr_is_piped():
    piped = io.StringIO()
    with Progress(3, stream=piped) as progress:
        progress.start("fp8-mixtral-dense")
        progress.advance("fp8-mixtral-dense")
    assert piped.getvalue() == ""
    with Progress(3, stream=Terminal(), enabled=False) as progress:  # --json
        progress.advance("fp8-mixtral-dense")
        assert progress.stream.getvalue() == ""
