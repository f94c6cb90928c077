"""Running a cell a recipe declares a known upstream defect for: it must fail, with the declared message."""

from __future__ import annotations

from collections.abc import Callable

from qcheck.recipes import KnownDefect, Recipe
from qcheck.suite.cases import Variant

__all__ = ["assert_known_defect_reproduces", "known_defect"]


def known_defect(recipe: Recipe, invariant: str, variant: Variant) -> KnownDefect | None:
    """The defect ``recipe`` declares for ``invariant`` on ``variant``, if any."""
    found = [d for d in recipe.known_defects if d.invariant == invariant and d.variant == variant.id]
    return found[0] if found else None


def assert_known_defect_reproduces(check: Callable[[], object], defect: KnownDefect, label: str) -> str:
    """Run ``check``; it must raise AssertionError matching ``defect.match``. Returns the failure's message."""
    __tracebackhide__ = True
    try:
        check()
    except AssertionError as e:
        message = str(e)
        if not defect.matches(message):
            raise AssertionError(
                f"{label}: known defect ({defect.reason}): {defect.invariant} failed, but not with a message "
                f"matching {defect.match!r}: {message}") from None
        return message
    raise AssertionError(
        f"{label}: known defect no longer reproduces: {defect.invariant} passes ({defect.reason}); "
        "remove it from the recipe's known_defects and say which library version fixed it")
