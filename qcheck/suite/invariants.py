"""The suite's invariants over the case table, shared by pytest and the CLI matrix.

Each ``check_*`` takes a :class:`~qcheck.cases.Case`, raises ``AssertionError``
(prefixed with the case id and, where it applies, the call site) when the
invariant is broken, and returns the figure it measured. ``INVARIANTS`` says
which apply to which recipe.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from qcheck.suite import cases as cases_mod
from qcheck import checks
from qcheck.checks._assertion import judged_as
from qcheck.layers import step
from qcheck.layers.bridge import Fp8Meta
from qcheck.suite.cases import BATCH, SEQ, Case, Variant, grad_leaves, train_step_runs
from qcheck.suite.cases import backward_applies as _backward_applies
from qcheck.suite import _site_programs, golden
from qcheck.suite._site_programs import SiteRuns, probe_group_sizes
from qcheck.suite._sharded import (SHARDED_ATOL, SHARDED_RTOL, assert_layer_sharded,
                                   assert_layer_sharded_matches, assert_sharded_matches)
from qcheck.suite._referee import assert_layer_matches_referee
from qcheck.layers.moe import MoE
from qcheck.recipes import ApplyRngs, Recipe, get_recipe

__all__ = [
    "INVARIANTS",
    "Invariant",
    "RunEnv",
    "assert_fp8_state_moves_only_in_backward",
    "assert_paths_agree",
    "assert_rng_state_constant",
    "assert_rng_state_grows",
    "assert_rng_state_matches_twin",
    "check_rng",
    "rng_entry_params",
    "assert_sites_carry_no_rng_stream",
    "assert_sites_cast_exact",
    "assert_sites_exact",
    "assert_sites_independent",
    "assert_layer_quantized",
    "check_coverage",
    "assert_sites_backward_exact",
    "check_backward",
    "check_sites",
    "check_exact",
    "check_golden",
    "check_sharded",
    "assert_sharded_matches",
    "assert_layer_sharded",
    "assert_layer_sharded_matches",
    "SHARDED_ATOL",
    "SHARDED_RTOL",
    "check_paths_agree",
    "check_referee",
    "assert_layer_matches_referee",
    "check_state",
    "check_train",
    "assert_layer_trains",
    "TRAIN_MAX_NORM",
    "TRAIN_MICROBATCHES",
    "check_tracks",
    "assert_grads_track",
    "check_grads",
    "grad_leaves",
    "train_step_runs",
    "fp8_meta_leaves",
    "probe_group_sizes",
    "case_site_runs",
    "site_runs",
]

#: dense and sparse sum the same products in a different order: float32 rounding only.
PATHS_RTOL, PATHS_ATOL = 1e-5, 1e-6


def _prefixed(prefix: str, fn: Callable[[], object]):
    __tracebackhide__ = True
    try:
        return fn()
    except AssertionError as e:
        # The check's own frames say nothing the message does not: one failure, one message.
        raise AssertionError(f"{prefix}: {e}") from None


def assert_sites_cast_exact(layer: MoE, cast_dtype, label: str) -> None:
    """Every call site of a fresh ``layer`` equals the einsum (or ragged_dot) of cast operands, bitwise."""
    __tracebackhide__ = True
    from qcheck.checks._fresh import judge_fresh_cast

    probes = [_site_programs.Probe(name, spec.matmul.regrouped(i), *checks.probe_operands(i, spec.lhs_shape,
                                                                                           spec.rhs_shape))
              for i, (name, spec) in enumerate(layer.site_specs(BATCH, SEQ).items())]
    runs = _site_programs.run_sites(layer, forward=probes)  # one program for all sites
    for p in probes:
        _prefixed(f"{label} site {p.site!r}", lambda: judged_as(
            checks.assert_fresh_cast_exact, judge_fresh_cast, p.matmul, p.lhs, p.rhs, runs.forward[p.site],
            cast_dtype=cast_dtype))


def assert_sites_exact(layer: MoE, recipe: Recipe, label: str, runs: SiteRuns | None = None) -> None:
    """Every call site of a fresh ``layer`` equals the matmul of referee-quantized probe operands, bitwise.

    :func:`qcheck.checks.assert_site_exact` (an einsum, or ``Ragged`` on the sparse
    path) per site, in the recipe's declared formats along each matmul's
    contraction axes, on probes that tell the reference from every neighbouring
    bug (another int8 variant or fp8 flavour, unscaled current scaling, blocks
    along the wrong axes, an operand unquantized). The sites run in one program
    (``runs``: one that also served other checks, :func:`case_site_runs`).
    """
    __tracebackhide__ = True
    from qcheck.checks import _site as _site_exact

    lhs_fmt, rhs_fmt = _site_exact.operand_formats(recipe)
    probes = _site_programs.exact_probes(layer, recipe)
    runs = runs or _site_programs.run_sites(layer, forward=probes)
    for p in probes:
        _prefixed(label, lambda: judged_as(
            checks.assert_site_exact, _site_exact.judge_site_exact, p.matmul, p.lhs, p.rhs, runs.forward[p.site],
            lhs_format=lhs_fmt, rhs_format=rhs_fmt, site=p.site, arithmetic=recipe.reference.matmul))


@functools.cache
def case_site_runs(case: Case) -> SiteRuns:
    """The case's fresh layer in one program: ``exact``'s and ``backward``'s probes, and the recorded forward pass.

    Built for whichever of the two apply to the case and read by both, once per
    process: the per-site programs were two thirds of the matrix's compiles.
    """
    return site_runs(cases_mod.layer(case), get_recipe(case.recipe), case.variant)


def site_runs(layer: MoE, recipe: Recipe, variant: Variant) -> SiteRuns:
    """:func:`case_site_runs` for any layer of ``variant``: the one program, for the checks that apply."""
    from qcheck.checks import _backward
    from qcheck.checks import _layer_backward

    exact, backward = _exact_applies(recipe, variant), _backward_applies(recipe, variant)
    through = backward and _layer_backward.through_layer_applies(recipe)
    x = cases_mod.layer_input(variant.model)
    return _site_programs.run_sites(
        layer,
        forward=_site_programs.exact_probes(layer, recipe) if exact else [],
        backward=_site_programs.backward_probes(layer, recipe) if backward else [],
        x=x if exact or through else None, capture=exact,
        layer_g=_backward.probe_grad(7, x.shape) if through else None)


def check_exact(case: Case) -> None:
    """Every site exact in the recipe's declared formats: on probes, and through one forward pass of the layer.

    :func:`assert_sites_exact` on the case's fresh layer, then
    :func:`qcheck.checks._site.judge_site_calls` on the site calls of
    its forward pass on the case's input, which sees a layer that skips a
    site, calls another site's wrapper, or skips quantization at one call site
    on one path. Both read :func:`case_site_runs`.
    """
    __tracebackhide__ = True
    from qcheck.checks import _site as _site_exact

    layer, recipe = cases_mod.layer(case), get_recipe(case.recipe)
    runs = case_site_runs(case)
    assert_sites_exact(layer, recipe, case.id, runs)
    _prefixed(case.id, lambda: judged_as(checks.assert_layer_sites_exact, _site_exact.judge_site_calls,
                                         tuple(layer.sites.keys()), runs.calls, recipe))


def assert_sites_independent(layer: MoE, label: str) -> None:
    """No two call sites are the same object or share a quantization-state array.

    RNG streams are left out: under ``ApplyRngs.SHARED`` every site holds the
    caller's stream by design.
    """
    __tracebackhide__ = True
    owner: dict[int, str] = {}
    seen_sites: dict[int, str] = {}
    for name, site in layer.sites.items():
        if id(site) in seen_sites:
            raise AssertionError(f"{label}: sites {seen_sites[id(site)]!r} and {name!r} are one object")
        seen_sites[id(site)] = name
        for path, var in nnx.to_flat_state(nnx.state(site, nnx.Not(nnx.RngState))):
            key = id(var.get_raw_value())
            if key in owner:
                raise AssertionError(
                    f"{label}: sites {owner[key]!r} and {name!r} share state ({'.'.join(map(str, path))})"
                )
            owner[key] = name


def assert_sites_carry_no_rng_stream(layer: MoE, label: str) -> None:
    """The call sites of a recipe that never draws (ApplyRngs.NONE) hold no RNG stream.

    A stream kept anyway is the seed's cost: RNG state in the compiled step, once per site per layer.
    """
    __tracebackhide__ = True
    if carrying := [name for name, site in layer.sites.items() if nnx.state(site, nnx.RngState)]:
        raise AssertionError(
            f"{label}: sites {carrying} of a recipe that never draws carry RNG streams (forked per site?)")


def check_sites(case: Case) -> None:
    """:func:`assert_sites_independent` on the case's fresh layer; no streams if the recipe never draws."""
    __tracebackhide__ = True
    layer = cases_mod.layer(case)
    assert_sites_independent(layer, case.id)
    if get_recipe(case.recipe).apply_rngs is ApplyRngs.NONE:
        assert_sites_carry_no_rng_stream(layer, case.id)


