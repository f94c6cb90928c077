"""Number formats: saturating casts and quantize→dequantize (qdq) in a named format.

Everything here is plain ``jax.numpy`` on top of ml_dtypes types, so a user can
check values against a format without building a layer. The fp8 formats are the
raw element types at scale 1 — exactly what a freshly built delayed-scaling fp8
layer applies — and saturate, unlike a bare ``astype`` (ml_dtypes turns e4m3fn
overflow into NaN).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import Array
from jax.typing import ArrayLike

__all__ = [
    "E2M1_GRID",
    "FP8_DTYPES",
    "NVFP4_BLOCK",
    "format_names",
    "qdq",
    "saturating_cast",
    "stochastic_round_e2m1",
]

#: fp8 element types qcheck knows, by the name ml_dtypes gives them.
FP8_DTYPES: dict[str, np.dtype] = {
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
}

INT8_MAX = 127

# Format name -> fp8 element type; int8 is handled separately (it needs a scale).
_FP8_FORMATS: dict[str, np.dtype] = {
    "e4m3fn": FP8_DTYPES["float8_e4m3fn"],
    "e4m3fnuz": FP8_DTYPES["float8_e4m3fnuz"],
    "e5m2": FP8_DTYPES["float8_e5m2"],
    "e5m2fnuz": FP8_DTYPES["float8_e5m2fnuz"],
}


#: NVFP4 (NVIDIA): float4_e2m1fn elements in blocks of 16 along the contraction
#: axis, a float8_e4m3fn scale per block, a float32 scale per tensor.
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: Below this tensor amax the NVFP4 tensor scale 6·448/amax would overflow float32.
NVFP4_MIN_AMAX = float(E2M1_MAX * E4M3_MAX / np.finfo(np.float32).max)
#: The non-negative values of float4_e2m1fn.
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)

_BLOCK_FORMATS = {"nvfp4": NVFP4_BLOCK}


def format_names() -> tuple[str, ...]:
    """The format names :func:`qdq` accepts."""
    return ("int8", *_FP8_FORMATS, *_BLOCK_FORMATS)


def saturating_cast(x: ArrayLike, dtype: np.dtype | type) -> Array:
    """Clip ``x`` to ±finfo(dtype).max, then round to ``dtype`` (nearest even)."""
    dtype = np.dtype(dtype)
    x = jnp.asarray(x)
    bound = float(ml_dtypes.finfo(dtype).max)
    return jnp.clip(x, -bound, bound).astype(dtype)


def _int8_qdq(x: Array, axis: int | tuple[int, ...]) -> Array:
    # AQT's default: symmetric, scale from the absolute max over the contraction
    # axes, round half to even, clip to ±127. An all-zero slice keeps scale 1 so
    # zeros stay zeros instead of becoming NaN.
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    # Test the scale, not amax: XLA on CPU flushes subnormals, so a slice whose
    # amax/127 is subnormal would otherwise divide by zero and come back NaN.
    scale = amax / INT8_MAX
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    codes = jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX)
    return (codes * scale).astype(x.dtype)


def _normalize_axis(axis: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for an array of rank {ndim}")
        out.append(a % ndim)
    return tuple(sorted(set(out)))


def _to_blocks(x: Array, axes: tuple[int, ...], block: int, fmt: str):
    """Move ``axes`` last and flatten them into blocks: ``[..., n_blocks, block]``, plus the inverse."""
    rest = [a for a in range(x.ndim) if a not in axes]
    moved = jnp.transpose(x, (*rest, *axes))
    lead = moved.shape[: len(rest)]
    k = math.prod(moved.shape[len(rest):])
    if k % block:
        where = (f"axis {axes[0]} has {k} elements" if len(axes) == 1 else
                 f"axes {axes} have {' x '.join(str(x.shape[a]) for a in axes)} = {k} elements")
        raise ValueError(
            f"{fmt} needs whole blocks of {block} along the contraction axis, but {where}, "
            f"which is not a multiple of {block}"
        )
    blocks = moved.reshape(*lead, k // block, block)

    def restore(y: Array) -> Array:
        return jnp.transpose(y.reshape(moved.shape), np.argsort((*rest, *axes)))

    return blocks, restore


def stochastic_round_e2m1(v: Array, key: Array) -> Array:
    """Round ``v`` (already in e2m1 units, |v| <= 6) to one of its two neighbours on the e2m1 grid.

    The upper neighbour is chosen with probability (|v| - lo) / (hi - lo), so the
    rounding is unbiased: E[result] = v.
    """
    grid = jnp.asarray(E2M1_GRID)
    a = jnp.minimum(jnp.abs(v), E2M1_MAX)
    lo_i = jnp.clip(jnp.searchsorted(grid, a, side="right") - 1, 0, grid.size - 1)
    lo, hi = grid[lo_i], grid[jnp.minimum(lo_i + 1, grid.size - 1)]
    p_up = jnp.where(hi > lo, (a - lo) / jnp.where(hi > lo, hi - lo, 1.0), 0.0)
    u = jax.random.uniform(key, v.shape, jnp.float32)
    return jnp.sign(v) * jnp.where(u < p_up, hi, lo)


def _nvfp4_qdq(x: Array, axes: tuple[int, ...], rng: Array | None) -> Array:
    # XLA rewrites a division by a broadcast operand into a multiplication by its
    # reciprocal (one ulp off: 2688 / 448 -> 6.0000005), so every division here is
    # scalar/scalar or has a per-block divisor, and exact scales stay exact. Under
    # jit, fusion may still move a result by one ulp against eager execution.
    blocks, restore = _to_blocks(x.astype(jnp.float32), axes, NVFP4_BLOCK, "nvfp4")
    amax = jnp.max(jnp.abs(blocks))
    # Per-tensor encode scale maps the global amax onto e2m1 max × e4m3 max. A
    # tensor so small that this scale overflows float32 is flushed to zero.
    representable = amax > NVFP4_MIN_AMAX
    s_enc = jnp.where(representable, jnp.float32(E2M1_MAX * E4M3_MAX) / amax, jnp.float32(1.0))
    block_amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    s_block = saturating_cast(block_amax * (s_enc / E2M1_MAX), _FP8_FORMATS["e4m3fn"]).astype(jnp.float32)
    nonzero = (s_block > 0) & representable
    encode = jnp.broadcast_to(s_enc, s_block.shape) / jnp.where(nonzero, s_block, 1.0)
    v = jnp.clip(blocks * encode, -E2M1_MAX, E2M1_MAX)
    if rng is None:
        q = v.astype(jnp.float4_e2m1fn).astype(jnp.float32)  # round to nearest even
    else:
        q = stochastic_round_e2m1(v, rng)
    decode = jnp.ones_like(encode) / encode
    return restore(jnp.where(nonzero, q * decode, 0.0)).astype(x.dtype)


def qdq(
    x: ArrayLike,
    fmt: str,
    *,
    axis: int | tuple[int, ...] = -1,
    rng: Array | None = None,
) -> Array:
    """Quantize then dequantize ``x`` in format ``fmt``, saturating.

    ``int8`` scales each slice by its absolute max over ``axis`` (the contraction
    axes of the matmul it feeds). The fp8 formats are the element type at scale 1,
    so ``axis`` does not change them. ``nvfp4`` flattens ``axis`` into blocks of
    16 (a ValueError if that is not a whole number of blocks) and rounds to
    nearest even, or stochastically when ``rng`` (a PRNG key) is given. The
    result has ``x``'s dtype.
    """
    if fmt not in format_names():
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(format_names())}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"qdq: x must be a floating-point array, got dtype {x.dtype}")
    axes = _normalize_axis(axis, x.ndim)
    if rng is not None and fmt not in ("nvfp4",):
        raise ValueError(f"format {fmt!r} has no stochastic rounding; only nvfp4 takes rng")
    if fmt == "int8":
        return _int8_qdq(x, axes)
    if fmt == "nvfp4":
        return _nvfp4_qdq(x, axes, rng)
    return saturating_cast(x, _FP8_FORMATS[fmt]).astype(x.dtype)
