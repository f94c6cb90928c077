"""The matrix the seeds tabulate by hand: every case, every invariant, pass or how it failed.

A cell is ``pass`` (with its figure where the check measures one: ``tracks``
the relative norm against ``none``, ``sharded`` the largest difference from the
single-device output, ``rng`` the u32 entry parameters of the train step,
``referee`` the worst difference from the float64 referee relative to a token's norm),
``-`` (the invariant does not apply to the case) or ``FAIL [n]``, where ``[n]``
points to the failure's full text below the table (and in ``--json``): the
diagnosis and the command that fixes it are never cut. A cell its recipe
declares (:mod:`qcheck.suite.cells`) reads ``not supported [n]`` (the
library refuses the case) or ``known defect [n]`` (the check fails as declared),
its note the library, version and reason; it turns ``FAIL`` once untrue.

Cases are independent (same seed, same bits in any process), so the matrix can
run them in worker processes (:func:`worker_pool`): compiling dominates and is
single-threaded, so two workers on two cores take between half and two thirds
of one process's time (docs/performance.md has the measurements).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed

from qcheck.suite import _process
from qcheck.suite.progress import Progress
from qcheck.suite import invariants
from qcheck.suite.cells import run_cell
from qcheck.suite.cases import Case, cases
from qcheck.recipes import get_recipe

__all__ = ["Cell", "PathsRow", "Row", "default_jobs", "failures", "format_table", "notes", "run_matrix",
           "run_paths_agree",
           "to_json", "worker_pool"]


@dataclasses.dataclass(frozen=True)
class Cell:
    status: str  #: "pass", "fail", "n/a", "unsupported" (the library refuses it) or "known" (a declared defect)
    detail: str = ""  #: for a failure, the exception type and its whole message; for a declared cell, its note
    figure: float | int | None = None

    def text(self, note: int | None = None) -> str:
        if self.status == "pass":
            if self.figure is None:
                return "pass"
            return f"pass {self.figure}" if isinstance(self.figure, int) else f"pass {self.figure:.4f}"
        if self.status == "n/a":
            return "-"
        word = _WORDS.get(self.status, "FAIL")
        return word if note is None else f"{word} [{note}]"


# Declared cells (qcheck.suite._declared_cells): checked like any other, their note says what the library does.
_WORDS = {"unsupported": "not supported", "known": "known defect"}


@dataclasses.dataclass(frozen=True)
class Row:
    case: Case
    cells: dict[str, Cell]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.cells.values())


def _cell(inv: invariants.Invariant, case: Case) -> Cell:
    verdict = run_cell(case, inv)  # the exception stays here: a worker sends back what pickles
    return Cell(verdict.status, verdict.detail, verdict.figure)


def _row(case: Case, env: invariants.RunEnv) -> Row:
    # The run's env travels with each case to the workers (bound invariants hold closures, which do not pickle).
    return Row(case, {inv.name: _cell(inv, case) for inv in env.invariants})


def run_matrix(
    recipes: tuple[str, ...] | None = None,
    *,
    models: tuple[str, ...] | None = None,
    paths: tuple[str, ...] | None = None,
    executor: Executor | None = None,
    env: invariants.RunEnv = invariants.RunEnv(),
    progress: Progress | None = None,
) -> list[Row]:
    """A row per case, in table order; computed in ``executor``'s workers when given.

    ``progress`` hears of each case as it starts (in this process) or ends.
    """
    selected = cases(recipes, models=models, paths=paths)
    progress = progress or Progress(len(selected), enabled=False)
    if executor is None:
        rows = []
        for c in selected:
            progress.start(c.id)
            rows.append(_row(c, env))
            progress.advance(c.id)
        return rows
    # The costliest cases (the RNG invariant's decoder stacks) first, so no
    # worker is left with one at the end while the others idle.
    rng = next(inv for inv in invariants.INVARIANTS if inv.name == "rng")
    order = sorted(selected, key=lambda c: not rng.applies(get_recipe(c.recipe), c.variant))
    futures = {executor.submit(_row, c, env): c for c in order}
    done = {}
    for future in as_completed(futures):
        done[futures[future]] = future.result()
        progress.advance(futures[future].id)
    return [done[c] for c in selected]


@dataclasses.dataclass(frozen=True)
class PathsRow:
    """Dense against sparse for the unquantized layer of one model, with or without dropping."""

    model: str
    dropping: bool
    cell: Cell

    @property
    def label(self) -> str:
        return f"none-{self.model}" + ("-drop" if self.dropping else "")


def _paths_row(model: str, dropping: bool) -> PathsRow:
    return PathsRow(model, dropping, _cell(invariants.PATHS, invariants.paths_case(model, dropping)))


def run_paths_agree(models: tuple[str, ...], *, executor: Executor | None = None) -> list[PathsRow]:
    """:data:`~qcheck.suite.invariants.PATHS` per model, without and with dropping."""
    pairs = [(m, d) for m in models for d in (False, True)]
    run = map if executor is None else executor.map
    return list(run(_paths_row, *zip(*pairs)))


def default_jobs() -> int:
    """Worker processes for ``--jobs auto``: one per CPU, on CPU-only JAX; one process with an accelerator.

    Every process would claim the accelerator's memory, and the programs are
    not what is slow there.
    """
    from importlib import metadata

    if os.environ.get("JAX_PLATFORMS", "cpu") != "cpu" or any(
        (d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm", "libtpu"))
        for d in metadata.distributions()
    ):
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _init_worker(recipe_modules: tuple[str, ...], cache_dir: str) -> None:
    from qcheck.recipes import import_recipes

    _process.setup(worker=True, cache_dir=cache_dir)  # this process has not started a backend yet
    _process.collect_less()  # a worker of qcheck's own command
    for spec in recipe_modules:
        import_recipes(spec)


@contextlib.contextmanager
def worker_pool(jobs: int, recipe_modules: tuple[str, ...] = ()) -> Iterator[Executor | None]:
    """``jobs`` worker processes for :func:`run_matrix` (``None`` for one: run in this process).

    Each worker imports ``recipe_modules``, runs one intra-op thread, and shares
    a compilation cache with the others (``$QCHECK_XLA_CACHE``'s if any, else one
    made for the pool and removed after it), so a program two workers need is
    compiled once. Workers are spawned, not forked: JAX does not survive a fork.
    """
    if jobs <= 1:
        yield None
        return
    cache = _process.persistent_cache_dir(default=False)  # the command's choice, or the user's
    made = None if cache else tempfile.mkdtemp(prefix="qcheck-xla-")
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                                 initargs=(tuple(recipe_modules), cache or made)) as executor:
            yield executor
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)


def failures(rows: list[Row]) -> list[tuple[str, str, str]]:
    """``(case id, invariant, full text)`` of every failed cell, in table order: the notes under the table."""
    return [(r.case.id, n, c.detail) for r in rows for n, c in r.cells.items() if c.status == "fail"]


def notes(rows: list[Row]) -> list[tuple[str, str, str]]:
    """``(case id, invariant, full text)`` of every failed or declared cell, in table order."""
    return [(r.case.id, n, c.detail) for r in rows for n, c in r.cells.items()
            if c.status in ("fail", *_WORDS)]


def format_table(rows: list[Row]) -> str:
    """The table, then every failure and declared cell in full, numbered as its cell says."""
    names = [inv.name for inv in invariants.INVARIANTS]
    listed = notes(rows)
    numbers = {(case_id, n): i for i, (case_id, n, _) in enumerate(listed, 1)}
    header = ["recipe", "model", "path", *names]
    body = [
        [r.case.recipe, r.case.variant.model, r.case.variant.id.split("-", 1)[1],
         *(r.cells[n].text(numbers.get((r.case.id, n))) for n in names)]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    fmt = lambda line: "  ".join(s.ljust(w) for s, w in zip(line, widths)).rstrip()  # noqa: E731
    lines = [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body)]
    for i, (case_id, name, text) in enumerate(listed, 1):
        lines += ["", f"[{i}] {case_id} {name}:", *("    " + t for t in text.splitlines())]
    return "\n".join(lines)


def to_json(rows: list[Row]) -> str:
    return json.dumps(
        {r.case.id: {n: dataclasses.asdict(c) for n, c in r.cells.items()} for r in rows},
        indent=2,
        sort_keys=True,
    )
