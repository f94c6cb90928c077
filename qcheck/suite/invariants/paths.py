"""Dense and sparse: the unquantized layer computes one function on both paths (a row of its own, not a
column: it compares two cases)."""

from __future__ import annotations

import numpy as np

from qcheck.checks.harness import assertion
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case

#: dense and sparse sum the same products in a different order: float32 rounding only.
PATHS_RTOL, PATHS_ATOL = 1e-5, 1e-6


#: The largest absolute difference the paths may show anywhere, on top of allclose.
PATHS_MAX_ABS = PATHS_ATOL * 10


def run_paths(model: str, dropping: bool) -> float:
    """Unquantized dense and sparse layers compute the same function; returns the max abs difference."""
    __tracebackhide__ = True
    dense = cases_mod.Variant(model, "dense", dropping)
    sparse = cases_mod.Variant(model, "sparse", dropping)
    label = f"none-{model}{'-drop' if dropping else ''}"
    worst = assert_paths_agree(
        cases_mod.layer_output(Case("none", dense)), cases_mod.layer_output(Case("none", sparse)), label=label)
    # allclose lets a large output differ by its rtol; the layer's outputs are O(1), so any such gap is no rounding.
    if not worst <= PATHS_MAX_ABS:
        raise AssertionError(f"{label}: dense and sparse differ by up to {worst:.3g}, beyond {PATHS_MAX_ABS}")
    return worst


@assertion
def assert_paths_agree(dense: np.ndarray, sparse: np.ndarray, *, label: str = "") -> float:
    """Dense and sparse outputs agree to float32 rounding; returns the max abs difference."""
    __tracebackhide__ = True
    worst = float(np.max(np.abs(dense - sparse)))
    if not np.allclose(dense, sparse, rtol=PATHS_RTOL, atol=PATHS_ATOL):
        raise AssertionError(
            f"dense and sparse differ by up to {worst:.3g} (rtol {PATHS_RTOL}, atol {PATHS_ATOL})"
        )
    return worst
