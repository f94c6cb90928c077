"""A recipe's fp8 types against the hardware it targets, read from the program forward and backward.

The control for every failure below is the same check passing on the healthy
recipe of the same shape.
"""

import jax.numpy as jnp
import pytest
from flax import nnx

import qcheck
from qcheck import checks, get_recipe, hardware
from qcheck.checks._fp8_native import declared_fp8_dtypes, declared_operand_fp8_dtypes
from qcheck.layers.moe import MODELS, MoE
from qcheck.recipes import DelayedScalingFp8, Expect, Recipe, registered
from qcheck.suite import cases, invariants

E4M3FN, E5M2, E5M2FNUZ = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e5m2fnuz
X = cases.layer_input("mixtral")


def _cast_einsum(x, w, scale):
    # Codes times a scale that was itself cast (as NVFP4's e4m3 block scales are).
    q = lambda v, d: v.astype(d).astype(jnp.float32)  # noqa: E731
    return jnp.einsum("tm,mh->th", q(x, E4M3FN), q(w, E4M3FN) * q(scale, E5M2FNUZ))


def _xw():
    return jnp.ones((4, 8), jnp.float32), jnp.ones((8, 2), jnp.float32), jnp.float32(2.0)


# -- the coverage map's backward pass --------------------------------------------


def test_coverage_backward_tags_the_gradient_matmuls_should_pass():
    records = qcheck.coverage(_cast_einsum, *_xw(), backward=True)
    assert [r.backward for r in records] == [False, True, True], qcheck.format_coverage(records)
    forward = records[0]
    assert forward.lhs_casts == {"float8_e4m3fn"}
    # The record reports the codes' cast; the scale's cast is kept beside it.
    assert str(forward.rhs) == "float8_e4m3fn" and forward.rhs_casts == {"float8_e4m3fn", "float8_e5m2fnuz"}
    assert "pass" in qcheck.format_coverage(records).splitlines()[0]


def test_coverage_without_backward_has_no_backward_records():
    records = qcheck.coverage(_cast_einsum, *_xw())
    assert len(records) == 1 and not records[0].backward
    assert "pass" not in qcheck.format_coverage(records).splitlines()[0]


def test_coverage_backward_refuses_errors():
    with pytest.raises(ValueError, match=r"coverage: errors=True .* pass errors=False with backward=True"):
        qcheck.coverage(_cast_einsum, *_xw(), errors=True, backward=True)


# -- targets ----------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda: hardware.fp8_target_dtypes("h100"),
    lambda: Expect(fp8_target="h100"),
])
def test_unknown_fp8_target_lists_the_valid_ones(call):
    with pytest.raises(ValueError, match=r"unknown fp8[_ ]target 'h100'; valid .*: nvidia, mi300"):
        call()


def test_every_recipe_with_declared_fp8_types_names_its_target():
    # Built-ins, contrib and adapter recipes alike (the latter two register through entry points).
    for name in qcheck.recipe_names():
        recipe = get_recipe(name)
        declared = declared_fp8_dtypes(recipe)
        target = recipe.expect.fp8_target
        assert (target is not None) == bool(declared), (name, target, declared)


# -- declared formats ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8", "nanoo_fp8", "nvfp4", "fp8_current", "mxfp8", "flax_fp8", "flax_nanoo_fp8"])
def test_recipe_fp8_native_should_pass(name):
    declared = checks.assert_recipe_fp8_native(get_recipe(name))
    assert declared and all(declared.values())


