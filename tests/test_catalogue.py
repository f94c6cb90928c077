"""The catalogue of bugs qcheck catches: each check fed the bug it exists for, as a table.

Each row of ``CATALOGUE`` plants one bug (a broken layer, recipe, loop or file, built
on purpose), names the check meant to catch it and the message (a regex) it must give;
``test_planted_bug_fails_its_check`` runs every row. If a row starts passing silently,
its check has gone blind. The controls, the same checks passing on healthy layers, are
the invariant suite itself; a row's ``control`` shows the bug hides from what it says.
docs/catalogue.md's table is rendered from the rows: ``python -m tests.test_catalogue``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from flax.linen import fp8_ops

import qcheck
from qcheck import check_layer, checks, formats, get_recipe
from qcheck.checks import harness
from qcheck.adapters import JaxScaledDotRecipe, scaled_dot_general_runs
from qcheck.adapters._jax import JaxScaledDotSite, einsum_dimension_numbers
from qcheck.checks._layer import INPUT_GRAD
from qcheck.checks._layer_backward import assert_layer_sites_backward_exact
from qcheck.checks._site import assert_layer_sites_exact
from qcheck.formats._blocks import normalize_axis, to_blocks
from qcheck.layers import step
from qcheck.layers.bridge import QuantSite
from qcheck.layers.moe import MODELS, MoE
from qcheck.recipes import ApplyRngs, DelayedScalingFp8, Expect, Recipe, Reference, registered
from qcheck.recipes._fp8 import DelayedScalingFp8Site
from qcheck.recipes._nvfp4 import NVFP4, NVFP4Site, quantizer_key
from qcheck.recipes._sites import FormatSite, SiteOps, fake_quant_matmul
from qcheck.suite import cases, golden, invariants
from qcheck.suite.cells import run_cell
from tests.helpers import (CHECK_LAYER_X, MOE_FULL_PRECISION, NaNBackwardMoE, SkipGradFp8, WrongAxesNVFP4,
                           assert_quantizers_draw_their_own_bits, decoder_at, module_train_step, nvfp4_dgrad,
                           sparse_moe, unpermute_moe)

E4M3FN, E4M3FNUZ = jnp.float8_e4m3fn, jnp.float8_e4m3fnuz
X = cases.layer_input("mixtral")
DENSE, SPARSE = cases.Variant("mixtral", "dense", False), cases.Variant("mixtral", "sparse", False)


def layer(recipe, *, dropping=False, path="dense", cls=MoE) -> MoE:
    return cls(MODELS["mixtral"], get_recipe(recipe), path=path,
               capacity_factor=1.0 if dropping else -1.0, rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)


def swap_site(target: MoE, name: str, recipe, cls=QuantSite) -> None:
    target.sites[name] = cls(get_recipe(recipe), name, rngs=nnx.Rngs(7))


# -- the planted bugs: layers, sites, recipes and loops broken on purpose -----------------------------------


class FlaxFp8EinsumNanoo(Recipe):
    """NANOO fp8 built on flax.linen.Fp8Einsum, which ignores e4m3_dtype."""

    def __init__(self):
        super().__init__("flax_fp8einsum_nanoo", apply_rngs=ApplyRngs.NONE,
                         reference=Reference(cast_dtype=E4M3FNUZ), materialize_at_build=True)

    def site_module(self, name):
        return nn.Fp8Einsum(e4m3_dtype=E4M3FNUZ, e5m2_dtype=jnp.float8_e5m2fnuz)


class UnsaturatedSite(SiteOps, nn.Module):
    def quantize_operands(self, lhs, rhs, axes):
        cast = lambda x: x.astype(E4M3FN).astype(x.dtype)  # noqa: E731 - the bug: no clip
        return cast(lhs), cast(rhs)


class Unsaturated(Recipe):
    def __init__(self):
        super().__init__("unsaturated_fp8", apply_rngs=ApplyRngs.NONE, reference=Reference(cast_dtype=E4M3FN))

    def site_module(self, name):
        return UnsaturatedSite()


# The edge shapes (issue 48), each in one of qcheck's own quantizers; `exact` and `tracks` see only normal inputs.


def planted_nvfp4_qdq(x, axis, bug: str):
    """qcheck's nvfp4 qdq (``nvfp4_quantize`` then ``nvfp4_dequantize``, op for op) with one bug planted:
    "no zero guard" (a block whose e4m3 scale is 0 still divides by it: 0 · (s_enc / 0) = NaN), "amax guard" (the
    guard asks the block's amax, which a tiny block passes while its scale rounds to 0: s_enc / 0 = inf), "global
    scale on the block scales" (s_enc sets the block scales but never multiplies the data, as JAX's before
    e1f12ba4), "tensor guard at zero" (the tensor amax guarded against 0 only, not NVFP4_MIN_AMAX: below it
    6 · 448 / amax overflows to inf, and a 0 in a block with a nonzero value codes 0 · inf = NaN)."""
    blocks, restore = to_blocks(x.astype(jnp.float32), normalize_axis(axis, x.ndim), formats.NVFP4_BLOCK, "nvfp4")
    amax = jnp.max(jnp.abs(blocks))
    representable = amax > (0.0 if bug == "tensor guard at zero" else formats.NVFP4_MIN_AMAX)
    s_enc = jnp.where(representable, jnp.float32(formats.NVFP4_RANGE) / amax, jnp.float32(1.0))
    block_amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    s_block = formats.saturating_cast(block_amax * (s_enc / formats.E2M1_MAX), E4M3FN)
    s_block = jnp.where(representable, s_block, jnp.zeros_like(s_block)).astype(jnp.float32)
    nonzero = {"no zero guard": jnp.ones_like(s_block, bool), "amax guard": block_amax > 0}.get(bug, s_block > 0)
    encode = jnp.broadcast_to(s_enc, s_block.shape) / jnp.where(nonzero, s_block, 1.0)
    decode = jnp.ones_like(encode) / encode
    if bug == "global scale on the block scales":
        encode = jnp.ones_like(encode) / jnp.where(nonzero, s_block, 1.0)
    q = formats.round_e2m1(jnp.clip(blocks * encode, -formats.E2M1_MAX, formats.E2M1_MAX))
    q = jnp.where(nonzero, q, jnp.zeros_like(q))
    return restore(jnp.where(nonzero, q * decode, 0.0)).astype(x.dtype)


def e8m0_read_as_exponent_bits(x, axis):
    """qcheck's mxfp8 codes and scales, the e8m0 scale decoded as the float32 whose exponent field its bits are
    (JAX's e8m0_to_dtype without its special case): code 0, 2^-127, reads as 0.0 and zeroes its block."""
    q = formats.quantize(x, "mxfp8", axis=axis)
    blocks, restore = to_blocks(q.codes.astype(jnp.float32), q.axis, formats.MX_BLOCK, "mxfp8")
    bits = jax.lax.bitcast_convert_type(q.scales["block"], jnp.uint8)[..., None]
    return restore(blocks * jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 23, jnp.float32)).astype(x.dtype)


class _PlantedNVFP4Site(NVFP4Site):
    bug: str = ""

    def matmul(self, op, lhs, rhs, axes):
        key = quantizer_key(self.make_rng("params"), f"{self.quantizer}/dgrad")
        return fake_quant_matmul(op, lhs, rhs, key, q_lhs=lambda x: planted_nvfp4_qdq(x, axes.lhs, self.bug),
                                 q_rhs=lambda x: planted_nvfp4_qdq(x, axes.rhs, self.bug),
                                 q_dgrad=lambda g, k: formats.qdq(g, "nvfp4", axis=axes.dgrad, rng=k),
                                 q_wgrad=lambda g: formats.qdq(g, "nvfp4", axis=axes.wgrad))


class PlantedNVFP4(NVFP4):
    def __init__(self, bug: str):
        super().__init__("nvfp4_" + bug.replace(" ", "_"))
        self.bug = bug

    def site_module(self, name):
        return _PlantedNVFP4Site(quantizer=name, bug=self.bug)


class _E8M0ExponentBitsSite(FormatSite):
    def matmul(self, op, lhs, rhs, axes):
        return fake_quant_matmul(op, lhs, rhs, None, q_lhs=lambda x: e8m0_read_as_exponent_bits(x, axes.lhs),
                                 q_rhs=lambda x: e8m0_read_as_exponent_bits(x, axes.rhs),
                                 q_dgrad=lambda g, _: formats.qdq(g, "mxfp8", axis=axes.dgrad),
                                 q_wgrad=lambda g: formats.qdq(g, "mxfp8", axis=axes.wgrad))


class E8M0ExponentBits(Recipe):
    def __init__(self):
        super().__init__("mxfp8_e8m0_exponent_bits", lhs="mxfp8", rhs="mxfp8", grad="mxfp8")

    def site_module(self, name):
        return _E8M0ExponentBitsSite(lhs="mxfp8", rhs="mxfp8", grad="mxfp8")


class _UnclippedFp8Site(DelayedScalingFp8Site):
    """qcheck's delayed-scaling fp8 site whose operand cast drops Flax's clip to the format's range."""

    def quantize_operands(self, lhs, rhs, axes):
        q_lhs, q_rhs = super().quantize_operands(lhs, rhs, axes)  # the amax histories and scales as they were

        def unclipped(x, q, scale):  # the forward values of the cast without its clip: NaN beyond 448
            return q + jax.lax.stop_gradient((x / scale).astype(self.e4m3_dtype).astype(x.dtype) * scale - q)

        return (unclipped(lhs, q_lhs, self.input_scale.value[0].astype(lhs.dtype)),
                unclipped(rhs, q_rhs, self.kernel_scale.value[0].astype(rhs.dtype)))


