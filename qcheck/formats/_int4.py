"""The int4 formats: Keras's ``quantize("int4")`` kernel codes, symmetric per slice along the contraction axes."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from qcheck.formats._int8 import KERAS_EPSILON
from qcheck.formats._quantized import Codes
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
