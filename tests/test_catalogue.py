"""The catalogue of bugs qcheck catches: each invariant fed the bug it exists for.

Every test here builds a broken layer on purpose and asserts that the
invariant fails on it with a message that names the problem. If one of these
starts passing silently, the invariant has gone blind. The controls — the same
invariants passing on healthy layers — are the invariant suite itself
(tests/test_invariants.py).
"""

import dataclasses
import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from flax.linen import fp8_ops

import qcheck
from qcheck import check_layer, checks, get_recipe
from qcheck.layers import step
from qcheck.suite import cases, golden, invariants
from qcheck.layers.bridge import QuantSite
from qcheck.layers.moe import MODELS, MoE
from qcheck.checks._site import assert_layer_sites_exact
from qcheck.recipes import ApplyRngs, DelayedScalingFp8, Recipe
from qcheck.recipes._fp8 import DelayedScalingFp8Site
from qcheck.recipes._sites import FormatSite, SiteOps
from tests.test_layer_check import INPUT_GRAD, MIXTRAL, _moe, _moe_full_precision, _NaNBackwardMoE
from tests.test_layer_check import X as LX

E4M3FN, E4M3FNUZ = jnp.float8_e4m3fn, jnp.float8_e4m3fnuz
X = cases.layer_input("mixtral")


def layer(recipe, *, dropping=False, path="dense", cls=MoE) -> MoE:
    return cls(MODELS["mixtral"], get_recipe(recipe), path=path,
               capacity_factor=1.0 if dropping else -1.0, rngs=nnx.Rngs(cases.SEED))


def swap_site(target: MoE, name: str, recipe, cls=QuantSite) -> None:
    target.sites[name] = cls(get_recipe(recipe), name, rngs=nnx.Rngs(7))


class FlaxFp8EinsumNanoo(Recipe):
    """NANOO fp8 built on flax.linen.Fp8Einsum, which ignores e4m3_dtype."""

    def __init__(self):
        super().__init__("flax_fp8einsum_nanoo", apply_rngs=ApplyRngs.NONE,
                         cast_dtype=E4M3FNUZ, materialize_at_build=True)

    def site_module(self, name):
        return nn.Fp8Einsum(e4m3_dtype=E4M3FNUZ, e5m2_dtype=jnp.float8_e5m2fnuz)


class UnsaturatedSite(SiteOps, nn.Module):
    def quantize_operands(self, lhs, rhs, axes):
        cast = lambda x: x.astype(E4M3FN).astype(x.dtype)  # noqa: E731 - the bug: no clip
        return cast(lhs), cast(rhs)


class Unsaturated(Recipe):
    def __init__(self):
        super().__init__("unsaturated_fp8", apply_rngs=ApplyRngs.NONE, cast_dtype=E4M3FN)

    def site_module(self, name):
        return UnsaturatedSite()


class ForwardWritesHistory(QuantSite):
    """Records the input amax during the forward pass, as an eager port might."""

    def __call__(self, eqn, lhs, rhs):
        out = super().__call__(eqn, lhs, rhs)
        self.input_amax_history[...] = self.input_amax_history[...].at[0].set(jnp.max(jnp.abs(lhs)))
        return out


class UnnormalizedSparseRouter(MoE):
    """A sparse path whose router forgets to renormalize the top-k weights."""

    def route(self, x):
        w, idx = super().route(x)
        return w * 0.9, idx


# -- fresh-layer exactness ------------------------------------------------------


def test_exact_catches_a_silently_unquantized_call_site():
    broken = layer("fp8")
    swap_site(broken, "wi_1", "none")
    with pytest.raises(AssertionError, match="site 'wi_1'.*silently unquantized"):
        invariants.assert_sites_cast_exact(broken, E4M3FN, "bug")


def test_exact_catches_nanoo_built_on_flax_fp8einsum():
    broken = MoE(MODELS["mixtral"], FlaxFp8EinsumNanoo(), rngs=nnx.Rngs(0))
    with pytest.raises(AssertionError, match="site 'wi_0'.*wrong fp8 flavour"):
        invariants.assert_sites_cast_exact(broken, E4M3FNUZ, "bug")


def test_exact_catches_the_wrong_flavour_on_the_sparse_path():
    healthy_fp8 = cases.layer(cases.Case("fp8", cases.Variant("mixtral", "sparse", False)))
    with pytest.raises(AssertionError, match="ragged_dot differs.*wrong fp8 flavour"):
        invariants.assert_sites_cast_exact(healthy_fp8, E4M3FNUZ, "bug")


def test_exact_catches_a_cast_without_saturation():
    broken = MoE(MODELS["mixtral"], Unsaturated(), capacity_factor=1.0, rngs=nnx.Rngs(0))
    with pytest.raises(AssertionError, match="site 'dispatch'.*unsaturated cast"):
        invariants.assert_sites_cast_exact(broken, E4M3FN, "bug")


def test_exact_and_state_catch_a_fresh_scale_that_is_not_one():
    broken = layer("nanoo_fp8")
    broken.sites["wo"].kernel_scale[...] = jnp.full((1,), 2.0)
    with pytest.raises(AssertionError, match="site 'wo'.*scale not 1"):
        invariants.assert_sites_cast_exact(broken, E4M3FNUZ, "bug")
    with pytest.raises(AssertionError, match=r"fresh layer has scales != 1 .*sites\.wo\.kernel_scale"):
        invariants.assert_fp8_state_moves_only_in_backward(broken, X, "bug")


# -- check_layer on any layer and its twin --------------------------------------------

def test_check_layer_catches_a_twin_with_other_weights():
    # Before any figure: a twin with other weights would fail tracks and gradients for the wrong reason.
    with pytest.raises(ValueError, match=r"^check_layer: reference's weights differ from layer's: gate "
                                         r"\(float32\[32, 8\]\) differs in 256 of 256 values; make the twin with "
                                         r"qcheck.copy_params_into\(layer, twin\)$"):
        check_layer(_moe("fp8"), _moe("none", seed=1), LX, skip=_moe_full_precision)


def test_check_layer_catches_nan_gradients():
    layer = _NaNBackwardMoE(MIXTRAL, qcheck.get_recipe("fp8"), path="sparse", rngs=nnx.Rngs(0))
    with pytest.raises(AssertionError) as info:
        check_layer(layer, _moe("none"), LX, skip=_moe_full_precision)
    message = str(info.value)
    assert message.startswith("check_layer: 5 check(s) failed:\n")
    for path, size in ((INPUT_GRAD, LX.size), ("gate", 32 * 8), ("wo", 8 * 64 * 32)):
        assert f"  gradients: {path} (float32) has {size} non-finite values out of {size} in the layer" in message


class _DropSkipsInt8Site(FormatSite):
    """int8, except on the token-dropping path's expert matmuls, which it runs unquantized."""

    def __call__(self, eqn, lhs, rhs):
        if eqn == "EBCM,EMH->EBCH":  # the bug: one equation, one path
            return jnp.einsum(eqn, lhs, rhs)
        return super().__call__(eqn, lhs, rhs)


class DropSkipsInt8(Recipe):
    def __init__(self):
        super().__init__("int8", lhs="int8", rhs="int8")

    def site_module(self, name):
        return _DropSkipsInt8Site(lhs="int8", rhs="int8")


