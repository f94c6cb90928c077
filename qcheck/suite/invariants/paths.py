"""Dense and sparse: the unquantized layer computes one function on both paths. A row of its own, not a column (it
compares two cases), run like every column through :func:`qcheck.suite.cells.run_cell` as :data:`PATHS`."""

from __future__ import annotations

import numpy as np

from qcheck.checks.harness import assertion
from qcheck.suite import cases as cases_mod
from qcheck.recipes import Recipe
from qcheck.suite.cases import Case, Variant

#: dense and sparse sum the same products in a different order: float32 rounding only.
PATHS_RTOL, PATHS_ATOL = 1e-5, 1e-6


#: The largest absolute difference the paths may show anywhere, on top of allclose.
PATHS_MAX_ABS = PATHS_ATOL * 10


doc = "the unquantized layer computes one function on the dense and the sparse path, with and without dropping"


def applies(recipe: Recipe, variant: Variant) -> bool:
    """On an unquantized recipe's dense case, which is compared with its sparse twin: a row of its own."""
    return not recipe.quantized and variant.path == "dense" and "sparse" in recipe.expect.paths


def paths_case(model: str, dropping: bool) -> Case:
    """The case the dense == sparse row of ``model`` runs on: the unquantized dense layer."""
    return Case("none", Variant(model, "dense", dropping))


def run(case: Case) -> float:
    """The case's dense layer and its sparse twin compute the same function; returns the max abs difference."""
    __tracebackhide__ = True
    dense = case.variant
    sparse = Variant(dense.model, "sparse", dense.dropping)
    label = f"{case.recipe}-{dense.model}{'-drop' if dense.dropping else ''}"
    worst = assert_paths_agree(
        cases_mod.layer_output(case), cases_mod.layer_output(Case(case.recipe, sparse)), label=label)
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
