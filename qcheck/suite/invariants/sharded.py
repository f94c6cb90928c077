"""The ``sharded`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

import functools

from qcheck.recipes import Recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant
from qcheck.suite._sharded import SHARDED_ATOL, assert_layer_sharded_matches

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("the layer on a 2 x 4 mesh of host devices computes the single-device output (the figure: the largest "
       "difference)")


def run(case: Case) -> float:
    """:func:`assert_layer_sharded_matches` for the case's layer on the ("data", "expert") mesh.

    Against :func:`~qcheck.cases.layer_output`, the output every other check
    reads: for fp8-class recipes that is the forward pass inside the train step,
    so no second single-device program is compiled for this check (on jax
    0.10.2 it is bitwise equal to the forward program's output anyway).
    """
    __tracebackhide__ = True
    worst = assert_layer_sharded_matches(
        functools.partial(cases_mod.sharded_layer, case), cases_mod.layer_output(case),
        cases_mod.layer_input(case.variant.model), mesh=cases_mod.mesh(), label=case.id)
    # allclose lets a large output differ by its rtol too; anywhere beyond the atol is more than a reduction order.
    if not worst <= SHARDED_ATOL:
        raise AssertionError(f"{case.id}: the sharded layer differs by up to {worst:.3g}, beyond {SHARDED_ATOL}")
    return worst


def applies(recipe: Recipe, variant: Variant) -> bool:
    # Sharded twins exist per model and path, without token dropping.
    return not variant.dropping
