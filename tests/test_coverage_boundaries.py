"""Quantizer evidence across every boundary: codes, scales and zero points made on one side of a body (a
``shard_map``'s, a ``scan``'s, a ``jax.checkpoint``'s, a nested ``jax.jit``'s, a ``custom_vjp``'s) and multiplied
on the other are held bitwise to the quantizer that made them, in plain JAX.

Should-pass / should-fail pairs:

* EasyDeL 0.3.0's fused MoE, in small: per-expert int8 codes (one scale per expert per output column: qcheck's
  ``int8``, one scale per index of every axis but the contraction axis) made outside a ``jax.shard_map`` and fed
  to ``jax.lax.ragged_dot`` inside it, on one device and split along the expert axis over two: held bitwise;
  one weight scale shared by all experts fails, naming the site. The same inside ``jax.checkpoint``, a nested
  ``jax.jit``, a ``custom_vjp``, a while loop's body and a cond's branches, and for an einsum over per-expert
  weights inside ``jax.lax.scan``;
* qwix's asymmetric int8 (``int8_qwix_minmax``): codes and zero points made outside a scan or a shard_map, or
  only the zero point, added inside before the rounding; a floored zero point fails on both matmuls;
* the reverse: codes made inside a body (per iteration, per shard) and multiplied after it;
* codes split along their contraction axis over the shards are held whole, as their quantizer made them (a
  shard's slice held alone would be a false alarm); the codes' scale shared across columns still fails;
* a caller's codes clipped again inside a body are not the codes its quantizer made: held by type, failing.
"""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import qcheck

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(16, 32)).astype(np.float32))
# Experts' weights whose magnitudes differ per expert: one scale shared across them changes most codes.
WE = jnp.asarray((RNG.normal(size=(4, 32, 24)) * np.array([1, 3, 10, 30])[:, None, None]).astype(np.float32))
INT8 = {"weights": "int8", "activations": "int8"}
SHARED = "they match one scale shared across axis 0 (size 4)"
NOT_INT8 = r"rhs \(weight\): codes are not int8's: \d+ of 3072 codes differ from the referee's"


def _mesh(devices: int) -> Mesh:
    if len(jax.devices()) < devices:
        pytest.skip(f"needs {devices} devices (qcheck's test processes force 8 host devices)")
    return Mesh(np.array(jax.devices()[:devices]), ("expert",))


def _int8(v, axis):
    """int8 codes and their scale, absmax / 127 reduced over ``axis``: qcheck's ``int8`` where ``axis`` is what a
    matmul contracts."""
    scale = jnp.max(jnp.abs(v), axis=axis, keepdims=True) / 127
    return jnp.clip(jnp.round(v / scale), -127, 127).astype(jnp.int8), scale


def _qdq(v, axis):
    codes, scale = _int8(v, axis)
    return codes.astype(jnp.float32) * scale


def _weight_codes(w, shared: bool):
    """Per-expert codes with one scale per expert per output column, or one per column shared by all experts."""
    return _int8(w, (0, 1) if shared else 1)


