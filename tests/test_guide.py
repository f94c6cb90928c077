"""docs/adding-a-recipe.md, followed step by step with a recipe module outside the repository.

The recipe module and the commands are read out of the guide itself, so the
guide cannot drift from what works. Everything runs in this process, so the
layers it shares with the rest of the suite are not built twice (the registry
is restored afterwards); the pytest step runs one model and path of the new
recipe, without -n.
"""

import re
import shlex
from pathlib import Path

import pytest

from qcheck.suite import golden
from tests.helpers import INNER
from qcheck.suite.cli import main
from qcheck.recipes import registered
from qcheck.recipes._registry import step_aside

REPO = Path(__file__).parent.parent
GUIDE = (REPO / "docs" / "adding-a-recipe.md").read_text()
PLACEHOLDER = "/path/to/my_recipes.py"


def guide_blocks(kind: str) -> list[str]:
    return re.findall(rf"<!-- guide: {kind} -->\n```\w+\n(.*?)```", GUIDE, re.S)


@pytest.fixture
def registry():
    """Whatever the guide registers is gone again after the test.

    A recipe of the same name registered by the run itself (someone following
    the guide, then running the suite with --qcheck-recipes) steps aside meanwhile.
    """
    with registered():
        for name in re.findall(r'qcheck\.Recipe\(\s*"(\w+)"', guide_blocks("recipe module")[0]):
            step_aside(name)
        yield


def test_the_guide_takes_a_new_recipe_from_nothing_to_a_passing_suite(tmp_path, monkeypatch, capsys, registry,
                                                                      pytester):
    (module_text,) = guide_blocks("recipe module")
    add, matrix, suite = (shlex.split(b.strip()) for b in guide_blocks("step"))
    module = tmp_path / "elsewhere" / "my_recipes.py"
    module.parent.mkdir()
    module.write_text(module_text)
    golden_root = pytester.path / "golden"  # the project's own directory, found by default
    monkeypatch.chdir(pytester.path)
    fill = lambda argv: [a.replace(PLACEHOLDER, str(module)) for a in argv]  # noqa: E731
    name = add[add.index("add") + 1]

    # Step 2: one command writes the five cases, into the project's ./golden.
    assert add[:1] == ["qcheck"]
    assert main(fill(add)[1:]) == 0
    assert sorted(p.name for p in (golden_root / name).iterdir()) == [
        "gemma-dense.json", "gemma-sparse.json", "mixtral-dense-drop.json", "mixtral-dense.json",
        "mixtral-sparse.json"]
    assert "5 new" in capsys.readouterr().out

    # Step 3: the module's recipes, and only they, in the matrix, passing (in this
    # process: the layers it shares with the suite are built already; workers get
    # the module too, see tests/test_determinism.py).
    assert matrix[:1] == ["qcheck"]
    assert main(fill(matrix)[1:] + ["--model", "mixtral", "--jobs", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[1:2] == ["mixtral"]]
    assert {r[0] for r in rows} == {name} and len(rows) == 3
    assert all(r[3] == "pass" and "FAIL" not in r for r in rows)

    # Step 4: from the project, the flag alone brings the invariant suite, for the module's recipes only.
    assert suite[:3] == ["pytest", "-n", "auto"]
    args = fill(suite)[3:] + [*INNER, "-k", "mixtral-dense and not drop"]
    run = pytester.inline_run(*args)
    assert run.ret == 0
    passed = sorted(r.nodeid.split("::")[-1] for r in run.getreports("pytest_runtest_logreport")
                    if r.when == "call" and r.passed)
    assert passed == [f"test_call_sites_share_no_state[{name}-mixtral-dense]",
                      f"test_every_call_site_matmul_is_quantized[{name}-mixtral-dense]",
                      f"test_fresh_sites_equal_cast_reference_bitwise[{name}-mixtral-dense]",
                      f"test_fresh_sites_gradients_equal_referee_gradient_matmuls_bitwise[{name}-mixtral-dense]",
                      f"test_golden_case[{name}-mixtral-dense]",
                      f"test_layer_stays_finite_and_exact_on_edge_rows[{name}-mixtral-dense]",
                      f"test_layer_tracks_unquantized_twin[{name}-mixtral-dense]",
                      f"test_sharded_layer_computes_the_same_function[{name}-mixtral-dense]",
                      f"test_train_step_gradients_track_unquantized_twin[{name}-mixtral-dense]"]


def test_the_guide_registers_a_recipe_for_one_test():
    import qcheck

    (block,) = guide_blocks("registered")
    ran = {}
    exec(compile(block, "docs/adding-a-recipe.md", "exec"), ran)
    name = ran["planted"].name
    assert name not in qcheck.recipe_names()  # registered for the block only
    with pytest.raises(ValueError, match=rf"unknown recipe '{name}'"):
        qcheck.get_recipe(name)


def test_the_guides_registration_example_fails_on_a_registration_that_leaks(monkeypatch):
    import contextlib

    import qcheck
    from qcheck import register_recipe

    @contextlib.contextmanager
    def leaky(*recipes):  # the bug: registers, never restores
        for recipe in recipes:
            register_recipe(recipe)
        yield recipes

    (block,) = guide_blocks("registered")
    monkeypatch.setattr(qcheck, "registered", leaky)
    with registered(), pytest.raises(AssertionError):  # the outer block takes the leaked recipe away again
        exec(compile(block, "docs/adding-a-recipe.md", "exec"), {})