def assert_layer_quantized(layer: MoE, x, label: str):
    """Every matmul of ``layer`` but those it keeps in full precision by design takes quantized operands.

    Tracing only: the coverage map of the layer's forward pass
    (:func:`qcheck.coverage`), with the router, the combine and the dropping
    masks (``qcheck.layers.moe.UNQUANTIZED_BY_DESIGN``) skipped. It sees a single call
    site that multiplies in full precision on one path, which ``tracks`` cannot.
    """
    __tracebackhide__ = True
    from qcheck._coverage import assert_quantized, skip_functions
    from qcheck.layers.moe import UNQUANTIZED_BY_DESIGN

    return _prefixed(label, lambda: assert_quantized(layer, x, skip=skip_functions(*UNQUANTIZED_BY_DESIGN)))


def assert_layer_fp8_native(layer: MoE, x, recipe: Recipe, label: str, *, backward: bool = True) -> None:
    """The fp8 types ``layer``'s matmul operands are cast to, and those ``recipe`` declares, suit its target.

    Native to ``recipe.expect.fp8_target``, forward and backward; nothing to check
    without a target. Tracing only: one vjp trace (the forward pass alone
    without ``backward``). Folded into ``coverage``, not a column of its own:
    it reads the same coverage map of the same fresh layer, at the cost of a
    trace, and a recipe's flavour is a property of what its matmuls take.
    """
    __tracebackhide__ = True
    if recipe.expect.fp8_target is None:
        return
    from qcheck.checks._fp8_native import assert_fp8_dtypes_native, assert_recipe_fp8_native, declared_operand_fp8_dtypes

    _prefixed(label, lambda: assert_recipe_fp8_native(recipe))
    if declared_operand_fp8_dtypes(recipe):  # else no fp8 type reaches an operand's chain (NVFP4)
        _prefixed(label, lambda: assert_fp8_dtypes_native(layer, x, target=recipe.expect.fp8_target, backward=backward))


