"""Each public check, shown passing on correct code and failing on the bug it exists for."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from qcheck import checks, get_recipe
from qcheck.checks import harness
from qcheck.layers.bridge import QuantSite

E4M3FN, E4M3FNUZ = jnp.float8_e4m3fn, jnp.float8_e4m3fnuz
EQN = "bd,de->be"
LHS, RHS = checks.probe_operands(0, (8, 32), (32, 16))


def fresh_site(recipe: str) -> QuantSite:
    return QuantSite(get_recipe(recipe), "probe", rngs=nnx.Rngs(0))


# -- rel_norm ---------------------------------------------------------------


def test_rel_norm_measures_relative_l2_error():
    ref = np.array([3.0, 4.0], np.float32)
    assert checks.rel_norm(ref * 1.5, ref) == pytest.approx(0.5)
    assert checks.rel_norm(ref, ref) == 0.0


def test_rel_norm_rejects_mismatched_shapes_and_zero_reference():
    with pytest.raises(ValueError, match=r"shape \(2,\).*shape \(1, 2\)"):
        checks.rel_norm(np.ones(2), np.ones((1, 2)))
    with pytest.raises(ValueError, match="all zeros"):
        checks.rel_norm(np.ones(3), np.zeros(3))


# -- assert_tracks ------------------------------------------------------------


def test_assert_tracks_should_pass_on_a_quantized_result():
    rng = np.random.default_rng(0)
    lhs, rhs = (rng.normal(size=s).astype(np.float32) for s in ((8, 32), (32, 16)))
    ref = np.asarray(jnp.einsum(EQN, lhs, rhs))
    quant = np.asarray(fresh_site("fp8")(EQN, lhs, rhs))
    figure = checks.assert_tracks(quant, ref, max_rel_norm=0.22)
    assert 0 < figure < 0.22


def test_assert_tracks_should_fail_on_a_silent_unquantized_fallback():
    ref = np.asarray(jnp.einsum(EQN, LHS, RHS))
    with pytest.raises(AssertionError, match="bitwise equal to the unquantized reference"):
        checks.assert_tracks(ref.copy(), ref)


def test_assert_tracks_should_fail_beyond_the_bound():
    ref = np.linspace(1.0, 2.0, 16, dtype=np.float32)
    with pytest.raises(AssertionError, match=r"relative norm 0\.30\d* exceeds the bound 0\.22"):
        checks.assert_tracks(ref * 1.3, ref, max_rel_norm=0.22)


def test_assert_tracks_should_fail_on_broadcastable_shapes():
    with pytest.raises(AssertionError, match=r"shape \(1, 4\) but reference has shape \(4,\)"):
        checks.assert_tracks(np.ones((1, 4)), np.ones(4) * 1.01)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_assert_tracks_should_fail_on_non_finite_values(bad):
    ref = np.ones(4, np.float32)
    actual = ref.copy()
    actual[2] = bad
    with pytest.raises(AssertionError, match="actual has 1 non-finite values out of 4"):
        checks.assert_tracks(actual, ref)
    with pytest.raises(AssertionError, match="reference has 1 non-finite values"):
        checks.assert_tracks(ref, actual)


def test_assert_tracks_refuses_a_zero_reference():
    with pytest.raises(ValueError, match="reference is all zeros"):
        checks.assert_tracks(np.ones(4), np.zeros(4))


# -- assert_fresh_cast_exact --------------------------------------------------


@pytest.mark.parametrize("recipe, flavour", [("fp8", E4M3FN), ("nanoo_fp8", E4M3FNUZ)])
def test_fresh_cast_exact_should_pass_on_a_fresh_fp8_site(recipe, flavour):
    checks.assert_fresh_cast_exact(fresh_site(recipe), EQN, LHS, RHS, cast_dtype=flavour)


def test_fresh_cast_exact_agrees_with_flax_fp8einsum():
    # An independent implementation of the same recipe passes the same reference.
    flax_fp8 = nnx.bridge.ToNNX(nn.Fp8Einsum()).lazy_init(EQN, LHS, RHS)
    checks.assert_fresh_cast_exact(flax_fp8, EQN, LHS, RHS, cast_dtype=E4M3FN)


@pytest.mark.parametrize("recipe, flavour", [("fp8", E4M3FNUZ), ("nanoo_fp8", E4M3FN)])
def test_fresh_cast_exact_should_fail_on_the_wrong_flavour(recipe, flavour):
    with pytest.raises(AssertionError, match="wrong fp8 flavour"):
        checks.assert_fresh_cast_exact(fresh_site(recipe), EQN, LHS, RHS, cast_dtype=flavour)


def test_fresh_cast_exact_should_fail_on_flax_fp8einsum_asked_for_fnuz():
    # flax.linen.Fp8Einsum ignores e4m3_dtype and casts to e4m3fn: NANOO built on it is wrong.
    flax_fp8 = nnx.bridge.ToNNX(nn.Fp8Einsum(e4m3_dtype=E4M3FNUZ)).lazy_init(EQN, LHS, RHS)
    with pytest.raises(AssertionError, match="float8_e4m3fn-cast reference bitwise \\(wrong fp8 flavour\\)"):
        checks.assert_fresh_cast_exact(flax_fp8, EQN, LHS, RHS, cast_dtype=E4M3FNUZ)


def test_fresh_cast_exact_should_fail_on_a_silently_unquantized_einsum():
    with pytest.raises(AssertionError, match="silently unquantized"):
        checks.assert_fresh_cast_exact(jnp.einsum, EQN, LHS, RHS, cast_dtype=E4M3FN)


def test_fresh_cast_exact_should_fail_on_a_cast_without_saturation():
    def unsaturated(eqn, lhs, rhs):
        cast = lambda x: x.astype(E4M3FN).astype(x.dtype)  # noqa: E731 - the bug: no clip
        return jnp.einsum(eqn, cast(lhs), cast(rhs))

    with pytest.raises(AssertionError, match="non-finite values \\(an unsaturated cast"):
        checks.assert_fresh_cast_exact(unsaturated, EQN, LHS, RHS, cast_dtype=E4M3FN)


def test_fresh_cast_exact_should_fail_when_the_scale_is_not_one():
    site = fresh_site("fp8")
    site.input_scale[...] = jnp.full((1,), 2.0, jnp.float32)
    with pytest.raises(AssertionError, match="scale not 1"):
        checks.assert_fresh_cast_exact(site, EQN, LHS, RHS, cast_dtype=E4M3FN)


def test_fresh_cast_exact_refuses_operands_that_cannot_fail():
    exact = np.array([[1.0, 2.0], [0.5, -4.0]], np.float32)  # representable in every fp8 type
    with pytest.raises(ValueError, match="equals the unquantized einsum 'bd,de->be' bitwise"):
        checks.assert_fresh_cast_exact(jnp.einsum, EQN, exact, exact, cast_dtype=E4M3FN)


def test_fresh_cast_exact_refuses_operands_blind_to_the_flavour():
    # Both e4m3 flavours have 3 mantissa bits at this magnitude: 1 + 2^-5 rounds to
    # 1.0 in each, so their references agree and a wrong flavour would pass.
    x = np.full((2, 2), 1.0 + 2.0**-5, np.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn-cast reference equals the float8_e4m3fnuz-cast reference bitwise"):
        checks.assert_fresh_cast_exact(jnp.einsum, EQN, x, x, cast_dtype=E4M3FN)


@pytest.mark.parametrize("bad", [jnp.bfloat16, jnp.int8, "float32", ml_dtypes.float4_e2m1fn])
def test_fresh_cast_exact_rejects_a_non_fp8_cast_dtype(bad):
    with pytest.raises(ValueError, match="cast_dtype must be an fp8 type .*float8_e4m3fn"):
        checks.assert_fresh_cast_exact(jnp.einsum, EQN, LHS, RHS, cast_dtype=bad)


def test_fresh_ragged_cast_exact_should_pass_and_fail():
    lhs, rhs = checks.probe_operands(1, (12, 32), (3, 32, 16))
    sizes = np.array([5, 7, 0], np.int32)
    checks.assert_fresh_cast_exact(
        fresh_site("nanoo_fp8").ragged_dot, checks.Ragged(sizes), lhs, rhs, cast_dtype=E4M3FNUZ)
    with pytest.raises(AssertionError, match="^assert_fresh_cast_exact: ragged_dot differs .*silently unquantized"):
        checks.assert_fresh_cast_exact(jax.lax.ragged_dot, checks.Ragged(sizes), lhs, rhs, cast_dtype=E4M3FNUZ)


def test_cast_reference_saturates_instead_of_overflowing_to_nan():
    x = np.array([464.01, -1e9, 241.0, 1.0], np.float32)
    np.testing.assert_array_equal(harness.cast_reference(x, E4M3FN), [448.0, -448.0, 240.0, 1.0])
    np.testing.assert_array_equal(harness.cast_reference(x, E4M3FNUZ), [240.0, -240.0, 240.0, 1.0])
    assert np.isnan(x.astype(ml_dtypes.float8_e4m3fn)[0])  # what the clip protects against


# -- entry_params -------------------------------------------------------------


def test_entry_params_counts_parameters_by_element_type():
    def fn(x, key, n):
        return x * 2, jax.random.fold_in(key, n)

    counts = harness.entry_params(fn, jnp.ones((3, 4)), jax.random.key(0), jnp.int32(1))
    assert counts == {"f32": 1, "s32": 1, "u32": 1, "total": 3}
    raw = harness.entry_params(fn, jnp.ones(3), jax.random.PRNGKey(0), jnp.int32(1))
    assert raw["u32"] == 1


def test_entry_params_does_not_count_unused_arguments():
    assert harness.entry_params(lambda x, unused: x + 1, jnp.ones(2), jnp.ones(5)) == {"f32": 1, "total": 1}


def _stack_of_wrappers(n: int, share: bool):
    rngs = nnx.Rngs(0)
    sites = [QuantSite(get_recipe("int8"), f"s{i}", rngs=rngs) for i in range(n)]
    if share:
        for s in sites:
            s.share_rngs(rngs)
    return nnx.List(sites)


def _step_params(n: int, share: bool) -> int:
    graphdef, state = nnx.split(_stack_of_wrappers(n, share))

    def step(state, x):
        stack = nnx.merge(graphdef, state, copy=True)
        for s in stack:
            x = s(EQN, x, jnp.ones((32, 32)))
        return x, nnx.state(stack)

    return harness.entry_params(step, state, jnp.ones((2, 32)))["u32"]


def test_entry_params_sees_a_forked_stream_per_wrapper():
    # The seed's bug: every wrapper keeps its own forked Rngs, so RNG state grows with depth.
    assert _step_params(1, share=False) < _step_params(4, share=False)
    assert _step_params(1, share=True) == _step_params(4, share=True)