def test_exact_catches_an_int8_site_unquantized_on_the_token_dropping_path():
    invariants.assert_sites_exact(layer(DropSkipsInt8()), get_recipe("int8"), "dense")  # passes off that path
    broken = layer(DropSkipsInt8(), dropping=True)
    with pytest.raises(AssertionError, match=r"bug: assert_layer_sites_exact: site 'wi_0' einsum 'EBCM,EMH->EBCH' "
                       r"\(int8 x int8\).*equals the unquantized matmul bitwise"):
        assert_layer_sites_exact(broken, X, "int8", label="bug")


class _WrongAxesMxfp8Site(FormatSite):
    def matmul(self, op, lhs, rhs, axes):  # the bug: weights blocked along axis -1, the default
        return super().matmul(op, lhs, rhs, dataclasses.replace(axes, rhs=(-1,)))


class WrongAxesMxfp8(Recipe):
    def __init__(self):
        super().__init__("mxfp8", lhs="mxfp8", rhs="mxfp8", grad="mxfp8")

    def site_module(self, name):
        return _WrongAxesMxfp8Site(lhs="mxfp8", rhs="mxfp8", grad="mxfp8")


def test_exact_catches_mxfp8_weights_blocked_along_the_wrong_axes():
    broken = layer(WrongAxesMxfp8())
    with pytest.raises(AssertionError, match=r"bug: assert_site_exact: site 'wi_0' einsum 'BSM,EMH->BSEH' "
                       r"\(mxfp8 x mxfp8\).*equals rhs in mxfp8 along the wrong axes \(2,\)"):
        invariants.assert_sites_exact(broken, get_recipe("mxfp8"), "bug")
    with pytest.raises(AssertionError, match=r"site 'wi_0' einsum 'BSM,EMH->BSEH' \(mxfp8 x mxfp8\).*"
                       r"equals rhs in mxfp8 along the wrong axes \(2,\)"):
        assert_layer_sites_exact(broken, X, "mxfp8")


class WiZeroTwice(MoE):
    """A dense layer that calls site 'wi_0' where 'wi_1' belongs: both sites quantize, so probes pass."""

    def _dense(self, x, weights, idx):
        wi_0, wi_1, wo = self._weights()
        s = self.sites
        h = self._act(s["wi_0"]("BSM,EMH->BSEH", x, wi_0), s["wi_0"]("BSM,EMH->BSEH", x, wi_1))
        out = s["wo"]("BSEH,EHM->BSEM", h, wo)
        combine = jnp.sum(jax.nn.one_hot(idx, self.config.num_experts) * weights[..., None], axis=2)
        return self.combine("BSEM,BSE->BSM", out, combine)


def test_exact_catches_a_layer_calling_wi_0_where_wi_1_belongs():
    broken = layer("int8", cls=WiZeroTwice)
    invariants.assert_sites_exact(broken, get_recipe("int8"), "probes")  # each site alone is fine
    with pytest.raises(AssertionError, match=r"bug: assert_layer_sites_exact: site 'wi_1' was never called .*"
                       r"wi_0 x2, wi_1 x0, wo x1"):
        assert_layer_sites_exact(broken, X, "int8", label="bug")


from qcheck.adapters import JaxScaledDotRecipe, scaled_dot_general_runs  # noqa: E402
from qcheck.adapters._jax import JaxScaledDotSite, einsum_dimension_numbers  # noqa: E402

needs_scaled_matmul = pytest.mark.skipif(
    not scaled_dot_general_runs(), reason=f"jax {jax.__version__} has no {jax.default_backend()} lowering for "
                                          "jax.nn.scaled_matmul (jax 0.10.2 on CPU)")


def _to_3d(x, sub: str, first: str, keep: str, contract: str):
    """``x`` as (batch, rows, contraction), each group of indices flattened in ``sub``'s order."""
    groups = [[i for i in sub if i in g] for g in (first, keep, contract)]
    size = dict(zip(sub, x.shape))
    t = jnp.transpose(x, [sub.index(i) for g in groups for i in g])
    return t.reshape([int(np.prod([size[i] for i in g])) for g in groups])


class JaxNvfp4BeforeE1f12ba4(JaxScaledDotSite):
    """jax.nn.scaled_dot_general's nvfp4 as it was before jax commit e1f12ba4, on jax.nn.scaled_matmul."""

    def _einsum(self, eqn, lhs, rhs):
        from qcheck.formats import jax_nvfp4_global_scale

        (sa, sb), out = eqn.split("->")[0].split(","), eqn.split("->")[1]
        batch = "".join(i for i in sa if i in sb and i in out)
        contract = "".join(i for i in sa if i in sb and i not in out)
        free_a, free_b = "".join(i for i in sa if i not in sb), "".join(i for i in sb if i not in sa)

        def quantize(x, sub, free):
            g = jax_nvfp4_global_scale(x)
            x3 = _to_3d(x, sub, batch, free, contract)
            blocks = x3.reshape(*x3.shape[:2], -1, 16)
            # The bug: the global scale divides the block scales, but the data is never divided by it.
            s = jnp.clip(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / 6.0 / g, 0, 448).astype(E4M3FN)
            codes = jnp.clip(blocks / s.astype(jnp.float32), -6, 6).astype(jnp.float4_e2m1fn)
            return codes.reshape(x3.shape), s[..., 0], g

        (ca, sa_, ga), (cb, sb_, gb) = quantize(lhs, sa, free_a), quantize(rhs, sb, free_b)
        y = jax.nn.scaled_matmul(ca, cb, sa_, sb_, preferred_element_type=jnp.float32) * (ga * gb)
        size = dict(zip(sa, lhs.shape)) | dict(zip(sb, rhs.shape))
        produced = batch + free_a + free_b
        return jnp.transpose(y.reshape([size[i] for i in produced]), [produced.index(i) for i in out])


class JaxNoConfigs(JaxScaledDotSite):
    """jax.nn.scaled_dot_general called without configs: lax.dot_general in full precision."""

    def _einsum(self, eqn, lhs, rhs):
        dims, perm = einsum_dimension_numbers(eqn)
        return jnp.transpose(jax.nn.scaled_dot_general(lhs, rhs, dims, configs=None), perm)


class _PlantedJax(JaxScaledDotRecipe):
    def __init__(self, name, site_cls):
        super().__init__(name, "nvfp4")
        self.site_cls = site_cls

    def site_module(self, name):
        return self.site_cls(mode="nvfp4")


@needs_scaled_matmul
def test_exact_catches_jax_nvfp4_global_scale_applied_to_block_scales_not_data():
    # jax commit e1f12ba4 (July 2025) fixed it; JAX's own tests missed it, their reference being a matmul
    # of the same dequantized tensors. Here the referee quantizes independently.
    from qcheck.referees._libraries import quantize_jax_nvfp4_e1f12ba4

    planted = _PlantedJax("jax_nvfp4_e1f12ba4", JaxNvfp4BeforeE1f12ba4)
    with pytest.raises(AssertionError, match=r"bug: assert_site_exact: site 'wi_0' einsum 'BSM,EMH->BSEH' "
                       r"\(nvfp4_jax x nvfp4_jax\): differs .*it equals both operands in JAX's nvfp4 before "
                       r"e1f12ba4 \(the global scale divides the block scales but not the data, so its e2m1 codes "
                       r"are mostly zero\) bitwise"):
        invariants.assert_sites_exact(layer(planted), planted, "bug")
    codes, _, _ = quantize_jax_nvfp4_e1f12ba4(np.asarray(X), (2,))  # the claim, on the layer's own input
    assert np.mean(codes.astype(np.float32) == 0) > 0.99


