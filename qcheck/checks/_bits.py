"""Bit patterns: how every exact check compares arrays (never allclose)."""

from __future__ import annotations

import numpy as np
from jax.typing import ArrayLike


def bits(a: ArrayLike) -> np.ndarray:
    """``a``'s elements as unsigned integers of the same width: equal bits, equal integers (NaNs and -0 too)."""
    a = np.ascontiguousarray(a)
    if a.dtype.itemsize not in (1, 2, 4, 8):
        raise ValueError(f"bits: no unsigned integer type of {a.dtype.itemsize} bytes for dtype {a.dtype}")
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def bitwise_equal(a: ArrayLike, b: ArrayLike) -> bool:
    """Same shape, same dtype, same bits."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


def as_float32(x: ArrayLike, what: str) -> np.ndarray:
    """``x`` as a host array, refused (TypeError naming ``what``) unless it is float32 already: no silent cast."""
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise TypeError(f"{what} must be a float32 array, got dtype {a.dtype}")
    return a