def check_coverage(case: Case) -> int:
    """:func:`assert_layer_quantized` and :func:`assert_layer_fp8_native` on the case's fresh layer.

    Returns how many matmuls are quantized.
    """
    __tracebackhide__ = True
    layer, x = cases_mod.layer(case), cases_mod.layer_input(case.variant.model)
    records = assert_layer_quantized(layer, x, case.id)
    recipe = get_recipe(case.recipe)
    assert_layer_fp8_native(layer, x, recipe, case.id, backward=cases_mod.gradient_tiles(recipe, case.variant))
    return sum(r.quantized for r in records)


def assert_sites_backward_exact(layer: MoE, recipe: Recipe, label: str, runs: SiteRuns | None = None) -> None:
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
    from qcheck.checks import _backward

    probes = _site_programs.backward_probes(layer, recipe)
    runs = runs or _site_programs.run_sites(layer, backward=probes)
    for p in probes:
        _prefixed(f"{label} site {p.site!r}", lambda: judged_as(
            checks.assert_site_backward_exact, _backward.judge_site_backward, layer.get_einsum(p.site).site_name,
            p.matmul, p.lhs, p.rhs, p.g, runs.grads[p.site], recipe=recipe, key=runs.key))


def check_backward(case: Case) -> None:
    """Every site's gradients exact: on probes, and in one backward pass of the layer.

    :func:`assert_sites_backward_exact` on the case's fresh layer, then
    :func:`qcheck.checks._layer_backward.judge_site_grad_calls` on the
    gradients each site gave in the layer's own backward pass (not for NVFP4's
    stochastic DGRAD), which sees a layer that takes a site's gradient from
    anywhere else. Both read :func:`case_site_runs`.
    """
    __tracebackhide__ = True
    from qcheck.checks import _layer_backward

    recipe, runs = get_recipe(case.recipe), case_site_runs(case)
    assert_sites_backward_exact(cases_mod.layer(case), recipe, case.id, runs)
    if runs.grad_calls is not None:
        _prefixed(case.id, lambda: judged_as(_layer_backward.assert_layer_sites_backward_exact,
                                             _layer_backward.judge_site_grad_calls, runs.grad_calls, recipe))


