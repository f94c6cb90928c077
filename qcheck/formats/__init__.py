"""Number formats: saturating casts, quantize/dequantize with the codes, and qdq in a named format.

Everything here is plain ``jax.numpy`` on top of ml_dtypes types, so a user can
check values against a format without building a layer. Each format is one
:class:`Format` record in :data:`FORMATS` (its kind, element type, block size,
scales and their rule, and its siblings: the formats a bug would compute
instead); the rest is read off the records. The fp8 formats are the
raw element types at scale 1 — exactly what a freshly built delayed-scaling fp8
layer applies — and saturate, unlike a bare ``astype`` (ml_dtypes turns e4m3fn
overflow into NaN). ``e4m3fn_current`` and ``e5m2_current`` scale the whole
tensor by its own amax (TransformerEngine's Float8CurrentScaling); ``nvfp4`` and
``mxfp8`` are block formats. ``int8`` is symmetric absmax/127 (AQT with
``preserve_max_val=True``); ``int8_aqt`` and ``int8_qwix`` are the int8 that
AQT's and qwix's defaults compute, absmax/127.5; ``int8_keras`` is Keras's, an encode scale
127 / (absmax + 1e-7), and ``int4_keras`` its per-channel int4, 7 / (absmax + 1e-7) with codes -8..7 in
ml_dtypes' int4, and ``int4_keras_grouped`` its default int4, a scale and an int8 zero point per group of 128
along the contraction axis; ``int8_qwix_minmax`` is qwix's asymmetric (minmax) int8, a zero point per slice beside
its scale; ``mxfp8_jax`` and ``nvfp4_jax`` are the block formats
``jax.nn.scaled_dot_general`` computes (see :mod:`qcheck.adapters`). :func:`quantize` returns the element codes and the
scales in their storage types, :func:`dequantize` maps them back, and
:func:`qdq` is the one after the other. A user's own format is a record too:
:func:`register_format` (or :func:`registered_formats` for a ``with`` block)
adds it with the user's numpy referee, and every check takes its name.
"""

from __future__ import annotations

from qcheck import _versions

_versions.require_supported()  # before JAX's own import errors can read as qcheck's

from qcheck.formats._block_scaled import MX_BLOCK, NVFP4_BLOCK, NVFP4_MIN_AMAX  # noqa: E402
from qcheck.formats._codec import dequantize, qdq, quantize  # noqa: E402
from qcheck.formats._elements import (E2M1_GRID, E2M1_MAX, E4M3_EMAX, E4M3_MAX, E8M0_MAX_EXP,  # noqa: E402
                                      E8M0_MIN_EXP, round_e2m1, saturating_cast, stochastic_round_e2m1)
from qcheck.formats._fp8 import CURRENT_MAX_SCALE  # noqa: E402
from qcheck.formats._int8 import INT8_EDGE, INT8_MAX  # noqa: E402
from qcheck.formats._jax_rules import NVFP4_RANGE, jax_nvfp4_global_scale  # noqa: E402
from qcheck.formats._quantized import Quantized  # noqa: E402
from qcheck.formats._record import ALL_FORMS, TWO_FORMS, Format  # noqa: E402
from qcheck.formats._registry import register_format, registered_formats  # noqa: E402
from qcheck.formats._table import (AXIS_FORMATS, FORMATS, FP8_DTYPES, FP8_SIBLINGS, block_size,  # noqa: E402
                                   builtin_format_names, cast_format, format_names, get_format)

__all__ = [
    "ALL_FORMS",
    "AXIS_FORMATS",
    "CURRENT_MAX_SCALE",
    "E2M1_GRID",
    "E2M1_MAX",
    "E4M3_EMAX",
    "E4M3_MAX",
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "FORMATS",
    "FP8_DTYPES",
    "FP8_SIBLINGS",
    "INT8_EDGE",
    "INT8_MAX",
    "MX_BLOCK",
    "NVFP4_BLOCK",
    "TWO_FORMS",
    "NVFP4_MIN_AMAX",
    "NVFP4_RANGE",
    "Format",
    "Quantized",
    "block_size",
    "builtin_format_names",
    "cast_format",
    "dequantize",
    "format_names",
    "get_format",
    "jax_nvfp4_global_scale",
    "qdq",
    "quantize",
    "register_format",
    "registered_formats",
    "round_e2m1",
    "saturating_cast",
    "stochastic_round_e2m1",
]