def fused_moe(x, codes, scale):
    """EasyDeL's fused MoE in small: tokens sorted by expert, one grouped matmul on the dequantized experts."""
    groups = jnp.full((codes.shape[0],), x.shape[0] // codes.shape[0], jnp.int32)
    return jax.lax.ragged_dot(x, codes.astype(jnp.float32) * scale, groups)


def _line(fn, text: str) -> str:
    """``file:line`` of the first line of ``fn`` holding ``text``: how a finding names its site."""
    lines, start = inspect.getsourcelines(fn)
    return f"test_coverage_boundaries.py:{start + next(i for i, line in enumerate(lines) if text in line)}"


def _sharded_moe(devices: int, shared: bool):
    """Codes and scales made outside a shard_map, the grouped matmul inside it; over two devices the tokens, the
    experts and their scales are split along the expert axis (a shared scale is every shard's)."""

    def layer(x, w):
        codes, scale = _weight_codes(w, shared)
        split = P("expert")
        return jax.shard_map(fused_moe, mesh=_mesh(devices), in_specs=(split, split, P() if shared else split),
                             out_specs=split, check_vma=False)(_qdq(x, 1), codes, scale)
    return layer


@pytest.mark.parametrize("devices", [1, 2])
def test_codes_made_outside_a_shard_map_are_held_bitwise_inside_should_pass(devices):
    records = qcheck.assert_quantized(_sharded_moe(devices, False), X, qcheck.weights(WE), declared=INT8)
    assert [(r.primitive, r.lhs_hold.strength, r.rhs_hold.strength) for r in records] == [
        ("ragged_dot_general", "bitwise", "bitwise")]


@pytest.mark.parametrize("devices", [1, 2])
def test_a_weight_scale_shared_by_all_experts_outside_a_shard_map_should_fail_naming_the_site(devices):
    with pytest.raises(AssertionError, match=r"1 of 1 matmuls differ from the declared quantization") as info:
        qcheck.assert_quantized(_sharded_moe(devices, True), X, qcheck.weights(WE), declared=INT8)
    message = str(info.value).replace("\\", "/")
    assert f"ragged_dot_general at " in message and f"{_line(fused_moe, 'ragged_dot')} (fused_moe)" in message
    # The codes are the caller's quantizer's, held whole (no shard named): one quantizer made them.
    assert re.search(NOT_INT8, message) and SHARED in message, message


# -- jax.checkpoint, a nested jax.jit, a custom_vjp, a while loop, a cond: bodies on the caller's values -----

@jax.custom_vjp
def _vjp_moe(x, codes, scale):
    return fused_moe(x, codes, scale)


def _vjp_moe_fwd(x, codes, scale):
    return fused_moe(x, codes, scale), (codes, scale)


def _vjp_moe_bwd(res, g):
    codes, scale = res
    return fused_moe(g, jnp.swapaxes(codes, 1, 2), jnp.swapaxes(scale, 1, 2)), None, None


_vjp_moe.defvjp(_vjp_moe_fwd, _vjp_moe_bwd)

def _while(x, codes, scale):
    """A while loop whose body multiplies the caller's codes (its consts): they are the caller's, whatever the
    iteration, though the loop keeps no value of its own quantizers per iteration."""
    return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, fused_moe(x, codes, scale)),
                              (0, jnp.zeros((x.shape[0], codes.shape[2]), jnp.float32)))[1]


def _cond(x, codes, scale):
    """Both branches multiply the caller's codes: held in each, whichever the inputs take."""
    return jax.lax.cond(x.sum() > 0, fused_moe, lambda *a: -fused_moe(*a), x, codes, scale)


CALLS = {"jax.checkpoint": lambda: jax.checkpoint(fused_moe), "jax.jit": lambda: jax.jit(fused_moe),
         "custom_vjp": lambda: _vjp_moe, "while_loop": lambda: _while, "cond": lambda: _cond}


def _called_moe(call: str, shared: bool):
    def layer(x, w):
        return CALLS[call]()(_qdq(x, 1), *_weight_codes(w, shared))
    return layer


@pytest.mark.parametrize("call", list(CALLS))
def test_codes_made_outside_a_called_body_are_held_bitwise_inside_should_pass(call):
    records = qcheck.assert_quantized(_called_moe(call, False), X, qcheck.weights(WE), declared=INT8)
    assert [(r.lhs_hold.strength, r.rhs_hold.strength) for r in records] == [("bitwise", "bitwise")] * (
        2 if call == "cond" else 1)


@pytest.mark.parametrize("call", list(CALLS))
def test_a_shared_expert_scale_outside_a_called_body_should_fail(call):
    with pytest.raises(AssertionError, match=NOT_INT8) as info:
        qcheck.assert_quantized(_called_moe(call, True), X, qcheck.weights(WE), declared=INT8)
    assert SHARED in str(info.value) and "(fused_moe)" in str(info.value)


# -- an einsum over per-expert weights inside jax.lax.scan ----------------------------------------------------

def experts_einsum(x, codes, scale):
    """The dense MoE path: every expert's tokens ([experts, tokens, k]) against its dequantized weights."""
    return jnp.einsum("etk,ekn->etn", x, codes.astype(jnp.float32) * scale)


