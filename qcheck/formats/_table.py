"""Every number format qcheck knows, one record each: the one place a format is added.

A new format is a :class:`Format` here, with its quantizer (and dequantizer,
where no existing one fits) in the module of its kind, and its independent
reference under the same name in ``qcheck/referees/_formats.py``
(``tests/test_referees.py`` holds the two tables to each other). Everything
else that enumerates formats (the names, the fp8 types and flavours, the
siblings the checks' probes tell apart, the tests' tables, each "unknown
format" error) is read off these records; ``tests/test_layout.py`` finds any
other literal list of format names in qcheck.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from qcheck._choices import require_choice
from qcheck.formats._affine import EASYDEL_GROUP, int8_easydel_dequantize, int8_easydel_quantize
from qcheck.formats._block_scaled import (MX_BLOCK, NVFP4_BLOCK, NVFP4_JIT_DECODE_ULPS, NVFP4_MIN_AMAX,
                                          e8m0_block_dequantize, mxfp8_quantize, nvfp4_dequantize, nvfp4_quantize)
from qcheck.formats._elements import E4M3_EMAX, E4M3_MAX, E8M0_MIN_EXP
from qcheck.formats._fp8 import CURRENT_MAX_SCALE, cast_dequantize, cast_quantize, current_dequantize, current_quantize
from qcheck.formats._int4 import (KERAS_INT4_GROUP, int4_keras_grouped_quantize, int4_keras_quantize,
                                  int4_zero_point_dequantize)
from qcheck.formats._int8 import (INT8_EDGE, int8_aqt_quantize, int8_dequantize, int8_keras_dequantize,
                                  int8_keras_quantize, int8_qwix_minmax_quantize, int8_qwix_quantize, int8_quantize,
                                  int8_zero_point_dequantize)
from qcheck.formats._jax_rules import NVFP4_RANGE, mxfp8_jax_quantize, nvfp4_jax_dequantize, nvfp4_jax_quantize
from qcheck.formats._record import ALL_FORMS, Format

_INT8 = np.dtype(np.int8)
_INT4 = np.dtype(ml_dtypes.int4)
_UINT8 = np.dtype(np.uint8)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
_E4M3FNUZ = np.dtype(ml_dtypes.float8_e4m3fnuz)
_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
_E5M2FNUZ = np.dtype(ml_dtypes.float8_e5m2fnuz)
_E3M4 = np.dtype(ml_dtypes.float8_e3m4)
_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def _int(name: str, rule: str, quantize, siblings: tuple[str, ...], dequantize=int8_dequantize,
         divides: bool = False, guarded_below: float | None = None) -> Format:
    return Format(name, "int", _INT8, None, {"slice": _F32}, rule, siblings, quantize, dequantize, divides=divides,
                  forms=ALL_FORMS, guarded_below=guarded_below)


def _cast(name: str, element: np.dtype, sibling: str, grad: str | None = None,
          parting_binade: tuple[int, int] | None = None) -> Format:
    return Format(name, "cast", element, None, {}, "none: the element type at scale 1, saturating", (sibling,),
                  cast_quantize, cast_dequantize, grad=grad, parting_binade=parting_binade)


# e5m2 and e5m2fnuz share every value from 2^-14 up, their maximum (57344) too, and a saturating cast
# never reaches e5m2's inf; a matmul's sum hides that e5m2fnuz has no -0. They part only where e5m2 is
# subnormal: in [2^-15, 2^-14) e5m2fnuz is normal (1.25 * 2^-15 and 1.75 * 2^-15 are its own values) and
# e5m2 keeps one bit (2^-15, 1.5 * 2^-15), so about half the values there round apart. Those are normal
# float32 values, which XLA's CPU backend does not flush (it flushes float32 subnormals only), and XLA
# casts them to e5m2's subnormals exactly, as ml_dtypes does (measured on jax 0.10.2 and 0.12).
# e4m3fn and e4m3fnuz need no such binade: they part on the probes' own values above 240, e4m3fnuz's maximum.
_E5M2_PARTING = (-15, -14)


def _current(name: str, element: np.dtype, siblings: tuple[str, ...]) -> Format:
    # Below fmax / CURRENT_MAX_SCALE the scale is capped.
    return Format(name, "current", element, None, {"tensor": _F32},
                  "one encode scale fmax / amax per tensor, capped at CURRENT_MAX_SCALE (TransformerEngine's "
                  "Float8CurrentScaling)", siblings, current_quantize, current_dequantize,
                  guarded_below=float(ml_dtypes.finfo(element).max) / CURRENT_MAX_SCALE)


#: The smallest normal float32, 2^-126: where a scale computed from an amax leaves the normal range.
_F32_TINY = float(np.finfo(np.float32).tiny)


#: In the order :func:`format_names` lists them.
FORMATS: tuple[Format, ...] = (
    _int("int8", "absmax / 127 per slice, codes ±127 (AQT with preserve_max_val=True)", int8_quantize,
         ("int8_aqt", "int8_qwix")),
    # grad: the gradient flavour of the same family, as Flax's fp8 and NANOO fp8 pair them.
    _cast("e4m3fn", _E4M3FN, "e4m3fnuz", grad="e5m2"),
    _cast("e4m3fnuz", _E4M3FNUZ, "e4m3fn", grad="e5m2fnuz"),
    _cast("e5m2", _E5M2, "e5m2fnuz", parting_binade=_E5M2_PARTING),
    _cast("e5m2fnuz", _E5M2FNUZ, "e5m2", parting_binade=_E5M2_PARTING),
    _current("e4m3fn_current", _E4M3FN, ("e4m3fn", "e5m2_current")),
    _current("e5m2_current", _E5M2, ("e5m2", "e4m3fn_current")),
    Format("nvfp4", "block", _E2M1, NVFP4_BLOCK, {"block": _E4M3FN, "tensor": _F32},
           "NVIDIA's: encode scale 6 · 448 / amax per tensor, e4m3fn scale amax_b / 6 per block of 16",
           (), nvfp4_quantize, nvfp4_dequantize, stochastic=True, decode_ulps=NVFP4_JIT_DECODE_ULPS,
           guarded_below=NVFP4_MIN_AMAX),
    # Below 2^-119 a block's exponent clips to e8m0's smallest scale, 2^-127.
    Format("mxfp8", "block", _E4M3FN, MX_BLOCK, {"block": _E8M0},
           "OCP MX v1.0: 2^(floor(log2 amax_b) - 8) per block of 32", ("e4m3fn",), mxfp8_quantize,
           e8m0_block_dequantize, guarded_below=2.0 ** (E8M0_MIN_EXP + E4M3_EMAX)),
    # JAX's rules (jax.nn.scaled_dot_general): the OCP / NVIDIA format they depart from is the bug a wrong
    # rule would be.
    # Below 2688 · 2^-127 the power-of-two global scale clips at 2^-126.
    Format("nvfp4_jax", "block", _E2M1, NVFP4_BLOCK, {"block": _E4M3FN, "tensor": _F32},
           "JAX's: a power-of-two global scale (jax_nvfp4_global_scale), e4m3fn scale amax_b / 6 per block of 16",
           ("nvfp4",), nvfp4_jax_quantize, nvfp4_jax_dequantize, guarded_below=NVFP4_RANGE * 2.0**E8M0_MIN_EXP),
    # Below 448 · 2^-127 a block's amax / 448 is below e8m0's smallest scale, 2^-127, which it takes (XLA's CPU,
    # which flushes amax / 448 below 2^-126, from 448 · 2^-126).
    Format("mxfp8_jax", "block", _E4M3FN, MX_BLOCK, {"block": _E8M0},
           "JAX's: amax_b / 448 rounded up to a power of two per block of 32", ("mxfp8", "e4m3fn"),
           mxfp8_jax_quantize, e8m0_block_dequantize, probe_spread=True, forms=ALL_FORMS,
           guarded_below=E4M3_MAX * 2.0**E8M0_MIN_EXP),
    # Below 127.5 / float32's max the reciprocal of the scale overflows, and the guard makes it 1 (above it, on
    # a backend that flushes subnormals, from 127.5 · 2^-126). int8's own guard is at a scale of 0 only.
    _int("int8_aqt", "absmax / 127.5 per slice, x · (1 / scale) clipped to ±127 (AQT v2's default)",
         int8_aqt_quantize, ("int8", "int8_qwix"), guarded_below=INT8_EDGE / float(np.finfo(np.float32).max)),
    # Below 127.5 · 2^-63 the scale is below qwix's floor sqrt(float32 tiny) and becomes 1: codes 0.
    _int("int8_qwix", "absmax / 127.5 per slice, a saturating cast to -128..127 (qwix's)", int8_qwix_quantize,
         ("int8", "int8_aqt"), guarded_below=INT8_EDGE * _F32_TINY**0.5),
    # No siblings: on the probes' magnitudes its epsilon moves no code, so they could not tell it from int8
    # (qcheck.checks' probes must part a format from each sibling); the coverage check's diagnosis still names
    # it, trying every int8 rule (the epsilon moves codes where a slice's absmax is small: near 1e-5 its top code
    # is 126).
    _int("int8_keras", "an encode scale 127 / (absmax + 1e-7) per slice, x · scale clipped to ±127, x ≈ codes / "
         "scale (Keras's abs_max_quantize)", int8_keras_quantize, (), int8_keras_dequantize, divides=True),
    # Keras's quantize("int4") with Int4QuantizationConfig(block_size=-1): its one int4 rule qcheck has. Codes of
    # ml_dtypes.int4, the values Keras stores in int8 and packs two to a byte (a site reads them unpacked: int4).
    # No siblings: the int8 formats' codes are another type, which a site's type already tells apart.
    Format("int4_keras", "int", _INT4, None, {"slice": _F32},
           "an encode scale 7 / (absmax + 1e-7) per slice, x · scale clipped to [-8, 7], x ≈ codes / scale "
           "(Keras's abs_max_quantize with value_range (-8, 7))", (), int4_keras_quantize, int8_keras_dequantize,
           divides=True, forms=ALL_FORMS),
    # An IEEE-style 8-bit float with 3 exponent and 4 mantissa bits (ml_dtypes 0.7.0 float8_e3m4: max 15.5,
    # normal from 2^-2, inf and NaN, so an unsaturated cast of 100 is inf): more precision, less range. Its
    # sibling is e4m3fn, the fp8 type a bug would cast to instead; its gradient flavour e5m2, the gradient type
    # every fp8 recipe pairs with a non-fnuz forward type.
    _cast("e3m4", _E3M4, "e4m3fn", grad="e5m2"),
    # qwix's asymmetric int8: a zero point per slice beside the scale. Siblings: qwix's own symmetric int8, the rule a
    # wrong calibration method computes instead (their codes part on any slice whose min is not -max). Below an amax
    # of 127.5 · 2^-63 a slice's span (at most twice its amax) / 255 is below qwix's floor, and the scale becomes 1.
    Format("int8_qwix_minmax", "int", _INT8, None, {"slice": _F32, "zero_point": _INT8},
           "asymmetric: (max - min) / 255 per slice, min and max clipped around 0, an int8 zero point "
           "round(-128 - min / scale), codes round(x / scale + zero point) saturating to -128..127, x ≈ (codes - "
           "zero point) · scale (qwix's calibration_method='minmax')", ("int8_qwix",), int8_qwix_minmax_quantize,
           int8_zero_point_dequantize, forms=ALL_FORMS, guarded_below=INT8_EDGE * _F32_TINY**0.5),
    # Keras's default quantize("int4"): Int4QuantizationConfig(block_size=128), asymmetric per group of 128
    # inputs. Kind "block": one scale (and one zero point) per group of `block` elements along the flattened
    # contraction axes, laid out [..., n_groups] as the other block formats'; unlike theirs, a last partial group
    # is allowed (Keras pads it with zeros, which take part in its min and max). Sibling: Keras's per-channel
    # int4, the rule a layer built with block_size=-1 computes (their codes part wherever a group's range is
    # not the channel's, or not symmetric).
    Format("int4_keras_grouped", "block", _INT4, KERAS_INT4_GROUP, {"block": _F32, "zero_point": _INT8},
           "asymmetric per group of 128 along the contraction axis: scale ((max - min) + 1e-7) / 15, an int8 zero "
           "point round(-min / scale) - 8 clipped to [-8, 7], codes round(x / scale) + zero point clipped to "
           "[-8, 7], x ≈ (codes - zero point) · scale (Keras's abs_max_quantize_grouped_with_zero_point; a last "
           "partial group is zero-padded)", ("int4_keras",), int4_keras_grouped_quantize,
           int4_zero_point_dequantize, parameters=("block",)),
    # EasyDeL 0.3.0's INT8 (ejkernel 0.0.78's affine mode, 8 bits): per group of 64 (QuantizationConfig's
    # group_size), unsigned codes 0..255 over the group's own min and max (not clipped around 0), a float16 scale
    # and a float16 zero point that is never rounded (so 0 is no code, and qdq(0) is not 0). Sibling: qwix's
    # minmax int8, the asymmetric rule with a whole zero point over a range holding 0 (their codes part on every
    # group). Its float16 scale and zero point are EasyDeL's defect edges: a group whose span is below 255 times
    # float16's smallest subnormal stores scale 0, and one whose min is more than 257 spans from 0 a zero point
    # of inf (tests/test_easydel.py); nothing in the rule guards them.
    Format("int8_easydel", "block", _UINT8, EASYDEL_GROUP, {"block": _F16, "zero_point": _F16},
           "affine per group of 64: scale (max - min) / 255 (0 replaced by 1), zero point -min / scale, codes "
           "round(x / scale + zero point) clipped to 0..255, scale and zero point stored float16, x ≈ (codes - zero "
           "point) · scale (ejkernel's affine mode, EasyDeL's QuantizationConfig(dtype=INT8))", ("int8_qwix_minmax",),
           int8_easydel_quantize, int8_easydel_dequantize, forms=ALL_FORMS, parameters=("block",)),
)

_BY_NAME: dict[str, Format] = {f.name: f for f in FORMATS}
_BUILTIN = tuple(_BY_NAME)

#: fp8 element types qcheck knows, by the name ml_dtypes gives them.
FP8_DTYPES: dict[str, np.dtype] = {f.element.name: f.element for f in FORMATS if f.kind == "cast"}

#: Each fp8 format's sibling flavour (fnuz <-> not fnuz): what a wrong-flavour bug casts to instead.
FP8_SIBLINGS: dict[str, str] = {f.name: f.siblings[0] for f in FORMATS if f.kind == "cast"}

#: Formats whose quantization depends on the axes it runs along (a scale per slice or per block); the
#: plain fp8 and current-scaled formats treat the whole tensor alike along any axes.
AXIS_FORMATS: frozenset[str] = frozenset(f.name for f in FORMATS if f.per_axis)


def format_names() -> tuple[str, ...]:
    """The format names :func:`~qcheck.formats.qdq` and :func:`~qcheck.formats.quantize` accept."""
    return tuple(_BY_NAME)


def get_format(name: str, *, where: str | None = None) -> Format:
    """The record of format ``name``; a one-line ValueError listing the valid names (prefixed ``where: ``) if none."""
    return _BY_NAME[require_choice("format", name, _BY_NAME, where=where)]


def cast_format(dtype, *, where: str | None = None) -> Format:
    """The record of the cast format whose element type is ``dtype`` (``float8_e4m3fn`` -> ``e4m3fn``); a one-line
    ValueError listing the cast formats' types (prefixed ``where: ``) if none."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = repr(dtype)
    casts = {f.element.name: f for f in _BY_NAME.values() if f.kind == "cast"}
    if name not in casts:
        raise ValueError(f"{where + ': ' if where else ''}cast_dtype must be an fp8 type (a cast format's element type: "
                         f"{', '.join(casts)}), got {dtype!r}")
    return casts[name]


def builtin_format_names() -> tuple[str, ...]:
    """The names of the formats qcheck itself defines (:data:`FORMATS`), without the plug-ins."""
    return _BUILTIN


def add_record(record: Format) -> None:
    """Make ``record`` a format :func:`get_format` knows (for the plug-in registry, which checks it first)."""
    _BY_NAME[record.name] = record


def restore_records(names: tuple[str, ...]) -> None:
    """Forget every plug-in format not in ``names`` (for the plug-in registry); the built-ins stay."""
    for name in [n for n in _BY_NAME if n not in names and n not in _BUILTIN]:
        del _BY_NAME[name]


def block_size(fmt: str) -> int | None:
    """Elements per scale block along the quantized axes (``nvfp4*``: 16, ``mxfp8*``: 32); None for other formats."""
    return get_format(fmt).block