def test_coverage_catches_scaled_dot_general_called_without_configs():
    # configs=None falls back to lax.dot_general (since jax ae29f63e; before, it quantized to MXFP8
    # silently): every expert matmul in full precision, while the recipe declares nvfp4_jax.
    planted = _PlantedJax("jax_no_configs", JaxNoConfigs)
    with pytest.raises(AssertionError, match=r"3 of 5 matmuls reach full precision:\n  dot_general at .*"
                       r"lhs \(\d+, \d+, \d+\) float32 \[full precision\].*lhs and rhs unquantized"):
        invariants.assert_layer_quantized(layer(planted), X, "bug")


# -- the backward pass: each site's gradients, bitwise --------------------------------


def _with_planted_site(recipe: str, planted: Recipe, site: str = "wo", path: str = "dense") -> MoE:
    broken = layer(recipe, path=path)
    broken.sites[site] = QuantSite(planted, site, rngs=nnx.Rngs(7))
    return broken


def test_backward_catches_fp8_output_gradients_cast_to_e4m3_not_e5m2():
    # The forward pass is bitwise unchanged, so exact, tracks and golden all pass.
    from qcheck.recipes import DelayedScalingFp8

    broken = _with_planted_site("fp8", DelayedScalingFp8("fp8", e4m3_dtype=E4M3FN, e5m2_dtype=E4M3FN))
    invariants.assert_sites_cast_exact(broken, E4M3FN, "forward")  # passes: only the backward moved
    with pytest.raises(AssertionError, match=r"bug site 'wo': .*dgrad \(g in float8_e5m2\).*equals the gradient "
                       r"with g in float8_e4m3fn \(the forward flavour\)"):
        invariants.assert_sites_backward_exact(broken, get_recipe("fp8"), "bug")


def test_backward_catches_nvfp4_blocking_the_input_gradient_along_the_weight_gradient_axes():
    from tests.test_backward import _WrongAxesNVFP4

    broken = _with_planted_site("nvfp4", _WrongAxesNVFP4(), path="sparse")
    with pytest.raises(AssertionError, match=r"bug site 'wo': .*dgrad \(g in nvfp4 along axes \(1,\), stochastic\)"
                       r".*along the wgrad axes \(0,\) bitwise"):
        invariants.assert_sites_backward_exact(broken, get_recipe("nvfp4"), "bug")


def test_backward_catches_a_gradient_that_skipped_quantization():
    from tests.test_backward import _SkipGradFp8

    broken = _with_planted_site("nanoo_fp8", _SkipGradFp8("nanoo_fp8", e4m3_dtype=E4M3FNUZ,
                                                           e5m2_dtype=jnp.float8_e5m2fnuz))
    with pytest.raises(AssertionError, match=r"bug site 'wo': .*dgrad \(g in float8_e5m2fnuz\).*equals the "
                       r"gradient with unquantized g bitwise"):
        invariants.assert_sites_backward_exact(broken, get_recipe("nanoo_fp8"), "bug")


# -- fp8 state -------------------------------------------------------------------


def test_state_catches_a_forward_pass_that_writes_amax_history():
    broken = layer("fp8")
    swap_site(broken, "wo", "fp8", cls=ForwardWritesHistory)
    broken.sites["wo"].input_amax_history[...] = jnp.zeros(1024)  # undo what lazy_init's call wrote
    with pytest.raises(AssertionError, match=r"forward pass changed fp8 state at \['sites\.wo\.input_amax_history'\]"):
        invariants.assert_fp8_state_moves_only_in_backward(broken, X, "bug")


def test_state_catches_a_layer_that_lost_its_fp8_state():
    with pytest.raises(AssertionError, match="no fp8 scales or amax histories"):
        invariants.assert_fp8_state_moves_only_in_backward(
            cases.layer(cases.Case("int8", cases.Variant("mixtral", "dense", False))), X, "bug")


# -- the training loop's fp8 state (a user's own loops on Flax's fp8 ops, tests/fp8_loops.py) -----------


@functools.cache  # one warmed-up state for the five: states are immutable
def _loop_state():
    from tests import fp8_loops

    return fp8_loops, fp8_loops.warm(fp8_loops.new_state(fp8_loops.Mlp())), fp8_loops.batch()


_LEAF = r"params/_overwrite_with_gradient/Dense_\d/Fp8DirectDotGeneralOp_0/"


def test_fp8_state_catches_a_loop_summing_fp8_state_across_microbatches():
    loops, state, batch = _loop_state()
    qcheck.assert_fp8_state_matches(loops.whole_batch, loops.accumulated("max"), state, batch)  # merged by max
    with pytest.raises(AssertionError, match=_LEAF + r"kernel_amax_history\[0\]: step_a [\d.]+, step_b [\d.]+, "
                       r"ratio 2: a ratio of 2: summed across 2 microbatches or uses"):
        qcheck.assert_fp8_state_matches(loops.whole_batch, loops.accumulated("sum"), state, batch)


def test_fp8_state_catches_a_loop_keeping_the_last_microbatchs_amax_only():
    loops, state, batch = _loop_state()
    with pytest.raises(AssertionError, match=r"(?s)4 of 12 fp8 leaves differ .*\n  " + _LEAF + (
            r"input_amax_history\[0\]: step_a [\d.]+, step_b [\d.]+, ratio 0\.\d+: smaller than step_a's: part of "
            r"the batch not recorded \(the last microbatch only\?\)")):
        qcheck.assert_fp8_state_matches(loops.whole_batch, loops.accumulated("last"), state, batch)


def test_fp8_state_catches_a_loop_clipping_fp8_state_with_the_gradients():
    loops, state, batch = _loop_state()
    qcheck.assert_fp8_state_matches(loops.whole_batch, loops.clipped(fp8_too=False), state, batch)  # params only
    with pytest.raises(AssertionError, match=r"(?s)12 of 12 fp8 leaves differ between step_a and step_b \(bitwise\); "
                       r"likely cause: every differing leaf is step_a's times 0\.00\d+: following the clip factor, "
                       r"the optimizer touched the fp8 state.*\n  " + _LEAF + r"input_amax_history\[0\]: step_a"):
        qcheck.assert_fp8_state_matches(loops.whole_batch, loops.clipped(fp8_too=True), state, batch)


def test_fp8_state_catches_a_loop_weight_decaying_fp8_state():
    loops, state, batch = _loop_state()
    qcheck.assert_fp8_state_matches(loops.whole_batch, loops.weight_decayed(fp8_too=False), state, batch)
    with pytest.raises(AssertionError, match=r"(?s)likely cause: every differing leaf is step_a's plus 0\.01 x its "
                       r"value before the step: weight decay applied to the fp8 state.*\n  " + _LEAF + "input_scale: "):
        qcheck.assert_fp8_state_matches(loops.whole_batch, loops.weight_decayed(fp8_too=True), state, batch)


def test_fp8_state_catches_a_flax_fp8_op_reused_on_two_inputs():
    # Weight tying: one Dense (one Fp8DirectDotGeneralOp) called on each half of the batch. Flax's
    # autodiff adds the op's fp8 "gradients" (flax 0.12.8, 0.12.12); its fp32_max_grad dtype takes the max.
    loops, _, batch = _loop_state()
    once = loops.warm(loops.new_state(loops.Halves()))
    twice = loops.new_state(loops.Halves(reuse=True)).apply_fn

    def reused(state, batch, max_grad=False):
        return loops.whole_batch(state.replace(apply_fn=twice), batch, max_grad=max_grad)

    qcheck.assert_fp8_state_matches(loops.whole_batch, functools.partial(reused, max_grad=True), once, batch)
    with pytest.raises(AssertionError, match=r"(?s)6 of 6 fp8 leaves differ.*\n  " + _LEAF.replace(r"\d", "0") + (
            r"input_amax_history\[0\]: step_a [\d.]+, step_b [\d.]+, ratio 1\.\d+: larger than step_a's: more than "
            r"the max of what the site saw")):
        qcheck.assert_fp8_state_matches(loops.whole_batch, reused, once, batch)


