"""The int8 formats: symmetric absmax per slice along the contraction axes, as qcheck, AQT, qwix and Keras compute
it, and qwix's asymmetric minmax int8, whose codes carry a zero point per slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from qcheck.formats._quantized import Codes, Quantized
from qcheck.formats._record import Format

INT8_MAX = 127
#: AQT v2's default int8 (``preserve_max_val=False``) and qwix's int8 both map a
#: slice's absmax onto the edge of the last int8 bucket, 127.5, not onto 127.
INT8_EDGE = 127.5
#: Keras's ``backend.epsilon()`` (keras 3.15.1), which ``abs_max_quantize`` adds to a slice's absmax.
KERAS_EPSILON = 1e-7


def int8_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # absmax/127, which is AQT v2 with preserve_max_val=True (not AQT's default,
    # absmax/127.5: see int8_aqt): symmetric, scale from the absolute max over the
    # contraction axes, round half to even, clip to ±127. An all-zero slice keeps scale 1 so
    # zeros stay zeros instead of becoming NaN. Arithmetic stays in x's dtype; the
    # scale is stored widened, which is exact.
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    # Test the scale, not amax: XLA on CPU flushes subnormals, so a slice whose
    # amax/127 is subnormal would otherwise divide by zero and come back NaN.
    scale = amax / INT8_MAX
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    codes = jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX)
    return codes.astype(jnp.int8), {"slice": scale.astype(jnp.promote_types(x.dtype, jnp.float32))}


def int8_aqt_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # AQT v2's default int8 (aqtp 0.9.0: quantizer_make(8), as config_v4 builds
    # it), op for op: AbsMaxCalibration turns an all-zero absmax into 1, the scale
    # is absmax / 127.5 (IntSymmetric with preserve_zero and not preserve_max_val),
    # QTensor.quant multiplies by reciprocal(scale), an infinite reciprocal (a
    # scale flushed to zero) becoming 1, then IntSymmetric clips to ±127 and
    # rounds half to even. The same operations, so XLA rewrites them alike.
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    amax = jnp.where(amax == 0, jnp.ones_like(amax), amax)
    scale = amax / INT8_EDGE
    inv = jax.lax.reciprocal(scale)
    inv = jnp.where(jnp.isinf(inv), jnp.ones_like(inv), inv)
    codes = jax.lax.round(jnp.clip(x * inv, -INT8_MAX, INT8_MAX), jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    return codes.astype(jnp.int8), {"slice": scale.astype(jnp.promote_types(x.dtype, jnp.float32))}


def int8_qwix_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # qwix 0.1.8's int8 (qarray.quantize, absmax calibration), op for op: scale
    # absmax / 127.5 (get_symmetric_bound: iinfo.max + 0.5), a scale below
    # sqrt(finfo.tiny) (2^-63 in float32: a slice with absmax below about 1.4e-17
    # comes back zero) replaced by 1, x / scale rounded half to even, then a
    # saturating cast: codes in [-128, 127], so -absmax -> -128 but +absmax -> 127.
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = amax / INT8_EDGE
    scale = jnp.where(scale < float(jnp.finfo(x.dtype).tiny) ** 0.5, jnp.ones_like(scale), scale)
    codes = jnp.clip(jnp.round(x / scale), -INT8_MAX - 1, INT8_MAX)
    return codes.astype(jnp.int8), {"slice": scale.astype(jnp.promote_types(x.dtype, jnp.float32))}


#: qwix's asymmetric int8 range (numerics.get_asymmetric_bound(int8): (-128.0, 127.0)); a slice's span maps
#: onto its 255 steps.
INT8_MIN = -128
INT8_STEPS = 255.0


def int8_qwix_minmax_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # qwix 0.1.8's minmax int8 (calibration_method="minmax"), op for op: qarray.py calibrate (the slice's min and
    # max, clipped so min <= 0 <= max, "so that 0 can be accurately quantized"), compute_scale_zero_point (scale
    # (max - min) / (127 - -128), a scale below sqrt(finfo.tiny) replaced by 1, zero point -128 - min / scale
    # rounded half to even and cast to int8: convert_to), quantize_with_scale_zero_point (x / scale plus the
    # zero point as a float, rounded half to even, a saturating cast). x ≈ (codes - zero_point) · scale; an
    # all-zero slice has scale 1, zero point -128 and codes -128.
    lo = jnp.minimum(jnp.min(x, axis=axes, keepdims=True), 0)
    hi = jnp.maximum(jnp.max(x, axis=axes, keepdims=True), 0)
    scale = (hi - lo) / INT8_STEPS
    scale = jnp.where(scale < float(jnp.finfo(x.dtype).tiny) ** 0.5, jnp.ones_like(scale), scale)
    zero_point = jnp.clip(jnp.round(INT8_MIN - lo / scale), INT8_MIN, INT8_MAX).astype(jnp.int8)
    codes = jnp.clip(jnp.round(x / scale + zero_point.astype(x.dtype)), INT8_MIN, INT8_MAX)
    return codes.astype(jnp.int8), {"slice": scale.astype(jnp.promote_types(x.dtype, jnp.float32)),
                                    "zero_point": zero_point}


def int8_zero_point_dequantize(q: Quantized, fmt: Format) -> Array:
    # qwix's dequantize: the codes and the zero point as floats of the scale's type, subtracted (exact: both are
    # integers within ±255), times the scale: one rounding, as qwix's.
    scale = q.scales["slice"]
    return ((q.codes.astype(scale.dtype) - q.scales["zero_point"].astype(scale.dtype)) * scale).astype(q.dtype)


def int8_keras_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # Keras 3.15.1's int8 (keras/src/quantizers/quantizers.py, abs_max_quantize, value_range (-127, 127)),
    # op for op: an encode scale 127 / (absmax + epsilon) in x's dtype, x · scale rounded half to even,
    # clipped to ±127. The epsilon keeps an all-zero slice finite (scale 1.27e9, codes 0) and makes a slice of
    # small values (absmax near 1e-5) reach fewer codes than ±127. The stored scale is Keras's: x ≈ codes / scale.
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.divide(INT8_MAX, amax + KERAS_EPSILON).astype(x.dtype)
    codes = jnp.clip(jnp.round(x * scale), -INT8_MAX, INT8_MAX)
    return codes.astype(jnp.int8), {"slice": scale.astype(jnp.promote_types(x.dtype, jnp.float32))}


def int8_keras_dequantize(q: Quantized, fmt: Format) -> Array:
    # Keras divides by its encode scale (Dense's int8 call: the product over inputs_scale · kernel_scale). XLA
    # computes a division by a broadcast operand as a product with its reciprocal, and where it sees the scale's
    # own division (127 / (absmax + eps)) in the same program it reorders the two; the barrier keeps the first
    # rewrite only, so qdq's bits are code · float32(1 / scale) in every program (the referee's xla_reciprocal).
    scale = jax.lax.optimization_barrier(q.scales["slice"])
    return (q.codes.astype(scale.dtype) / scale).astype(q.dtype)


def int8_dequantize(q: Quantized, fmt: Format) -> Array:
    # codes (7 bits) × scale (at most 24) is exact in float32, so the one rounding
    # is to q.dtype: the same bits as multiplying in x's dtype. int8 has no
    # negative zero, so a negative value that rounds to code 0 comes back +0.0.
    scale = q.scales["slice"]
    return (q.codes.astype(scale.dtype) * scale).astype(q.dtype)