def _scanned_experts(shared: bool):
    """Codes made once outside a scan over two steps (a decoder's layers sharing them), the einsum inside."""

    def layer(x, w):
        codes, scale = _weight_codes(w, shared)
        xq = _qdq(x.reshape(4, 4, 32), 2)

        def step(carry, _):
            return carry, experts_einsum(xq, codes, scale)
        return jax.lax.scan(step, 0.0, None, length=2)[1]
    return layer


def test_codes_made_outside_a_scan_are_held_bitwise_by_its_einsum_should_pass():
    records = qcheck.assert_quantized(_scanned_experts(False), X, qcheck.weights(WE), declared=INT8)
    assert [(r.primitive, r.lhs_hold.strength, r.rhs_hold.strength) for r in records] == [
        ("dot_general", "bitwise", "bitwise")]


def test_a_shared_expert_scale_outside_a_scan_should_fail_naming_the_einsum():
    with pytest.raises(AssertionError, match=NOT_INT8) as info:
        qcheck.assert_quantized(_scanned_experts(True), X, qcheck.weights(WE), declared=INT8)
    message = str(info.value).replace("\\", "/")
    assert f"{_line(experts_einsum, 'jnp.einsum')} (experts_einsum)" in message and SHARED in message, message


# -- zero points across a scan and a shard_map (qwix's asymmetric int8) ------------------------------------------

X_ZP = jnp.asarray((np.random.default_rng(4).normal(size=(8, 32)) + 0.5).astype(np.float32))
W_ZP = jnp.asarray(np.random.default_rng(5).normal(size=(32, 16)).astype(np.float32))
MINMAX = {"weights": "int8_qwix", "activations": "int8_qwix_minmax"}
_TINY = float(np.sqrt(np.finfo(np.float32).tiny))


def _minmax_scale(x, floored: bool):
    """qwix 0.1.8's minmax int8 per row: scale (max - min) / 255 (min and max clipped around 0), an int8 zero point
    round(-128 - min / scale); ``floored`` plants floor for the rounding."""
    lo = jnp.minimum(jnp.min(x, axis=1, keepdims=True), 0.0)
    hi = jnp.maximum(jnp.max(x, axis=1, keepdims=True), 0.0)
    scale = (hi - lo) / 255.0
    scale = jnp.where(scale < _TINY, 1.0, scale)
    return (jnp.floor if floored else jnp.round)(-128.0 - lo / scale).astype(jnp.int8), scale


def _minmax_codes(x, zero_point, scale):
    return jnp.round(x / scale + zero_point.astype(jnp.float32)).astype(jnp.int8)


def zero_point_matmuls(codes, zero_point, scale, w_codes, w_scale):
    """qwix's int8 matmul of asymmetric codes: the codes' product, less the zero point's own (its correction)."""
    dims = (([1], [0]), ([], []))
    product = jax.lax.dot_general(codes, w_codes, dims, preferred_element_type=jnp.int32)
    correction = jax.lax.dot_general(jnp.broadcast_to(zero_point, codes.shape), w_codes, dims,
                                     preferred_element_type=jnp.int32)
    return (product - correction).astype(jnp.float32) * scale * w_scale


def _qwix_weight(w):
    scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / 127.5
    scale = jnp.where(scale < _TINY, 1.0, scale)
    return jnp.round(w / scale).astype(jnp.int8), scale


def _in_scan(fn, *args):
    return jax.lax.scan(lambda c, _: (c, fn(*args)), 0.0, None, length=2)[1]


def _in_shard_map(devices: int):
    def run(fn, *args):
        # The activations' rows (and their zero points and scales) split along the mesh; the weight whole.
        specs = tuple(P("expert") if a.shape[0] == X_ZP.shape[0] else P() for a in args)
        return jax.shard_map(fn, mesh=_mesh(devices), in_specs=specs, out_specs=P("expert"),
                             check_vma=False)(*args)
    return run


BODIES = {"scan": lambda: _in_scan, "shard_map": lambda: _in_shard_map(1),
          "shard_map over 2 devices": lambda: _in_shard_map(2)}