class _ReusedFp8Site(DelayedScalingFp8Site):
    """One fp8 op applied twice to the input (``halves``: once to each half, a chunked einsum; else twice to
    all of it, summing two quantizations): autodiff sums what the two uses record."""

    halves: bool = True

    def quantize_operands(self, lhs, rhs, axes):
        def q(x, scale, history):
            return fp8_ops.in_qdq(x.dtype, self.e4m3_dtype, x, scale.value, history.value)

        if lhs.size < 2:  # the 1-element call that materializes the state
            return super().quantize_operands(lhs, rhs, axes)
        if self.halves:
            flat, half = lhs.reshape(-1), lhs.size // 2
            parts = [q(part, self.input_scale, self.input_amax_history) for part in (flat[:half], flat[half:])]
            q_lhs = jnp.concatenate(parts).reshape(lhs.shape)
        else:
            q_lhs = (q(lhs, self.input_scale, self.input_amax_history)
                     + q(lhs, self.input_scale, self.input_amax_history)) / 2
        return q_lhs, q(rhs, self.kernel_scale, self.kernel_amax_history)


class _ReusedFp8(DelayedScalingFp8):
    def __init__(self, halves: bool):
        super().__init__("fp8_halves" if halves else "fp8_twice", e4m3_dtype=E4M3FN, e5m2_dtype=jnp.float8_e5m2)
        self.halves = halves

    def site_module(self, name):
        return _ReusedFp8Site(amax_history_length=self.amax_history_length, e4m3_dtype=self.e4m3_dtype,
                              e5m2_dtype=self.e5m2_dtype, halves=self.halves)


def _reused_case(monkeypatch, halves: bool) -> cases.Case:
    planted = _ReusedFp8(halves)
    monkeypatch.setitem(qcheck.recipes._registry._REGISTRY, planted.name, planted)
    case = cases.Case(planted.name, cases.Variant("mixtral", "dense", False))
    assert "train" in [i.name for i in invariants.INVARIANTS if i.applies(planted, case.variant)]
    return case


def test_train_catches_a_site_reused_on_two_halves_summing_its_amax(monkeypatch):
    case = _reused_case(monkeypatch, halves=True)
    with pytest.raises(AssertionError, match=rf"(?s)^{case.id} \(one batch vs 2 microbatches\): "
                       r"assert_fp8_state_matches: 3 of 18 fp8 leaves differ.*\n  sites/wi_0/input_amax_history\[0\]: "
                       r"step_a [\d.]+, step_b [\d.]+, ratio 1\.\d+: larger than step_a's: more than the max of "
                       r"what the site saw"):
        invariants.check_train(case)


def test_train_catches_a_site_quantizing_its_input_twice_recording_twice_its_amax(monkeypatch):
    # Twice the amax in one batch and in each microbatch alike: the relations hold, the referee's amax does not.
    case = _reused_case(monkeypatch, halves=False)
    with pytest.raises(AssertionError, match=rf"^{case.id}: sites/wi_0/input_amax_history\[0\], "
                       r"sites/wi_0/kernel_amax_history\[0\] after one step are ([\d.]+), [\d.]+; the referee's "
                       r"amaxes of the operands site 'wi_0' received are ([\d.]+) \(lhs\), [\d.]+ \(rhs\): the site "
                       r"records other amaxes than its operands'") as info:
        invariants.check_train(case)
    recorded, referee = map(float, re.search(r"are ([\d.]+),.* are ([\d.]+) \(lhs", str(info.value)).groups())
    assert recorded == pytest.approx(2 * referee, rel=1e-8)  # figures printed to 9 digits


@jax.custom_vjp
def _qdq_unrolled(x, scale, history):
    return fp8_ops.in_qdq(x.dtype, E4M3FN, x, scale, history)


def _qdq_unrolled_fwd(x, scale, history):
    y, vjp = jax.vjp(_qdq_unrolled.__wrapped__, x, scale, history)
    return y, (vjp, history)


def _qdq_unrolled_bwd(res, g):
    vjp, history = res
    dx, dscale, new_history = vjp(g)
    return dx, dscale, history.at[0].set(new_history[0])  # the bug: the newest amax written over, no roll


_qdq_unrolled.defvjp(_qdq_unrolled_fwd, _qdq_unrolled_bwd)


class _UnrolledFp8Site(DelayedScalingFp8Site):
    def quantize_operands(self, lhs, rhs, axes):
        _, q_rhs = super().quantize_operands(lhs, rhs, axes)
        return _qdq_unrolled(lhs, self.input_scale.value, self.input_amax_history.value), q_rhs


class _UnrolledFp8(DelayedScalingFp8):
    def site_module(self, name):
        return _UnrolledFp8Site(amax_history_length=self.amax_history_length, e4m3_dtype=self.e4m3_dtype,
                                e5m2_dtype=self.e5m2_dtype)


def test_train_catches_an_amax_history_written_over_at_0_not_rolled(monkeypatch):
    # One step from a fresh history of zeros cannot tell; the second step's history can.
    planted = _UnrolledFp8("fp8_unrolled", e4m3_dtype=E4M3FN, e5m2_dtype=jnp.float8_e5m2)
    monkeypatch.setitem(qcheck.recipes._registry._REGISTRY, planted.name, planted)
    case = cases.Case(planted.name, cases.Variant("mixtral", "dense", False))
    with pytest.raises(AssertionError, match=rf"^{case.id}: sites/wi_0/input_amax_history at step 2 was not "
                       r"rolled \(each history rolls once per step, newest amax at 0\)"):
        invariants.check_train(case)


# -- tracking the unquantized twin ----------------------------------------------


def test_tracks_catches_a_layer_whose_quantization_silently_fell_away():
    broken = layer("fp8")
    for name in broken.site_names():
        swap_site(broken, name, "none")
    out, _ = step.apply(broken, X)
    with pytest.raises(AssertionError, match="bitwise equal to the unquantized reference"):
        checks.assert_tracks(out, cases.layer_output(cases.Case("none", cases.Variant("mixtral", "dense", False))))


# -- the train step's gradients against the twin's -----------------------------------


class PlantedGradSite(SiteOps, nn.Module):
    """e4m3fn operands at scale 1; the output gradient quantized by a planted ``bug``."""

    bug: str

    def matmul(self, op, lhs, rhs, axes):
        from qcheck import formats
        from qcheck.recipes._sites import fake_quant_matmul

        if self.bug == "e4m3_scale_1":  # g ~ 1e-3 in e4m3fn at scale 1: most of it flushes to 0
            q_g = lambda g: jnp.clip(g, -448, 448).astype(E4M3FN).astype(g.dtype)  # noqa: E731
        else:  # "empty_history": a delayed scale 448 / amax from a history of zeros, unguarded
            q_g = lambda g: g * (448.0 / jnp.zeros((), g.dtype))  # noqa: E731
        return fake_quant_matmul(op, lhs, rhs, None,
                                 q_lhs=lambda x: formats.qdq(x, "e4m3fn", axis=axes.lhs),
                                 q_rhs=lambda x: formats.qdq(x, "e4m3fn", axis=axes.rhs),
                                 q_dgrad=lambda g, _: q_g(g), q_wgrad=q_g)