def _exact_applies(recipe: Recipe, variant: Variant) -> bool:
    # Recipes that declare operand formats (lhs=/rhs=) or a cast dtype.
    return recipe.lhs is not None or recipe.reference.cast_dtype is not None


def check_tracks(case: Case) -> float:
    """The layer output tracks its unquantized twin within the recipe's bound, and is not equal to it."""
    __tracebackhide__ = True
    recipe = get_recipe(case.recipe)
    return _prefixed(case.id, lambda: checks.assert_tracks(
        cases_mod.layer_output(case),
        cases_mod.layer_output(case.reference),
        max_rel_norm=recipe.expect.max_rel_norm,
    ))


def assert_grads_track(grads: dict[str, np.ndarray], reference: dict[str, np.ndarray], *,
                       max_grad_rel_norm: float, distinct: bool, label: str) -> float:
    """Every gradient is finite and within ``max_grad_rel_norm`` of the twin's at the same path.

    Not all of them may be bitwise equal to the twin's (a layer that fell back
    to full precision); with ``distinct`` (the recipe quantizes gradients: a
    ``grad`` format, or fp8-class) none may: one that is never saw the
    gradient quantizer. Returns the worst relative norm.
    """
    __tracebackhide__ = True
    if set(grads) != set(reference):
        raise AssertionError(f"{label}: gradients at {sorted(grads)}, the none twin's at {sorted(reference)}")
    worst = 0.0
    for path in sorted(grads):
        g, r = np.asarray(grads[path]), np.asarray(reference[path])
        if (bad := int(g.size - np.count_nonzero(np.isfinite(g)))) > 0:
            raise AssertionError(f"{label}: gradient of {path} ({g.dtype}) has {bad} non-finite values of {g.size}")
        figure = checks.rel_norm(g, r)
        if not figure <= max_grad_rel_norm:
            raise AssertionError(
                f"{label}: gradient of {path} ({g.dtype}) is {figure:.4g} from the none twin's (relative norm; "
                f"bound {max_grad_rel_norm}); {np.count_nonzero(g == 0)} of {g.size} values are 0, twin "
                f"{np.count_nonzero(r == 0)}")
        if distinct and g.dtype == r.dtype and np.array_equal(g.view(np.uint8), r.view(np.uint8)):
            raise AssertionError(
                f"{label}: gradient of {path} ({g.dtype}) is bitwise equal to the none twin's, but the recipe "
                "quantizes gradients (quantization skipped?)")
        worst = max(worst, figure)
    if grads and all(np.array_equal(np.asarray(grads[k]).view(np.uint8), np.asarray(reference[k]).view(np.uint8))
                     for k in grads):
        raise AssertionError(f"{label}: every gradient is bitwise equal to the none twin's — the quantized path "
                             "was not taken (silent fallback?)")
    return worst


def _quantizes_grads(recipe: Recipe) -> bool:
    # A declared grad format, or fp8-class (the e5m2 output-gradient cast).
    return recipe.grad is not None or recipe.reference.cast_dtype is not None


def check_grads(case: Case) -> float:
    """One train step: gradients finite and tracking the ``none`` twin's within the recipe's grad bound."""
    __tracebackhide__ = True
    recipe = get_recipe(case.recipe)
    return assert_grads_track(
        grad_leaves(cases_mod.layer_step(case).grads), grad_leaves(cases_mod.layer_step(case.reference).grads),
        max_grad_rel_norm=recipe.expect.max_grad_rel_norm, distinct=_quantizes_grads(recipe), label=case.id)


