"""Writing golden cases: what ``qcheck golden add/update`` and ``pytest --update-golden`` run.

Each case is recorded (:mod:`qcheck.suite.golden.record`), compared with the
file it would replace (:mod:`qcheck.suite.golden.compare`) to say what
changed, and only then stored (:mod:`qcheck.suite.golden.store`): all of a
command's files or none.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qcheck.recipes import get_recipe
from qcheck.suite import _toolchain
from qcheck.suite.progress import Progress
from qcheck.suite.golden.compare import bitwise_same, differences, moved_within_tolerance
from qcheck.suite.golden.record import measure
from qcheck.suite.golden.store import (GoldenCase, GoldenFileError, check_writable, read_case, render, root_for,
                                       to_record, update_command, write_files)

__all__ = ["summarize", "write_case", "write_cases"]

_OUTCOMES = ("new", "changed", "replaced", "unchanged", "refused")


def summarize(lines: list[str]) -> str:
    """``"2 new, 1 changed, 0 replaced, 25 unchanged"`` for the lines :func:`write_case` returned."""
    counts = {k: sum(f": {k}" in line for line in lines) for k in _OUTCOMES}
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def write_cases(cases: list[GoldenCase], user: Path, *, overwrite: bool,
                progress: Progress | None = None) -> list[str]:
    """Measure every case, then write all of their files or none; returns a summary line per case.

    Each case goes to :func:`~qcheck.suite.golden.store.root_for` its recipe.
    Without ``overwrite`` an existing file is a FileExistsError before anything
    is measured. Nothing is written until every case is measured, and a failure
    while writing restores whatever had been written already
    (:func:`~qcheck.suite.golden.store.write_files`), so a recipe never ends up
    half-recorded. ``progress`` hears of each case as it is measured.
    """
    targets = [(c, root_for(c.recipe, user)) for c in cases]
    if not overwrite and (taken := [str(c.file(r)) for c, r in targets if c.file(r).exists()]):
        raise FileExistsError(
            f"golden files exist, nothing written: {', '.join(taken)}; rewrite them with "
            f"`{update_command(cases[0].recipe, targets[0][1])}`")
    for directory in {r for _, r in targets}:
        check_writable(directory)
    progress = progress or Progress(len(targets), enabled=False)
    planned = []
    for c, r in targets:
        progress.start(c.id)
        planned.append(_plan(c, r, overwrite=overwrite))
        progress.advance(c.id)
    write_files([(path, text) for path, text, _ in planned if text is not None])
    return [line for _, _, line in planned]


def _plan(case: GoldenCase, root: Path, *, overwrite: bool) -> tuple[Path, str | None, str]:
    """What writing ``case`` would do: the file, its new text (None: leave it) and the summary line.

    The file is the main one, unless the main one was written by a toolchain computing its divisions in another
    form (:meth:`GoldenCase.form_file`): then this toolchain's values go beside it, and only where they differ
    from the main file's, so no toolchain overwrites another's reference.
    """
    path = case.file(root)
    values = measure(case)
    if not _finite(values):
        return path, None, f"{path}: refused: its output or gradients are not finite, and a golden case never pins NaN"
    if path.exists() and overwrite:
        try:
            main = read_case(case, root)
        except GoldenFileError:
            main = None
        form = _toolchain.division_form()
        if main is not None and main.record["provenance"].get("xla_form", form) != form:
            if form == "unknown":  # no file could hold it: the referee would hold this toolchain's values to nothing
                return path, None, (f"{path}: refused: XLA computes its divisions in a form the referee does not know "
                                    f"(qcheck --version), so no file of this toolchain's values is written")
            beside = case.form_file(root, form)
            if not beside.exists() and not differences(main, values):
                return beside, None, f"{path}: unchanged (this toolchain's values match it)"
            path = beside
            if not path.exists():
                return path, render(to_record(case, values, tolerance=main.tolerance)), f"{path}: new"
    if path.exists():
        if not overwrite:
            raise FileExistsError(
                f"golden file {path} exists; rewrite it with `{update_command(case.recipe, root)}` "
                "or `pytest --update-golden`")
        try:
            stored = read_case(case, root, path)
        except GoldenFileError as e:
            return path, render(to_record(case, values)), f"{path}: replaced an unusable file ({e})"
        if bitwise_same(stored, values):
            return path, None, f"{path}: unchanged"
        what = differences(stored, values) or [moved_within_tolerance(stored, values)]
        return (path, render(to_record(case, values, tolerance=stored.tolerance)),
                f"{path}: changed: " + "; ".join(what))
    return path, render(to_record(case, values)), f"{path}: new"


def _finite(values: dict) -> bool:
    return bool(np.all(np.isfinite(np.asarray(values["output"])))
                and all(np.all(np.isfinite(np.asarray(g))) for g in values["grads"].values()))


def write_case(case: GoldenCase, root: Path, *, overwrite: bool) -> str:
    """Measure ``case`` and write its file atomically; returns a one-line summary of what changed.

    Without ``overwrite`` an existing file is a FileExistsError. With it, a file
    whose values are bitwise unchanged is left alone (its provenance too).
    """
    get_recipe(case.recipe)
    path, text, line = _plan(case, root, overwrite=overwrite)
    if text is not None:
        write_files([(path, text)])
    return line