class PlantedGrad(Recipe):
    def __init__(self, bug: str):
        super().__init__(f"planted_{bug}", lhs="e4m3fn", rhs="e4m3fn", grad="e5m2")
        self.bug = bug

    def site_module(self, name):
        return PlantedGradSite(bug=self.bug)


def _planted_grads(bug: str) -> tuple[dict, dict]:
    broken = MoE(MODELS["mixtral"], PlantedGrad(bug), rngs=nnx.Rngs(cases.SEED))
    twin = cases.layer_step(cases.Case("none", cases.Variant("mixtral", "dense", False)))
    return invariants.grad_leaves(step.train_step(broken, X).grads), invariants.grad_leaves(twin.grads)


def test_grads_catches_nan_gradients_from_an_unguarded_empty_amax_history():
    grads, twin = _planted_grads("empty_history")
    with pytest.raises(AssertionError, match=r"bug: gradient of \w+ \(float32\) has \d+ non-finite values of \d+"):
        invariants.assert_grads_track(grads, twin, max_grad_rel_norm=0.3, distinct=True, label="bug")


def test_grads_catches_output_gradients_cast_to_e4m3_at_scale_1():
    # The forward pass is a healthy e4m3fn layer: tracks passes; only the gradients are flushed.
    grads, twin = _planted_grads("e4m3_scale_1")
    with pytest.raises(AssertionError, match=r"bug: gradient of \w+ \(float32\) is 0\.[6-9]\d* from the none "
                       r"twin's \(relative norm; bound 0\.3\); \d+ of \d+ values are 0"):
        invariants.assert_grads_track(grads, twin, max_grad_rel_norm=0.3, distinct=True, label="bug")


def test_grads_catches_a_layer_that_fell_back_to_full_precision():
    broken = layer("fp8")
    for name in broken.site_names():
        swap_site(broken, name, "none")
    twin = cases.layer_step(cases.Case("none", cases.Variant("mixtral", "dense", False)))
    grads = invariants.grad_leaves(step.train_step(broken, X).grads)
    twin = invariants.grad_leaves(twin.grads)
    with pytest.raises(AssertionError, match=r"bug: gradient of gate \(float32\) is bitwise equal to the none twin's"):
        invariants.assert_grads_track(grads, twin, max_grad_rel_norm=0.3, distinct=True, label="bug")
    # A recipe that declares no gradient quantization: all of them equal is still a fallback.
    with pytest.raises(AssertionError, match=r"bug: every gradient is bitwise equal to the none twin's — the "
                       r"quantized path was not taken"):
        invariants.assert_grads_track(grads, twin, max_grad_rel_norm=0.3, distinct=False, label="bug")


# -- quantization coverage: each matmul, not the layer as a whole -------------------


def _line(location: str) -> str:
    path, line = location.rsplit(":", 1)
    return Path(path).read_text().splitlines()[int(line) - 1]


def test_coverage_catches_one_call_site_unquantized_on_the_sparse_path():
    # One expert matmul multiplying in full precision, on one path: the layer still
    # lands well inside its bound and differs from its twin, so tracks passes.
    broken = layer("fp8", path="sparse")
    swap_site(broken, "wo", "none")
    out, _ = step.apply(broken, X)
    sparse_none = cases.layer_output(cases.Case("none", cases.Variant("mixtral", "sparse", False)))
    assert checks.assert_tracks(out, sparse_none, max_rel_norm=0.22) < 0.22
    with pytest.raises(AssertionError, match=r"1 of 5 matmuls reach full precision:\n  ragged_dot_general at "
                       r"qcheck/layers/moe.py:\d+ \(MoE._sparse\).*lhs and rhs unquantized") as info:
        invariants.assert_layer_quantized(broken, X, "bug")
    location = str(info.value).split(" at ", 1)[1].split(" ", 1)[0]
    assert 's["wo"].ragged_dot(h, wo, sizes)' in _line(location)  # that call, on that line


def test_coverage_catches_a_layer_that_quantizes_nothing_listing_every_expert_matmul():
    unquantized = cases.layer(cases.Case("none", cases.Variant("mixtral", "dense", True)))
    with pytest.raises(AssertionError, match=r"5 of 9 matmuls reach full precision") as info:
        invariants.assert_layer_quantized(unquantized, X, "bug")
    listed = [line.split(" at ", 1)[1].split(" ", 1)[0] for line in str(info.value).splitlines()[1:]]
    calls = [_line(loc) for loc in listed]
    assert [next(n for n in ("dispatch", "wi_0", "wi_1", "wo", "combine") if f's["{n}"]' in c) for c in calls] == [
        "dispatch", "wi_0", "wi_1", "wo", "combine"]


def test_coverage_catches_nanoo_declared_and_built_in_e4m3fn(monkeypatch):
    # exact, backward and tracks follow the declaration, which agrees with the site:
    # only the hardware it targets (MI300, fnuz types) says the flavour is wrong.
    from qcheck.recipes import DelayedScalingFp8

    planted = DelayedScalingFp8("nanoo_fp8_e4m3fn", e4m3_dtype=E4M3FN, e5m2_dtype=jnp.float8_e5m2fnuz,
                                fp8_target="mi300")
    monkeypatch.setitem(qcheck.recipes._registry._REGISTRY, planted.name, planted)
    case = cases.Case(planted.name, cases.Variant("mixtral", "dense", False))
    with pytest.raises(AssertionError, match=rf"^{case.id}: assert_recipe_fp8_native: .*target 'mi300'.*: "
                       r"lhs float8_e4m3fn"):
        invariants.check_coverage(case)
    # The program alone, declaration aside: the site, the type, the pass, the target.
    with pytest.raises(AssertionError, match=r"not native to target 'mi300' \(native fp8: float8_e4m3fnuz, "
                       r"float8_e5m2fnuz\):\n  forward: dot_general at qcheck/layers/moe.py:\d+ \(MoE._dense\): "
                       r"lhs cast to float8_e4m3fn"):
        checks.assert_fp8_dtypes_native(cases.layer(case), X, target="mi300")


# -- independent call sites -------------------------------------------------------


def test_sites_catches_two_names_bound_to_one_site():
    broken = layer("fp8")
    broken.sites["wi_1"] = broken.sites["wi_0"]
    with pytest.raises(AssertionError, match="sites 'wi_0' and 'wi_1' are one object"):
        invariants.assert_sites_independent(broken, "bug")


def test_sites_catches_two_sites_sharing_a_scale():
    broken = layer("fp8")
    broken.sites["wo"].input_scale = broken.sites["wi_0"].input_scale
    with pytest.raises(AssertionError, match=r"sites 'wi_0' and 'wo' share state \(input_scale\)"):
        invariants.assert_sites_independent(broken, "bug")


def test_sites_catches_streams_kept_by_a_recipe_that_never_draws():
    broken = MoE(MODELS["mixtral"], get_recipe("fp8"), rngs=nnx.Rngs(0), apply_rngs=ApplyRngs.PRIVATE)
    with pytest.raises(AssertionError, match=r"sites \['wi_0', 'wi_1', 'wo'\] of a recipe that never draws carry"):
        invariants.assert_sites_carry_no_rng_stream(broken, "bug")


# -- dense and sparse agree --------------------------------------------------------


