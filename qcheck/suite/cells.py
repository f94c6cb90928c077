"""One cell of the suite, a case and an invariant, run one way for every front end.

The matrix, the pytest plugin's items and :class:`qcheck.testing.InvariantTestCase`
all call :func:`run_cell`, so a cell's verdict does not depend on who asks: a
cell its recipe declares (:mod:`qcheck.suite._declared_cells`) is checked as declared
(the library still refuses it, or the invariant still fails as the declared
defect), an invariant that does not apply is ``n/a``, any other cell runs the
invariant, with every assertion it holds.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from qcheck._choices import require_choice
from qcheck.recipes import Unsupported, get_recipe
from qcheck.suite._declared_cells import declared, run_declared
from qcheck.suite.cases import Case

if TYPE_CHECKING:
    from qcheck.suite.invariants import Invariant

__all__ = ["STATUSES", "Verdict", "declared", "invariant_named", "run_cell"]

#: What a cell can be: "unsupported" (the library refuses it) and "known" (a declared defect) are declared cells.
STATUSES = ("pass", "fail", "n/a", "unsupported", "known")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How one cell came out, with the figure its invariant measured or the note of its declaration."""

    status: str  #: one of :data:`STATUSES`
    detail: str = ""  #: a failure's exception type and whole message; a declared cell's note
    figure: float | int | None = None
    #: The exception a failed cell raised, for a front end that reports it as a test failure of its own.
    error: BaseException | None = dataclasses.field(default=None, compare=False, repr=False)

    def raise_failure(self) -> None:
        """Raise the failure, if the cell failed: a front end's test fails exactly as the invariant did."""
        __tracebackhide__ = True
        if self.error is not None:
            raise self.error


def _failed(e: BaseException) -> Verdict:
    return Verdict("fail", f"{type(e).__name__}: {e}", error=e)


def invariant_named(name: str) -> Invariant:
    """The invariant called ``name``, as :data:`~qcheck.suite.invariants.INVARIANTS` has it now."""
    from qcheck.suite.invariants import INVARIANTS

    by_name = {i.name: i for i in INVARIANTS}
    return by_name[require_choice("invariant", name, by_name)]


def run_cell(case: Case, invariant: str | Invariant) -> Verdict:
    """The verdict of ``invariant`` on ``case``; never raises for the cell's own failure (its verdict says it).

    ``invariant``: a name in :data:`~qcheck.suite.invariants.INVARIANTS`, or an
    invariant as a run bound it (:meth:`~qcheck.suite.invariants.RunEnv.bind`).
    """
    inv = invariant_named(invariant) if isinstance(invariant, str) else invariant
    recipe = get_recipe(case.recipe)
    found = declared(recipe, case.variant, inv.name)
    if found is not None:
        try:
            note = run_declared(case, inv)  # fails once the declaration is stale
        except Exception as e:  # noqa: BLE001 - a cell reports any failure
            return _failed(e)
        return Verdict("unsupported" if isinstance(found, Unsupported) else "known", note)
    if not inv.applies(recipe, case.variant):
        return Verdict("n/a")
    try:
        figure = inv.run(case)
    except Exception as e:  # noqa: BLE001 - a cell reports any failure, as the seeds' table does
        return _failed(e)
    return Verdict("pass", figure=figure)