class UnclippedFp8(DelayedScalingFp8):
    def __init__(self):
        super().__init__("fp8_unclipped", e4m3_dtype=E4M3FN, e5m2_dtype=jnp.float8_e5m2)

    def site_module(self, name):
        return _UnclippedFp8Site(amax_history_length=self.amax_history_length, e4m3_dtype=self.e4m3_dtype,
                                 e5m2_dtype=self.e5m2_dtype)


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


class _WrongAxesMxfp8Site(FormatSite):
    def matmul(self, op, lhs, rhs, axes):  # the bug: weights blocked along axis -1, the default
        return super().matmul(op, lhs, rhs, dataclasses.replace(axes, rhs=(-1,)))


class WrongAxesMxfp8(Recipe):
    def __init__(self):
        super().__init__("mxfp8", lhs="mxfp8", rhs="mxfp8", grad="mxfp8")

    def site_module(self, name):
        return _WrongAxesMxfp8Site(lhs="mxfp8", rhs="mxfp8", grad="mxfp8")


class WiZeroTwice(MoE):
    """A dense layer that calls site 'wi_0' where 'wi_1' belongs: both sites quantize, so probes pass."""

    def _dense(self, x, weights, idx):
        wi_0, wi_1, wo = self._weights()
        s = self.sites
        h = self._act(s["wi_0"]("BSM,EMH->BSEH", x, wi_0), s["wi_0"]("BSM,EMH->BSEH", x, wi_1))
        out = s["wo"]("BSEH,EHM->BSEM", h, wo)
        combine = jnp.sum(jax.nn.one_hot(idx, self.config.num_experts) * weights[..., None], axis=2)
        return self.combine("BSEM,BSE->BSM", out, combine)



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


@functools.cache
def _jax_nvfp4_before_e1f12ba4() -> _PlantedJax:
    """The recipe the row's layer is built with and its sites are held to (one object for both)."""
    return _PlantedJax("jax_nvfp4_e1f12ba4", JaxNvfp4BeforeE1f12ba4)


def _with_planted_site(recipe: str, planted: Recipe, site: str = "wo", path: str = "dense") -> MoE:
    broken = layer(recipe, path=path)
    broken.sites[site] = QuantSite(planted, site, rngs=nnx.Rngs(7))
    return broken


@functools.cache  # one warmed-up state for the five: states are immutable
def _loop_state():
    from tests import fp8_loops

    return fp8_loops, fp8_loops.warm(fp8_loops.new_state(fp8_loops.Mlp())), fp8_loops.batch()


_LEAF = r"params/_overwrite_with_gradient/Dense_\d/Fp8DirectDotGeneralOp_0/"


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


class RoundedByBatch(MoE):
    """A layer whose output rounds otherwise at another batch size, as XLA:CPU's matmuls do for some shapes
    (jax 0.12 on a Xeon with AMX, Gemma's router logits): the microbatch relation can then hold only to rounding."""

    def __call__(self, x):
        y = super().__call__(x)
        return y * jnp.float32(1 + 2**-20) if x.shape[0] == X.shape[0] else y


def rounded_by_batch(recipe: Recipe) -> RoundedByBatch:
    return RoundedByBatch(MODELS["mixtral"], recipe, rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)


def rounds_by_batch_and_trains(planted: dict) -> None:
    assert invariants.output_rows_differ(planted["healthy"], X, invariants.TRAIN_MICROBATCHES)[0] > 0
    invariants.assert_layer_trains(planted["healthy"], X)


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
    broken = MoE(MODELS["mixtral"], PlantedGrad(bug), rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)
    twin = cases.layer_step(cases.Case("none", cases.Variant("mixtral", "dense", False)))
    return invariants.grad_leaves(step.train_step(broken, X).grads), invariants.grad_leaves(twin.grads)


def _line(location: str) -> str:
    path, line = location.rsplit(":", 1)
    return Path(path).read_text().splitlines()[int(line) - 1]


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
    invariants.assert_layer_sharded_matches(build_sharded, cases.layer_output(SHARDED_CASE), X, mesh=cases.mesh(),
                                            label="bug")


GOLDEN_CASE = golden.GoldenCase("int8", "mixtral", "dense")


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


class DropsExpertScale(MoE):
    """Gemma's router without its per-expert output scale."""

    def route(self, x):
        logits = jnp.einsum("BSM,ME->BSE", x.astype(jnp.float32), self.gate[...])
        _, idx = jax.lax.top_k(logits, self.config.top_k)
        w = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), idx, axis=-1)
        return w / jnp.sum(w, axis=-1, keepdims=True), idx


class SoftmaxBeforeTopK(MoE):
    """Mixtral's router taking the softmax over all experts, then the top k of it, not renormalised."""

    def route(self, x):
        logits = jnp.einsum("BSM,ME->BSE", x.astype(jnp.float32), self.gate[...])
        return jax.lax.top_k(jax.nn.softmax(logits, axis=-1), self.config.top_k)


class UnrenormalizedGemma(MoE):
    """Gemma's router without the renormalisation of the chosen k probabilities."""

    def route(self, x):
        logits = jnp.einsum("BSM,ME->BSE", x.astype(jnp.float32), self.gate[...])
        _, idx = jax.lax.top_k(logits, self.config.top_k)
        w = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), idx, axis=-1)
        return w * self.per_expert_scale[...][idx], idx


class SwappedActivation(MoE):
    """GELU where the config says SiLU, SiLU where it says GELU."""

    def _act(self, h0, h1):
        act = jax.nn.silu if self.config.activation == "gelu" else functools.partial(jax.nn.gelu, approximate=True)
        return act(h0) * h1


# -- how each bug is planted (rows share these; each returns what the row's checks are called on) ----------


@dataclasses.dataclass
class Planting:
    """What a row's ``plant`` may use: the test's monkeypatch and tmp_path, and ``enter`` for a context
    (a recipe registered with :func:`qcheck.registered`) that lasts until the row's checks are done."""

    monkeypatch: pytest.MonkeyPatch
    tmp_path: Path
    enter: Callable[[contextlib.AbstractContextManager], Any]


def fp8_with(swaps: Mapping[str, str], path: str = "dense") -> MoE:
    """The fp8 layer with the sites named in ``swaps`` built under other recipes."""
    broken = layer("fp8", path=path)
    for name, recipe in swaps.items():
        swap_site(broken, name, recipe)
    return broken


def fp8_fallen_back(p: Planting | None = None) -> MoE:
    """An fp8 layer whose every site fell back to the unquantized one."""
    return fp8_with({name: "none" for name in layer("none").site_names()})


def with_planted_site(recipe: str, planted: Recipe, site: str = "wo", path: str = "dense") -> MoE:
    broken = layer(recipe, path=path)
    broken.sites[site] = QuantSite(planted, site, rngs=nnx.Rngs(7))
    return broken


def none_output(path: str = "dense") -> np.ndarray:
    return cases.layer_output(cases.Case("none", cases.Variant("mixtral", path, False)))


def nanoo_scale_two(p: Planting) -> MoE:
    broken = layer("nanoo_fp8")
    broken.sites["wo"].kernel_scale[...] = jnp.full((1,), 2.0)
    return broken


def forward_writes_history(p: Planting) -> MoE:
    broken = layer("fp8")
    swap_site(broken, "wo", "fp8", cls=ForwardWritesHistory)
    broken.sites["wo"].input_amax_history[...] = jnp.zeros(1024)  # undo what lazy_init's call wrote
    return broken


def two_names_one_site(p: Planting) -> MoE:
    broken = layer("fp8")
    broken.sites["wi_1"] = broken.sites["wi_0"]
    return broken


def two_sites_one_scale(p: Planting) -> MoE:
    broken = layer("fp8")
    broken.sites["wo"].input_scale = broken.sites["wi_0"].input_scale
    return broken


def planted_case(p: Planting, planted: Recipe, variant: cases.Variant = DENSE) -> cases.Case:
    """``planted`` registered for the row (as a user's --recipes module would), and its case (dense Mixtral)."""
    p.enter(registered(planted))
    return cases.Case(planted.name, variant)


_PLANTED = itertools.count()


def layer_case(p: Planting, broken: MoE, like: str, variant: cases.Variant = DENSE) -> cases.Case:
    """A case whose fresh layer is ``broken``: recipe ``like`` registered for the row under a name of its own (so
    no cached program of another row is served), its case built as ``broken``, as the cell builds its layer."""
    planted = copy.copy(get_recipe(like))
    planted.name = f"planted{next(_PLANTED)}_{like}"
    p.enter(registered(planted))
    case, real = cases.Case(planted.name, variant), cases.layer
    p.monkeypatch.setattr(cases, "layer", lambda c: broken if c == case else real(c))
    return case


def as_case(build: Callable[[Planting], MoE], like: str, variant: cases.Variant = DENSE) -> Callable:
    """A row's plant: the layer ``build`` plants, as the fresh layer of a case of recipe ``like`` (:func:`layer_case`)."""
    return lambda p: layer_case(p, build(p), like, variant)


def reused_case(p: Planting, halves: bool) -> cases.Case:
    case = planted_case(p, _ReusedFp8(halves))
    assert "train" in [i.name for i in invariants.INVARIANTS if i.applies(get_recipe(case.recipe), case.variant)]
    return case


def dropping_twin(p: Planting) -> dict:
    healthy = step.apply(layer("none", path="sparse", cls=UnnormalizedSparseRouter), X)[0]
    return {"dense": none_output(), "sparse": np.asarray(healthy)}