def fp8_meta_leaves(state: nnx.State) -> dict[str, np.ndarray]:
    """The fp8 scales and amax histories in ``state``, by dotted path."""
    return {
        ".".join(map(str, path)): np.asarray(v.get_value())
        for path, v in nnx.to_flat_state(nnx.filter_state(state, Fp8Meta))
    }


def _unmoved(before: dict[str, np.ndarray], after: dict[str, np.ndarray], suffix: str) -> list[str]:
    return [k for k in before if k.endswith(suffix) and np.array_equal(before[k], after[k])]


def check_state(case: Case) -> None:
    """:func:`assert_fp8_state_moves_only_in_backward` on the case's fresh layer."""
    __tracebackhide__ = True
    layer = cases_mod.layer(case)
    assert_fp8_state_moves_only_in_backward(
        layer, cases_mod.layer_input(case.variant.model), case.id, first=cases_mod.layer_step(case)
    )


def assert_fp8_state_moves_only_in_backward(
    layer: MoE, x, label: str, *, first: step.StepOutput | None = None
) -> None:
    """Fresh scales are 1 and histories 0; a forward pass moves none; backward passes move them all.

    The forward pass is the one inside the train step: its effect on the fp8
    variables is read right after the call, before gradients overwrite them.

    One backward pass writes every amax history. The scales it returns are still
    computed from the (empty) history the forward pass saw, so they move on the
    second step — delayed scaling, as in Flax and TransformerEngine.
    """
    __tracebackhide__ = True
    fresh = fp8_meta_leaves(nnx.state(layer))
    if not fresh:
        raise AssertionError(f"{label}: the layer has no fp8 scales or amax histories")
    wrong = [k for k, v in fresh.items() if not np.all(v == (1 if k.endswith("_scale") else 0))]
    if wrong:
        raise AssertionError(f"{label}: fresh layer has scales != 1 or histories != 0 at {wrong}")

    if first is None:  # the case table passes its cached step: one run per case
        first = step.train_step(layer, x)
    after_forward = fp8_meta_leaves(first.fp8_meta_after_forward)
    if moved := [k for k, v in after_forward.items() if not np.array_equal(v, fresh[k])]:
        raise AssertionError(f"{label}: a forward pass changed fp8 state at {moved}")

    if still := _unmoved(fresh, fp8_meta_leaves(first.fp8_meta), "_history"):
        raise AssertionError(f"{label}: one backward pass left amax histories unchanged at {still}")
    second = step.train_step(layer, x, fp8_meta=first.fp8_meta)
    if still := _unmoved(fresh, fp8_meta_leaves(second.fp8_meta), "_scale"):
        raise AssertionError(f"{label}: two backward passes left scales unchanged at {still}")


#: The ``train`` invariant's microbatches, and a clip threshold far below the cases' gradient norms (about 0.25).
TRAIN_MICROBATCHES, TRAIN_MAX_NORM = 2, 1e-3


def _train_applies(recipe: Recipe, variant: Variant) -> bool:
    # Where the recipe carries fp8 state and the case trains. Not with token dropping: each expert's capacity
    # follows from the tokens in the batch, so microbatches drop other tokens than the whole batch does.
    return recipe.materialize_at_build and not variant.dropping and train_step_runs(recipe, variant)


def _site_leaves(state: dict[str, np.ndarray], site: str, suffix: str) -> list[str]:
    return [k for k in state if k.startswith(f"sites/{site}/") and k.endswith(suffix)]


