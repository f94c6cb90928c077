"""The block formats as NVIDIA and OCP define them: NVFP4 (e2m1 in blocks of 16) and MXFP8 (e4m3 in blocks of 32).

NVFP4: float4_e2m1fn elements in blocks of 16 along the contraction axis, a
float8_e4m3fn scale per block, a float32 scale per tensor. MXFP8 (OCP
Microscaling v1.0): float8_e4m3fn elements in blocks of 32 along the contraction
axes, one float8_e8m0fnu (power of two) scale per block. An MXFP8 block whose
amax is below 2^-119 takes the clamped scale 2^-127 and does not reach 448.
XLA on CPU reads subnormal float32 as zero, so a subnormal x comes back 0 there
(a block of them is an all-zero block: scale 2^-127).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from qcheck.formats._blocks import to_blocks
from qcheck.formats._elements import (E2M1_MAX, E4M3_EMAX, E4M3_MAX, E8M0_MAX_EXP, E8M0_MIN_EXP, pow2, round_e2m1,
                                      saturating_cast, stochastic_round_e2m1)
from qcheck.formats._quantized import Codes, Quantized
from qcheck.formats._record import Format

NVFP4_BLOCK = 16
MX_BLOCK = 32
#: Below this tensor amax the NVFP4 tensor scale 6·448/amax would overflow float32.
NVFP4_MIN_AMAX = float(E2M1_MAX * E4M3_MAX / np.finfo(np.float32).max)
#: Named exclusion, measured on XLA CPU (jax 0.10.2): under jax.jit, XLA's
#: algebraic simplifier rewrites NVFP4's decode ``code · (1 / (s_enc / s_block))``
#: (the order qcheck documents, and eager execution computes bit for bit) into
#: ``code · (s_block / s_enc)`` for qdq alone in a program (bitwise on 200 random
#: tensors spanning 2^±90, up to 2 ulps from the documented order), and into other
#: orders when more shares the program (nvfp4_quantize warns of it).
#: Only the jitted nvfp4 qdq output may differ, by at most this many float32
#: ulps; codes and scales are always bitwise, and ``jit=False`` is bitwise.
NVFP4_JIT_DECODE_ULPS = 2


def _nvfp4_decode(s_block: Array, s_enc: Array) -> tuple[Array, Array, Array]:
    """``(nonzero, encode, decode)`` per block from the e4m3 block scales ``[..., n_blocks, 1]``."""
    # Shared by quantize and dequantize so that dequantize recomputes encode from
    # the stored scales by the very same operations (s_enc / s_block, then
    # 1 / encode) and so matches qdq bit for bit; q · (block / tensor), the
    # textbook order, differs by an ulp.
    s_block = s_block.astype(jnp.float32)
    nonzero = s_block > 0
    encode = jnp.broadcast_to(s_enc, s_block.shape) / jnp.where(nonzero, s_block, 1.0)
    decode = jnp.ones_like(encode) / encode
    return nonzero, encode, decode


def nvfp4_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # XLA rewrites a division by a broadcast operand into a multiplication by its
    # reciprocal (one ulp off: 2688 / 448 -> 6.0000005), so every division here is
    # scalar/scalar or has a per-block divisor, and exact scales stay exact. Under
    # jit, fusion may still move a result by one ulp against eager execution.
    blocks, restore = to_blocks(x.astype(jnp.float32), axes, fmt.block, fmt.name)
    amax = jnp.max(jnp.abs(blocks))
    # Per-tensor encode scale maps the global amax onto e2m1 max × e4m3 max. A
    # tensor so small that this scale overflows float32 is flushed to zero: its
    # block scales are zero (they would round to zero in e4m3 anyway).
    representable = amax > NVFP4_MIN_AMAX
    s_enc = jnp.where(representable, jnp.float32(E2M1_MAX * E4M3_MAX) / amax, jnp.float32(1.0))
    block_amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    s_block = saturating_cast(block_amax * (s_enc / E2M1_MAX), fmt.scales["block"])
    s_block = jnp.where(representable, s_block, jnp.zeros_like(s_block))
    nonzero, encode, _ = _nvfp4_decode(s_block, s_enc)
    v = jnp.clip(blocks * encode, -E2M1_MAX, E2M1_MAX)
    q = round_e2m1(v) if rng is None else stochastic_round_e2m1(v, rng)
    # The e2m1 values as float32; quantize stores them as float4_e2m1fn (exact).
    codes = restore(jnp.where(nonzero, q, jnp.zeros_like(q)))
    return codes, {"block": s_block[..., 0], "tensor": s_enc}


def nvfp4_dequantize(q: Quantized, fmt: Format) -> Array:
    blocks, restore = to_blocks(q.codes.astype(jnp.float32), q.axis, fmt.block, fmt.name)
    nonzero, _, decode = _nvfp4_decode(q.scales["block"][..., None], q.scales["tensor"])
    return restore(jnp.where(nonzero, blocks * decode, 0.0)).astype(q.dtype)


def mxfp8_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    blocks, restore = to_blocks(x.astype(jnp.float32), axes, fmt.block, fmt.name)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    # floor(log2 amax) exactly: amax = m · 2^e with m in [0.5, 1). A zero block
    # (or a subnormal one, which XLA on CPU reads as zero anyway) takes the
    # smallest scale, as log2(0) = -inf clamped to the e8m0 range would.
    _, e = jnp.frexp(amax)
    normal = amax >= np.finfo(np.float32).tiny
    exp = jnp.where(normal, jnp.clip(e - 1 - E4M3_EMAX, E8M0_MIN_EXP, E8M0_MAX_EXP), E8M0_MIN_EXP)
    # Divide by multiplying by 2^-exp, exact: a float32 amax is below 2^128, so
    # exp <= 119 and 2^-exp lies in [2^-119, 2^127], normal.
    codes = saturating_cast(blocks * pow2(-exp), fmt.element)
    bits = (exp - E8M0_MIN_EXP).astype(jnp.uint8)
    return restore(codes), {"block": jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)[..., 0]}


def e8m0_block_dequantize(q: Quantized, fmt: Format) -> Array:
    """Codes times their block's e8m0 scale, in float32 (MXFP8, and JAX's CPU lowering of its mxfp8)."""
    blocks, restore = to_blocks(q.codes.astype(jnp.float32), q.axis, fmt.block, fmt.name)
    bits = jax.lax.bitcast_convert_type(q.scales["block"], jnp.uint8)[..., None]
    exp = bits.astype(jnp.int32) + E8M0_MIN_EXP
    # The smallest e8m0 scale, 2^-127, is subnormal in float32 and XLA on CPU
    # would flush it to zero, so the scale is applied in two normal halves. Each
    # product is exact; only a result below 2^-126 (a subnormal x) flushes.
    half = exp // 2
    return restore(blocks * pow2(half) * pow2(exp - half)).astype(q.dtype)
