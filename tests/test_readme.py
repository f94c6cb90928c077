"""The README's Python example runs as written, and its matrix excerpts have the matrix's columns."""

import re
from pathlib import Path

import pytest

from qcheck.suite import invariants

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_the_python_example_runs(capsys):
    (block,) = re.findall(r"<!-- readme: example -->\n```python\n(.*?)```", README, re.S)
    assert len(block.strip().splitlines()) <= 12
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("primitive") and "float8_e4m3fn" in out


def test_the_matrix_excerpts_have_the_matrix_columns():
    headers = [line.split() for line in README.splitlines() if line.startswith("recipe ")]
    assert len(headers) == 2
    for header in headers:
        assert header == ["recipe", "model", "path", *(inv.name for inv in invariants.INVARIANTS)]


def test_the_invariants_table_lists_every_invariant():
    rows = re.findall(r"^\| `(\w+)` \|", README, re.M)
    assert rows == [inv.name for inv in invariants.INVARIANTS]


def test_the_invariants_table_and_the_cli_help_say_what_each_invariant_holds(capsys):
    from qcheck.suite.cli import main

    assert all(inv.doc for inv in invariants.INVARIANTS)
    table = "\n".join(["| invariant | holds |", "|---|---|",
                       *(f"| `{inv.name}` | {inv.doc} |" for inv in invariants.INVARIANTS)])
    assert table in README, "render the README's invariants table from the invariants' doc"
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for inv in invariants.INVARIANTS:
        assert f"{inv.name} {inv.doc}" in help_text, inv.name


def test_the_readme_stays_short():
    lines = len(README.splitlines())
    assert lines <= 150, f"README.md has {lines} lines; details belong in docs/"


def test_the_recipe_guide_names_every_invariant():
    guide = (Path(__file__).parent.parent / "docs" / "adding-a-recipe.md").read_text()
    matrix_step = guide.split("## 3. See it in the matrix", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)`", matrix_step))
    assert not (missing := [inv.name for inv in invariants.INVARIANTS if inv.name not in named]), missing
