"""``x`` in a format: its element codes and its scales, each in its storage type."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax import Array


@dataclasses.dataclass(frozen=True)
class Quantized:
    """``x`` in a format: the element codes and the scales, each in its storage type.

    ``codes`` has ``x``'s shape, in the format's element type (``Format.element``):
    int8 for the int8 formats, the float8 type for the fp8, current-scaled and
    ``mxfp8`` formats, float4_e2m1fn for ``nvfp4``. ``scales`` by format (a block
    format's ``[..., n_blocks]`` is the non-contraction axes of ``x`` in order,
    then one entry per block along the flattened contraction axes):

    - ``int8``, ``int8_aqt``, ``int8_qwix``: ``"slice"``, float32 (float64
      for a float64 ``x``), ``x``'s shape with ``axis`` kept as 1:
      x ≈ codes · slice.
    - ``int8_keras``: ``"slice"`` as above, but Keras's encode scale
      127 / (absmax + 1e-7): x ≈ codes / slice.
    - ``int8_qwix_minmax``: ``"slice"`` as for ``int8_qwix`` ((max - min) / 255), and
      ``"zero_point"``, int8, the same shape: x ≈ (codes - zero_point) · slice.
    - ``int4_keras_grouped``: ``"block"``, float32 ``[..., n_groups]`` (groups of 128, a last partial group
      counted: Keras zero-pads it), and ``"zero_point"``, int8, the same shape: x ≈ (codes - zero_point) · block.
    - fp8 formats: none (scale 1).
    - ``*_current``: ``"tensor"``, a float32 scalar, the encode scale
      fmax / amax: x ≈ codes · (1 / tensor).
    - ``nvfp4``: ``"block"``, float8_e4m3fn ``[..., n_blocks]``, and
      ``"tensor"``, a float32 scalar, the encode scale 6 · 448 / amax:
      x ≈ codes · block / tensor. A flushed block has block scale 0.
    - ``mxfp8``, ``mxfp8_jax``: ``"block"``, float8_e8m0fnu ``[..., n_blocks]``: x ≈ codes · block.
    - ``nvfp4_jax``: ``"block"``, float8_e4m3fn ``[..., n_blocks]``, and
      ``"tensor"``, the float32 global scale (a power of two, the decode
      scale): x ≈ codes · block · tensor.

    ``axis`` is the normalized contraction axes; ``dtype`` is ``x``'s dtype,
    which :func:`~qcheck.formats.dequantize` returns. A pytree, so it crosses ``jax.jit``.
    """

    format: str
    codes: Array
    scales: dict[str, Array]
    axis: tuple[int, ...]
    dtype: np.dtype


jax.tree_util.register_dataclass(Quantized, data_fields=["codes", "scales"], meta_fields=["format", "axis", "dtype"])

#: What a format's quantizer returns: the codes and the named scales.
Codes = tuple[Array, dict[str, Array]]