@pytest.mark.parametrize("recipe, match", [
    (Recipe("slip", lhs="e4m3fn", rhs="e4m3fn", grad="e5m2fnuz", expect=Expect(fp8_target="nvidia")),
     r"recipe 'slip' declares fp8 types not native to its target 'nvidia' \(native fp8: float8_e4m3fn, "
     r"float8_e5m2\): grad float8_e5m2fnuz$"),
    (DelayedScalingFp8("nanoo_e4m3fn", e4m3_dtype=E4M3FN, e5m2_dtype=E5M2FNUZ, expect=Expect(fp8_target="mi300")),
     r"recipe 'nanoo_e4m3fn' .*target 'mi300' .*: lhs float8_e4m3fn, rhs float8_e4m3fn, "
     r"reference.cast_dtype float8_e4m3fn, e4m3_dtype float8_e4m3fn$"),
])
def test_recipe_fp8_native_should_fail(recipe, match):
    with pytest.raises(AssertionError, match=r"^assert_recipe_fp8_native: " + match):
        checks.assert_recipe_fp8_native(recipe)


def test_recipe_fp8_native_needs_a_target():
    with pytest.raises(ValueError, match=r"recipe 'int8' declares no fp8_target; pass target="):
        checks.assert_recipe_fp8_native(get_recipe("int8"))


# -- what the layer casts to, forward and backward -------------------------------


def _layer(recipe: Recipe, path: str = "dense") -> MoE:
    return MoE(MODELS["mixtral"], recipe, path=path, rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)


@pytest.mark.parametrize("name", ["fp8", "nanoo_fp8", "flax_fp8", "flax_nanoo_fp8", "fp8_current", "mxfp8"])
@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_fp8_dtypes_native_should_pass(name, path):
    recipe = get_recipe(name)
    records = checks.assert_fp8_dtypes_native(_layer(recipe, path), X, target=recipe.expect.fp8_target)
    assert any(r.backward for r in records) and any(not r.backward for r in records)


def test_fp8_dtypes_native_reads_both_flavours_of_a_healthy_nanoo_layer():
    # The control that the check sees what it must: the fnuz casts themselves, in both passes.
    records = checks.assert_fp8_dtypes_native(_layer(get_recipe("nanoo_fp8")), X, target="mi300")
    seen = {(r.backward, d) for r in records for d in r.lhs_casts | r.rhs_casts}
    assert seen == {(False, "float8_e4m3fnuz"), (True, "float8_e4m3fnuz"), (True, "float8_e5m2fnuz")}


def test_fp8_dtypes_native_fails_on_the_healthy_layer_against_the_other_target():
    with pytest.raises(AssertionError, match=r"not native to target 'nvidia' .*\n  forward: dot_general at "
                       r"qcheck/layers/moe.py:\d+ \(MoE._dense\): lhs cast to float8_e4m3fnuz(.|\n)*backward: .*"
                       r"float8_e5m2fnuz"):
        checks.assert_fp8_dtypes_native(_layer(get_recipe("nanoo_fp8")), X, target="nvidia")


def test_fp8_dtypes_native_skip_must_be_callable():
    with pytest.raises(TypeError, match=r"skip must be a callable"):
        checks.assert_fp8_dtypes_native(_layer(get_recipe("fp8")), X, target="nvidia", skip="MoE.route")


def _nanoo_in_e4m3fn() -> DelayedScalingFp8:
    """nanoo_fp8 with the e4m3 flavour wrong in declaration and site alike (the e5m2 flavour kept)."""
    return DelayedScalingFp8("nanoo_fp8_e4m3fn", e4m3_dtype=E4M3FN, e5m2_dtype=E5M2FNUZ,
                             expect=Expect(fp8_target="mi300"))


@pytest.fixture
def nanoo_in_e4m3fn():
    with registered(_nanoo_in_e4m3fn()) as (planted,):
        yield planted


def test_coverage_invariant_catches_nanoo_declared_and_built_in_e4m3fn(nanoo_in_e4m3fn):
    planted = nanoo_in_e4m3fn
    case = cases.Case(planted.name, cases.Variant("mixtral", "sparse", False))
    with pytest.raises(AssertionError, match=rf"^{case.id}: assert_recipe_fp8_native: .*target 'mi300'.*"
                       r"lhs float8_e4m3fn"):
        invariants.run_coverage(case)
    # The declaration aside, the program alone fails too, naming the site, the type and the pass.
    layer = cases.layer(case)
    with pytest.raises(AssertionError, match=r"not native to target 'mi300' \(native fp8: float8_e4m3fnuz, "
                       r"float8_e5m2fnuz\):\n  forward: ragged_dot_general at qcheck/layers/moe.py:\d+ \(MoE._sparse\): "
                       r"lhs cast to float8_e4m3fn"):
        checks.assert_fp8_dtypes_native(layer, X, target="mi300")