def golden_int8(p: Planting, patch: str | None = None) -> Path:
    """GOLDEN_CASE written under tmp_path, then (``patch``) its numerics drifted by 2**-12 as the run sees them."""
    golden.write_case(GOLDEN_CASE, p.tmp_path, overwrite=False)
    scale = np.float32(1 + 2**-12)
    if patch == "output":
        real = cases.layer_output
        p.monkeypatch.setattr(cases, "layer_output",
                              lambda case: real(case) * scale if case.recipe == "int8" else real(case))
    elif patch == "grads":
        real_step = cases.layer_step

        def drifted(case):
            out = real_step(case)
            by = scale if case.recipe == "int8" else np.float32(1)
            return out._replace(grads=jax.tree.map(lambda g: g * by, out.grads))

        p.monkeypatch.setattr(cases, "layer_step", drifted)
    return p.tmp_path


def golden_edited_by_hand(p: Planting) -> Path:
    golden.write_case(GOLDEN_CASE, p.tmp_path, overwrite=False)
    path = GOLDEN_CASE.file(p.tmp_path)
    record = json.loads(path.read_text())
    row = record["output"]["bits"][0]
    record["output"]["bits"][0] = ("0" if row[0] != "0" else "1") + row[1:]  # a plausible-looking edit
    path.write_text(json.dumps(record, indent=1))
    return p.tmp_path


def golden_fed_codes(p: Planting) -> dict:
    liar = QuantSite(DeclaresInt8(), "wi_0", rngs=None)
    fed = golden.site_operands(liar, golden.CANONICAL_EQN, *golden.canonical_operands("mixtral"))
    golden.write_case(GOLDEN_CASE, p.tmp_path, overwrite=False)  # the healthy int8 site's codes
    p.monkeypatch.setattr(golden.record, "operand_codes", lambda recipe, model: fed)  # where measure reads it
    return {"fed": fed, "root": p.tmp_path}


GEMMA = golden.GoldenCase("none", "gemma", "dense")


def gemma_dropping_its_scale(p: Planting) -> dict:
    # A bug in the layer itself: a quantized layer and its unquantized twin drop the scale alike
    # (nothing for tracks to see), and so do both paths (dense == sparse passes, the control). Only
    # the numerics pinned on the seed move, and only because the scale is drawn away from 1.
    golden.write_case(GEMMA, p.tmp_path, overwrite=False)
    real = cases.layer
    dropped = DropsExpertScale(MODELS["gemma"], get_recipe("none"), rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)
    sparse = DropsExpertScale(MODELS["gemma"], get_recipe("none"), path="sparse", rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)
    x = cases.layer_input("gemma")
    paths = {"dense": np.asarray(step.apply(dropped, x)[0]), "sparse": np.asarray(step.apply(sparse, x)[0])}
    p.monkeypatch.setattr(cases, "layer", lambda case: dropped if case == GEMMA.case else real(case))
    p.monkeypatch.setattr(cases, "forward_output", cases.forward_output.__wrapped__)  # no cached healthy output
    p.monkeypatch.setattr(cases, "layer_step", cases.layer_step.__wrapped__)
    p.monkeypatch.setattr(cases, "layer_output", cases.layer_output.__wrapped__)
    return {"paths": paths, "root": p.tmp_path}


def unsalted_quantizer_keys(p: Planting) -> Callable:
    # Without the per-quantizer hash, two SHARED quantizers at one stream state draw the same bits.
    p.monkeypatch.setattr("qcheck.recipes._nvfp4.quantizer_key", lambda base, quantizer: base)
    return nvfp4_dgrad.__wrapped__  # not the cached, salted gradients


def reused_flax_op(p: Planting) -> dict:
    # Weight tying: one Dense (one Fp8DirectDotGeneralOp) called on each half of the batch. Flax's
    # autodiff adds the op's fp8 "gradients" (flax 0.12.8, 0.12.12); its fp32_max_grad dtype takes the max.
    loops, _, batch = _loop_state()
    once = loops.warm(loops.new_state(loops.Halves()))
    twice = loops.new_state(loops.Halves(reuse=True)).apply_fn

    def reused(state, batch, max_grad=False):
        return loops.whole_batch(state.replace(apply_fn=twice), batch, max_grad=max_grad)

    return {"loops": loops, "once": once, "batch": batch, "reused": reused}


def mesh_only_reassembly(p: Planting) -> Callable:
    return lambda mesh: MeshOnlyReassembly(MODELS["mixtral"], get_recipe("int8"), rngs=nnx.Rngs(cases.SEED), seed=cases.SEED, mesh=mesh)


def planted_layer(cls: type[MoE], model: str) -> Callable[[Planting], MoE]:
    """The unquantized layer of ``model`` with the bug ``cls`` plants in the layer code every recipe runs."""
    return lambda p: cls(MODELS[model], get_recipe("none"), rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)


def unsharded_twin(p: Planting) -> Callable:
    # The twin ignores the mesh; only its input lands on it.
    return lambda mesh: MoE(MODELS["mixtral"], get_recipe("int8"), rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)


# -- what a row's control asserts before its checks fail: where the bug hides -----------------------------


def _matmul_lines(message: str) -> list[str]:
    """The lines of a coverage message that name a matmul (not its findings, not what was declared)."""
    return [line for line in message.splitlines()[1:] if line.startswith("  ") and not line.startswith("    ")]


def matmul_line(message: str, i: int = 0) -> str:
    """The source line of the ``i``-th matmul a coverage message lists."""
    location = _matmul_lines(message)[i].split(" at ", 1)[1].split(" ", 1)[0]
    path, line = location.rsplit(":", 1)
    return Path(path).read_text().splitlines()[int(line) - 1]


def names_one_ragged_dot_of_wo(message: str, planted) -> None:
    assert 's["wo"].ragged_dot(h, wo, sizes)' in matmul_line(message)  # that call, on that line


def lists_every_expert_matmul_in_order(message: str, planted) -> None:
    calls = [matmul_line(message, i) for i in range(len(_matmul_lines(message)))]
    assert [next(n for n in ("dispatch", "wi_0", "wi_1", "wo", "combine") if f's["{n}"]' in c) for c in calls] == [
        "dispatch", "wi_0", "wi_1", "wo", "combine"]


def names_every_gradient_nan(message: str, planted) -> None:
    for path, size in ((INPUT_GRAD, CHECK_LAYER_X.size), ("gate", 32 * 8), ("wo", 8 * 64 * 32)):
        assert f"  gradients: {path} (float32) has {size} non-finite values out of {size} in the layer" in message


def records_twice_the_referees_amax(message: str, planted) -> None:
    recorded, referee = map(float, re.search(r"are ([\d.]+),.* are ([\d.]+) \(lhs", message).groups())
    assert recorded == pytest.approx(2 * referee, rel=1e-8)  # figures printed to 9 digits


def codes_mostly_zero(message: str, planted) -> None:
    from qcheck.referees._libraries import quantize_jax_nvfp4_e1f12ba4

    codes, _, _ = quantize_jax_nvfp4_e1f12ba4(np.asarray(X), (2,))  # the claim, on the layer's own input
    assert np.mean(codes.astype(np.float32) == 0) > 0.99


def tracks_within_bound(case: cases.Case) -> None:
    broken = cases.layer(case)
    # One expert matmul in full precision, on one path: the layer lands inside its bound, unlike its twin.
    assert checks.assert_tracks(step.apply(broken, X)[0], none_output("sparse"), max_rel_norm=0.22) < 0.22


def layer_alone_is_healthy(build) -> None:
    healthy_alone, _ = step.apply(build(None), X)
    assert np.array_equal(np.asarray(healthy_alone), cases.layer_output(SHARDED_CASE))  # the bug needs the mesh


def tracking_alone_misses_unwritten_rows(pair) -> None:
    # On CPU the unwritten rows are zeros in the layer and in its twin alike: the comparison passes.
    layer_out, twin_out = (np.asarray(nnx.clone(m)(CHECK_LAYER_X)) for m in pair)
    assert 0 < checks.assert_tracks(layer_out, twin_out, max_rel_norm=0.22) <= 0.22


def outputs_alone_are_blind(build) -> None:
    # Its output is the single-device layer's, bitwise, so comparing outputs alone passes at 0.0.
    placed = jax.device_put(X, jax.sharding.NamedSharding(cases.mesh(), jax.sharding.PartitionSpec("data")))
    blind = np.asarray(step.apply(build(None), placed)[0])
    assert invariants.assert_sharded_matches(cases.layer_output(SHARDED_CASE), blind, label="blind") == 0.0


def each_site_and_the_forward_healthy(case: cases.Case) -> None:
    broken = cases.layer(case)
    invariants.assert_sites_backward_exact(broken, get_recipe("fp8"), label="probes")  # each site alone is fine
    assert_layer_sites_exact(broken, X, "fp8", label="forward")  # and so is the forward
    assert_layer_sites_backward_exact(layer("fp8", path="sparse"), X, "fp8", label="healthy")


def quantized_tracks_its_twin(case: cases.Case) -> None:
    broken = cases.layer(case)
    # The bug is in code the quantized layer and its twin share: int8 tracks the planted twin, as check_layer sees.
    x = cases.layer_input(broken.config.model)
    int8 = type(broken)(broken.config, get_recipe("int8"), rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)
    assert checks.assert_tracks(step.apply(int8, x)[0], step.apply(broken, x)[0], max_rel_norm=0.22) < 0.22


def one_stream_is_flat(forked) -> None:
    """The fix beside the bug: the same decoder, its sites sharing the caller's stream, passes the same check."""
    checks.assert_rng_state_flat(decoder_at("nvfp4"), module_train_step, X, layers=(1, 2))


