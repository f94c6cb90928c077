"""Quantize, dequantize and qdq by format name, each dispatched through the format's record."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from qcheck.formats._blocks import normalize_axis
from qcheck.formats._quantized import Quantized
from qcheck.formats._table import format_names, get_format



def quantize(
    x: ArrayLike,
    fmt: str,
    *,
    axis: int | tuple[int, ...] = -1,
    rng: Array | None = None,
) -> Quantized:
    """``x`` in format ``fmt``: its element codes and scales, saturating (see :class:`Quantized`).

    ``int8`` scales each slice by its absolute max over ``axis`` (the contraction
    axes of the matmul it feeds) / 127, codes ±127 (AQT with
    ``preserve_max_val=True``). ``int8_aqt`` is AQT v2's default int8: absmax /
    127.5, x · (1 / scale) clipped to ±127. ``int8_qwix`` is qwix's: absmax /
    127.5, x / scale with a saturating cast, codes -128..127, and slices whose
    scale is below 2^-63 (float32) come back zero. ``int8_keras`` is Keras's: an encode scale 127 / (absmax
    + 1e-7), x · scale clipped to ±127, so an all-zero slice stays zero and a slice of values near 1e-5
    reaches only ±126. ``int8_qwix_minmax`` is qwix's minmax: (max - min) / 255 per slice over min and max
    clipped around 0, an int8 zero point round(-128 - min / scale), codes round(x / scale + zero point)
    in -128..127. The fp8 formats are the element type at scale 1,
    and the ``*_current`` formats scale the whole tensor by fmax / amax, so
    ``axis`` does not change them. ``nvfp4`` (blocks of 16) and ``mxfp8`` (blocks
    of 32) flatten ``axis`` into blocks, a ValueError if that is not a whole
    number of blocks. ``nvfp4`` rounds to nearest even, or stochastically when
    ``rng`` (a PRNG key) is given; no other format takes ``rng``. ``mxfp8_jax``
    and ``nvfp4_jax`` are JAX's ``scaled_dot_general`` rule: the mxfp8 block
    scale rounded up to 2^ceil(log2(amax / 448)); nvfp4 divided by a
    power-of-two global scale (:func:`jax_nvfp4_global_scale`), then e4m3fn
    block scales amax / 6 and codes x / block.
    """
    q = _quantize(x, fmt, axis, rng)
    element = get_format(fmt).element
    if q.codes.dtype != element:  # nvfp4's e2m1 values, computed as float32
        q = dataclasses.replace(q, codes=q.codes.astype(element))
    return q


def _quantize(x: ArrayLike, fmt: str, axis: int | tuple[int, ...], rng: Array | None) -> Quantized:
    # quantize() without storing nvfp4's codes as e2m1: qdq() leaves the type out
    # of the program (round_e2m1 says why), with the same values.
    record = get_format(fmt)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {x.dtype}")
    axes = normalize_axis(axis, x.ndim)
    if rng is not None and not record.stochastic:
        raise ValueError(f"format {fmt!r} has no stochastic rounding; only {', '.join(f for f in format_names() if get_format(f).stochastic)} takes rng")
    codes, scales = record.quantize(x, axes, record, rng)
    return Quantized(format=fmt, codes=codes, scales=scales, axis=axes, dtype=np.dtype(x.dtype))


def dequantize(q: Quantized) -> Array:
    """The values ``q`` stands for, in the dtype of the array it was quantized from."""
    record = get_format(q.format)
    return record.dequantize(q, record)


def qdq(
    x: ArrayLike,
    fmt: str,
    *,
    axis: int | tuple[int, ...] = -1,
    rng: Array | None = None,
) -> Array:
    """Quantize then dequantize ``x`` in format ``fmt``, saturating: the values of ``dequantize(quantize(x, ...))``.

    See :func:`quantize` for the formats, ``axis`` and ``rng``. The result has
    ``x``'s dtype.
    """
    if isinstance(x, jax.core.Tracer):
        # The record is a static argument too: a plug-in format registered again under its name is another record.
        return _nested_qdq(x, fmt, normalize_axis(axis, x.ndim), rng, get_format(fmt))
    return dequantize(_quantize(x, fmt, axis, rng))


# Inside a trace (a layer's forward pass or train step) qdq is a nested jit, so
# JAX traces it once per format, axes and operand type in a process, however
# many call sites, layers and programs share them: the matrix traces qdq 135
# times instead of 568. XLA inlines the call before it fuses anything, so
# the compiled program and its bits are the same (tests/test_formats.py
# compares the two). Eager calls stay op by op, as eager quantize and dequantize
# are: one fused program can round an NVFP4 value an ulp away from the same
# operations run one by one (see nvfp4_quantize).
@functools.partial(jax.jit, static_argnums=(1, 2, 4))
def _nested_qdq(x: Array, fmt: str, axes: tuple[int, ...], rng: Array | None, record) -> Array:
    return dequantize(_quantize(x, fmt, axes, rng))
