"""The int4 formats: Keras's ``quantize("int4")`` kernel codes, symmetric per slice along the contraction axes
(``int4_keras``) or, Keras's default, asymmetric per group of 128 along them (``int4_keras_grouped``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from qcheck.formats._int8 import KERAS_EPSILON
from qcheck.formats._quantized import Codes, Quantized
from qcheck.formats._record import Format

#: Keras's int4 value range, ``AbsMaxQuantizer(value_range=(-8, 7))`` (keras 3.15.1, dense.py:1063-1072).
INT4_MIN, INT4_MAX = -8, 7


def int4_keras_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # Keras 3.15.1's per-channel int4 (Int4QuantizationConfig(block_size=None or -1): dense.py:1061-1074, the
    # kernel through abs_max_quantize with value_range (-8, 7); keras/src/quantizers/quantizers.py:67-119), op for
    # op: an encode scale 7 / (absmax + epsilon) in x's dtype, x · scale rounded half to even, clipped to [-8, 7].
    # x · scale stays below 7 in magnitude, so the codes are -7..7 and -8 is never reached. Keras stores them in
    # int8 and packs two per byte (pack_int4); qcheck's codes are their value set, ml_dtypes.int4.
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.divide(INT4_MAX, amax + KERAS_EPSILON).astype(x.dtype)
    codes = jnp.clip(jnp.round(x * scale), INT4_MIN, INT4_MAX)
    return codes.astype(jnp.int4), {"slice": scale.astype(jnp.promote_types(x.dtype, jnp.float32))}


#: Keras's default int4 group: ``Int4QuantizationConfig(block_size=128)`` (keras 3.15.1,
#: keras/src/quantizers/quantization_config.py:113), 128 inputs per scale and zero point.
KERAS_INT4_GROUP = 128
#: The int4 code steps a group's [min, max] spans: 7 - (-8).
INT4_STEPS = INT4_MAX - INT4_MIN


def zero_padded_groups(x: Array, axes: tuple[int, ...], group: int):
    """``x`` with ``axes`` moved last, flattened, zero-padded to whole groups: ``[..., n_groups, group]``, plus the
    inverse (which drops the padding). Keras pads a last partial group with zero rows (quantizers.py:197-205)."""
    rest = [a for a in range(x.ndim) if a not in axes]
    moved = jnp.transpose(x, (*rest, *axes))
    lead = moved.shape[: len(rest)]
    k = math.prod(moved.shape[len(rest):])
    n = -(-k // group)
    flat = jnp.pad(moved.reshape(*lead, k), [(0, 0)] * len(lead) + [(0, n * group - k)])

    def restore(y: Array) -> Array:
        y = y.reshape(*lead, n * group)[..., :k]
        return jnp.transpose(y.reshape(moved.shape), np.argsort((*rest, *axes)))

    return flat.reshape(*lead, n, group), restore


def int4_keras_grouped_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # Keras 3.15.1's default int4 (Int4QuantizationConfig(block_size=128)): Dense/EinsumDense.quantize call
    # abs_max_quantize_grouped_with_zero_point(kernel, block_size, to_numpy=True) (dense.py:1080,
    # einsum_dense.py:1325), whose numpy path (quantizers.py:182-234) is, op for op in x's dtype: the contraction
    # axis zero-padded to whole groups, each group's min and max (the padding's zeros included, so a last
    # partial group's range always holds 0; a full group's need not), scale ((max - min) + 1e-7) / 15, zero point
    # round(-min / scale) - 8 clipped to [-8, 7] (stored int8), codes round(x / scale) + zero point clipped to
    # [-8, 7] (rounding half to even). x ≈ (codes - zero point) · scale (dequantize_with_sz_map). A group of one
    # sign far from 0 (min > 0, say) clips its zero point to -8 and its codes saturate at 7: Keras's rule, kept.
    # XLA rewrites a division by a constant or by a broadcast operand as a product with its reciprocal (one
    # more rounding: the scale comes out an ulp off numpy's); the barriers hand it operands it cannot see
    # through, so each quotient is numpy's one correctly rounded division.
    groups, restore = zero_padded_groups(x, axes, fmt.block)
    lo = jnp.min(groups, axis=-1, keepdims=True)
    hi = jnp.max(groups, axis=-1, keepdims=True)
    steps = jax.lax.optimization_barrier(jnp.full(lo.shape, INT4_STEPS, x.dtype))
    # The barrier on the scale too: XLA rewrites -lo / (span / 15) as (-lo · 15) / span, which overflows to inf
    # for a span near float32's max (a zero point of 7 where Keras's is 0) and moves an ulp elsewhere.
    scale = jax.lax.optimization_barrier(((hi - lo) + jnp.asarray(KERAS_EPSILON, x.dtype)) / steps)
    zero = jnp.clip(jnp.round(-lo / scale) + INT4_MIN, INT4_MIN, INT4_MAX)
    wide = jax.lax.optimization_barrier(jnp.broadcast_to(scale, groups.shape))
    codes = jnp.clip(jnp.round(groups / wide) + zero, INT4_MIN, INT4_MAX)
    return restore(codes).astype(jnp.int4), {"block": scale[..., 0].astype(jnp.promote_types(x.dtype, jnp.float32)),
                                             "zero_point": zero[..., 0].astype(jnp.int8)}


def int4_zero_point_dequantize(q: Quantized, fmt: Format) -> Array:
    # Keras's dequantize_with_sz_map (quantizers.py:1196-1240): the codes minus their group's zero point as
    # floats of the scale's type (exact: integers within ±15), times the group's scale: one rounding.
    scale = q.scales["block"]
    groups, restore = zero_padded_groups(q.codes.astype(scale.dtype), q.axis, fmt.block)
    out = (groups - q.scales["zero_point"].astype(scale.dtype)[..., None]) * scale[..., None]
    return restore(out).astype(q.dtype)
