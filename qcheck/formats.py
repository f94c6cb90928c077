"""Number formats: saturating casts and quantize→dequantize (qdq) in a named format.

Everything here is plain ``jax.numpy`` on top of ml_dtypes types, so a user can
check values against a format without building a layer. The fp8 formats are the
raw element types at scale 1 — exactly what a freshly built delayed-scaling fp8
layer applies — and saturate, unlike a bare ``astype`` (ml_dtypes turns e4m3fn
overflow into NaN).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import Array
from jax.typing import ArrayLike

__all__ = [
    "FP8_DTYPES",
    "format_names",
    "qdq",
    "saturating_cast",
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


def format_names() -> tuple[str, ...]:
    """The format names :func:`qdq` accepts."""
    return ("int8", *_FP8_FORMATS)


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
    scale = jnp.where(amax > 0, amax / INT8_MAX, jnp.ones_like(amax))
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


def qdq(x: ArrayLike, fmt: str, *, axis: int | tuple[int, ...] = -1) -> Array:
    """Quantize then dequantize ``x`` in format ``fmt``, saturating.

    ``int8`` scales each slice by its absolute max over ``axis`` (the contraction
    axes of the matmul it feeds). The fp8 formats are the element type at scale 1,
    so ``axis`` does not change them. The result has ``x``'s dtype.
    """
    if fmt not in format_names():
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(format_names())}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"qdq: x must be a floating-point array, got dtype {x.dtype}")
    axes = _normalize_axis(axis, x.ndim)
    if fmt == "int8":
        return _int8_qdq(x, axes)
    return saturating_cast(x, _FP8_FORMATS[fmt]).astype(x.dtype)
