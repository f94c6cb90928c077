"""Comparing a golden case with this run: what drifted, by how much, and both sides' provenance.

Codes and entry parameters compare exactly; the output, the relative norm and
the gradients within the tolerance stored in the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qcheck.checks.harness import assertion
from qcheck.recipes import recipe_names
from qcheck.suite.golden.record import measure
from qcheck.suite.golden.store import (GoldenCase, Stored, add_command, builtin_root, grad_sample, provenance,
                                       toolchain_file,
                                       read_case, to_record, update_command)

__all__ = ["bitwise_same", "assert_case_matches", "differences", "moved_within_tolerance"]


def differences(stored: Stored, values: dict[str, Any]) -> list[str]:
    """What differs between a stored case and measured ``values``, one line per key; empty if it matches."""
    tol, out = stored.tolerance, []
    got, want = np.asarray(values["output"]), stored.output
    if got.shape != want.shape or got.dtype != want.dtype:
        out.append(f"output: got shape {got.shape} {got.dtype}, golden {want.shape} {want.dtype}")
    else:
        rtol, atol = tol["output"]["rtol"], tol["output"]["atol"]
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        bad = ~(diff <= atol + rtol * np.abs(want.astype(np.float64)))
        if bad.any():
            i = np.unravel_index(np.argmax(np.where(bad, diff, -1)), diff.shape)
            i = tuple(int(j) for j in i)
            out.append(
                f"output: {int(bad.sum())} of {bad.size} values outside rtol {rtol}, atol {atol}; "
                f"worst at {i}: got {got[i]!r}, golden {want[i]!r} (|diff| {diff[i]:.3g})")
    rel, golden_rel = float(values["rel_norm"]), float(stored.record["rel_norm"])
    if not abs(rel - golden_rel) <= tol["rel_norm"]["atol"]:
        out.append(f"rel_norm: got {rel:.6g}, golden {golden_rel:.6g} (atol {tol['rel_norm']['atol']})")
    if dict(values["entry_params"]) != stored.record["entry_params"]:
        out.append(f"entry_params: got {dict(values['entry_params'])}, golden {stored.record['entry_params']}")
    out += _grad_differences(stored, values["grads"])
    codes = values["codes"]
    if set(codes) != set(stored.codes):
        out.append(f"codes: got keys {sorted(codes)}, golden {sorted(stored.codes)}")
    for k in sorted(set(codes) & set(stored.codes)):
        g, w = np.asarray(codes[k]), stored.codes[k]
        if g.shape != w.shape or g.dtype != w.dtype:
            out.append(f"codes[{k!r}]: got shape {g.shape} {g.dtype.name}, golden {w.shape} {w.dtype.name}")
            continue
        # Bytes per element, flattened: a view cannot change the itemsize of a 0-d array.
        gb = g.reshape(-1).view(np.uint8).reshape(g.size, -1)
        wb = w.reshape(-1).view(np.uint8).reshape(w.size, -1)
        mismatch = np.any(gb != wb, axis=-1)
        if mismatch.any():
            j = int(np.argmax(mismatch))
            i = tuple(int(n) for n in np.unravel_index(j, g.shape))
            out.append(
                f"codes[{k!r}]: {int(mismatch.sum())} of {mismatch.size} differ, first at {i}: "
                f"got {g[i]!r} (0x{gb[j].tobytes()[::-1].hex()}), golden {w[i]!r} (0x{wb[j].tobytes()[::-1].hex()})")
    return out


def _outside(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> tuple[np.ndarray, np.ndarray]:
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return ~(diff <= atol + rtol * np.abs(want.astype(np.float64))), diff


def _grad_differences(stored: Stored, grads: dict[str, np.ndarray]) -> list[str]:
    """Each gradient leaf's sample, elementwise, and its norm, within the ``grads`` tolerance."""
    rtol, atol = stored.tolerance["grads"]["rtol"], stored.tolerance["grads"]["atol"]
    if set(grads) != set(stored.grads):
        return [f"grads: got leaves {sorted(grads)}, golden {sorted(stored.grads)}"]
    out = []
    for k in sorted(grads):
        stride, got = grad_sample(grads[k])
        want, summary = stored.grads[k], stored.record["grads_summary"][k]
        if got.shape != want.shape or got.dtype != want.dtype or stride != summary.get("stride"):
            out.append(f"grads[{k!r}]: got a sample of {got.shape} {got.dtype} (stride {stride}), golden "
                       f"{want.shape} {want.dtype} (stride {summary.get('stride')})")
            continue
        bad, diff = _outside(got, want, rtol, atol)
        if bad.any():
            i = int(np.argmax(np.where(bad, diff, -1)))
            out.append(f"grads[{k!r}]: {int(bad.sum())} of {bad.size} sampled values outside rtol {rtol}, atol "
                       f"{atol}; worst at element {i * stride}: got {got[i]!r}, golden {want[i]!r} "
                       f"(|diff| {diff[i]:.3g})")
        norm = float(np.linalg.norm(np.asarray(grads[k], np.float64)))
        if not abs(norm - summary["norm"]) <= rtol * abs(summary["norm"]):
            out.append(f"grads[{k!r}]: norm {norm:.9g}, golden {summary['norm']:.9g} (rtol {rtol})")
    return out


