"""Cells a recipe declares: what its library refuses (Unsupported) and the library defects a check catches.

Both are checked, never skipped: a refused cell runs the library's own
reproduction of the refusal (:func:`qcheck.recipes.assert_still_unsupported`),
a known defect runs the invariant and asserts its failure message. Either
raises AssertionError, telling to drop the declaration, once it no longer holds.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

from qcheck._choices import require_choice
from qcheck.recipes import KnownDefect, Recipe, Unsupported, assert_still_unsupported, get_recipe
from qcheck.suite.cases import Case, Variant

if TYPE_CHECKING:
    from qcheck.suite.invariants import Invariant

#: The invariants each kind of refusal covers: "gradient", every check that differentiates the layer.
KIND_INVARIANTS = {"gradient": frozenset({"backward", "grads", "state", "train", "rng"})}
#: Of those, the ones that say "not supported" for any recipe; the others (fp8 state, RNG plumbing) only
#: where they would run for the recipe at all, else they stay "-".
_ALWAYS = frozenset({"backward", "grads"})


def declared(recipe: Recipe, variant: Variant, invariant: str) -> Unsupported | KnownDefect | None:
    """The recipe's declaration covering ``invariant`` on the variant's path, if any (refusals first)."""
    from qcheck.suite import invariants

    for u in recipe.expect.unsupported:
        if variant.path in u.paths and invariant in KIND_INVARIANTS[u.kind]:
            if invariant in _ALWAYS or any(i.name == invariant and i.applies(recipe, variant)
                                           for i in invariants.INVARIANTS):
                return u
    found = [d for d in recipe.expect.known_defects
             if variant.path in d.paths and invariant == d.invariant and (not d.models or variant.model in d.models)
             and d.dropping in (None, variant.dropping) and not d.fixed_here]
    # Where defects seen on other versions cover the same cell, the one seen on the installed version answers.
    return next((d for d in found if d.seen_here), found[0] if found else None)


@functools.cache
def _refusal(declared_: Unsupported) -> str:
    # One run of the library per declaration and process: every cell it covers asks the same question.
    return assert_still_unsupported(declared_, declared_.library)


def run_declared(case: Case, invariant: str | Invariant) -> str:
    """The note for a declared cell, after checking the declaration still holds; AssertionError if not.

    ``invariant``: a name in :data:`~qcheck.suite.invariants.INVARIANTS`, or an
    invariant as a run bound it (:meth:`~qcheck.suite.invariants.RunEnv.bind`).
    """
    __tracebackhide__ = True
    from qcheck.suite import invariants

    if isinstance(invariant, str):
        by_name = {i.name: i for i in invariants.INVARIANTS}
        inv = by_name[require_choice("invariant", invariant, by_name)]
    else:
        inv = invariant
    found = declared(get_recipe(case.recipe), case.variant, inv.name)
    if found is None:
        raise ValueError(f"{case.id}: no Unsupported or KnownDefect declaration covers invariant {inv.name!r}")
    if isinstance(found, Unsupported):
        return _refusal(found)
    try:
        inv.run(case)
    except AssertionError as e:
        if not re.search(found.match, str(e)):
            raise AssertionError(f"{case.id}: {inv.name} fails, but not as the declared {found.library} defect "
                                 f"({found.match!r}): {e}") from None
        return f"{found.text()} ({e})"
    if not found.seen_here:  # a version it was never seen on: say so, as a pass
        on = found.keyed_on
        return (f"known defect of {found.library} (seen on {'' if on == found.library else on + ' '}"
                f"{', '.join(found.seen)}) does not show on {on} {found.keyed_version}: {inv.name} passes "
                f"({found.reason}); if it is fixed there, declare fixed_in={found.keyed_version!r}")
    raise AssertionError(f"{case.id}: {inv.name} passes where {found.library} {found.version} has the declared "
                         f"defect ({found.reason}): fixed upstream? drop the KnownDefect declaration")


def check_golden_case(case, root) -> str:
    """Check a golden case (a :class:`~qcheck.suite.golden.GoldenCase` in ``root``): ``"match"``, or, where its
    recipe declares a library defect on its golden cell, the defect's note once it is shown still to hold."""
    __tracebackhide__ = True
    from qcheck.suite import golden
    from qcheck.suite.invariants import INVARIANTS, RunEnv

    cell = Case(case.recipe, Variant(case.model, case.path, case.dropping))
    if declared(get_recipe(case.recipe), cell.variant, "golden") is not None:
        return run_declared(cell, RunEnv(root).bind(next(i for i in INVARIANTS if i.name == "golden")))
    golden.assert_case_matches(case, root)
    return "match"