def _asymmetric(body: str, made: str, floored: bool):
    """Asymmetric int8 activations whose codes and zero point are made outside the body (``made="outside"``), or
    only the zero point, the codes rounded inside (``made="zero point"``); the two matmuls inside."""

    def layer(x, w):
        zero_point, scale = _minmax_scale(x, floored)
        w_codes, w_scale = _qwix_weight(w)
        if made == "outside":
            return BODIES[body]()(zero_point_matmuls, _minmax_codes(x, zero_point, scale), zero_point, scale,
                                  w_codes, w_scale)

        def inside(x, zero_point, scale, w_codes, w_scale):
            return zero_point_matmuls(_minmax_codes(x, zero_point, scale), zero_point, scale, w_codes, w_scale)
        return BODIES[body]()(inside, x, zero_point, scale, w_codes, w_scale)
    return layer


@pytest.mark.parametrize("made", ["outside", "zero point"])
@pytest.mark.parametrize("body", list(BODIES))
def test_zero_points_made_outside_a_body_are_held_bitwise_inside_should_pass(body, made):
    records = qcheck.assert_quantized(_asymmetric(body, made, False), X_ZP, qcheck.weights(W_ZP), declared=MINMAX)
    # The codes' matmul and the zero point's correction, each operand held bitwise (the zero point to the
    # referee's zero points of the codes' quantizer's input).
    assert [(r.lhs_hold.strength, r.rhs_hold.strength) for r in records] == [("bitwise", "bitwise")] * 2


@pytest.mark.parametrize("made", ["outside", "zero point"])
@pytest.mark.parametrize("body", list(BODIES))
def test_a_floored_zero_point_made_outside_a_body_should_fail_on_both_matmuls(body, made):
    with pytest.raises(AssertionError, match=r"2 of 2 matmuls differ from the declared quantization") as info:
        qcheck.assert_quantized(_asymmetric(body, made, True), X_ZP, qcheck.weights(W_ZP), declared=MINMAX)
    message = str(info.value).replace("\\", "/")
    assert f"{_line(zero_point_matmuls, 'product = ')} (zero_point_matmuls)" in message, message
    assert f"{_line(zero_point_matmuls, 'correction = ')} (zero_point_matmuls)" in message, message
    # Rounded inside a body, the codes and zero points are held run by run, and the run is named.
    run = {"scan": " (iteration 0)", "shard_map": " (shard 0)", "shard_map over 2 devices": " (shard 0)"}[body]
    run = run if made == "zero point" else ""
    assert re.search(rf"lhs \(activation\){re.escape(run)}: codes are not int8_qwix_minmax's", message), message
    assert re.search(rf"lhs \(activation\){re.escape(run)}: zero point is not int8_qwix_minmax's: \d+ of \d+ differ "
                     r"from the referee's", message), message


def test_zero_points_made_inside_a_scan_body_are_held_there_should_pass():
    """Codes, zero points and both matmuls all inside the body: the link is put back with the body's quantizers."""

    def layer(x, w):
        def inside(x, w):
            zero_point, scale = _minmax_scale(x, False)
            return zero_point_matmuls(_minmax_codes(x, zero_point, scale), zero_point, scale, *_qwix_weight(w))
        return _in_scan(inside, x, w)

    records = qcheck.assert_quantized(layer, X_ZP, qcheck.weights(W_ZP), declared=MINMAX)
    assert [(r.lhs_hold.strength, r.rhs_hold.strength) for r in records] == [("bitwise", "bitwise")] * 2


# -- the reverse: codes made inside a body, multiplied after it ------------------------------------------------

def _quantized_per_shard(devices: int, shared: bool):
    """Each shard quantizes its experts (one scale per expert per column, or one shared by the shard's experts);
    the caller multiplies the gathered codes."""

    def quantize(w):
        codes, scale = _int8(w, (0, 1) if shared else 1)
        return codes, jnp.broadcast_to(scale, (w.shape[0], 1, w.shape[2]))

    def layer(x, w):
        codes, scale = jax.shard_map(quantize, mesh=_mesh(devices), in_specs=P("expert"),
                                     out_specs=(P("expert"), P("expert")), check_vma=False)(w)
        return fused_moe(_qdq(x, 1), codes, scale)
    return layer


