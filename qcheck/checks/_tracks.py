"""The relative-norm bound: a quantized result near its unquantized reference, and not equal to it."""

from __future__ import annotations

import numpy as np
from jax.typing import ArrayLike

from qcheck.checks._assertion import assertion
from qcheck.checks._bits import bitwise_equal
from qcheck.checks._figures import Figures


def concrete(x: ArrayLike, what: str) -> np.ndarray:
    try:
        return np.asarray(x)
    except Exception as e:  # a tracer, say
        raise TypeError(f"{what} must be a concrete array, got {type(x).__name__}") from e


def rel_norm(actual: ArrayLike, reference: ArrayLike) -> float:
    """‖actual − reference‖₂ / ‖reference‖₂, computed in float32."""
    a = concrete(actual, "actual").astype(np.float32)
    r = concrete(reference, "reference").astype(np.float32)
    if a.shape != r.shape:
        raise ValueError(f"rel_norm: actual has shape {a.shape}, reference has shape {r.shape}")
    denom = np.linalg.norm(r.ravel())
    if denom == 0:
        raise ValueError("rel_norm: the reference is all zeros, so a relative norm is undefined")
    return float(np.linalg.norm((a - r).ravel()) / denom)


def count_nonfinite(x: ArrayLike) -> int:
    """How many of ``x``'s values are not finite."""
    x = np.asarray(x)
    if x.dtype.kind != "f":  # ml_dtypes' types (bfloat16, fp8: kind "V") and integers read as float32
        x = x.astype(np.float32)
    # A float array as it is: a float32 copy of a layer's every gradient first would double the memory read.
    return int(x.size - np.count_nonzero(np.isfinite(x)))


@assertion
def assert_tracks(actual: ArrayLike, reference: ArrayLike, *, max_rel_norm: float = 0.22, label: str = "") -> Figures:
    """Assert a quantized result stays near its unquantized reference without equalling it.

    Passes only when the shapes are equal (no broadcasting), both are finite,
    ``rel_norm(actual, reference) <= max_rel_norm``, and the two are not bitwise
    equal: a quantized path that silently fell back to full precision fails.
    Returns the measured relative norm (:class:`~qcheck.checks.Figures`: ``rel_norm``).
    """
    a, r = concrete(actual, "actual"), concrete(reference, "reference")
    if a.shape != r.shape:
        raise AssertionError(
            f"actual has shape {a.shape} but reference has shape {r.shape} "
            "(no broadcasting)"
        )
    for what, x in (("actual", a), ("reference", r)):
        if (n := count_nonfinite(x)) > 0:
            raise AssertionError(f"{what} has {n} non-finite values out of {x.size}")
    if not np.any(r):
        raise ValueError("the reference is all zeros; a relative bound cannot judge it")
    if bitwise_equal(a, r):
        raise AssertionError(
            "actual is bitwise equal to the unquantized reference — "
            "the quantized path was not taken (silent fallback?)"
        )
    figure = rel_norm(a, r)
    if not figure <= max_rel_norm:
        raise AssertionError(
            f"relative norm {figure:.4f} exceeds the bound {max_rel_norm}"
        )
    return Figures(figure, rel_norm=figure)
