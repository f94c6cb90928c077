"""The ``referee`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

import numpy as np

from qcheck.recipes import Recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant
from qcheck.suite._layer_matches import assert_layer_matches_referee

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("the unquantized layer computes, token by token, what a float64 numpy referee written from its router's "
       "definition computes (the figure: the worst difference relative to the token's norm)")


def run(case: Case) -> float:
    """:func:`assert_layer_matches_referee` on the case's output, within its row's tolerance (``referee_tolerance``).

    The output is :func:`~qcheck.cases.layer_output`, the one every other
    check reads (for ``none``, the forward pass inside its train step): no
    program of its own, the referee runs in numpy.
    """
    __tracebackhide__ = True
    rtol, atol = case.variant.referee_tolerance
    worst = assert_layer_matches_referee(cases_mod.layer(case), np.asarray(cases_mod.layer_input(case.variant.model)),
                                         rtol=rtol, atol=atol, output=cases_mod.layer_output(case), label=case.id)
    # The figure is relative to a token's norm: the row's rtol bounds it on every token, whatever the atol allows.
    if not worst <= rtol:
        raise AssertionError(f"{case.id}: the layer is {worst:.3g} from the float64 referee (relative to a "
                             f"token's norm), beyond {rtol}")
    return worst


def applies(recipe: Recipe, variant: Variant) -> bool:
    # The unquantized layers only: a quantized one differs from the referee by its quantization, and runs
    # the same layer code as its twin, which this holds on every variant.
    return not recipe.quantized
