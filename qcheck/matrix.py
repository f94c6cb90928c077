"""The matrix the seeds tabulate by hand: every case, every invariant, pass or how it failed."""

from __future__ import annotations

import dataclasses
import json

from qcheck import invariants
from qcheck.cases import Case, cases
from qcheck.recipes import get_recipe

__all__ = ["Cell", "Row", "format_table", "run_matrix", "to_json"]


@dataclasses.dataclass(frozen=True)
class Cell:
    status: str  #: "pass", "fail" or "n/a"
    detail: str = ""  #: the figure, or the exception type and message
    figure: float | int | None = None

    def text(self) -> str:
        if self.status == "pass":
            if self.figure is None:
                return "pass"
            return f"pass {self.figure}" if isinstance(self.figure, int) else f"pass {self.figure:.4f}"
        return "-" if self.status == "n/a" else f"FAIL {self.detail}"


@dataclasses.dataclass(frozen=True)
class Row:
    case: Case
    cells: dict[str, Cell]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.cells.values())


def _run(check, case: Case) -> Cell:
    try:
        figure = check(case)
    except Exception as e:  # noqa: BLE001 - a cell reports any failure, as the seeds' table does
        first_line = str(e).splitlines()[0] if str(e) else ""
        return Cell("fail", f"{type(e).__name__}: {first_line}"[:160])
    return Cell("pass", figure=figure)


def run_matrix(
    recipes: tuple[str, ...] | None = None,
    *,
    models: tuple[str, ...] | None = None,
    paths: tuple[str, ...] | None = None,
) -> list[Row]:
    rows = []
    for case in cases(recipes, models=models, paths=paths):
        recipe = get_recipe(case.recipe)
        cells = {
            inv.name: _run(inv.run, case) if inv.applies(recipe, case.variant) else Cell("n/a")
            for inv in invariants.INVARIANTS
        }
        rows.append(Row(case, cells))
    return rows


def format_table(rows: list[Row]) -> str:
    names = [inv.name for inv in invariants.INVARIANTS]
    header = ["recipe", "model", "path", *names]
    body = [
        [r.case.recipe, r.case.variant.model, r.case.variant.id.split("-", 1)[1],
         *(r.cells[n].text() for n in names)]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    fmt = lambda line: "  ".join(s.ljust(w) for s, w in zip(line, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body)])


def to_json(rows: list[Row]) -> str:
    return json.dumps(
        {r.case.id: {n: dataclasses.asdict(c) for n, c in r.cells.items()} for r in rows},
        indent=2,
        sort_keys=True,
    )
