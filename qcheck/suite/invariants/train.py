"""The ``train`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

import functools

import numpy as np

from qcheck.checks.harness import assertion
from qcheck.layers import step
from qcheck.layers.moe import MoE
from qcheck.recipes import Recipe, get_recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant, train_step_runs
from qcheck.suite.invariants._programs import case_site_runs, serves

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("`qcheck.train`, the reference trainer, leaves the same fp8 state after a step on the batch as over 2 "
       "microbatches, and clipped and weight-decayed as not; each amax history rolls once per step and holds the "
       "referee's amax of what its site received")


#: The ``train`` invariant's microbatches, and a clip threshold far below the cases' gradient norms (about 0.25).
TRAIN_MICROBATCHES, TRAIN_MAX_NORM = 2, 1e-3
#: The microbatch relation's tolerance where the layer's own output rounds a microbatch's rows otherwise than the
#: whole batch's (XLA:CPU picks matmul kernels by shape: jax 0.12 on a Xeon with AMX does so for Gemma's router
#: logits, moving its output gradients' amax by 2 ulps): far above that rounding, far below the factors the bugs
#: move a leaf by (M, 1/M, the clip factor).
TRAIN_RTOL = 1e-5


def applies(recipe: Recipe, variant: Variant) -> bool:
    # Where the recipe carries fp8 state and the case trains. Not with token dropping: each expert's capacity
    # follows from the tokens in the batch, so microbatches drop other tokens than the whole batch does.
    return recipe.materialize_at_build and not variant.dropping and train_step_runs(recipe, variant)


def _site_leaves(state: dict[str, np.ndarray], site: str, suffix: str) -> list[str]:
    return [k for k in state if k.startswith(f"sites/{site}/") and k.endswith(suffix)]


@assertion
def assert_layer_trains(layer: MoE, x, *, label: str = "", calls=None) -> int:
    """qcheck's reference trainer (:func:`qcheck.train`) on ``layer`` keeps the fp8 state it must.

    With :func:`qcheck.assert_fp8_state_matches`, bitwise, from the fresh
    layer: one step on ``x`` == the same step in ``TRAIN_MICROBATCHES``
    microbatches (merged by max); an unclipped step without weight decay == a
    step clipped to ``TRAIN_MAX_NORM`` with weight decay. Then each site's
    input and kernel histories hold, after one step, the numpy amaxes of the
    two operands the site received in the layer's forward pass (``calls``,
    recorded by :func:`qcheck.checks.harness.record_site_calls`; skipped without),
    bitwise, as a pair (Flax's ``Fp8Einsum`` records the weight as its "input"
    where ``jnp.einsum`` swaps the operands), and every amax history rolls
    exactly once per step (over two steps). The output gradient's amax has no
    cheap referee: the microbatch relation holds it.

    The microbatch relation is bitwise unless the layer's output itself differs
    between the whole batch and its microbatches (:func:`output_rows_differ`:
    XLA may compile a matmul of another shape to a kernel that sums in another
    order); only then it is held to ``TRAIN_RTOL``, and a failure says so.
    Returns how many fp8 leaves were held.
    """
    __tracebackhide__ = True
    from qcheck.checks import assert_fp8_state_matches, fp8_state
    from qcheck.checks.harness import history_rolls
    from qcheck.layers.trainer import train

    fresh = fp8_state(layer)
    unclipped = functools.partial(train, max_norm=None, weight_decay=0.0)
    m = TRAIN_MICROBATCHES
    microbatched = functools.partial(unclipped, microbatches=m)
    relation = _which(label, f"one batch vs {m} microbatches")
    try:
        first = assert_fp8_state_matches(unclipped, microbatched, layer, x, label=relation)
    except AssertionError:
        differ, total = output_rows_differ(layer, x, m)
        if not differ:
            raise
        try:
            first = assert_fp8_state_matches(unclipped, microbatched, layer, x, rtol=TRAIN_RTOL, label=relation)
        except AssertionError as e:
            e.args = (f"{e.args[0]}\n(held to rtol {TRAIN_RTOL:g}, not bitwise: the layer's output on the whole "
                      f"batch differs from its output on the {m} microbatches in {differ} of {total} values)",
                      *e.args[1:])
            raise
    assert_fp8_state_matches(unclipped, functools.partial(train, max_norm=TRAIN_MAX_NORM, weight_decay=0.1),
                             layer, x, label=_which(label, "unclipped vs clipped and weight-decayed"))
    loop = functools.partial(train, layer, x, microbatches=m, max_norm=TRAIN_MAX_NORM)
    # Step 2 rolls what the same loop's step 1 left (bitwise the whole batch's, unless its output rounds otherwise).
    one, second = fp8_state(loop(steps=1)), fp8_state(loop(steps=2))
    for call in calls or ():
        # The pair, not which is which: Flax's Fp8Einsum names the operand jnp.einsum hands its dot_general
        # first "input", and for some equations (the dense path's wo) that is the weight.
        want = sorted(np.float32(np.max(np.abs(np.asarray(o, np.float32)))) for o in (call.lhs, call.rhs))
        for ins, ker in zip(_site_leaves(first, call.site, "input_amax_history"),
                            _site_leaves(first, call.site, "kernel_amax_history")):
            got = sorted((first[ins][0], first[ker][0]))
            if np.array(got, np.float32).view(np.uint32).tolist() != np.array(want).view(np.uint32).tolist():
                raise AssertionError(
                    f"{ins}[0], {ker}[0] after one step are {first[ins][0]:.9g}, {first[ker][0]:.9g}; "
                    f"the referee's amaxes of the operands site {call.site!r} received are "
                    f"{float(np.max(np.abs(call.lhs))):.9g} (lhs), {float(np.max(np.abs(call.rhs))):.9g} (rhs): "
                    "the site records other amaxes than its operands' (summed over uses?)")
    for key in sorted(k for k in fresh if k.endswith("history")):
        for n, before, after in ((1, fresh[key], first[key]), (2, one[key], second[key])):
            if (rolls := history_rolls(before, after)) != 1:
                what = {None: "is no roll of the one before", 0: "was not rolled"}.get(rolls, f"rolled {rolls} times")
                raise AssertionError(f"{key} at step {n} {what} (each history rolls once per step, "
                                     "newest amax at 0)")
    return len(fresh)


def _which(label: str, relation: str) -> str:
    return f"{label} ({relation})" if label else relation


def output_rows_differ(layer: MoE, x, microbatches: int) -> tuple[int, int]:
    """How many of ``layer``'s output values differ bitwise between ``x`` whole and in ``microbatches`` parts; of how
    many."""
    whole = np.asarray(step.apply(layer, x)[0])
    parts = np.concatenate([np.asarray(step.apply(layer, part)[0]) for part in np.split(np.asarray(x), microbatches)])
    as_bytes = [a.reshape(-1).view(np.uint8).reshape(a.size, -1) for a in (whole, parts)]
    return int(np.any(as_bytes[0] != as_bytes[1], axis=1).sum()), whole.size


def run(case: Case) -> None:
    """:func:`assert_layer_trains` on the case's fresh layer, its sites' operands from :func:`case_site_runs`."""
    __tracebackhide__ = True
    recipe = get_recipe(case.recipe)
    calls = case_site_runs(case).calls if serves("exact", recipe, case.variant) else None
    assert_layer_trains(cases_mod.layer(case), cases_mod.layer_input(case.variant.model), label=case.id,
                        calls=calls)
