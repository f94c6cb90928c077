"""The ``golden`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

from pathlib import Path

from qcheck.recipes import Recipe
from qcheck.suite.cases import Case, Variant
from qcheck.suite import golden as golden_cases

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("the case matches its golden file: codes and entry parameters exactly, outputs and gradients within the "
       "tolerance stored in the file")


def run(case: Case, golden_root: Path = Path("golden")) -> None:
    """The case matches its golden file (qcheck's own recipes: the package's; others: ``golden_root``'s).

    A run binds ``golden_root`` once (:class:`RunEnv`); the other invariants need nothing but the case.
    """
    __tracebackhide__ = True
    v = case.variant
    gcase = golden_cases.GoldenCase(case.recipe, v.model, v.path, v.dropping)
    golden_cases.assert_case_matches(gcase, golden_cases.root_for(case.recipe, golden_root))


def applies(recipe: Recipe, variant: Variant) -> bool:
    # Every variant, against the package's golden cases and ./golden; a run binds its own directory (RunEnv).
    return True
