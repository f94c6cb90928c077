"""The ``grads`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

import numpy as np

from qcheck import checks
from qcheck.checks.harness import assertion
from qcheck.recipes import Recipe, get_recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant, grad_leaves, has_gradients

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("one train step: every parameter's gradient is finite and within the recipe's gradient bound of the twin's "
       "(0.3; NVFP4 0.5), not equal to it where the recipe quantizes gradients (the figure: the worst norm)")


@assertion
def assert_grads_track(grads: dict[str, np.ndarray], reference: dict[str, np.ndarray], *,
                       max_grad_rel_norm: float, distinct: bool, label: str = "") -> float:
    """Every gradient is finite and within ``max_grad_rel_norm`` of the twin's at the same path.

    Not all of them may be bitwise equal to the twin's (a layer that fell back
    to full precision); with ``distinct`` (the recipe quantizes gradients: a
    ``grad`` format, or fp8-class) none may: one that is never saw the
    gradient quantizer. Returns the worst relative norm.
    """
    __tracebackhide__ = True
    if set(grads) != set(reference):
        raise AssertionError(f"gradients at {sorted(grads)}, the none twin's at {sorted(reference)}")
    worst = 0.0
    for path in sorted(grads):
        g, r = np.asarray(grads[path]), np.asarray(reference[path])
        if (bad := int(g.size - np.count_nonzero(np.isfinite(g)))) > 0:
            raise AssertionError(f"gradient of {path} ({g.dtype}) has {bad} non-finite values of {g.size}")
        figure = checks.rel_norm(g, r)
        if not figure <= max_grad_rel_norm:
            raise AssertionError(
                f"gradient of {path} ({g.dtype}) is {figure:.4g} from the none twin's (relative norm; "
                f"bound {max_grad_rel_norm}); {np.count_nonzero(g == 0)} of {g.size} values are 0, twin "
                f"{np.count_nonzero(r == 0)}")
        if distinct and g.dtype == r.dtype and np.array_equal(g.view(np.uint8), r.view(np.uint8)):
            raise AssertionError(
                f"gradient of {path} ({g.dtype}) is bitwise equal to the none twin's, but the recipe "
                "quantizes gradients (quantization skipped?)")
        worst = max(worst, figure)
    if grads and all(np.array_equal(np.asarray(grads[k]).view(np.uint8), np.asarray(reference[k]).view(np.uint8))
                     for k in grads):
        raise AssertionError("every gradient is bitwise equal to the none twin's — the quantized path "
                             "was not taken (silent fallback?)")
    return worst


def _quantizes_grads(recipe: Recipe) -> bool:
    # A declared grad format, or fp8-class (the e5m2 output-gradient cast).
    return recipe.grad is not None or recipe.reference.cast_dtype is not None


def run(case: Case) -> float:
    """One train step: gradients finite and tracking the ``none`` twin's within the recipe's grad bound."""
    __tracebackhide__ = True
    recipe = get_recipe(case.recipe)
    figure = assert_grads_track(
        grad_leaves(cases_mod.layer_step(case).grads), grad_leaves(cases_mod.layer_step(case.reference).grads),
        max_grad_rel_norm=recipe.expect.max_grad_rel_norm, distinct=_quantizes_grads(recipe), label=case.id)
    if not figure > 0:
        raise AssertionError(f"{case.id}: every gradient is {figure} from the none twin's (relative norm): the "
                             "quantized path was not taken")
    return figure


def applies(recipe: Recipe, variant: Variant) -> bool:
    """Every quantized recipe, wherever its case has gradients (:func:`~qcheck.suite.cases.has_gradients`); the
    ``backward`` invariant only where an exact reference exists too."""
    return recipe.quantized and has_gradients(recipe, variant)
