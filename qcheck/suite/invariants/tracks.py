"""The ``tracks`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

from qcheck import checks
from qcheck.recipes import Recipe, get_recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("the layer stays within the recipe's relative-norm bound of its unquantized twin and is not equal to it "
       "(the figure: the norm)")


def run(case: Case) -> float:
    """The layer output tracks its unquantized twin within the recipe's bound, and is not equal to it."""
    __tracebackhide__ = True
    recipe = get_recipe(case.recipe)
    figure = checks.assert_tracks(cases_mod.layer_output(case), cases_mod.layer_output(case.reference),
                                  max_rel_norm=recipe.expect.max_rel_norm, label=case.id)
    if not figure > 0:
        raise AssertionError(f"{case.id}: the layer output is {figure} from the unquantized twin's (relative norm): "
                             "a quantized layer that computes the twin's output exactly quantized nothing")
    return figure


def applies(recipe: Recipe, variant: Variant) -> bool:
    return recipe.quantized
