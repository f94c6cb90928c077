"""``python -m qcheck``: the matrix the seeds tabulate by hand."""

import json
import subprocess
import sys

import pytest

from qcheck.__main__ import main


def test_matrix_prints_every_case_of_a_recipe_and_passes(capsys):
    # The same layers the invariant tests use, so this costs little beyond them.
    assert main(["--recipe", "nanoo_fp8", "--model", "mixtral", "--path", "sparse", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["recipe", "model", "path", "sites", "exact", "tracks", "state", "rng",
                                           "sharded", "golden"]
    (row,) = [line.split() for line in out.splitlines() if line.startswith("nanoo_fp8")]
    assert row[2] == "sparse" and row[3:6] == ["pass", "pass", "pass"] and row[7:] == ["pass", "-", "pass", "0.0000", "pass"]
    assert 0 < float(row[6]) < 0.22
    assert "all 1 cases pass" in out


def test_matrix_json_has_each_cell_with_its_figure(capsys):
    assert main(["matrix", "--recipe", "int8", "--model", "mixtral", "--path", "dense", "--json", "--jobs", "1"]) == 0
    cells = json.loads(capsys.readouterr().out)
    assert set(cells) == {"int8-mixtral-dense", "int8-mixtral-dense-drop"}
    assert cells["int8-mixtral-dense"]["exact"]["status"] == "n/a"
    assert 0 < cells["int8-mixtral-dense"]["tracks"]["figure"] < 0.22


def test_unknown_names_exit_2_listing_the_valid_ones(capsys):
    assert main(["--recipe", "fp4"]) == 2
    assert "unknown recipe 'fp4'; registered recipes: none, int8" in capsys.readouterr().err
    assert main(["--model", "llama"]) == 2
    assert "unknown model 'llama'; valid models: mixtral, gemma" in capsys.readouterr().err


def test_a_failing_cell_fails_the_matrix(capsys, monkeypatch):
    from qcheck import invariants

    def broken(case):
        raise AssertionError(f"{case.id}: relative norm 0.9 exceeds the bound 0.22")

    patched = tuple(
        invariants.Invariant(i.name, i.applies, broken if i.name == "tracks" else i.run)
        for i in invariants.INVARIANTS
    )
    monkeypatch.setattr(invariants, "INVARIANTS", patched)
    assert main(["--recipe", "int8", "--model", "gemma", "--path", "sparse", "--jobs", "1"]) == 1  # patched here
    captured = capsys.readouterr()
    assert "FAIL AssertionError: int8-gemma-sparse: relative norm 0.9 exceeds the bound 0.22" in captured.out
    assert "1 checks failed: int8-gemma-sparse" in captured.err


def test_jobs_must_be_a_positive_number_or_auto(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--jobs", "0"])
    assert exit_.value.code == 2 and "--jobs takes a positive integer or 'auto', got '0'" in capsys.readouterr().err


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "qcheck", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "matrix" in done.stdout


def test_dense_sparse_rows_report_a_failure(capsys, monkeypatch):
    from qcheck import __main__ as cli
    from qcheck import invariants

    def broken(model, dropping):
        raise AssertionError(f"none-{model}: dense and sparse differ by up to 0.5")

    monkeypatch.setattr(invariants, "check_paths_agree", broken)
    assert cli._paths_agree(("gemma",)) == ["none-gemma", "none-gemma-drop"]
    assert "dense == sparse  none-gemma         FAIL none-gemma: dense and sparse differ" in capsys.readouterr().out
