"""The fp8 formats: the element type at scale 1, and current scaling (one scale per tensor from its own amax)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
from jax import Array

from qcheck.formats._elements import saturating_cast
from qcheck.formats._quantized import Codes, Quantized
from qcheck.formats._record import Format

#: Cap on a current-scaled tensor's scale fmax / amax. Uncapped it would overflow
#: float32 for amax below fmax / float32 max (TransformerEngine clamps it to the
#: float32 max there); capped at 2^126 its inverse, the decode scale, stays a
#: normal float32 that XLA on CPU does not flush to zero. A tensor whose amax is
#: below fmax · 2^-126 (about 5e-36 for e4m3fn, 7e-34 for e5m2) so does not
#: reach the format's largest value; it is still quantized, not flushed.
CURRENT_MAX_SCALE = 2.0**126


def cast_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    return saturating_cast(x, fmt.element), {}


def cast_dequantize(q: Quantized, fmt: Format) -> Array:
    return q.codes.astype(q.dtype)


def current_quantize(x: Array, axes: tuple[int, ...], fmt: Format, rng: Array | None) -> Codes:
    # TransformerEngine's Float8CurrentScaling: the scale maps this tensor's own
    # amax (over all of it, whatever the contraction axes) onto the format's max.
    # XLA rewrites a division by a broadcast operand into a multiplication by its
    # reciprocal, so both scale divisions are scalar/scalar.
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    fmax = jnp.float32(ml_dtypes.finfo(fmt.element).max)
    scale = jnp.where(amax > 0, jnp.minimum(fmax / amax, jnp.float32(CURRENT_MAX_SCALE)), jnp.float32(1.0))
    return saturating_cast(x.astype(jnp.float32) * scale, fmt.element), {"tensor": scale}


def current_dequantize(q: Quantized, fmt: Format) -> Array:
    # XLA on CPU flushes a product below 2^-126 to zero, so an x just above
    # float32's smallest normal whose code rounds down may come back 0.
    scale_inv = jnp.float32(1.0) / q.scales["tensor"]
    return (q.codes.astype(jnp.float32) * scale_inv).astype(q.dtype)
