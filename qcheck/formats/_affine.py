"""EasyDeL's affine int8 (``int8_easydel``): ejkernel's ``quantize(mode="affine", bits=8)``, unsigned codes with a
float16 scale and a float16 (fractional) zero point per group."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from qcheck.formats._int4 import zero_padded_groups
from qcheck.formats._quantized import Codes, Quantized
from qcheck.formats._record import Format

#: ejkernel's affine 8-bit codes, 0..2^8 - 1 (quantizations.py _quantize_affine: qmax = 2**bits - 1).
AFFINE_QMAX = 255
#: EasyDeL's default INT8 group (easydel/layers/quantization/_configs.py resolve_ejkernel_quant_params: 64).
EASYDEL_GROUP = 64


def int8_easydel_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # ejkernel 0.0.78's _quantize_affine (ejkernel/quantization/_quants/quantizations.py), as EasyDeL 0.3.0's
    # QuantizationConfig(dtype=INT8) reaches it (bits 8, mode "affine"), op for op in x's dtype: each group's max
    # and min (not clipped around 0), scale (max - min) / 255 (0 replaced by 1), zero point -min / scale (a
    # fraction: never rounded), codes round(x / scale + zero point) half to even, clipped to 0..255. The codes are
    # computed with the float32 scale and zero point; both are then stored float16 (QuantRuntimeConfig's
    # affine_metadata_dtype, "fp16" off TPU), which is what dequantization reads. EasyDeL groups a kernel
    # (in, out) along its output axis (prepack_quantized_weights(transpose=False): axis "col"), so ``axes`` is the
    # output axis there. ejkernel refuses an axis its group does not divide; here a last partial group is
    # zero-padded (qcheck's choice, as int4_keras_grouped's). XLA may compute (max - min) / 255 as a product with
    # float32(1 / 255) (under jit; eager it divides) and x / scale by its reciprocal: the record's forms.
    groups, restore = zero_padded_groups(x, axes, fmt.block)
    # IEEE leaves open which of -0 and +0 is the min of a group holding both (XLA and numpy part on it); +0 here and
    # in the referee, so a zero min's zero point is -0, as ejkernel's is on a group of +0s.
    lo = jnp.min(groups, axis=-1, keepdims=True)
    lo = jnp.where(lo == 0, jnp.zeros_like(lo), lo)
    hi = jnp.max(groups, axis=-1, keepdims=True)
    scale = (hi - lo) / AFFINE_QMAX
    scale = jnp.where(scale == 0, jnp.ones_like(scale), scale)
    zero = -lo / scale
    codes = jnp.clip(jnp.round(groups / scale + zero), 0, AFFINE_QMAX)
    return restore(codes).astype(jnp.uint8), {"block": scale[..., 0].astype(jnp.float16),
                                              "zero_point": zero[..., 0].astype(jnp.float16)}


def int8_easydel_dequantize(q: Quantized, fmt: Format) -> Array:
    # (codes - zero point) · scale, from the float16 scale and zero point, in float32 (the difference is exact:
    # an integer 0..255 and a float16; the product rounds once). ejkernel's own dequantize computes this in its
    # runtime's compute type, float16 off TPU (bfloat16 on TPU), one more rounding per step.
    scale = q.scales["block"].astype(jnp.promote_types(q.dtype, jnp.float32))
    groups, restore = zero_padded_groups(q.codes.astype(scale.dtype), q.axis, fmt.block)
    out = (groups - q.scales["zero_point"].astype(scale.dtype)[..., None]) * scale[..., None]
    return restore(out).astype(q.dtype)