def assert_layer_trains(layer: MoE, x, label: str, *, calls=None) -> int:
    """qcheck's reference trainer (:func:`qcheck.train`) on ``layer`` keeps the fp8 state it must.

    With :func:`qcheck.assert_fp8_state_matches`, bitwise, from the fresh
    layer: one step on ``x`` == the same step in ``TRAIN_MICROBATCHES``
    microbatches (merged by max); an unclipped step without weight decay == a
    step clipped to ``TRAIN_MAX_NORM`` with weight decay. Then each site's
    input and kernel histories hold, after one step, the numpy amaxes of the
    two operands the site received in the layer's forward pass (``calls``,
    recorded by :func:`qcheck.checks._site.record_site_calls`; skipped without),
    bitwise, as a pair (Flax's ``Fp8Einsum`` records the weight as its "input"
    where ``jnp.einsum`` swaps the operands), and every amax history rolls
    exactly once per step (over two steps). The output gradient's amax has no
    cheap referee: the microbatch relation holds it.
    Returns how many fp8 leaves were held.
    """
    __tracebackhide__ = True
    from qcheck.checks._fp8_state import assert_fp8_state_matches, fp8_state, history_rolls
    from qcheck.layers.trainer import train

    fresh = fp8_state(layer)
    unclipped = functools.partial(train, max_norm=None, weight_decay=0.0)
    m = TRAIN_MICROBATCHES
    first = assert_fp8_state_matches(unclipped, functools.partial(unclipped, microbatches=m), layer, x,
                                     label=f"{label} (one batch vs {m} microbatches)")
    assert_fp8_state_matches(unclipped, functools.partial(train, max_norm=TRAIN_MAX_NORM, weight_decay=0.1),
                             layer, x, label=f"{label} (unclipped vs clipped and weight-decayed)")
    second = fp8_state(train(layer, x, steps=2, microbatches=m, max_norm=TRAIN_MAX_NORM))
    for call in calls or ():
        # The pair, not which is which: Flax's Fp8Einsum names the operand jnp.einsum hands its dot_general
        # first "input", and for some equations (the dense path's wo) that is the weight.
        want = sorted(np.float32(np.max(np.abs(np.asarray(o, np.float32)))) for o in (call.lhs, call.rhs))
        for ins, ker in zip(_site_leaves(first, call.site, "input_amax_history"),
                            _site_leaves(first, call.site, "kernel_amax_history")):
            got = sorted((first[ins][0], first[ker][0]))
            if np.array(got, np.float32).view(np.uint32).tolist() != np.array(want).view(np.uint32).tolist():
                raise AssertionError(
                    f"{label}: {ins}[0], {ker}[0] after one step are {first[ins][0]:.9g}, {first[ker][0]:.9g}; "
                    f"the referee's amaxes of the operands site {call.site!r} received are "
                    f"{float(np.max(np.abs(call.lhs))):.9g} (lhs), {float(np.max(np.abs(call.rhs))):.9g} (rhs): "
                    "the site records other amaxes than its operands' (summed over uses?)")
    for key in sorted(k for k in fresh if k.endswith("history")):
        for n, before, after in ((1, fresh[key], first[key]), (2, first[key], second[key])):
            if (rolls := history_rolls(before, after)) != 1:
                what = {None: "is no roll of the one before", 0: "was not rolled"}.get(rolls, f"rolled {rolls} times")
                raise AssertionError(f"{label}: {key} at step {n} {what} (each history rolls once per step, "
                                     "newest amax at 0)")
    return len(fresh)


def check_train(case: Case) -> None:
    """:func:`assert_layer_trains` on the case's fresh layer, its sites' operands from :func:`case_site_runs`."""
    __tracebackhide__ = True
    recipe = get_recipe(case.recipe)
    calls = case_site_runs(case).calls if _exact_applies(recipe, case.variant) else None
    assert_layer_trains(cases_mod.layer(case), cases_mod.layer_input(case.variant.model), case.id, calls=calls)


def check_paths_agree(model: str, dropping: bool) -> float:
    """Unquantized dense and sparse layers compute the same function; returns the max abs difference."""
    __tracebackhide__ = True
    dense = cases_mod.Variant(model, "dense", dropping)
    sparse = cases_mod.Variant(model, "sparse", dropping)
    return assert_paths_agree(
        cases_mod.layer_output(Case("none", dense)),
        cases_mod.layer_output(Case("none", sparse)),
        f"none-{model}{'-drop' if dropping else ''}",
    )


def assert_paths_agree(dense: np.ndarray, sparse: np.ndarray, label: str) -> float:
    """Dense and sparse outputs agree to float32 rounding; returns the max abs difference."""
    __tracebackhide__ = True
    worst = float(np.max(np.abs(dense - sparse)))
    if not np.allclose(dense, sparse, rtol=PATHS_RTOL, atol=PATHS_ATOL):
        raise AssertionError(
            f"{label}: dense and sparse differ by up to {worst:.3g} (rtol {PATHS_RTOL}, atol {PATHS_ATOL})"
        )
    return worst