def bitwise_same(stored: Stored, values: dict[str, Any]) -> bool:
    """Whether ``values`` would be stored as the very bits ``stored`` holds (provenance aside)."""
    fresh = to_record(GoldenCase(**{k: stored.record["case"][k] for k in ("recipe", "model", "path", "dropping")}),
                      values, tolerance=stored.tolerance)
    keys = ("rel_norm", "entry_params", "codes", "output", "grads_summary", "grads")
    return all(fresh[k] == stored.record[k] for k in keys)


def moved_within_tolerance(stored: Stored, values: dict[str, Any]) -> str:
    """How far ``values`` moved from ``stored`` where :func:`differences` found nothing outside tolerance."""
    got, want = np.asarray(values["output"], np.float64), stored.output.astype(np.float64)
    moved = int(np.sum(got != want))
    rel = abs(float(values["rel_norm"]) - float(stored.record["rel_norm"]))
    return (f"within tolerance: output {moved} of {got.size} values moved, max |diff| "
            f"{float(np.max(np.abs(got - want))):.2g}; rel_norm moved {rel:.2g}")


def _provenance_line(p: dict[str, Any]) -> str:
    return (f"jax {p.get('jax')}, jaxlib {p.get('jaxlib')}, flax {p.get('flax')}, ml_dtypes {p.get('ml_dtypes')}, "
            f"numpy {p.get('numpy')}, backend {p.get('backend')} ({p.get('device_kind')}), "
            f"seed {p.get('seed')}, {p.get('date')}")


@assertion
def assert_case_matches(case: GoldenCase, root: Path, *, label: str = "") -> None:
    """Assert the case's current numerics match its golden file.

    A missing file fails with the exact command that creates it; an unusable
    file raises :class:`GoldenFileError`; a mismatch says which key, how far,
    and both sides' provenance. Every message names the case (or its file), so
    callers need no ``label``.
    """
    __tracebackhide__ = True
    path = case.file(root)
    if case.recipe not in recipe_names():
        raise AssertionError(
            f"golden case {case.id} ({path}) is for recipe {case.recipe!r}, which is not registered "
            f"(registered: {', '.join(recipe_names())}); name its module with --qcheck-recipes / "
            "--recipes, or install the package that provides it")
    if not path.exists():
        if Path(root).resolve() == builtin_root():
            raise AssertionError(
                f"golden case {case.id} has no file ({path}): it ships with qcheck, so this installation "
                "is incomplete; reinstall qcheck")
        raise AssertionError(
            f"golden case {case.id} has no file ({path}); create the recipe's cases with:\n"
            f"  {add_command(case.recipe, root)}")
    path = toolchain_file(case, root)
    stored = read_case(case, root, path)
    problems = differences(stored, measure(case))
    if problems:
        raise AssertionError(
            f"golden case {case.id} does not match {path}:\n  " + "\n  ".join(problems)
            + f"\ngolden written with: {_provenance_line(stored.record['provenance'])}"
            + f"\nthis run:            {_provenance_line(provenance())}"
            + f"\n{_what_moved(stored.record['provenance'], provenance(), update_command(case.recipe, root))}")


def _what_moved(then: dict[str, Any], now: dict[str, Any], update: str) -> str:
    """Whether the recipe's numerics moved or the toolchain did, and which part of it."""
    moved = [f"{k} {then.get(k)} -> {now[k]}" for k in ("jax", "jaxlib", "flax", "ml_dtypes", "numpy", "backend")
             if then.get(k) != now[k]]
    if then.get("xla_form", "unrecorded") != now["xla_form"]:
        moved.append(f"XLA's divisions {then.get('xla_form', 'unrecorded')} -> {now['xla_form']}")
    if not moved:
        return (f"the toolchain is the one the file was written with: the recipe's numerics moved; if the change is "
                f"intended: `{update}` or `pytest --update-golden`")
    return (f"the toolchain moved since the file was written ({'; '.join(moved)}): if the recipe did not change, "
            f"this is the toolchain's doing; `{update}` on this toolchain records its values (beside the file, "
            f"where XLA's divisions moved); if the recipe changed, the same command on each toolchain")
