"""The one program of a case's fresh layer that ``exact``, ``backward``, ``train`` and ``edges`` read, built for
whichever of the invariants it serves apply (:data:`SERVES`: each of those modules registers its own ``applies``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from qcheck.layers.moe import MoE
from qcheck.recipes import Recipe, get_recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant
from qcheck.suite import _site_programs
from qcheck.suite._site_programs import SiteRuns

#: The invariants the one program serves, "exact" and "backward", each by the ``applies`` its module registers
#: when it is imported (their modules import this one, so it cannot import them).
SERVES: dict[str, Callable[[Recipe, Variant], bool]] = {}


def serves(name: str, recipe: Recipe, variant: Variant) -> bool:
    """Whether invariant ``name`` (registered in :data:`SERVES`) applies to ``recipe`` on ``variant``."""
    return SERVES[name](recipe, variant)


@functools.cache
def case_site_runs(case: Case) -> SiteRuns:
    """The case's fresh layer in one program: ``exact``'s and ``backward``'s probes, and the recorded forward pass.

    Built for whichever of the two apply to the case and read by both, once per
    process: the per-site programs were two thirds of the matrix's compiles.
    """
    return site_runs(cases_mod.layer(case), get_recipe(case.recipe), case.variant)


def site_runs(layer: MoE, recipe: Recipe, variant: Variant, x: jax.Array | None = None) -> SiteRuns:
    """:func:`case_site_runs` for any layer of ``variant``: the one program, for the checks that apply.

    ``x``: the layer's passes on another input of the case input's shape and type (``edges``' rows), the same
    compiled program run again.
    """
    from qcheck import checks
    from qcheck.checks import harness

    exact, backward = serves("exact", recipe, variant), serves("backward", recipe, variant)
    through = backward and harness.through_layer_applies(recipe)
    x = cases_mod.layer_input(variant.model) if x is None else x
    return _site_programs.run_sites(
        layer,
        forward=_site_programs.exact_probes(layer, recipe) if exact else [],
        backward=_site_programs.backward_probes(layer, recipe) if backward else [],
        x=x if exact or through else None, capture=exact,
        layer_g=checks.probe_grad(7, x.shape) if through else None)