#: Depths of the unrolled decoder whose train steps the RNG invariant compares.
RNG_DEPTHS = (1, 2, 8)
#: The PRIVATE control only has to show growth; two depths do, at a third of the tracing.
RNG_CONTROL_DEPTHS = (1, 2)


def rng_entry_params(
    model: str, recipe: str, *, depths=RNG_DEPTHS, apply_rngs: ApplyRngs | None = None
) -> dict[int, dict[str, int]]:
    """Entry parameters of the jitted train step of an unrolled decoder, per depth."""
    return {n: _step_entry_params(model, recipe, n, apply_rngs) for n in depths}


@functools.cache
def _step_entry_params(model: str, recipe: str, layers: int, apply_rngs: ApplyRngs | None) -> dict[str, int]:
    stack = cases_mod.decoder(model, recipe, layers, apply_rngs=apply_rngs)
    graphdef, params, meta, rest = step.split_for_step(stack)
    x = cases_mod.layer_input(model)
    return checks.entry_params(step.train_step_fn(graphdef), params, meta, rest, x, compile=False)


def assert_rng_state_constant(u32_by_depth: dict[int, int], label: str) -> int:
    """The step's u32 entry parameters do not depend on the number of layers."""
    __tracebackhide__ = True
    if len(set(u32_by_depth.values())) != 1:
        raise AssertionError(
            f"{label}: RNG state grows with depth — u32 entry parameters by layer count: "
            f"{u32_by_depth} (a forked stream per wrapper per layer?)"
        )
    return next(iter(u32_by_depth.values()))


def assert_rng_state_grows(u32_by_depth: dict[int, int], label: str) -> None:
    """Control: with a private stream per site, u32 entry parameters strictly grow with depth."""
    __tracebackhide__ = True
    counts = [u32_by_depth[n] for n in sorted(u32_by_depth)]
    if not all(a < b for a, b in zip(counts, counts[1:])):
        raise AssertionError(
            f"{label}: forced PRIVATE, u32 entry parameters should grow with depth but are "
            f"{u32_by_depth}; the measurement is not seeing per-site streams"
        )


def assert_rng_state_matches_twin(u32: int, twin_u32: int, label: str) -> int:
    """A recipe that shares the caller's stream adds no RNG state: the step's u32 entry parameters are the twin's.

    ``twin_u32``: the unquantized stack's at the same depth (its own stream's
    key and count). Flatness over depth does not see one stream made for the
    whole stack (a fork of the caller's stream every site shares): flat, but a
    stream that is not the caller's. Returns ``u32``.
    """
    __tracebackhide__ = True
    if u32 != twin_u32:
        raise AssertionError(
            f"{label}: the train step carries {u32} u32 entry parameters, the unquantized stack's {twin_u32}: "
            "RNG state beyond the caller's stream (a stream of the sites' own, shared across layers?)")
    return u32


def check_rng(case: Case) -> int:
    """The recipe's own RNG mode keeps step RNG state flat over 1/2/8 layers; forced PRIVATE grows."""
    __tracebackhide__ = True
    model, label = case.variant.model, f"{case.recipe}-{case.variant.model}"

    def u32(mode, depths):
        counts = rng_entry_params(model, case.recipe, depths=depths, apply_rngs=mode)
        return {n: c.get("u32", 0) for n, c in counts.items()}

    flat = assert_rng_state_constant(u32(None, RNG_DEPTHS), label)
    assert_rng_state_grows(u32(ApplyRngs.PRIVATE, RNG_CONTROL_DEPTHS), f"{label} (private control)")
    return flat


#: The RNG invariant runs on these models' plain dense layer. Streams reach a
#: layer only through its call sites, which both models build with the same code
#: (Gemma differs in its router, expert count and activation, none of which
#: draws), so Gemma's decoders would trace five more stacks (up to 8 layers) to
#: measure the same plumbing.
RNG_MODELS = ("mixtral",)


def _rng_applies(recipe: Recipe, variant: Variant) -> bool:
    # For recipes that draw from a shared stream. Recipes that never draw are held
    # to carrying no stream at all by `sites`, and their u32 entry parameters are
    # pinned by their golden cases.
    return (recipe.apply_rngs is ApplyRngs.SHARED and variant.model in RNG_MODELS
            and variant == Variant(variant.model, "dense", False))