def test_paths_agree_catches_a_sparse_routing_bug():
    dense = cases.layer_output(cases.Case("none", cases.Variant("mixtral", "dense", False)))
    sparse, _ = step.apply(layer("none", path="sparse", cls=UnnormalizedSparseRouter), X)
    with pytest.raises(AssertionError, match="dense and sparse differ by up to"):
        invariants.assert_paths_agree(dense, np.asarray(sparse), "bug")


class StraightThroughWo(MoE):
    """On the sparse path the layer takes ``wo``'s gradients from a plain ragged_dot (straight through).

    The forward value is the site's (``stop_gradient(site) + plain - stop_gradient(plain)``),
    and the site itself is healthy, so forward exact, probes and tracks all pass.
    """

    def _sparse(self, x, weights, idx):
        real = self.sites["wo"]

        class _StraightThrough:
            def ragged_dot(self, lhs, rhs, sizes, **kwargs):
                plain = jax.lax.ragged_dot(lhs, rhs, sizes)
                return jax.lax.stop_gradient(real.ragged_dot(lhs, rhs, sizes, **kwargs)) + (
                    plain - jax.lax.stop_gradient(plain))

        # The layer's own code around its call to the site, not the site: the recorder wraps the real one.
        sites = self.sites
        object.__setattr__(self, "sites", {**sites, "wo": _Around(sites["wo"], _StraightThrough())})
        try:
            return super()._sparse(x, weights, idx)
        finally:
            object.__setattr__(self, "sites", sites)


class _Around:
    """The layer's call of ``site.ragged_dot`` goes through ``around`` (which calls the site inside)."""

    def __init__(self, site, around):
        self.site, self.around = site, around

    def ragged_dot(self, lhs, rhs, sizes, **kwargs):
        return self.around.ragged_dot(lhs, rhs, sizes, **kwargs)


def test_backward_catches_a_layer_taking_a_weights_gradient_around_its_site():
    broken = layer("fp8", path="sparse", cls=StraightThroughWo)
    invariants.assert_sites_backward_exact(broken, get_recipe("fp8"), "probes")  # each site alone is fine
    assert_layer_sites_exact(broken, X, "fp8", label="forward")  # and so is the forward
    from qcheck.checks._layer_backward import assert_layer_sites_backward_exact

    assert_layer_sites_backward_exact(layer("fp8", path="sparse"), X, "fp8", label="healthy")
    with pytest.raises(AssertionError, match=r"bug: assert_layer_sites_backward_exact: the layer's gradient of its "
                       r"parameter 'wo' is not the gradient its site gave \(they differ at \d+ of 16384 elements; "
                       r"the site's is all zeros\): the layer takes that weight's gradient from elsewhere"):
        assert_layer_sites_backward_exact(broken, X, "fp8", label="bug")


# -- sharded layers ---------------------------------------------------------------


class MeshOnlyReassembly(MoE):
    """Stitches the 'expert' shards of ``wi_0`` back in the wrong order, on a mesh only.

    Each of the four shards holds two experts; the bug swaps the first two blocks.
    Without a mesh the layer is healthy, so only the sharded check can see it.
    """

    def _weights(self):
        wi_0, wi_1, wo = super()._weights()
        return (wi_0 if self.mesh is None else wi_0[np.array([2, 3, 0, 1, 4, 5, 6, 7])]), wi_1, wo


SHARDED_CASE = cases.Case("int8", cases.Variant("mixtral", "dense", False))


def _check_sharded(build_sharded):
    invariants.assert_layer_sharded_matches(build_sharded, cases.layer_output(SHARDED_CASE), X, "bug",
                                            mesh=cases.mesh())


def test_sharded_catches_experts_reassembled_in_the_wrong_order():
    alone = MeshOnlyReassembly(MODELS["mixtral"], get_recipe("int8"), rngs=nnx.Rngs(cases.SEED))
    healthy_alone, _ = step.apply(alone, X)
    assert np.array_equal(np.asarray(healthy_alone), cases.layer_output(SHARDED_CASE))  # the bug needs the mesh
    with pytest.raises(AssertionError, match=r"^bug: the sharded layer differs from the single-device one at \d+ of "
                       r"2048 values, by up to .*\(rtol 1e-05, atol 1e-06\)"):
        _check_sharded(lambda mesh: MeshOnlyReassembly(MODELS["mixtral"], get_recipe("int8"),
                                                       rngs=nnx.Rngs(cases.SEED), mesh=mesh))


def test_sharded_catches_a_twin_built_without_its_mesh():
    # The twin ignores the mesh; only its input lands on it. Its output is the
    # single-device layer's, bitwise, so comparing outputs alone passes at 0.0
    # and a mesh-only bug would go unseen.
    unsharded = lambda mesh: MoE(MODELS["mixtral"], get_recipe("int8"), rngs=nnx.Rngs(cases.SEED))  # noqa: E731
    placed = jax.device_put(X, jax.sharding.NamedSharding(cases.mesh(), jax.sharding.PartitionSpec("data")))
    blind = np.asarray(step.apply(unsharded(None), placed)[0])
    assert invariants.assert_sharded_matches(cases.layer_output(SHARDED_CASE), blind, "blind") == 0.0
    with pytest.raises(AssertionError, match=r"^bug: the sharded twin is not sharded: weight 'wi_0' "
                       r"\(float32\[8, 32, 64\]\) is SingleDeviceSharding on 1 device\(s\), not on the 4-way "
                       r"'expert' mesh of 8 devices \(built without its mesh\?\)"):
        _check_sharded(unsharded)


# -- RNG state of the compiled step ----------------------------------------------


def test_rng_catches_a_forked_stream_per_layer():
    # The seed's bug: every wrapper keeps its fork, so the step's RNG state grows per layer.
    forked = invariants.rng_entry_params("mixtral", "nvfp4", depths=(1, 2), apply_rngs=ApplyRngs.PRIVATE)
    with pytest.raises(AssertionError, match=r"RNG state grows with depth .*\{1: 8, 2: 14\}"):
        invariants.assert_rng_state_constant({n: c["u32"] for n, c in forked.items()}, "bug")


def test_rng_control_catches_a_measurement_that_sees_nothing():
    with pytest.raises(AssertionError, match="forced PRIVATE, u32 entry parameters should grow"):
        invariants.assert_rng_state_grows({1: 2, 2: 2, 8: 2}, "bug")


def test_reused_stochastic_rounding_bits_are_visible(monkeypatch):
    # Without the per-quantizer hash, two SHARED quantizers at one stream state draw
    # the same bits — the property test_rng.py asserts against.
    from qcheck.recipes import _nvfp4
    from tests.helpers import nvfp4_dgrad

    monkeypatch.setattr(_nvfp4, "quantizer_key", lambda base, quantizer: base)
    assert np.array_equal(nvfp4_dgrad.__wrapped__("wi_0", 5), nvfp4_dgrad.__wrapped__("wi_1", 5))


# -- golden cases ------------------------------------------------------------------

GOLDEN_CASE = golden.GoldenCase("int8", "mixtral", "dense")


def test_golden_catches_numerics_drift(tmp_path, monkeypatch):
    golden.write_case(GOLDEN_CASE, tmp_path, overwrite=False)
    real = cases.layer_output
    drifted = lambda case: real(case) * np.float32(1 + 2**-12) if case.recipe == "int8" else real(case)  # noqa: E731
    monkeypatch.setattr(cases, "layer_output", drifted)
    with pytest.raises(AssertionError, match=r"(?s)int8-mixtral-dense does not match .*output: \d+ of 2048 values "
                       r"outside rtol.*golden written with: jax .*this run: .*golden update int8"):
        golden.check_case(GOLDEN_CASE, tmp_path)


