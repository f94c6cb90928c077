"""Element types: saturating casts, e2m1 rounding, and the constants of the types the formats store."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import Array
from jax.typing import ArrayLike

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: The non-negative values of float4_e2m1fn.
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
#: Exponent of e4m3's largest binade (448 = 1.75 · 2^8): an MXFP8 block's scale is
#: 2^(floor(log2 amax) − 8), so its amax lands in [256, 512) and saturates above 448.
E4M3_EMAX = 8
#: The exponents float8_e8m0fnu encodes (bits 0..254; 255 is NaN).
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


def saturating_cast(x: ArrayLike, dtype: np.dtype | type) -> Array:
    """Clip ``x`` to ±finfo(dtype).max, then round to ``dtype`` (nearest even)."""
    dtype = np.dtype(dtype)
    x = jnp.asarray(x)
    bound = float(ml_dtypes.finfo(dtype).max)
    return jnp.clip(x, -bound, bound).astype(dtype)


def round_e2m1(v: Array) -> Array:
    """``v`` (in e2m1 units, |v| <= 6) rounded to nearest e2m1 value, ties to even, in float32.

    Exactly ``v.astype(float4_e2m1fn).astype(float32)``, without the e2m1 type:
    XLA CPU's legacy fusion emitters (``--xla_cpu_use_fusion_emitters=false``,
    which a user may set) round that conversion the wrong way next to
    midpoints on jaxlib 0.10, so an emulated NVFP4 layer computes the same bits
    under any emitter. The grid's step is 1/2 below 2, 1 below 4 and 2 up to
    6; scaling by a power of two is exact and ``round`` is half to even, so a tie
    goes to the even mantissa (1.75 -> 2, 2.5 -> 2, 5 -> 4).
    """
    a = jnp.abs(v)
    on_grid = jnp.where(a < 2, jnp.round(a * 2) * 0.5, jnp.where(a < 4, jnp.round(a), jnp.round(a * 0.5) * 2))
    return jnp.copysign(on_grid, v)


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


def pow2(e: Array) -> Array:
    """2^e as float32, built from its bits so it is exact; ``e`` must lie in [-126, 127]."""
    return jax.lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)