def check_sharded(case: Case) -> float:
    """:func:`assert_layer_sharded_matches` for the case's layer on the ("data", "expert") mesh.

    Against :func:`~qcheck.cases.layer_output`, the output every other check
    reads: for fp8-class recipes that is the forward pass inside the train step,
    so no second single-device program is compiled for this check (on jax
    0.10.2 it is bitwise equal to the forward program's output anyway).
    """
    __tracebackhide__ = True
    return assert_layer_sharded_matches(
        functools.partial(cases_mod.sharded_layer, case), cases_mod.layer_output(case),
        cases_mod.layer_input(case.variant.model), case.id, mesh=cases_mod.mesh())


def check_referee(case: Case) -> float:
    """:func:`assert_layer_matches_referee` on the case's output, within its row's tolerance (``referee_tolerance``).

    The output is :func:`~qcheck.cases.layer_output`, the one every other
    check reads (for ``none``, the forward pass inside its train step): no
    program of its own, the referee runs in numpy.
    """
    __tracebackhide__ = True
    rtol, atol = case.variant.referee_tolerance
    return assert_layer_matches_referee(cases_mod.layer(case), np.asarray(cases_mod.layer_input(case.variant.model)),
                                        case.id, rtol=rtol, atol=atol, output=cases_mod.layer_output(case))


def check_golden(case: Case, golden_root: Path = Path("golden")) -> None:
    """The case matches its golden file (qcheck's own recipes: the package's; others: ``golden_root``'s).

    A run binds ``golden_root`` once (:class:`RunEnv`); the other invariants need nothing but the case.
    """
    __tracebackhide__ = True
    v = case.variant
    gcase = golden.GoldenCase(case.recipe, v.model, v.path, v.dropping)
    golden.check_case(gcase, golden.root_for(case.recipe, golden_root))


@dataclasses.dataclass(frozen=True)
class Invariant:
    """A per-case check and the cases it applies to."""

    name: str
    applies: Callable[[Recipe, Variant], bool]
    run: Callable[[Case], float | None]


INVARIANTS: tuple[Invariant, ...] = (
    Invariant("sites", lambda r, v: r.quantized, check_sites),
    Invariant("coverage", lambda r, v: r.quantized, check_coverage),
    Invariant("exact", _exact_applies, check_exact),
    Invariant("backward", _backward_applies, check_backward),
    Invariant("tracks", lambda r, v: r.quantized, check_tracks),
    # Wherever the case trains; `backward` only where an exact reference exists too.
    Invariant("grads", cases_mod.grads_applies, check_grads),
    Invariant("state", lambda r, v: r.materialize_at_build, check_state),
    Invariant("train", _train_applies, check_train),
    Invariant("rng", _rng_applies, check_rng),
    # Sharded twins exist per model and path, without token dropping; golden cases for every variant.
    Invariant("sharded", lambda r, v: not v.dropping, check_sharded),
    # The unquantized layers only: a quantized one differs from the referee by its quantization, and runs the
    # same layer code as its twin, which this holds on every variant.
    Invariant("referee", lambda r, v: not r.quantized, check_referee),
    # Against the package's golden cases and ./golden; a run binds its own directory (RunEnv).
    Invariant("golden", lambda r, v: True, check_golden),
)


@dataclasses.dataclass(frozen=True)
class RunEnv:
    """One run of the suite, built once: what its invariants need besides the case.

    That is where the user's golden cases live, and ``golden`` is the one
    invariant that reads it: :attr:`invariants` is :data:`INVARIANTS` with
    that directory bound, so every other check keeps taking the case alone.
    """

    golden_root: Path = Path("golden")

    @property
    def invariants(self) -> tuple[Invariant, ...]:
        """:data:`INVARIANTS` (as it stands when asked) as this run runs them."""
        return tuple(self.bind(inv) for inv in INVARIANTS)

    def bind(self, invariant: Invariant) -> Invariant:
        """``invariant`` as this run runs it: the golden check against :attr:`golden_root`, others as they are."""
        if invariant.run is check_golden:
            return dataclasses.replace(invariant, run=functools.partial(check_golden, golden_root=self.golden_root))
        return invariant
