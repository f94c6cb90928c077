"""The block formats ``jax.nn.scaled_dot_general`` computes (jax/_src/cudnn/scaled_matmul_stablehlo.py
``quantize``, the same rule in jax 0.10.2 and 0.12.0.1 for float32 operands)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from qcheck.formats._blocks import to_blocks
from qcheck.formats._elements import E2M1_MAX, E4M3_MAX, E8M0_MAX_EXP, E8M0_MIN_EXP, pow2, round_e2m1, saturating_cast
from qcheck.formats._quantized import Codes, Quantized
from qcheck.formats._record import Format

#: NVFP4's two-level range: e2m1's max times e4m3's max.
NVFP4_RANGE = E2M1_MAX * E4M3_MAX  # 2688


def jax_nvfp4_global_scale(x: ArrayLike) -> Array:
    """The power of two at or above ``max|x| / 2688`` (1 for an all-zero ``x``), a float32 scalar.

    JAX leaves the NVFP4 global scale to the caller (``get_scaled_dot_general_config("nvfp4",
    global_scale)``, default 1); NVIDIA's is ``amax / (6 · 448)``. Rounded up to a power of two, dividing
    by it is exact and JAX's rescaling of the product by both operands' global scales is exact too, so
    the product equals the einsum of the dequantized operands bit for bit. A scalar, not JAX's default
    shape (1,), which ``jax_numpy_rank_promotion="raise"`` refuses to broadcast against the operand. Exact, without a division:
    with amax = m · 2^e (m in [0.5, 1)) and 2688 = 0.65625 · 2^12, the scale is 2^(e - 12) when
    m <= 0.65625, else 2^(e - 11).
    """
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.max(jnp.abs(x))
    m, e = jnp.frexp(amax)
    k = jnp.clip(jnp.where(m <= 0.65625, e - 12, e - 11), E8M0_MIN_EXP + 1, E8M0_MAX_EXP)
    return jnp.where(amax >= np.finfo(np.float32).tiny, pow2(k), jnp.float32(1.0))


def _e8m0_round_up_bits(s: Array) -> Array:
    # JAX's cast_to_e8m0_with_rounding_up, op for op: the float32 exponent, plus one when any mantissa bit
    # is set, except in the top binade (exponent 254) and for subnormals of at most half the smallest normal.
    bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
    exp, mant = bits >> 23, bits & 0x7FFFFF
    up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    return jnp.where(up, exp + 1, exp).astype(jnp.uint8)


def _e8m0_decode(bits: Array) -> Array:
    # JAX's e8m0_to_dtype: the bits as a float32 exponent; bits 0 (2^-127) as the float32 value 2^-127.
    v = jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 23, jnp.float32)
    return jnp.where(v == 0, jnp.float32(2.0**-127), v)


def mxfp8_jax_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # JAX's mxfp8: scale amax / 448 (XLA: times float32(1 / 448)) rounded UP to a power of two, where
    # OCP MX v1.0 takes 2^(floor(log2 amax) - 8); codes x / scale clipped to ±448 and cast to e4m3fn.
    blocks, restore = to_blocks(x.astype(jnp.float32), axes, fmt.block, fmt.name)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    bits = _e8m0_round_up_bits(amax * jnp.float32(1 / E4M3_MAX))
    codes = saturating_cast(blocks / _e8m0_decode(bits), fmt.element)
    return restore(codes), {"block": jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)[..., 0]}


def nvfp4_jax_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # JAX's nvfp4 with qcheck's power-of-two global scale g: x / g, block scale amax_b / 6 (XLA: times
    # float32(1 / 6)) clipped to [0, 448] and cast to e4m3fn, codes (x / g) / block clipped to ±6 and cast
    # to e2m1. One level below the global scale, where qcheck's nvfp4 divides s_enc / s_block first.
    g = jax_nvfp4_global_scale(x)
    blocks, restore = to_blocks(x.astype(jnp.float32) / g, axes, fmt.block, fmt.name)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    s_block = jnp.clip(amax * jnp.float32(1 / E2M1_MAX), 0, E4M3_MAX).astype(jnp.float8_e4m3fn)
    v = jnp.clip(blocks / s_block.astype(jnp.float32), -E2M1_MAX, E2M1_MAX)
    # A block whose scale rounds to 0 divides by 0: ±6, and 0 / 0 (NaN), which XLA's e2m1 cast makes -0.
    v = jnp.where(jnp.isnan(v), jnp.float32(-0.0), v)
    return restore(round_e2m1(v)), {"block": s_block[..., 0], "tensor": g}


def nvfp4_jax_dequantize(q: Quantized, fmt: Format) -> Array:
    # codes times the e4m3 block scale, then the (power-of-two: exact) global scale.
    blocks, restore = to_blocks(q.codes.astype(jnp.float32), q.axis, fmt.block, fmt.name)
    out = blocks * q.scales["block"].astype(jnp.float32)[..., None] * q.scales["tensor"]
    return restore(out).astype(q.dtype)
