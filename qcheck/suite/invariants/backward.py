"""The ``backward`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

from qcheck import checks
from qcheck.checks import harness
from qcheck.checks.harness import assertion, judged_as
from qcheck.layers.moe import MoE
from qcheck.recipes import Recipe, get_recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant
from qcheck.suite import _site_programs
from qcheck.suite._site_programs import SiteRuns
from qcheck.suite.invariants import _programs, grads
from qcheck.suite.invariants._programs import case_site_runs

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("each site's input and weight gradients equal, bitwise, the referee's gradient matmuls (g quantized as the "
       "recipe declares): on probes, and in one backward pass of the layer, whose weight gradients must be the "
       "ones their sites gave")


@assertion
def assert_sites_backward_exact(layer: MoE, recipe: Recipe, runs: SiteRuns | None = None, *, label: str = "") -> None:
    """Both gradients of every call site of a fresh ``layer`` equal the referee's gradient matmuls, bitwise.

    :func:`qcheck.checks.assert_site_backward_exact` per site (on ``Ragged``
    on the sparse path): the output gradient quantized as the recipe declares
    (fp8-class: cast to the e5m2 flavour at scale 1; ``grad=``: the referee's
    format along each gradient matmul's contraction; NVFP4's DGRAD with the
    site's own uniforms), on probes chosen so that a wrong flavour, wrong axes
    or a skipped quantization each give other bits. The sites' vjps run in one
    program (``runs``: one that also served other checks, :func:`case_site_runs`).
    """
    __tracebackhide__ = True
    probes = _site_programs.backward_probes(layer, recipe)
    runs = runs or _site_programs.run_sites(layer, backward=probes)
    for p in probes:
        judged_as(assert_sites_backward_exact, harness.judge_site_backward, layer.get_einsum(p.site).site_name,
                  p.matmul, p.lhs, p.rhs, p.g, runs.grads[p.site], recipe=recipe, key=runs.key,
                  label=label)


def run(case: Case) -> None:
    """Every site's gradients exact: on probes, and in one backward pass of the layer.

    :func:`assert_sites_backward_exact` on the case's fresh layer, then
    :func:`qcheck.checks.harness.judge_site_grad_calls` on the
    gradients each site gave in the layer's own backward pass (not for NVFP4's
    stochastic DGRAD), which sees a layer that takes a site's gradient from
    anywhere else. Both read :func:`case_site_runs`.
    """
    __tracebackhide__ = True
    recipe, runs = get_recipe(case.recipe), case_site_runs(case)
    assert_sites_backward_exact(cases_mod.layer(case), recipe, runs, label=case.id)
    if runs.grad_calls is not None:
        judged_as(checks.assert_layer_sites_backward_exact, harness.judge_site_grad_calls,
                  runs.grad_calls, recipe, label=case.id)


def applies(recipe: Recipe, variant: Variant) -> bool:
    """Where the case trains (``grads`` applies), on the recipe's ``backward_paths``.

    A library recipe narrows ``backward_paths`` where qcheck has no exact
    reference for its gradients; its gradients are still held to the ``none``
    twin's by ``grads``.
    """
    return variant.path in recipe.expect.backward_paths and grads.applies(recipe, variant)


_programs.SERVES["backward"] = applies