def _quantized_per_layer(shared: bool):
    """A scan over the experts quantizes one per iteration (the codes its ys); the einsum after the loop."""

    def layer(x, w):
        def step(carry, we):
            return carry, _int8(we, None if shared else 0)
        _, (codes, scale) = jax.lax.scan(step, 0.0, w)
        return experts_einsum(_qdq(x.reshape(4, 4, 32), 2), codes, scale)
    return layer


REVERSE = {"shard_map": lambda shared: _quantized_per_shard(1, shared),
           "shard_map over 2 devices": lambda shared: _quantized_per_shard(2, shared),
           "scan": _quantized_per_layer}


@pytest.mark.parametrize("body", list(REVERSE))
def test_codes_made_inside_a_body_are_held_bitwise_after_it_should_pass(body):
    records = qcheck.assert_quantized(REVERSE[body](False), X, qcheck.weights(WE), declared=INT8)
    assert [(r.lhs_hold.strength, r.rhs_hold.strength) for r in records] == [("bitwise", "bitwise")]


@pytest.mark.parametrize("body", list(REVERSE))
def test_a_shared_scale_made_inside_a_body_should_fail_after_it_naming_the_run(body):
    with pytest.raises(AssertionError, match=r"1 of 1 matmuls differ from the declared quantization") as info:
        qcheck.assert_quantized(REVERSE[body](True), X, qcheck.weights(WE), declared=INT8)
    message = str(info.value)
    run, what = {"shard_map": ("shard 0", SHARED), "shard_map over 2 devices": ("shard 0", "shared across axis 0 "
                                                                                "(size 2)"),
                 "scan": ("iteration 0", "they match one scale for the whole tensor")}[body]
    assert f"rhs (weight) ({run}): codes are not int8's" in message and what in message, message


# -- a split contraction axis, and codes changed inside a body --------------------------------------------------

def partial_product(x, codes, scale):
    return jax.lax.psum(x @ (codes.astype(jnp.float32) * scale), "expert")


def _split_contraction(whole_tensor_scale: bool):
    """A weight quantized per column over all of k outside a shard_map that splits k over two shards and sums
    their partial products: each shard's slice is not a quantization of its own, the caller's whole is."""

    def layer(x, w):
        codes, scale = _int8(w[0], None if whole_tensor_scale else 0)
        return jax.shard_map(partial_product, mesh=_mesh(2), in_specs=(P(None, "expert"), P("expert"), P()),
                             out_specs=P(), check_vma=False)(_qdq(x, 1), codes, scale)
    return layer


def test_codes_split_along_their_contraction_axis_are_held_whole_should_pass():
    records = qcheck.assert_quantized(_split_contraction(False), X, qcheck.weights(WE), declared=INT8)
    assert [(r.lhs_hold.strength, r.rhs_hold.strength) for r in records] == [("bitwise", "bitwise")]


def test_codes_split_along_their_contraction_axis_with_one_scale_for_the_tensor_should_fail():
    with pytest.raises(AssertionError, match=r"rhs \(weight\): codes are not int8's: .*they match one scale for the "
                                             r"whole tensor"):
        qcheck.assert_quantized(_split_contraction(True), X, qcheck.weights(WE), declared=INT8)


def test_a_callers_codes_clipped_again_inside_a_body_are_not_held_bitwise_should_fail():
    """Clipped to ±63 inside the shard_map (fewer levels than int8's), the codes the matmul multiplies are not
    those the caller's quantizer made, nor a quantizer's of the body: held by type, which fails."""

    def clipped(x, codes, scale):
        return fused_moe(x, jnp.clip(codes.astype(jnp.float32), -63, 63), scale)

    def layer(x, w):
        codes, scale = _weight_codes(w, False)
        return jax.shard_map(clipped, mesh=_mesh(1), in_specs=P(), out_specs=P(), check_vma=False)(
            _qdq(x, 1), codes, scale)

    with pytest.raises(AssertionError, match=r"rhs \(weight\) held by its type only, not bitwise as int8 fixes its "
                                             r"bits: its codes do not trace back to a quantizer"):
        qcheck.assert_quantized(layer, X, qcheck.weights(WE), declared=INT8)