def test_golden_catches_gradients_that_drifted(tmp_path, monkeypatch):
    # The forward pass (output, codes, rel_norm) is untouched: only the train step's gradients move.
    golden.write_case(GOLDEN_CASE, tmp_path, overwrite=False)
    real = cases.layer_step

    def drifted(case):
        out = real(case)
        scale = np.float32(1 + 2**-12) if case.recipe == "int8" else np.float32(1)
        return out._replace(grads=jax.tree.map(lambda g: g * scale, out.grads))

    monkeypatch.setattr(cases, "layer_step", drifted)
    with pytest.raises(AssertionError, match=r"(?s)int8-mixtral-dense does not match .*grads\['gate'\]: \d+ of 256 "
                       r"sampled values outside rtol 1e-05, atol 5e-08.*grads\['wi_0'\]: norm .*golden update int8"):
        golden.check_case(GOLDEN_CASE, tmp_path)


class CastsE4m3Site(SiteOps, nn.Module):
    def quantize_operands(self, lhs, rhs, axes):
        q = lambda x: jnp.clip(x, -448, 448).astype(E4M3FN).astype(x.dtype)  # noqa: E731
        return q(lhs), q(rhs)


class DeclaresInt8(Recipe):
    """Declares int8 operands; its site casts them to e4m3fn."""

    def __init__(self):
        super().__init__("int8", lhs="int8", rhs="int8")

    def site_module(self, name):
        return CastsE4m3Site()


def test_golden_records_what_a_site_feeds_its_matmul_not_its_declaration(tmp_path, monkeypatch):
    liar = QuantSite(DeclaresInt8(), "wi_0", rngs=None)
    fed = golden.site_operands(liar, golden.CANONICAL_EQN, *golden.canonical_operands("mixtral"))
    assert sorted(fed) == ["lhs", "lhs.float8_e4m3fn", "rhs", "rhs.float8_e4m3fn"]  # no int8 anywhere
    golden.write_case(GOLDEN_CASE, tmp_path, overwrite=False)  # the healthy int8 site's codes
    monkeypatch.setattr(golden, "operand_codes", lambda recipe, model: fed)
    with pytest.raises(AssertionError, match=r"(?s)int8-mixtral-dense does not match .*codes: got keys \['lhs', "
                       r"'lhs.float8_e4m3fn', 'rhs', 'rhs.float8_e4m3fn'\], golden \['lhs', 'lhs.int8', 'rhs', "
                       r"'rhs.int8'\].*codes\['lhs'\]: \d+ of 128 differ"):
        golden.check_case(GOLDEN_CASE, tmp_path)


def test_golden_catches_a_file_edited_by_hand(tmp_path):
    golden.write_case(GOLDEN_CASE, tmp_path, overwrite=False)
    path = GOLDEN_CASE.file(tmp_path)
    record = json.loads(path.read_text())
    row = record["output"]["bits"][0]
    record["output"]["bits"][0] = ("0" if row[0] != "0" else "1") + row[1:]  # a plausible-looking edit
    path.write_text(json.dumps(record, indent=1))
    with pytest.raises(golden.GoldenFileError, match="does not match its digest: it was edited by hand"):
        golden.check_case(GOLDEN_CASE, tmp_path)


class DropsExpertScale(MoE):
    """Gemma's router without its per-expert output scale."""

    def route(self, x):
        logits = jnp.einsum("BSM,ME->BSE", x.astype(jnp.float32), self.gate[...])
        _, idx = jax.lax.top_k(logits, self.config.top_k)
        w = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), idx, axis=-1)
        return w / jnp.sum(w, axis=-1, keepdims=True), idx


def test_golden_catches_gemma_dropping_its_per_expert_scale(tmp_path, monkeypatch):
    # A bug in the layer itself: a quantized layer and its unquantized twin drop
    # the scale alike (nothing for tracks to see), and so do both paths (dense ==
    # sparse passes, below). Only the numerics pinned on the seed move, and only
    # because the scale is drawn away from 1.
    gemma = golden.GoldenCase("none", "gemma", "dense")
    golden.write_case(gemma, tmp_path, overwrite=False)
    real = cases.layer
    dropped = DropsExpertScale(MODELS["gemma"], get_recipe("none"), rngs=nnx.Rngs(cases.SEED))
    sparse = DropsExpertScale(MODELS["gemma"], get_recipe("none"), path="sparse", rngs=nnx.Rngs(cases.SEED))
    x = cases.layer_input("gemma")
    invariants.assert_paths_agree(np.asarray(step.apply(dropped, x)[0]), np.asarray(step.apply(sparse, x)[0]), "blind")
    monkeypatch.setattr(cases, "layer", lambda case: dropped if case == gemma.case else real(case))
    monkeypatch.setattr(cases, "forward_output", cases.forward_output.__wrapped__)  # no cached healthy output
    monkeypatch.setattr(cases, "layer_step", cases.layer_step.__wrapped__)
    monkeypatch.setattr(cases, "layer_output", cases.layer_output.__wrapped__)
    with pytest.raises(AssertionError, match=r"(?s)none-gemma-dense does not match .*output: 2048 of 2048 values "
                       r"outside rtol"):
        golden.check_case(gemma, tmp_path)


# -- the catalogue, as the README shows it ------------------------------------------

