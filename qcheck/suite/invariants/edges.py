"""The ``edges`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``).

A normal draw never holds the inputs where quantizers break (:data:`qcheck.checks.harness.EDGE_ROWS`): a token row of
zeros (a scale of 0, then 0 / 0), of tiny values (an amax past an ``== 0`` guard whose scale underflows), with one
value beyond the format's range (a cast without saturation), at the format's largest code; and the whole input
scaled below every format's smallest guarded amax, since a per-tensor scale (NVFP4's tensor scale) sees only the
tensor's amax, which one row never brings near its guard. The suite is compile-bound, so no layer program is
compiled here: the case's own programs, which ``grads`` (or ``tracks``) and ``exact`` compile anyway, run again
on the case's input with its first token row replaced by each row, and on the tiny tensor (same shapes, same
programs). The train step's output, gradients and next fp8 state must stay finite (the forward output
where the case does not train), and where ``exact`` holds the sites, each site call of the layer's forward pass,
and of its backward pass where ``backward`` holds it through the layer, must stay bitwise the referee's of the
operands it received. Only what an edge row breaks anew counts: a site that already differs on the plain input
is ``exact``'s or ``backward``'s to report, a value already not finite there ``grads``'.
"""

from __future__ import annotations

import numpy as np

from qcheck.checks import harness
from qcheck.checks.harness import assertion
from qcheck.layers import step
from qcheck.layers.moe import MoE
from qcheck.recipes import Recipe, get_recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant, grad_leaves, train_step_runs
from qcheck.suite.invariants._programs import serves, site_runs

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("the layer's compiled programs again, on its input with one token row of zeros, of tiny values, with a "
       "value beyond the format's range, or at its largest code, and on its whole input scaled below every "
       "format's smallest guarded amax (a per-tensor scale sees only the tensor's amax): output, gradients and fp8 "
       "state stay finite, and each site call the referee's, bitwise, where `exact` holds it (the figure: the "
       "edges run; 4 where no format is declared, whose largest code the saturation row needs)")


def _finite_values(layer: MoE, recipe: Recipe, variant: Variant, x) -> dict[str, np.ndarray]:
    """What must stay finite, by the name a failure gives it: the train step's output, gradients and next fp8
    state (the program ``grads`` compiled), else the forward output (``tracks``')."""
    if not train_step_runs(recipe, variant):
        return {"the output": np.asarray(step.apply(layer, x)[0])}
    out = step.train_step(layer, x)
    return {"the output": np.asarray(out.output),
            **{f"gradient of {path}": g for path, g in grad_leaves(out.grads).items()},
            **{f"fp8 state {path} after the step": v for path, v in grad_leaves(out.fp8_meta).items()}}


def _holds_sites(recipe: Recipe, variant: Variant) -> bool:
    # Where the one program of the case's sites records the layer's passes (site_runs).
    return serves("exact", recipe, variant) or (serves("backward", recipe, variant)
                                                and harness.through_layer_applies(recipe))


def _site_failures(layer: MoE, recipe: Recipe, variant: Variant, x, *, edge: bool) -> dict[str, str]:
    """Each site call of the layer's passes on ``x`` that is not the referee's, with what its judgement says.

    ``edge``: ``x`` is an edge, where a site may receive an all-zero operand (the tiny tensor's hidden
    activations underflow), on which the referee's product is the unquantized one: held to it all the same
    (an unquantized site is ``exact``'s, on the plain input)."""
    runs = site_runs(layer, recipe, variant, x)
    failed: dict[str, str] = {}
    for call in runs.calls or ():
        try:
            harness.judge_site_calls((call.site,), [call], recipe, refuse=not edge)
        except (AssertionError, ValueError) as e:
            failed[f"{call.site} forward"] = str(e)
    for call in runs.grad_calls or ():
        try:
            harness.judge_site_grad_calls([call], recipe)
        except (AssertionError, ValueError) as e:
            failed[f"{call.site} backward"] = str(e)
    return failed


def _nonfinite(v: np.ndarray) -> int:
    v = np.asarray(v)
    return int(v.size - np.count_nonzero(np.isfinite(v))) if np.issubdtype(v.dtype, np.inexact) else 0


@assertion
def assert_layer_edges(layer: MoE, recipe: Recipe, variant: Variant, *, label: str = "") -> int:
    """``layer`` (a fresh layer of ``variant``) on each edge of its input: finite, and its sites exact.

    The rows replace the first token row of :func:`qcheck.suite.cases.layer_input`
    (:func:`qcheck.checks.harness.format_edge_rows`, the saturation row at the largest
    code of the activations' declared format); the tiny tensor replaces all of it. Each
    runs the programs the case compiled for ``grads`` (or ``tracks``) and ``exact``
    again, at no compile. Fails naming the edge and what went wrong there, only where
    the plain input does not already fail so. Returns how many edges ran.
    """
    __tracebackhide__ = True
    x = cases_mod.layer_input(variant.model)
    holds = _holds_sites(recipe, variant)
    fmt = harness.operand_formats(recipe)[0] if serves("exact", recipe, variant) else None
    rows = harness.format_edge_rows(x, fmt, dict.fromkeys(harness.EDGE_ROWS))
    finite_before = {k: _nonfinite(v) == 0 for k, v in _finite_values(layer, recipe, variant, x).items()}
    failing_before = _site_failures(layer, recipe, variant, x, edge=False) if holds else {}
    lines, ran = [], 0
    for kind, x_edge in rows.items():
        if isinstance(x_edge, str):  # not run (no declared format: no largest code); the figure says how many ran
            continue
        ran += 1
        what = harness.EDGE_ROWS[kind]
        bad = [f"{name} ({n} of {np.size(v)})" for name, v in _finite_values(layer, recipe, variant, x_edge).items()
               if finite_before.get(name, True) and (n := _nonfinite(v))]
        if bad:
            lines.append(f"{what}: not finite: {', '.join(bad)}")
        if holds:
            lines += [f"{what}: {message}" for site, message in
                      _site_failures(layer, recipe, variant, x_edge, edge=True).items() if site not in failing_before]
    if lines:
        raise AssertionError("\n".join(lines))
    return ran


def run(case: Case) -> int:
    """:func:`assert_layer_edges` on the case's fresh layer: how many edges it ran."""
    __tracebackhide__ = True
    return assert_layer_edges(cases_mod.layer(case), get_recipe(case.recipe), case.variant, label=case.id)


def applies(recipe: Recipe, variant: Variant) -> bool:
    return recipe.quantized