def test_coverage_invariant_runs_the_fp8_check_on_fp8_recipes():
    # Control of the wiring: the same invariant passes on the healthy recipes it covers.
    for name in ("fp8", "nanoo_fp8"):
        assert invariants.run_coverage(cases.Case(name, cases.Variant("mixtral", "sparse", False))) == 3


def test_the_fp8_check_costs_a_trace_not_a_compile():
    layer = _layer(get_recipe("fp8"), "sparse")
    checks.assert_no_recompiles(lambda: checks.assert_fp8_dtypes_native(layer, X, target="nvidia"),
                                warmup=lambda: None)


def test_coverage_invariant_checks_the_forward_alone_where_gradients_cannot_tile():
    # MXFP8's 32-blocks cannot tile the dropping layer's 16-token gradient matmuls: forward only.
    case = cases.Case("mxfp8", cases.Variant("mixtral", "dense", True))
    assert invariants.run_coverage(case) > 0
    records = checks.assert_fp8_dtypes_native(cases.layer(case), X, target="nvidia", backward=False)
    assert records and not any(r.backward for r in records)
    assert {d for r in records for d in r.lhs_casts} == {"float8_e4m3fn"}


def test_fp8_dtypes_native_refuses_a_program_without_fp8_casts():
    # int8 everywhere, and NVFP4 (e2m1 codes; its e4m3 block scales divide, which the map does not follow).
    for name in ("int8", "nvfp4"):
        with pytest.raises(ValueError, match=r"none of the \d+ matmuls takes an operand cast to an fp8 type"):
            checks.assert_fp8_dtypes_native(_layer(get_recipe(name)), X, target="nvidia")
    assert declared_operand_fp8_dtypes(get_recipe("nvfp4")) == set()
    assert declared_operand_fp8_dtypes(get_recipe("nanoo_fp8")) == {"float8_e4m3fnuz"}


def _einsum_grad_cast_to(dtype):
    """e4m3fn operands forward; the output gradient cast to ``dtype`` in the backward pass only."""
    import jax

    @jax.custom_vjp
    def grad_cast(y):
        return y

    grad_cast.defvjp(lambda y: (y, None), lambda _, g: (g.astype(dtype).astype(g.dtype),))

    def fn(x, w):
        q = lambda v: v.astype(E4M3FN).astype(jnp.float32)  # noqa: E731
        return grad_cast(jnp.einsum("tm,mh->th", q(x), q(w)))

    return fn


def test_fp8_dtypes_native_sees_a_cast_made_only_in_the_backward_pass():
    x, w, _ = _xw()
    records = checks.assert_fp8_dtypes_native(_einsum_grad_cast_to(E5M2), x, w, target="nvidia")
    assert [(r.backward, sorted(r.lhs_casts | r.rhs_casts)) for r in records] == [
        (False, ["float8_e4m3fn"]), (True, ["float8_e4m3fn", "float8_e5m2"]), (True, ["float8_e4m3fn", "float8_e5m2"])]
    # Both gradient matmuls take g as their lhs at the same line: one line names them (no forward line).
    with pytest.raises(AssertionError, match=r"^assert_fp8_dtypes_native: 1 operand casts to fp8 types not native to "
                       r"target 'nvidia' \(native fp8: float8_e4m3fn, float8_e5m2\):\n"
                       r"  backward: dot_general at tests/test_fp8_native.py:\d+ \(.*fn\): lhs cast to float8_e5m2fnuz$"):
        checks.assert_fp8_dtypes_native(_einsum_grad_cast_to(E5M2FNUZ), x, w, target="nvidia")