#: (bug, what catches it, the test above that shows it). The README's table is
#: rendered from this list and checked against it, so the two cannot drift.
CATALOGUE = [
    ("an fp8 call site that silently stopped quantizing", "`exact`, `tracks` (not bitwise equal)",
     test_exact_catches_a_silently_unquantized_call_site),
    ("NANOO fp8 built on `flax.linen.Fp8Einsum`, which ignores `e4m3_dtype`", "`exact` (wrong fp8 flavour)",
     test_exact_catches_nanoo_built_on_flax_fp8einsum),
    ("the wrong e4m3 flavour on the sparse (ragged_dot) path", "`exact` via `assert_fresh_cast_exact` on `Ragged`",
     test_exact_catches_the_wrong_flavour_on_the_sparse_path),
    ("a cast without saturation (e4m3 overflow becomes NaN)", "`exact`",
     test_exact_catches_a_cast_without_saturation),
    ("a fresh layer whose scale is not 1", "`exact`, `state`",
     test_exact_and_state_catch_a_fresh_scale_that_is_not_one),
    ("an int8 call site that skips quantization on the token-dropping path only", "`exact` (through the layer)",
     test_exact_catches_an_int8_site_unquantized_on_the_token_dropping_path),
    ("MXFP8 weights blocked along the wrong axes (the default axis=-1)", "`exact`",
     test_exact_catches_mxfp8_weights_blocked_along_the_wrong_axes),
    ("a layer calling site 'wi_0' where 'wi_1' belongs (each site alone exact)", "`exact` (through the layer)",
     test_exact_catches_a_layer_calling_wi_0_where_wi_1_belongs),
    ("JAX's nvfp4 before e1f12ba4: the global scale applied to the block scales, not the data (codes mostly 0)",
     "`exact` (names the rule)", test_exact_catches_jax_nvfp4_global_scale_applied_to_block_scales_not_data),
    ("`jax.nn.scaled_dot_general` called with `configs=None` (full-precision `dot_general`)", "`coverage`",
     test_coverage_catches_scaled_dot_general_called_without_configs),
    ("a forward pass that writes fp8 state", "`state`",
     test_state_catches_a_forward_pass_that_writes_amax_history),
    ("an fp8 layer that lost its scales and histories", "`state`",
     test_state_catches_a_layer_that_lost_its_fp8_state),
    ("one call site multiplying in full precision on the sparse path only (`tracks` passes)", "`coverage`",
     test_coverage_catches_one_call_site_unquantized_on_the_sparse_path),
    ("a layer that quantizes nothing: every expert matmul listed with its line", "`coverage`",
     test_coverage_catches_a_layer_that_quantizes_nothing_listing_every_expert_matmul),
    ("fp8 output gradients cast to e4m3 instead of e5m2 (the forward pass unchanged)", "`backward`",
     test_backward_catches_fp8_output_gradients_cast_to_e4m3_not_e5m2),
    ("NVFP4 blocking the input gradient's copy of g along the weight-gradient axes", "`backward`",
     test_backward_catches_nvfp4_blocking_the_input_gradient_along_the_weight_gradient_axes),
    ("a gradient that skipped quantization", "`backward`", test_backward_catches_a_gradient_that_skipped_quantization),
    ("a layer taking a weight's gradient around its site (straight through, sparse path)",
     "`backward` (through the layer)", test_backward_catches_a_layer_taking_a_weights_gradient_around_its_site),
    ("a twin with other weights than the layer (`copy_params_into` not used)", "`check_layer`: the twin's weights",
     test_check_layer_catches_a_twin_with_other_weights),
    ("NaN gradients from a layer whose forward pass is fine", "`check_layer`: gradients",
     test_check_layer_catches_nan_gradients),
    ("NaN gradients from an unguarded delayed scale (empty amax history)", "`grads` (finite)",
     test_grads_catches_nan_gradients_from_an_unguarded_empty_amax_history),
    ("output gradients cast to e4m3 at scale 1, most flushed to 0 (the forward pass unchanged)",
     "`grads` (gradient bound)", test_grads_catches_output_gradients_cast_to_e4m3_at_scale_1),
    ("an fp8 layer whose every site fell back: gradients bitwise equal to the twin's", "`grads` (not bitwise equal)",
     test_grads_catches_a_layer_that_fell_back_to_full_precision),
    ("a training loop summing the fp8 state across microbatches like a gradient (amax, scale x M)",
     "`assert_fp8_state_matches` (batch == microbatches)",
     test_fp8_state_catches_a_loop_summing_fp8_state_across_microbatches),
    ("gradient accumulation keeping the last microbatch's amax only (marin #7659)",
     "`assert_fp8_state_matches` (batch == microbatches)",
     test_fp8_state_catches_a_loop_keeping_the_last_microbatchs_amax_only),
    ("`optax.clip_by_global_norm` over the fp8 state with the gradients (MaxText PR #672)",
     "`assert_fp8_state_matches` (clipped == unclipped)",
     test_fp8_state_catches_a_loop_clipping_fp8_state_with_the_gradients),
    ("weight decay added to the fp8 state's next values", "`assert_fp8_state_matches` (decayed == not)",
     test_fp8_state_catches_a_loop_weight_decaying_fp8_state),
    ("one Flax fp8 op reused on two inputs (weight tying): autodiff sums its amax and scales",
     "`assert_fp8_state_matches` (reused == applied once)", test_fp8_state_catches_a_flax_fp8_op_reused_on_two_inputs),
    ("an fp8 site applying one op to each half of its input: autodiff sums the amax", "`train` (batch == microbatches)",
     test_train_catches_a_site_reused_on_two_halves_summing_its_amax),
    ("an fp8 site quantizing its input twice: twice the amax in a batch and in its microbatches alike",
     "`train` (the referee's amax of what the site saw)",
     test_train_catches_a_site_quantizing_its_input_twice_recording_twice_its_amax),
    ("an amax history written over at 0 instead of rolled (one step cannot tell)", "`train` (rolls once per step)",
     test_train_catches_an_amax_history_written_over_at_0_not_rolled),
    ("a layer whose quantization fell away everywhere", "`tracks`",
     test_tracks_catches_a_layer_whose_quantization_silently_fell_away),
    ("NANOO fp8 declared and built with e4m3fn alike (`exact`, `backward`, `tracks` follow the declaration)",
     "`coverage` (fp8 types against the target hardware)", test_coverage_catches_nanoo_declared_and_built_in_e4m3fn),
    ("two call-site names bound to one wrapper", "`sites`", test_sites_catches_two_names_bound_to_one_site),
    ("two call sites sharing a scale", "`sites`", test_sites_catches_two_sites_sharing_a_scale),
    ("RNG streams kept by the sites of a recipe that never draws", "`sites`",
     test_sites_catches_streams_kept_by_a_recipe_that_never_draws),
    ("a sparse router that forgets to renormalize", "dense == sparse",
     test_paths_agree_catches_a_sparse_routing_bug),
    ("a forked RNG stream per wrapper per layer under SHARED", "`rng`",
     test_rng_catches_a_forked_stream_per_layer),
    ("an RNG measurement that sees nothing", "`rng`'s PRIVATE control",
     test_rng_control_catches_a_measurement_that_sees_nothing),
    ("stochastic-rounding bits reused across quantizers", "the per-quantizer-bits test in `tests/test_rng.py`",
     test_reused_stochastic_rounding_bits_are_visible),
    ("a recipe's layer output drifting from its golden case", "golden (`tests/test_golden.py`)",
     test_golden_catches_numerics_drift),
    ("a recipe's train-step gradients drifting from its golden case (the forward pass unchanged)", "golden (gradients)",
     test_golden_catches_gradients_that_drifted),
    ("a golden file edited by hand", "golden (content digest)", test_golden_catches_a_file_edited_by_hand),
    ("Gemma's router dropping its per-expert output scale (drawn around 1, so the output moves)",
     "golden (`tracks` and dense == sparse cannot: both sides drop it)",
     test_golden_catches_gemma_dropping_its_per_expert_scale),
    ("a plug-in whose site quantizes otherwise than it declares (int8 declared, e4m3fn cast)",
     "golden (codes traced from the site)", test_golden_records_what_a_site_feeds_its_matmul_not_its_declaration),
    ("expert shards reassembled in the wrong order, on a mesh only", "`sharded`",
     test_sharded_catches_experts_reassembled_in_the_wrong_order),
    ("a sharded twin built without its mesh (its output equals the single-device one)",
     "`sharded` (twin not sharded)", test_sharded_catches_a_twin_built_without_its_mesh),
]


def render_catalogue() -> str:
    rows = [f"| {bug} | {check} | `{test.__name__}` |" for bug, check, test in CATALOGUE]
    return "\n".join(["| bug | caught by | shown in tests/test_catalogue.py |", "|---|---|---|", *rows])


def test_catalogue_lists_every_failing_twin():
    listed = {test.__name__ for _, _, test in CATALOGUE}
    meta = {"test_catalogue_lists_every_failing_twin", "test_readme_shows_the_catalogue"}
    defined = {name for name in globals() if name.startswith("test_")} - meta
    assert defined == listed, f"CATALOGUE and the tests differ: {sorted(defined ^ listed)}"


def test_readme_shows_the_catalogue():
    root = Path(__file__).parent.parent
    catalogue = (root / "docs" / "catalogue.md").read_text()
    assert render_catalogue() in catalogue, (
        "docs/catalogue.md is out of date; print the table with "
        "`python -m tests.test_catalogue` and paste it over the old one"
    )
    readme = (root / "README.md").read_text()
    assert "(docs/catalogue.md)" in readme and f"{len(CATALOGUE)} planted bugs" in readme


if __name__ == "__main__":
    print(render_catalogue())