def fed_e4m3_codes(planted: dict) -> None:
    assert sorted(planted["fed"]) == ["lhs", "lhs.float8_e4m3fn", "rhs", "rhs.float8_e4m3fn"]  # no int8 anywhere


# -- the catalogue ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Catch:
    """The check meant to catch the bug, called on what the row planted: it must raise ``error``
    with a message matching ``message``."""

    check: Callable[..., Any]
    args: Callable[[Any], tuple]
    message: str
    kwargs: Mapping[str, Any] | Callable[[], Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    error: type[Exception] = AssertionError

    def __call__(self, planted: Any) -> Any:
        kwargs = self.kwargs() if callable(self.kwargs) else self.kwargs  # callable: built when the row runs
        return self.check(*self.args(planted), **kwargs)


@dataclasses.dataclass(frozen=True)
class Bug:
    """One planted bug: how to build it, the checks that catch it, and what the catalogue says of it."""

    name: str  # the row's test id
    bug: str  # the catalogue's words for it
    caught_by: str
    plant: Callable[[Planting], Any]
    catches: tuple[Catch, ...]
    control: Callable[[Any], None] | None = None  # holds on the planted bug: what it hides from
    then: Callable[[str, Any], None] | None = None  # claims on the last check's message beyond its regex
    marks: tuple = ()


def _run_cell(case: cases.Case, column: str) -> None:
    __tracebackhide__ = True
    verdict = run_cell(case, column)
    verdict.raise_failure()
    raise AssertionError(f"{case.id} {column}: {verdict.status}, not a failure")  # pytest.raises' match then fails


def cell(column: str, message: str) -> Catch:
    """The invariant ``column`` on the planted case, as every front end runs it (:func:`run_cell`): its message
    follows the case id and ``column``'s check."""
    return Catch(_run_cell, lambda case: (case, column), message)


def layer_sites_exact(recipe: str, message: str, **kwargs) -> Catch:
    """The public check on the planted case's layer, as a user calls it on theirs."""
    return Catch(assert_layer_sites_exact, lambda case: (cases.layer(case), X, recipe), message, kwargs)


#: The id of a case :func:`layer_case` planted: what a planted row's cell messages start with.
PLANTED = r"planted\d+_[\w-]+"


def grads_track(message: str, distinct: bool = True) -> Catch:
    return Catch(invariants.assert_grads_track, lambda grads: grads, message,
                 {"max_grad_rel_norm": 0.3, "distinct": distinct, "label": "bug"})


def fp8_state_matches(loop: Callable[[Any], Callable], message: str) -> Catch:
    """The whole-batch step against ``loop(loops)``, from the warmed-up state."""
    return Catch(qcheck.assert_fp8_state_matches, lambda ls: (ls[0].whole_batch, loop(ls[0]), ls[1], ls[2]), message)


def _bitwise(message: str) -> None:
    assert "held to rtol" not in message, "the layer's output rounds alike in microbatches: the relation is bitwise"


def run_train(message: str) -> Catch:
    return cell("train", message)


def edges(case: cases.Case, message: str) -> Catch:
    """The ``edges`` invariant on the planted ``case``: ``message`` follows its prefix (over lines)."""
    return cell("edges", rf"(?s)^{case.id}: assert_layer_edges: {message}")


def hides_from_exact_and_tracks(case: cases.Case) -> None:
    invariants.run_exact(case)  # each site bitwise the referee's on its probes and in the layer's forward on x
    invariants.run_tracks(case)


def zeros_still_guarded(message: str, case) -> None:
    assert "token row of zeros" not in message  # a zero block's amax is 0 too: only the tiny block slips past


def only_the_tiny_tensor(message: str, case) -> None:
    # One edge row inside a normal tensor leaves the tensor's amax, all its guard sees, normal.
    assert "token row" not in message, message


def tensor_guard_hides_from_all_but_the_tiny_tensor(case: cases.Case) -> None:
    """The planted recipe passes `exact` and `tracks`; the stock nvfp4 recipe passes `edges`, tiny tensor too."""
    hides_from_exact_and_tracks(case)
    assert invariants.run_edges(cases.Case("nvfp4", DENSE)) == len(harness.EDGE_ROWS)


def codes_mostly_zero_in_qchecks_nvfp4(message: str, case) -> None:
    q = np.asarray(planted_nvfp4_qdq(jnp.asarray(X), -1, "global scale on the block scales"))
    assert np.mean(q == 0) > 0.9  # the claim, on the layer's own input




def sharded_matches(message: str) -> Catch:
    return Catch(invariants.assert_layer_sharded_matches,
                 lambda build: (build, cases.layer_output(SHARDED_CASE), X), message,
                 lambda: {"mesh": cases.mesh(), "label": "bug"})


def golden_check(message: str, case=None, error: type[Exception] = AssertionError) -> Catch:
    return Catch(golden.assert_case_matches, lambda planted: (case or GOLDEN_CASE, planted if isinstance(planted, Path)
                                                     else planted["root"]), message, error=error)


def referee(message: str) -> Catch:
    """The ``referee`` invariant on the planted case (at the case table's tolerance)."""
    return cell("referee", rf"^{PLANTED}: assert_layer_matches_referee: token \(\d+, \d+\) "
                           r"differs from the float64 referee by [\d.]+ of its norm .*; worst at "
                           r"output\[\d+, \d+, \d+\]: .*" + message)


def moe_referee(model: str, message: str) -> Catch:
    """:func:`qcheck.assert_moe_matches_referee` on the planted layer, its parameters mapped as a user would."""
    roles = {"gate": "router", "wi_0": "gate", "wi_1": "up", "wo": "down"}
    if MODELS[model].router == "gemma":
        roles["per_expert_scale"] = "expert_scale"
    return Catch(checks.assert_moe_matches_referee, lambda case: (cases.layer(case), cases.layer_input(model), roles),
                 r"^assert_moe_matches_referee: token \(\d+, \d+\) differs from the float64 referee .*" + message,
                 {"style": MODELS[model].router, "top_k": MODELS[model].top_k})


def loops_state(p: Planting):
    return _loop_state()


def planted_grads(bug: str) -> Callable[[Planting], tuple]:
    return lambda p: _planted_grads(bug)


def fell_back_grads(p: Planting) -> tuple:
    twin = cases.layer_step(cases.Case("none", DENSE))
    return invariants.grad_leaves(step.train_step(fp8_fallen_back(), X).grads), invariants.grad_leaves(twin.grads)


#: What the referee's message says of the layer's output at the first differing token.
SAME_EXPERTS = (r"The referee \(\w+\) routes it to experts \[[\d, ]+\] with weights .*; the layer's output there is "
                r"the referee's experts \[[\d, ]+\] mixed with weights .*: the same experts, other weights$")
NO_MIX = (r"the layer's output there is no mix of the referee's expert outputs \(the best leaves [\d.e-]+ of its "
          r"norm\): its experts compute otherwise")
NANOO_E4M3FN = cases.Case("nanoo_fp8_e4m3fn", DENSE)
HALVES, TWICE, UNROLLED = (cases.Case(name, DENSE) for name in ("fp8_halves", "fp8_twice", "fp8_unrolled"))
NO_ZERO_GUARD, AMAX_GUARD, BLOCK_SCALES_ONLY, E8M0_BITS, UNCLIPPED, TENSOR_GUARD = (
    cases.Case(name, DENSE) for name in ("nvfp4_no_zero_guard", "nvfp4_amax_guard",
                                         "nvfp4_global_scale_on_the_block_scales", "mxfp8_e8m0_exponent_bits",
                                         "fp8_unclipped", "nvfp4_tensor_guard_at_zero"))
#: What the referee's message says of a site's first differing element.
DIFFERS = r"differs from the referee-quantized reference at \d+ of \d+ elements, first at \([\d, ]+\): "

CATALOGUE = [
    Bug("exact_catches_a_silently_unquantized_call_site",
        "an fp8 call site that silently stopped quantizing", "`exact`",
        lambda p: layer_case(p, fp8_with({"wi_1": "none"}), "fp8"),
        (cell("exact", r"^planted\d+_fp8-mixtral-dense: assert_sites_exact: site 'wi_1' einsum 'BSM,EMH->BSEH' "
                       r"\(e4m3fn x e4m3fn\): " + DIFFERS + r".*; it equals the unquantized matmul bitwise$"),)),
    Bug("exact_catches_nanoo_built_on_flax_fp8einsum",
        "NANOO fp8 built on `flax.linen.Fp8Einsum`, which ignores `e4m3_dtype`", "`exact` (wrong fp8 flavour)",
        lambda p: planted_case(p, FlaxFp8EinsumNanoo()),
        (cell("exact", r"^flax_fp8einsum_nanoo-mixtral-dense: assert_sites_exact: site 'wi_0' einsum 'BSM,EMH->BSEH' "
                       r"\(e4m3fnuz x e4m3fnuz\): .*it equals both operands in e4m3fn instead of e4m3fnuz bitwise$"),)),
    Bug("exact_catches_the_wrong_flavour_on_the_sparse_path",
        "the wrong e4m3 flavour on the sparse (ragged_dot) path", "`exact` (on `ragged_dot`)",
        lambda p: layer_case(p, cases.layer(cases.Case("fp8", SPARSE)), "nanoo_fp8", SPARSE),
        (cell("exact", r"^planted\d+_nanoo_fp8-mixtral-sparse: assert_sites_exact: site 'wi_0' ragged_dot "
                       r"\(e4m3fnuz x e4m3fnuz\): .*it equals both operands in e4m3fn instead of e4m3fnuz bitwise$"),)),
    Bug("exact_catches_a_cast_without_saturation",
        "a cast without saturation (e4m3 overflow becomes NaN)", "`exact`",
        lambda p: planted_case(p, Unsaturated(), cases.Variant("mixtral", "dense", True)),
        (cell("exact", r"^unsaturated_fp8-mixtral-dense-drop: assert_sites_exact: site 'dispatch' einsum "
                       r"'BSM,BSEC->EBCM' \(e4m3fn x e4m3fn\): .*got np\.float32\(nan\).*; it has \d+ non-finite "
                       r"values where the reference has none \(a cast without saturation overflows to NaN\)$"),)),
    Bug("exact_and_state_catch_a_fresh_scale_that_is_not_one",
        "a fresh layer whose scale is not 1", "`exact`, `state`",
        lambda p: layer_case(p, nanoo_scale_two(p), "nanoo_fp8"),
        (cell("exact", r"^planted\d+_nanoo_fp8-mixtral-dense: assert_sites_exact: site 'wo' einsum 'BSEH,EHM->BSEM' "
                       r"\(e4m3fnuz x e4m3fnuz\): " + DIFFERS),
         cell("state", r"^planted\d+_nanoo_fp8-mixtral-dense: assert_fp8_state_moves_only_in_backward: fresh layer "
                       r"has scales != 1 .*sites\.wo\.kernel_scale"))),
    Bug("exact_catches_an_int8_site_unquantized_on_the_token_dropping_path",
        "an int8 call site that skips quantization on the token-dropping path only", "`exact` (through the layer)",
        lambda p: layer_case(p, layer(DropSkipsInt8(), dropping=True), "int8", cases.Variant("mixtral", "dense", True)),
        (cell("exact", r"^planted\d+_int8-mixtral-dense-drop: assert_sites_exact: site 'wi_0' einsum 'EBCM,EMH->EBCH' "
                       r"\(int8 x int8\).*equals the unquantized matmul bitwise"),),
        control=lambda broken: invariants.assert_sites_exact(layer(DropSkipsInt8()), get_recipe("int8"),
                                                             label="dense")),
    Bug("exact_catches_mxfp8_weights_blocked_along_the_wrong_axes",
        "MXFP8 weights blocked along the wrong axes (the default axis=-1)", "`exact`",
        lambda p: layer_case(p, layer(WrongAxesMxfp8()), "mxfp8"),
        (cell("exact", r"^planted\d+_mxfp8-mixtral-dense: assert_sites_exact: site 'wi_0' einsum 'BSM,EMH->BSEH' "
                       r"\(mxfp8 x mxfp8\).*equals rhs in mxfp8 along the wrong axes \(2,\)"),)),
    Bug("exact_catches_a_layer_calling_wi_0_where_wi_1_belongs",
        "a layer calling site 'wi_0' where 'wi_1' belongs (each site alone exact)",
        "`exact` (through the layer), `assert_layer_sites_exact`",
        lambda p: layer_case(p, layer("int8", cls=WiZeroTwice), "int8"),
        (cell("exact", r"^planted\d+_int8-mixtral-dense: record_site_grads: site 'wi_0' is called more than once in "
                       r"one forward pass; another call site uses its wrapper"),
         layer_sites_exact("int8", r"bug: assert_layer_sites_exact: site 'wi_1' was never called .*"
                           r"wi_0 x2, wi_1 x0, wo x1", label="bug")),
        control=lambda case: invariants.assert_sites_exact(cases.layer(case), get_recipe("int8"), label="probes")),
    # jax commit e1f12ba4 (July 2025) fixed it; JAX's own tests missed it, their reference being a matmul
    # of the same dequantized tensors. Here the referee quantizes independently.
    Bug("exact_catches_jax_nvfp4_global_scale_applied_to_block_scales_not_data",
        "JAX's nvfp4 before e1f12ba4: the global scale applied to the block scales, not the data (codes mostly 0)",
        "`exact` (names the rule)",
        lambda p: planted_case(p, _jax_nvfp4_before_e1f12ba4()),
        (cell("exact",
               r"^jax_nvfp4_e1f12ba4-mixtral-dense: assert_sites_exact: site 'wi_0' einsum 'BSM,EMH->BSEH' "
               r"\(nvfp4_jax x nvfp4_jax\): differs .*it "
               r"equals both operands in JAX's nvfp4 before e1f12ba4 \(the global scale divides the block scales but "
               r"not the data, so its e2m1 codes are mostly zero\) bitwise"),),
        then=codes_mostly_zero, marks=(needs_scaled_matmul,)),
    # The edge shapes of issue 48, in qcheck's own quantizers: inputs a normal draw never holds.
    Bug("edges_catches_an_nvfp4_quantizer_without_a_zero_guard",
        "NVFP4 without its zero guard: an all-zero block's scale is 0, its codes 0 · (s_enc / 0) = NaN "
        "(`exact` and `tracks` pass)", "`edges` (token row of zeros)",
        lambda p: planted_case(p, PlantedNVFP4("no zero guard")),
        (edges(NO_ZERO_GUARD, r"token row of zeros: not finite: the output \(32 of 2048\), gradient of gate.*"
                              r"\ntoken row of zeros: site 'wi_0' einsum 'BSM,EMH->BSEH' \(nvfp4 x nvfp4\): "
                              + DIFFERS + r"got np\.float32\(nan\), expected np\.float32\(0\.0\)"),),
        control=hides_from_exact_and_tracks),
    Bug("edges_catches_an_nvfp4_guard_on_the_amax_that_a_tiny_block_slips_past",
        "NVFP4 guarded on the block's amax, not its scale: a tiny block passes the guard while its e4m3 scale "
        "rounds to 0, and s_enc / 0 overflows (codes NaN; `exact` and `tracks` pass)", "`edges` (token row of tiny "
        "values)",
        lambda p: planted_case(p, PlantedNVFP4("amax guard")),
        (edges(AMAX_GUARD, r"token row of tiny values \(around float32's smallest normal, and below it\): not "
                           r"finite: gradient of wi_0 .*site 'wi_0' einsum 'BSM,EMH->BSEH' \(nvfp4 x nvfp4\): "
                           + DIFFERS + r"got np\.float32\(nan\)"),),
        control=hides_from_exact_and_tracks, then=zeros_still_guarded),
    # Issue 55: a per-tensor scale sees only the tensor's amax, so only the whole tensor of tiny values reaches it.
    Bug("edges_catches_an_nvfp4_tensor_guard_that_a_tiny_tensor_amax_slips_past",
        "NVFP4 whose tensor amax is guarded against 0 only, not NVFP4_MIN_AMAX: a tensor of tiny values takes the "
        "tensor scale 6 · 448 / amax = inf, and a 0 in a block beside a nonzero value codes 0 · inf = NaN (`exact`, "
        "`tracks` and every token row pass; the stock nvfp4 passes)", "`edges` (whole tensor of tiny values)",
        lambda p: planted_case(p, PlantedNVFP4("tensor guard at zero")),
        (edges(TENSOR_GUARD, r"whole tensor of tiny values \(x scaled by a power of two below every format's "
                             r"smallest guarded amax\): not finite: gradient of wi_0 .*site 'wi_0' einsum "
                             r"'BSM,EMH->BSEH' \(nvfp4 x nvfp4\): " + DIFFERS + r"got np\.float32\(nan\), "
                             r"expected np\.float32\(0\.0\)"),),
        control=tensor_guard_hides_from_all_but_the_tiny_tensor, then=only_the_tiny_tensor),
    Bug("edges_catches_a_delayed_scaling_fp8_cast_without_saturation",
        "qcheck's delayed-scaling fp8 site casting without its clip: at a fresh scale of 1, an input of 1e5 "
        "becomes NaN (`tracks` passes)", "`edges` (a value beyond the range; `exact`'s probes too)",
        lambda p: planted_case(p, UnclippedFp8()),
        (edges(UNCLIPPED, r"token row with one value far beyond the format's range \(1e5\): not finite: the output "
                          r"\(32 of 2048\), .*site 'wi_0' einsum 'BSM,EMH->BSEH' \(e4m3fn x e4m3fn\): " + DIFFERS
                          + r"got np\.float32\(nan\)"),),
        control=invariants.run_tracks),
    Bug("edges_catches_an_e8m0_scale_code_0_decoded_as_zero",
        "MXFP8's E8M0 scale code 0 (2^-127) read as a float32 exponent field, 0.0: a block of tiny values "
        "multiplies as 0 (`exact` and `tracks` pass)", "`edges` (token row of tiny values)",
        lambda p: planted_case(p, E8M0ExponentBits()),
        (edges(E8M0_BITS, r"token row of tiny values .*: site 'wi_0' einsum 'BSM,EMH->BSEH' \(mxfp8 x mxfp8\): "
                          + DIFFERS + r"got np\.float32\(0\.0\), expected np\.float32\(-?[\d.]+e-3\d\)"),),
        control=hides_from_exact_and_tracks),
    # The JAX bug above in qcheck's own NVFP4: it shows on any input, so `edges` leaves it to `exact`.
    Bug("exact_catches_nvfp4_with_its_global_scale_on_the_block_scales_only",
        "qcheck's NVFP4 with its tensor scale applied to the block scales, not the data (codes mostly 0)",
        "`exact`, `tracks`", lambda p: planted_case(p, PlantedNVFP4("global scale on the block scales")),
        (cell("exact",
               rf"^{BLOCK_SCALES_ONLY.id}: assert_sites_exact: site 'wi_0' einsum 'BSM,EMH->BSEH' \(nvfp4 x nvfp4\): "
               + DIFFERS + r"got np\.float32\(0\.0\)"),
         cell("tracks", r"relative norm 1\.0000 exceeds the bound 0\.35")),
        then=codes_mostly_zero_in_qchecks_nvfp4),
    # configs=None falls back to lax.dot_general (since jax ae29f63e; before, it quantized to MXFP8
    # silently): every expert matmul in full precision, while the recipe declares nvfp4_jax.
    Bug("coverage_catches_scaled_dot_general_called_without_configs",
        "`jax.nn.scaled_dot_general` called with `configs=None` (full-precision `dot_general`)", "`coverage`",
        lambda p: planted_case(p, _PlantedJax("jax_no_configs", JaxNoConfigs)),
        (cell("coverage", r"3 of 5 matmuls differ from the declared quantization \(activations nvfp4_jax, weights "
                         r"nvfp4_jax \(the layer's recipe 'jax_no_configs'\)\):\n  dot_general at .*lhs \(\d+, \d+, "
                         r"\d+\) \[full precision\].*\n    lhs \(activation\) reaches the matmul in full precision; "
                         r"declared nvfp4_jax"),)),
    Bug("state_catches_a_forward_pass_that_writes_amax_history",
        "a forward pass that writes fp8 state", "`state`", as_case(forward_writes_history, "fp8"),
        (cell("state", rf"^{PLANTED}: assert_fp8_state_moves_only_in_backward: a forward pass changed fp8 "
                                    r"state at \['sites\.wo\.input_amax_history'\]"),)),
    Bug("state_catches_a_layer_that_lost_its_fp8_state",
        "an fp8 layer that lost its scales and histories", "`state`",
        as_case(lambda p: cases.layer(cases.Case("int8", DENSE)), "fp8"),
        (cell("state", rf"^{PLANTED}: assert_fp8_state_moves_only_in_backward: the layer has no fp8 scales "
                       "or amax histories"),)),
    # One expert matmul multiplying in full precision, on one path: the layer still lands well inside
    # its bound and differs from its twin, so tracks passes.
    Bug("coverage_catches_one_call_site_unquantized_on_the_sparse_path",
        "one call site multiplying in full precision on the sparse path only (`tracks` passes)", "`coverage`",
        as_case(lambda p: fp8_with({"wo": "none"}, path="sparse"), "fp8", SPARSE),
        (cell("coverage", r"1 of 5 matmuls differ from the declared quantization .*\n  ragged_dot_general at "
                         r"qcheck/layers/moe.py:\d+ \(MoE._sparse\).*\[full precision\]\n    lhs \(activation\) "
                         r"reaches the matmul in full precision; declared e4m3fn"),),
        control=tracks_within_bound, then=names_one_ragged_dot_of_wo),
    Bug("coverage_catches_a_layer_that_quantizes_nothing_listing_every_expert_matmul",
        "a layer that quantizes nothing: every expert matmul listed with its line", "`coverage`",
        as_case(lambda p: cases.layer(cases.Case("none", cases.Variant("mixtral", "dense", True))), "fp8",
                cases.Variant("mixtral", "dense", True)),
        (cell("coverage", r"5 of 8 matmuls reach full precision"),), then=lists_every_expert_matmul_in_order),
    # The forward pass is bitwise unchanged, so exact, tracks and golden all pass.
    Bug("backward_catches_fp8_output_gradients_cast_to_e4m3_not_e5m2",
        "fp8 output gradients cast to e4m3 instead of e5m2 (the forward pass unchanged)", "`backward`",
        as_case(lambda p: with_planted_site("fp8", DelayedScalingFp8("fp8", e4m3_dtype=E4M3FN, e5m2_dtype=E4M3FN)),
                "fp8"),
        (cell("backward", rf"^{PLANTED}: assert_sites_backward_exact: site 'wo' dgrad \(g in float8_e5m2\).*equals the gradient with g in "
                        r"float8_e4m3fn \(the forward flavour\)"),),
        control=lambda case: invariants.assert_sites_exact(cases.layer(case), get_recipe("fp8"), label="forward")),
    Bug("backward_catches_nvfp4_blocking_the_input_gradient_along_the_weight_gradient_axes",
        "NVFP4 blocking the input gradient's copy of g along the weight-gradient axes", "`backward`",
        as_case(lambda p: with_planted_site("nvfp4", WrongAxesNVFP4(), path="sparse"), "nvfp4", SPARSE),
        (cell("backward", rf"^{PLANTED}: assert_sites_backward_exact: site 'wo' dgrad \(g in nvfp4 along axes \(1,\), stochastic\).*along the "
                        r"wgrad axes \(0,\) bitwise"),)),
    Bug("backward_catches_a_gradient_that_skipped_quantization",
        "a gradient that skipped quantization", "`backward`",
        as_case(lambda p: with_planted_site("nanoo_fp8", SkipGradFp8("nanoo_fp8", e4m3_dtype=E4M3FNUZ,
                                                                     e5m2_dtype=jnp.float8_e5m2fnuz)), "nanoo_fp8"),
        (cell("backward", rf"^{PLANTED}: assert_sites_backward_exact: site 'wo' dgrad \(g in float8_e5m2fnuz\).*equals the gradient with "
                        r"unquantized g bitwise"),)),
    Bug("backward_catches_a_layer_taking_a_weights_gradient_around_its_site",
        "a layer taking a weight's gradient around its site (straight through, sparse path)",
        "`backward` (through the layer)", as_case(lambda p: layer("fp8", path="sparse", cls=StraightThroughWo), "fp8", SPARSE),
        (cell("backward",
               rf"^{PLANTED}: assert_layer_sites_backward_exact: the layer's gradient of its parameter 'wo' is not the gradient "
               r"its site gave \(they differ at \d+ of 16384 elements; the site's is all zeros\): the layer takes that "
               r"weight's gradient from elsewhere"),),
        control=each_site_and_the_forward_healthy),
    # Before any figure: a twin with other weights would fail tracks and gradients for the wrong reason.
    Bug("check_layer_catches_a_twin_with_other_weights",
        "a twin with other weights than the layer (`copy_params_into` not used)", "`check_layer`: the twin's weights",
        lambda p: (sparse_moe("fp8"), sparse_moe("none", seed=1)),
        (Catch(check_layer, lambda pair: (*pair, CHECK_LAYER_X),
               r"^check_layer: reference's weights differ from layer's: gate \(float32\[32, 8\]\) differs in 256 of 256 "
               r"values; make the twin with qcheck.copy_params_into\(layer, twin\)$", {"skip": MOE_FULL_PRECISION},
               ValueError),)),
    Bug("check_layer_catches_nan_gradients",
        "NaN gradients from a layer whose forward pass is fine", "`check_layer`: gradients",
        lambda p: NaNBackwardMoE(MODELS["mixtral"], get_recipe("fp8"), path="sparse", rngs=nnx.Rngs(0), seed=0),
        (Catch(check_layer, lambda broken: (broken, sparse_moe("none"), CHECK_LAYER_X),
               r"^check_layer: 5 check\(s\) failed:\n", {"skip": MOE_FULL_PRECISION}),),
        then=names_every_gradient_nan),
    Bug("check_layer_catches_rows_of_lax_empty_that_layer_and_twin_never_write",
        "an unpermute into `jax.lax.empty` leaving each sequence's last row unwritten, in code layer and twin share "
        "(zeros on CPU, garbage on GPU: maxtext#4905)",
        "`check_layer`: uninitialized (`assert_no_uninitialized_reads`)",
        lambda p: (unpermute_moe("fp8"), unpermute_moe("none")),
        (Catch(check_layer, lambda pair: (*pair, CHECK_LAYER_X),
               r"^check_layer: 2 check\(s\) failed:\n  uninitialized \(layer\): output reads memory the layer never "
               r"wrote, the buffer of jax\.lax\.empty float32\[128, 32\] at \S*helpers\.py:\d+ \(unpermute_into_empty\)"
               r": filled with NaN, then with a large finite value, it changes output in 64 and 64 of its 2048 values"
               r".*\n  uninitialized \(reference\): output reads memory the layer never wrote",
               {"skip": MOE_FULL_PRECISION}),),
        control=tracking_alone_misses_unwritten_rows),
    Bug("grads_catches_nan_gradients_from_an_unguarded_empty_amax_history",
        "NaN gradients from an unguarded delayed scale (empty amax history)", "`assert_grads_track` (`grads`'s check: finite)",
        planted_grads("empty_history"),
        (grads_track(r"^bug: assert_grads_track: gradient of \w+ \(float32\) has \d+ non-finite values of \d+"),)),
    # The forward pass is a healthy e4m3fn layer: tracks passes; only the gradients are flushed.
    Bug("grads_catches_output_gradients_cast_to_e4m3_at_scale_1",
        "output gradients cast to e4m3 at scale 1, most flushed to 0 (the forward pass unchanged)",
        "`assert_grads_track` (`grads`'s check: gradient bound)", planted_grads("e4m3_scale_1"),
        (grads_track(r"^bug: assert_grads_track: gradient of \w+ \(float32\) is 0\.[6-9]\d* "
                     r"from the none twin's \(relative norm; bound "
                     r"0\.3\); \d+ of \d+ values are 0"),)),
    # A recipe that declares no gradient quantization (distinct=False): all of them equal is still a fallback.
    Bug("grads_catches_a_layer_that_fell_back_to_full_precision",
        "an fp8 layer whose every site fell back: gradients bitwise equal to the twin's", "`assert_grads_track` (`grads`'s check: not bitwise equal)",
        fell_back_grads,
        (grads_track(r"^bug: assert_grads_track: gradient of gate \(float32\) is bitwise equal to the none twin's"),
         grads_track(r"^bug: assert_grads_track: every gradient is bitwise equal to the none twin's "
                     r"— the quantized path was not taken",
                     distinct=False))),
    Bug("fp8_state_catches_a_loop_summing_fp8_state_across_microbatches",
        "a training loop summing the fp8 state across microbatches like a gradient (amax, scale x M)",
        "`assert_fp8_state_matches` (batch == microbatches)", loops_state,
        (fp8_state_matches(lambda loops: loops.accumulated("sum"),
                           _LEAF + r"kernel_amax_history\[0\]: step_a [\d.]+, step_b [\d.]+, ratio 2: a ratio of 2: "
                           r"summed across 2 microbatches or uses"),),
        control=lambda ls: qcheck.assert_fp8_state_matches(ls[0].whole_batch, ls[0].accumulated("max"), *ls[1:])),
    Bug("fp8_state_catches_a_loop_keeping_the_last_microbatchs_amax_only",
        "gradient accumulation keeping the last microbatch's amax only (marin #7659)",
        "`assert_fp8_state_matches` (batch == microbatches)", loops_state,
        (fp8_state_matches(lambda loops: loops.accumulated("last"),
                           r"(?s)4 of 12 fp8 leaves differ .*\n  " + _LEAF + r"input_amax_history\[0\]: step_a [\d.]+, "
                           r"step_b [\d.]+, ratio 0\.\d+: smaller than step_a's: part of the batch not recorded \(the "
                           r"last microbatch only\?\)"),)),
    Bug("fp8_state_catches_a_loop_clipping_fp8_state_with_the_gradients",
        "`optax.clip_by_global_norm` over the fp8 state with the gradients (MaxText PR #672)",
        "`assert_fp8_state_matches` (clipped == unclipped)", loops_state,
        (fp8_state_matches(lambda loops: loops.clipped(fp8_too=True),
                           r"(?s)12 of 12 fp8 leaves differ between step_a and step_b \(bitwise\); likely cause: every "
                           r"differing leaf is step_a's times 0\.00\d+: following the clip factor, the optimizer "
                           r"touched the fp8 state.*\n  " + _LEAF + r"input_amax_history\[0\]: step_a"),),
        control=lambda ls: qcheck.assert_fp8_state_matches(ls[0].whole_batch, ls[0].clipped(fp8_too=False), *ls[1:])),
    Bug("fp8_state_catches_a_loop_weight_decaying_fp8_state",
        "weight decay added to the fp8 state's next values", "`assert_fp8_state_matches` (decayed == not)", loops_state,
        (fp8_state_matches(lambda loops: loops.weight_decayed(fp8_too=True),
                           r"(?s)likely cause: every differing leaf is step_a's plus 0\.01 x its value before the "
                           r"step: weight decay applied to the fp8 state.*\n  " + _LEAF + "input_scale: "),),
        control=lambda ls: qcheck.assert_fp8_state_matches(ls[0].whole_batch, ls[0].weight_decayed(fp8_too=False),
                                                           *ls[1:])),
    Bug("fp8_state_catches_a_flax_fp8_op_reused_on_two_inputs",
        "one Flax fp8 op reused on two inputs (weight tying): autodiff sums its amax and scales",
        "`assert_fp8_state_matches` (reused == applied once)", reused_flax_op,
        (Catch(qcheck.assert_fp8_state_matches, lambda r: (r["loops"].whole_batch, r["reused"], r["once"], r["batch"]),
               r"(?s)6 of 6 fp8 leaves differ.*\n  " + _LEAF.replace(r"\d", "0") + r"input_amax_history\[0\]: step_a "
               r"[\d.]+, step_b [\d.]+, ratio 1\.\d+: larger than step_a's: more than the max of what the site saw"),),
        control=lambda r: qcheck.assert_fp8_state_matches(
            r["loops"].whole_batch, functools.partial(r["reused"], max_grad=True), r["once"], r["batch"])),
    Bug("train_catches_a_site_reused_on_two_halves_summing_its_amax",
        "an fp8 site applying one op to each half of its input: autodiff sums the amax",
        "`train` (batch == microbatches)",
        lambda p: reused_case(p, halves=True),
        (run_train(rf"(?s)^{HALVES.id} \(one batch vs 2 microbatches\): assert_fp8_state_matches: 3 of 18 fp8 leaves "
                     r"differ.*\n  sites/wi_0/input_amax_history\[0\]: step_a [\d.]+, step_b [\d.]+, ratio 1\.\d+: "
                     r"larger than step_a's: more than the max of what the site saw"),),
        then=lambda message, case: _bitwise(message)),
    # The relation's rounding tolerance, taken only where the layer's output rounds by batch, still catches it.
    Bug("train_catches_a_site_reused_on_two_halves_where_the_layer_output_rounds_by_batch",
        "an fp8 site applying one op to each half of its input, in a layer whose output rounds otherwise in "
        "microbatches", "`assert_layer_trains` (`train`'s check: batch == microbatches, to rounding)",
        lambda p: {"bug": rounded_by_batch(_ReusedFp8(halves=True)), "healthy": rounded_by_batch(get_recipe("fp8"))},
        (Catch(invariants.assert_layer_trains, lambda planted: (planted["bug"], X),
               r"(?s)^bug \(one batch vs 2 microbatches\): assert_fp8_state_matches: 3 of 18 fp8 leaves differ.*\n  "
               r"sites/wi_0/input_amax_history\[0\]: step_a [\d.]+, step_b [\d.]+, ratio 1\.\d+: larger than step_a's.*"
               r"\n\(held to rtol 1e-05, not bitwise: the layer's output on the whole batch differs from its output on "
               r"the 2 microbatches in \d+ of 2048 values\)$", {"label": "bug"}),),
        control=rounds_by_batch_and_trains),
    # Twice the amax in one batch and in each microbatch alike: the relations hold, the referee's amax does not.
    Bug("train_catches_a_site_quantizing_its_input_twice_recording_twice_its_amax",
        "an fp8 site quantizing its input twice: twice the amax in a batch and in its microbatches alike",
        "`train` (the referee's amax of what the site saw)", lambda p: reused_case(p, halves=False),
        (run_train(rf"^{TWICE.id}: assert_layer_trains: sites/wi_0/input_amax_history\[0\], "
                     r"sites/wi_0/kernel_amax_history\[0\] after one "
                     r"step are ([\d.]+), [\d.]+; the referee's amaxes of the operands site 'wi_0' received are "
                     r"([\d.]+) \(lhs\), [\d.]+ \(rhs\): the site records other amaxes than its operands'"),),
        then=records_twice_the_referees_amax),
    # One step from a fresh history of zeros cannot tell; the second step's history can.
    Bug("train_catches_an_amax_history_written_over_at_0_not_rolled",
        "an amax history written over at 0 instead of rolled (one step cannot tell)", "`train` (rolls once per step)",
        lambda p: planted_case(p, _UnrolledFp8(UNROLLED.recipe, e4m3_dtype=E4M3FN, e5m2_dtype=jnp.float8_e5m2)),
        (run_train(rf"^{UNROLLED.id}: assert_layer_trains: sites/wi_0/input_amax_history at step 2 "
                     r"was not rolled \(each history rolls "
                     r"once per step, newest amax at 0\)"),)),
    Bug("tracks_catches_a_layer_whose_quantization_silently_fell_away",
        "a layer whose quantization fell away everywhere", "`tracks`", as_case(fp8_fallen_back, "fp8"),
        (cell("tracks", rf"^{PLANTED}: .*bitwise equal to the unquantized reference"),)),
    # exact, backward and tracks follow the declaration, which agrees with the site: only the hardware
    # it targets (MI300, fnuz types) says the flavour is wrong; the second check sees the program alone.
    Bug("coverage_catches_nanoo_declared_and_built_in_e4m3fn",
        "NANOO fp8 declared and built with e4m3fn alike (`exact`, `backward`, `tracks` follow the declaration)",
        "`coverage` (fp8 types against the target hardware)",
        lambda p: planted_case(p, DelayedScalingFp8(NANOO_E4M3FN.recipe, e4m3_dtype=E4M3FN,
                                                    e5m2_dtype=jnp.float8_e5m2fnuz, expect=Expect(fp8_target="mi300"))),
        (cell("coverage",
               rf"^{NANOO_E4M3FN.id}: assert_recipe_fp8_native: .*target 'mi300'.*: lhs float8_e4m3fn"),
         Catch(checks.assert_fp8_dtypes_native, lambda case: (cases.layer(case), X),
               r"not native to target 'mi300' \(native fp8: float8_e4m3fnuz, float8_e5m2fnuz\):\n  forward: "
               r"dot_general at qcheck/layers/moe.py:\d+ \(MoE._dense\): lhs cast to float8_e4m3fn",
               {"target": "mi300"}))),
    Bug("sites_catches_two_names_bound_to_one_site",
        "two call-site names bound to one wrapper", "`sites`", as_case(two_names_one_site, "fp8"),
        (cell("sites", rf"^{PLANTED}: assert_sites_independent: sites 'wi_0' and 'wi_1' are one object"),)),
    Bug("sites_catches_two_sites_sharing_a_scale",
        "two call sites sharing a scale", "`sites`", as_case(two_sites_one_scale, "fp8"),
        (cell("sites", rf"^{PLANTED}: assert_sites_independent: sites 'wi_0' and 'wo' share state \(input_scale\)"),)),
    Bug("sites_catches_streams_kept_by_a_recipe_that_never_draws",
        "RNG streams kept by the sites of a recipe that never draws", "`sites`",
        as_case(lambda p: MoE(MODELS["mixtral"], get_recipe("fp8"), rngs=nnx.Rngs(0), apply_rngs=ApplyRngs.PRIVATE),
                "fp8"),
        (cell("sites", rf"^{PLANTED}: assert_sites_carry_no_rng_stream: sites \['wi_0', 'wi_1', 'wo'\] "
                       r"of a recipe that never draws carry"),)),
    Bug("paths_agree_catches_a_sparse_routing_bug",
        "a sparse router that forgets to renormalize", "dense == sparse", dropping_twin,
        (Catch(invariants.assert_paths_agree, lambda out: (out["dense"], out["sparse"]),
               "^bug: assert_paths_agree: dense and sparse differ by up to", {"label": "bug"}),)),
    # Bugs in the layer code a quantized layer and its twin share: tracks, check_layer and dense == sparse cannot see
    # them; before the referee only the golden files of the unquantized layer could.
    Bug("referee_catches_a_mixtral_router_taking_the_softmax_over_all_experts_before_top_k",
        "Mixtral's router taking the softmax over all experts before top-k (the chosen weights not renormalised)",
        "`referee`, `assert_moe_matches_referee`", as_case(planted_layer(SoftmaxBeforeTopK, "mixtral"), "none", cases.Variant("mixtral", "dense", False)),
        (referee(SAME_EXPERTS), moe_referee("mixtral", SAME_EXPERTS)), control=quantized_tracks_its_twin),
    Bug("referee_catches_a_gemma_router_that_does_not_renormalise",
        "Gemma's router without the renormalisation of the chosen experts' probabilities",
        "`referee`, `assert_moe_matches_referee`", as_case(planted_layer(UnrenormalizedGemma, "gemma"), "none", cases.Variant("gemma", "dense", False)),
        (referee(SAME_EXPERTS), moe_referee("gemma", SAME_EXPERTS)), control=quantized_tracks_its_twin),
    Bug("referee_catches_the_activation_swapped_silu_for_gelu",
        "the experts' activation swapped (GELU in Mixtral, where SiLU belongs)",
        "`referee`, `assert_moe_matches_referee`", as_case(planted_layer(SwappedActivation, "mixtral"), "none", cases.Variant("mixtral", "dense", False)),
        (referee(NO_MIX), moe_referee("mixtral", NO_MIX)), control=quantized_tracks_its_twin),
    # The seed's bug: every wrapper keeps its fork, so the step's RNG state grows per layer.
    Bug("rng_catches_a_forked_stream_per_layer",
        "a forked RNG stream per wrapper per layer (every bridged site of a decoder keeping its fork: MaxText #5160)",
        "`assert_rng_state_flat` (`rng`'s check)", lambda p: decoder_at("nvfp4", apply_rngs="private"),
        (Catch(checks.assert_rng_state_flat, lambda build: (build, module_train_step, X),
               r"(?s)^bug: assert_rng_state_flat: RNG state grows with the layers: u32 entry parameters of the step "
               r"by layer count \{1: 8, 2: 14\}, RNG state leaves \{1: 8, 2: 14\}; .*\n  "
               r"layers/\*/sites/wo/to_nnx__rngs \(default\): \{1: 2, 2: 4\} \(e\.g\. layers/1/sites/wo/to_nnx__rngs\)",
               {"label": "bug", "layers": (1, 2)}),),
        control=one_stream_is_flat),
    Bug("rng_control_catches_a_measurement_that_sees_nothing",
        "an RNG measurement that sees nothing", "`assert_rng_state_grows` (`rng`'s PRIVATE control)", lambda p: {1: 2, 2: 2, 8: 2},
        (Catch(invariants.assert_rng_state_grows, lambda u32: (u32,),
               "^bug: assert_rng_state_grows: forced PRIVATE, u32 entry parameters should grow", {"label": "bug"}),)),
    Bug("reused_stochastic_rounding_bits_are_visible",
        "stochastic-rounding bits reused across quantizers", "the per-quantizer-bits test in `tests/test_rng.py`",
        unsalted_quantizer_keys,
        (Catch(assert_quantizers_draw_their_own_bits, lambda dgrad: (dgrad,),
               r"quantizers 'wi_0' and 'wi_1' drew the same stochastic-rounding bits at one stream state"),)),
    Bug("golden_catches_numerics_drift",
        "a recipe's layer output drifting from its golden case", "golden (`tests/test_golden.py`)",
        lambda p: golden_int8(p, "output"),
        (golden_check(r"(?s)^assert_case_matches: golden case int8-mixtral-dense does not match "
                      r".*output: \d+ of 2048 values outside rtol.*golden "
                      r"written with: jax .*this run: .*golden update int8"),)),
    # The forward pass (output, codes, rel_norm) is untouched: only the train step's gradients move.
    Bug("golden_catches_gradients_that_drifted",
        "a recipe's train-step gradients drifting from its golden case (the forward pass unchanged)",
        "golden (gradients)", lambda p: golden_int8(p, "grads"),
        (golden_check(r"(?s)^assert_case_matches: golden case int8-mixtral-dense does not match "
                      r".*grads\['gate'\]: \d+ of 256 sampled values outside "
                      r"rtol 1e-05, atol 5e-08.*grads\['wi_0'\]: norm .*golden update int8"),)),
    Bug("golden_catches_a_file_edited_by_hand",
        "a golden file edited by hand", "golden (content digest)", golden_edited_by_hand,
        (golden_check("^assert_case_matches: golden file .* does not match its digest: it was edited by hand",
                      error=golden.GoldenFileError),)),
    Bug("golden_catches_gemma_dropping_its_per_expert_scale",
        "Gemma's router dropping its per-expert output scale (drawn around 1, so the output moves)",
        "golden (`tracks` and dense == sparse cannot: both sides drop it)", gemma_dropping_its_scale,
        (golden_check(r"(?s)^assert_case_matches: golden case none-gemma-dense does not match .*output: 2048 of 2048 "
                      r"values outside rtol", case=GEMMA),),
        control=lambda planted: invariants.assert_paths_agree(planted["paths"]["dense"], planted["paths"]["sparse"],
                                                              label="blind")),
    Bug("golden_records_what_a_site_feeds_its_matmul_not_its_declaration",
        "a plug-in whose site quantizes otherwise than it declares (int8 declared, e4m3fn cast)",
        "golden (codes traced from the site)", golden_fed_codes,
        (golden_check(r"(?s)^assert_case_matches: golden case int8-mixtral-dense does not match "
                      r".*codes: got keys \['lhs', 'lhs.float8_e4m3fn', 'rhs', "
                      r"'rhs.float8_e4m3fn'\], golden \['lhs', 'lhs.int8', 'rhs', 'rhs.int8'\].*codes\['lhs'\]: \d+ of "
                      r"128 differ"),),
        control=fed_e4m3_codes),
    Bug("sharded_catches_experts_reassembled_in_the_wrong_order",
        "expert shards reassembled in the wrong order, on a mesh only",
        "`assert_layer_sharded_matches` (`sharded`'s check)", mesh_only_reassembly,
        (sharded_matches(r"^bug: assert_sharded_matches: the sharded layer differs "
                         r"from the single-device one at \d+ of 2048 values, by up to "
                         r".*\(rtol 1e-05, atol 1e-06\)"),),
        control=layer_alone_is_healthy),
    Bug("sharded_catches_a_twin_built_without_its_mesh",
        "a sharded twin built without its mesh (its output equals the single-device one)",
        "`assert_layer_sharded_matches` (`sharded`'s check: twin not sharded)", unsharded_twin,
        (sharded_matches(r"^bug: assert_layer_sharded: the sharded twin is not sharded: weight 'wi_0' "
                         r"\(float32\[8, 32, 64\]\) is "
                         r"SingleDeviceSharding on 1 device\(s\), not on the 4-way 'expert' mesh of 8 devices \(built "
                         r"without its mesh\?\)"),),
        control=outputs_alone_are_blind),
]


@pytest.fixture
def planting(monkeypatch, tmp_path):
    with contextlib.ExitStack() as stack:
        yield Planting(monkeypatch, tmp_path, stack.enter_context)


@pytest.mark.parametrize("row", [pytest.param(row, id=row.name, marks=row.marks) for row in CATALOGUE])
def test_planted_bug_fails_its_check(row: Bug, planting: Planting):
    planted = row.plant(planting)
    if row.control is not None:
        row.control(planted)
    for catch in row.catches:
        with pytest.raises(catch.error, match=catch.message) as info:
            catch(planted)
    if row.then is not None:
        row.then(str(info.value), planted)


# -- the catalogue, as docs/catalogue.md shows it ----------------------------------------------------------


def render_catalogue() -> str:
    rows = [f"| {row.bug} | {row.caught_by} | `{row.name}` |" for row in CATALOGUE]
    return "\n".join(["| bug | caught by | row of `CATALOGUE` in tests/test_catalogue.py |", "|---|---|---|", *rows])


def test_catalogue_rows_are_distinct_and_each_names_a_check():
    names = [row.name for row in CATALOGUE]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    assert all(row.catches and all(callable(c.check) for c in row.catches) for row in CATALOGUE)


def test_each_row_crediting_an_invariant_is_caught_through_its_cell():
    # A row naming a column of the matrix (before any parenthesis) is caught as the matrix would show it: run_cell
    # on a case. A row whose bug the case table cannot build (planted gradients, counts, a mesh) credits the check.
    columns = {i.name for i in invariants.INVARIANTS}
    for row in CATALOGUE:
        credited = {c for c in re.findall(r"`([\w.]+)`", row.caught_by.split("(")[0]) if c in columns}
        through = {c.args(None)[1] for c in row.catches if c.check is _run_cell}
        assert credited <= through, f"{row.name} credits {sorted(credited - through)} but is not caught through it"


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
