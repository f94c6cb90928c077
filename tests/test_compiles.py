"""No recompiles: each distinct program compiles at most once per process.

The suite's cached fixtures run first (work the rest of the suite reuses), then
the same steps on layers built afresh must not compile anything
(checks.assert_no_recompiles counts compile requests in JAX's own compile log).
A jit made anew per call, a static graph definition that does not compare
equal, or a shape that drifts would show here by function name.
"""

import jax
import jax.numpy as jnp
import pytest

from qcheck import checks
from qcheck.checks._site import judge_site_calls
from qcheck.layers import step
from qcheck.suite import cases, golden, invariants
from qcheck.suite.cases import SEED, Case, Variant, layer_input
from qcheck.layers.moe import build_moe
from qcheck.recipes import get_recipe

#: Every kind of program the suite compiles: fp8 state with dropping (train
#: steps, the per-site program of exact and backward), a drawing recipe on the sparse path (ragged
#: dot, stochastic rounding), golden's lowering and codes.
REPRESENTATIVE = (
    Case("fp8", Variant("mixtral", "dense", True)),
    Case("nvfp4", Variant("mixtral", "sparse", False)),
)


def suite_pass() -> None:
    """What the suite does for each case, on a freshly built layer."""
    for case in REPRESENTATIVE:
        v, recipe = case.variant, get_recipe(case.recipe)
        layer = build_moe(v.model, case.recipe, path=v.path, capacity_factor=v.capacity_factor, seed=SEED)
        x = layer_input(v.model)
        step.lower_train_step(*step.split_for_step(layer), x)  # golden's entry parameters
        invariants.assert_sites_independent(layer, label=case.id)
        if cases.train_step_runs(recipe, v):  # as cases.layer_output: the output comes from the train step
            first = step.train_step(layer, x)
            if recipe.materialize_at_build:  # as invariants.run_state
                step.train_step(layer, x, fp8_meta=first.fp8_meta)
        else:
            step.apply(layer, x)
        runs = invariants.site_runs(layer, recipe, v)  # as invariants.case_site_runs: exact's and backward's program
        if recipe.lhs is not None or recipe.reference.cast_dtype is not None:
            invariants.assert_sites_exact(layer, recipe, runs, label=case.id)
            judge_site_calls(tuple(layer.sites.keys()), runs.calls, recipe)  # as the exact invariant's run
        invariants.assert_sites_backward_exact(layer, recipe, runs, label=case.id)
    golden.operand_codes.__wrapped__("mxfp8", "gemma")


def suite_fixtures() -> None:
    """The same steps through the suite's per-process caches, which later tests reuse."""
    for case in REPRESENTATIVE:
        recipe = get_recipe(case.recipe)
        cases.layer_output(case)
        invariants.run_sites(case)
        if recipe.materialize_at_build:
            invariants.run_state(case)
        if recipe.lhs is not None or recipe.reference.cast_dtype is not None:
            invariants.run_exact(case)
        invariants.run_backward(case)
        golden.train_step_entry_params(case)
    golden.operand_codes("mxfp8", "gemma")


def test_each_program_compiles_once_per_process():
    checks.assert_no_recompiles(suite_pass, warmup=suite_fixtures, label="the suite's fixtures on fresh layers")


def test_a_jit_made_per_call_is_named_as_a_recompile():
    x = jnp.ones((2, 3))
    with pytest.raises(AssertionError, match=r"compiled 1 programs again:\n  jit\(<lambda>\) \(ShapedArray\(float32\[2,3\]\),\) x1"):
        checks.assert_no_recompiles(lambda: jax.jit(lambda v: v * 3)(x), label="bug")
