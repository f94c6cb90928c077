"""The ``exact`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

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
from qcheck.suite.invariants import _programs
from qcheck.suite.invariants._programs import case_site_runs

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("each call site of a fresh layer equals, bitwise, the matmul of its operands quantized by the numpy referee"
       " in the recipe's declared formats: on probes, and on what it receives in the layer's forward")


@assertion
def assert_sites_exact(layer: MoE, recipe: Recipe, runs: SiteRuns | None = None, *, label: str = "") -> None:
    """Every call site of a fresh ``layer`` equals the matmul of referee-quantized probe operands, bitwise.

    :func:`qcheck.checks.assert_site_exact` (an einsum, or ``Ragged`` on the sparse
    path) per site, in the recipe's declared formats along each matmul's
    contraction axes, on probes that tell the reference from every neighbouring
    bug (another int8 variant or fp8 flavour, unscaled current scaling, blocks
    along the wrong axes, an operand unquantized). The sites run in one program
    (``runs``: one that also served other checks, :func:`case_site_runs`).
    """
    __tracebackhide__ = True
    lhs_fmt, rhs_fmt = harness.operand_formats(recipe)
    probes = _site_programs.exact_probes(layer, recipe)
    runs = runs or _site_programs.run_sites(layer, forward=probes)
    for p in probes:
        judged_as(assert_sites_exact, harness.judge_site_exact, p.matmul, p.lhs, p.rhs, runs.forward[p.site],
                  lhs_format=lhs_fmt, rhs_format=rhs_fmt, site=p.site, arithmetic=recipe.reference.matmul, label=label)


def run(case: Case) -> None:
    """Every site exact in the recipe's declared formats: on probes, and through one forward pass of the layer.

    :func:`assert_sites_exact` on the case's fresh layer, then
    :func:`qcheck.checks.harness.judge_site_calls` on the site calls of
    its forward pass on the case's input, which sees a layer that skips a
    site, calls another site's wrapper, or skips quantization at one call site
    on one path. Both read :func:`case_site_runs`.
    """
    __tracebackhide__ = True
    layer, recipe = cases_mod.layer(case), get_recipe(case.recipe)
    try:
        runs = case_site_runs(case)
    except AssertionError as e:  # the program refused the layer (a wrapper called twice): named for the case
        raise AssertionError(f"{case.id}: {e}") from e
    assert_sites_exact(layer, recipe, runs, label=case.id)
    judged_as(checks.assert_layer_sites_exact, harness.judge_site_calls, tuple(layer.sites.keys()), runs.calls,
              recipe, label=case.id)


def applies(recipe: Recipe, variant: Variant) -> bool:
    """Recipes that declare operand formats (``lhs=``/``rhs=``) or a cast dtype: the formats a site is held to."""
    return recipe.lhs is not None or recipe.reference.cast_dtype is not None


_programs.SERVES["exact"] = applies
