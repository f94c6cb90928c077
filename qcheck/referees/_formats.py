"""Independent references for every qcheck number format, in numpy and ml_dtypes only.

Each format is written from its definition, not from ``qcheck.formats``: this
module imports neither JAX nor the code it referees, so a bug cannot be copied
from one side to the other. Where qcheck makes a documented choice the
definition leaves open (the all-zero scale, the cap on a current scale, the
NVFP4 tensor scale and the order its divisions run in), the referee follows the
choice, written again here, and the comment on the line names which it follows:
``[def]`` a format's definition, ``[qcheck]`` a choice qcheck documents,
``[XLA]`` a compiler rewrite, only behind the ``xla_reciprocal`` switch.

Arithmetic is IEEE float32 (numpy does not flush subnormals). ``ftz=True``
models a backend that does: every float32 read or written as a subnormal is
zero of the same sign, as XLA's CPU backend computes (flush-to-zero and
denormals-are-zero). It changes nothing for values away from float32's
subnormal range. ``xla_reciprocal`` models the rewrites of the int8
formats' divisions XLA may make, each of which moves a quantizer's bits:
``amax / 127`` (or 127.5; a division by a constant) as ``amax · float32(1/127)``,
one ulp away in about 4% of slices for 127 and 77% for 127.5, and ``x / scale``
(a division by a broadcast operand) as ``x · (1 / scale)``, which moves a code
where the quotient is within an ulp of a half (1 of 262144 normal values). Each
rewrite is legal on its own, so a referee holds the rule in every combination,
a :class:`Form`: ``True`` is both rewrites (XLA CPU, jax 0.10.2 to 0.12.0.1,
eager and jitted), ``False`` neither (the definition), and a form's name or
:class:`Form` either one alone (jax 0.12.1 rewrites the constant's division and
keeps ``x / scale``). A form applies to the whole tensor, never element by
element.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import ml_dtypes
import numpy as np

from qcheck.referees._choice import choice

_F32 = np.float32


class Form(NamedTuple):
    """Which divisions of a quantizer XLA computes as a product with the float32 reciprocal of the divisor:
    ``constant``, one by a constant (``amax / 127.5``); ``operand``, one by a broadcast operand (``x / scale``)."""

    constant: bool
    operand: bool


#: Every form a compiler may legally give a quantizer's divisions, by name, the definition first.
FORMS: dict[str, Form] = {
    "as written": Form(False, False),
    "all by reciprocal": Form(True, True),
    "constant by reciprocal": Form(True, False),
    "scale by reciprocal": Form(False, True),
}


def form_of(xla_reciprocal: bool | str | Form) -> Form:
    """The :class:`Form` ``xla_reciprocal`` names: a bool (both rewrites or neither), a name in :data:`FORMS`, or
    a :class:`Form`."""
    if isinstance(xla_reciprocal, Form):
        return xla_reciprocal
    if isinstance(xla_reciprocal, (bool, np.bool_)):
        return Form(bool(xla_reciprocal), bool(xla_reciprocal))
    if isinstance(xla_reciprocal, str):
        return FORMS[choice("referee form", xla_reciprocal, tuple(FORMS))]
    raise TypeError(f"xla_reciprocal must be a bool, a form name ({', '.join(FORMS)}) or a Form, "
                    f"got {type(xla_reciprocal).__name__}")


def form_name(xla_reciprocal: bool | str | Form) -> str:
    """The name in :data:`FORMS` of the form ``xla_reciprocal`` stands for."""
    form = form_of(xla_reciprocal)
    return next(name for name, f in FORMS.items() if f == form)

# [def] the element types, by format name.
_FP8 = {
    "e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
_E3M4 = np.dtype(ml_dtypes.float8_e3m4)  # [def] OCP's 8-bit float with 3 exponent bits, 4 mantissa bits
_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

_INT8_BOUND = 127  # [def] symmetric int8: codes in [-127, 127], -128 unused
# [def] AQT v2 IntSymmetric(8 bits, preserve_zero, not preserve_max_val) and qwix's
# get_symmetric_bound(int8): absmax maps onto the edge of the last bucket, 127 + 0.5.
_INT8_EDGE = _F32(127.5)
QWIX_MIN_SCALE = _F32(2.0**-63)  # [def] qwix: sqrt(float32 tiny) = sqrt(2^-126)
KERAS_EPSILON = _F32(1e-7)  # [def] Keras: backend.epsilon(), added to a slice's absmax
_INT4 = np.dtype(ml_dtypes.int4)  # [def] Keras int4: codes -8..7, stored in int8 and packed two to a byte
_INT4_LO, _INT4_HI = -8, 7  # [def] Keras AbsMaxQuantizer(value_range=(-8, 7)) for quantize("int4")
_NVFP4_BLOCK = 16  # [def] NVIDIA NVFP4: 16 e2m1 elements share one e4m3 scale
_MX_BLOCK = 32  # [def] OCP MX v1.0: k = 32 elements share one e8m0 scale
CURRENT_SCALE_CAP = _F32(2.0**126)  # [qcheck] formats.CURRENT_MAX_SCALE: 1/cap stays a normal float32


def _fmax(dtype: np.dtype) -> _F32:
    return _F32(ml_dtypes.finfo(dtype).max)


_E2M1_MAX = _fmax(_E2M1)  # 6
_E4M3_MAX = _fmax(_FP8["e4m3fn"])  # 448
# [def] OCP MX: emax of the element type, the exponent of its largest binade (448 = 1.75 · 2^8).
_E4M3_EMAX = int(np.frexp(_E4M3_MAX)[1]) - 1
_E8M0_MIN, _E8M0_MAX = -127, 127  # [def] e8m0 encodes 2^-127 .. 2^127 (bits 0..254)
# [def] the non-negative e2m1 values, read off the type itself.
_E2M1_GRID = np.unique(np.abs(np.arange(16, dtype=np.uint8).view(_E2M1).astype(_F32)))


def flush(a: np.ndarray, ftz: bool) -> np.ndarray:
    """``a`` with float32 subnormals replaced by zero of the same sign, when ``ftz``."""
    if not ftz:
        return a
    a = np.asarray(a, _F32)
    return np.where(np.abs(a) < np.finfo(_F32).tiny, np.copysign(_F32(0), a), a).astype(_F32)


def _saturate(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    # [def] a saturating cast: clip to ±max, then round to nearest even (ml_dtypes' cast).
    # NaN passes through the clip and stays NaN; ±inf becomes ±max.
    m = _fmax(dtype)
    return np.clip(v, -m, m).astype(dtype)


def _axes(axis: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    raw = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    if not raw:
        raise ValueError("axis must name at least one axis, got ()")
    for a in raw:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for x of rank {ndim}")
    return tuple(sorted({int(a) % ndim for a in raw}))


class Blocks:
    """``x`` with ``axes`` moved last (in order) and flattened into ``[..., n_blocks, block]``."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[int, ...], block: int, fmt: str):
        self.rest = [a for a in range(len(shape)) if a not in axes]
        self.perm = (*self.rest, *axes)
        self.moved = tuple(shape[a] for a in self.perm)
        k = math.prod(shape[a] for a in axes)
        if k % block:
            raise ValueError(f"{fmt}: axis {axes} holds {k} elements, not a whole number of blocks of {block}")
        self.shape = (*self.moved[: len(self.rest)], k // block, block)

    def split(self, x: np.ndarray) -> np.ndarray:
        return np.transpose(x, self.perm).reshape(self.shape)

    def join(self, b: np.ndarray) -> np.ndarray:
        return np.transpose(b.reshape(self.moved), np.argsort(self.perm))


def _int8(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None):
    # [def] symmetric absmax: scale = max|x| over the contraction axes / 127
    # ([XLA] or times the float32 reciprocal of 127, as XLA computes it).
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    form = form_of(xla_reciprocal)
    scale = flush(amax * (_F32(1) / _F32(_INT8_BOUND)) if form.constant else amax / _F32(_INT8_BOUND), ftz)
    # [qcheck] a slice whose scale is zero keeps scale 1, so zeros stay zeros.
    scale = np.where(scale > 0, scale, _F32(1)).astype(_F32)
    # [def] round half to even, then clip to ±127.
    codes = np.clip(np.round(flush(_divide(x, scale, form.operand), ftz)), -_INT8_BOUND, _INT8_BOUND)
    return codes.astype(np.int8), {"slice": scale}


def _divide(x: np.ndarray, scale: np.ndarray, xla_reciprocal: bool) -> np.ndarray:
    # [def] x / scale ([XLA] or x times the float32 reciprocal of scale, as XLA computes it;
    # a subnormal scale's reciprocal overflows, as it does there).
    with np.errstate(over="ignore"):
        return (x * (_F32(1) / scale) if xla_reciprocal else x / scale).astype(_F32)


def _edge_scale(amax: np.ndarray, ftz: bool, xla_reciprocal) -> np.ndarray:
    # [def] AQT's default and qwix: scale = absmax / 127.5 ([XLA] or times the float32 reciprocal of 127.5).
    constant = form_of(xla_reciprocal).constant
    return flush(amax * (_F32(1) / _INT8_EDGE) if constant else amax / _INT8_EDGE, ftz).astype(_F32)


def _int8_aqt(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None):
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    amax = np.where(amax == 0, _F32(1), amax)  # [def] AQT AbsMaxCalibration: an absmax of 0 becomes 1
    scale = _edge_scale(amax, ftz, xla_reciprocal)
    # [def] AQT QTensor.quant: x times reciprocal(scale); an infinite reciprocal becomes 1.
    with np.errstate(divide="ignore", over="ignore"):
        inv = _F32(1) / scale
    inv = np.where(np.isinf(inv), _F32(1), inv).astype(_F32)
    # [def] AQT IntSymmetric: clip to the last bucket's edge minus 0.5 (127), then round half to even.
    codes = np.round(np.clip(flush(x * inv, ftz), -_INT8_BOUND, _INT8_BOUND))
    return codes.astype(np.int8), {"slice": scale}


def _int8_qwix(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None):
    scale = _edge_scale(np.max(np.abs(x), axis=axes, keepdims=True), ftz, xla_reciprocal)
    scale = np.where(scale < QWIX_MIN_SCALE, _F32(1), scale).astype(_F32)  # [def] qwix: a scale below 2^-63 is 1
    # [def] qwix: round half to even, then a saturating cast to int8: codes -128..127.
    operand = form_of(xla_reciprocal).operand
    codes = np.clip(np.round(flush(_divide(x, scale, operand), ftz)), -_INT8_BOUND - 1, _INT8_BOUND)
    return codes.astype(np.int8), {"slice": scale}


_INT8_LOW, _INT8_STEPS = -128, _F32(255)  # [def] qwix get_asymmetric_bound(int8): (-128, 127), 255 steps


def _int8_qwix_minmax(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool,
                      uniforms: np.ndarray | None):
    # [def] qwix minmax: the slice's min and max, clipped so that min <= 0 <= max (0 is then a code).
    lo = np.minimum(np.min(x, axis=axes, keepdims=True), _F32(0))
    hi = np.maximum(np.max(x, axis=axes, keepdims=True), _F32(0))
    with np.errstate(over="ignore"):
        span = flush((hi - lo).astype(_F32), ftz)
    # [def] scale = span / 255 ([XLA] or times the float32 reciprocal of 255); below 2^-63 it is 1.
    form = form_of(xla_reciprocal)
    scale = flush(span * (_F32(1) / _INT8_STEPS) if form.constant else span / _INT8_STEPS, ftz).astype(_F32)
    scale = np.where(scale < QWIX_MIN_SCALE, _F32(1), scale).astype(_F32)
    # [def] zero point = -128 - min / scale (an IEEE division: min and scale have one shape, nothing for XLA to
    # rewrite), rounded half to even, saturating to int8.
    zero_point = np.clip(np.round(flush((_F32(_INT8_LOW) - flush((lo / scale).astype(_F32), ftz)).astype(_F32),
                                        ftz)), _INT8_LOW, _INT8_BOUND).astype(np.int8)
    # [def] codes = x / scale plus the zero point, rounded half to even, saturating to -128..127.
    shifted = flush((flush(_divide(x, scale, form.operand), ftz) + zero_point.astype(_F32)).astype(_F32), ftz)
    codes = np.clip(np.round(shifted), _INT8_LOW, _INT8_BOUND)
    return codes.astype(np.int8), {"slice": scale, "zero_point": zero_point}


def _int8_keras(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None):
    # [def] Keras abs_max_quantize: an encode scale 127 / (absmax + epsilon), in float32.
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    scale = flush(_F32(_INT8_BOUND) / (amax + KERAS_EPSILON), ftz).astype(_F32)
    # [def] x times the scale, rounded half to even, clipped to ±127.
    codes = np.clip(np.round(flush((x * scale).astype(_F32), ftz)), -_INT8_BOUND, _INT8_BOUND)
    return codes.astype(np.int8), {"slice": scale}


def _int4_keras(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool,
                uniforms: np.ndarray | None):
    # [def] Keras abs_max_quantize with value_range (-8, 7): an encode scale 7 / (absmax + epsilon), in float32.
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    scale = flush(_F32(_INT4_HI) / (amax + KERAS_EPSILON), ftz).astype(_F32)
    # [def] x times the scale, rounded half to even, clipped to [-8, 7].
    codes = np.clip(np.round(flush((x * scale).astype(_F32), ftz)), _INT4_LO, _INT4_HI)
    return codes.astype(_INT4), {"slice": scale}


_KERAS_GROUP = 128  # [def] Keras Int4QuantizationConfig's default block_size: 128 inputs per scale and zero point
_INT4_STEPS = _F32(15)  # [def] Keras: a group's [min, max] spans qmax - qmin = 7 - (-8) steps


class _Groups:
    """``x`` with ``axes`` moved last, flattened and zero-padded to ``[..., n_groups, group]`` (Keras pads a last
    partial group with zero rows, which then count in its min and max)."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[int, ...], group: int):
        self.rest = [a for a in range(len(shape)) if a not in axes]
        self.perm = (*self.rest, *axes)
        self.moved = tuple(shape[a] for a in self.perm)
        self.lead = self.moved[: len(self.rest)]
        self.k = math.prod(shape[a] for a in axes)
        self.n = -(-self.k // group)
        self.group = group

    def split(self, x: np.ndarray) -> np.ndarray:
        flat = np.transpose(x, self.perm).reshape(*self.lead, self.k)
        pad = np.zeros((*self.lead, self.n * self.group - self.k), flat.dtype)
        return np.concatenate([flat, pad], axis=-1).reshape(*self.lead, self.n, self.group)

    def join(self, g: np.ndarray) -> np.ndarray:
        flat = g.reshape(*self.lead, self.n * self.group)[..., : self.k]
        return np.transpose(flat.reshape(self.moved), np.argsort(self.perm))


def _int4_keras_grouped(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool,
                        uniforms: np.ndarray | None, block: int = _KERAS_GROUP):
    # [def] Keras abs_max_quantize_grouped_with_zero_point (numpy path, as quantize() calls it): per group of 128
    # along the contraction axis, zero-padded, its min and max. qcheck's quantizer keeps every division whole
    # (no operand XLA sees as a constant or a broadcast), so xla_reciprocal models nothing here. ``block``: the
    # group size (Int4QuantizationConfig(block_size=...)), 128 by default.
    g = _Groups(x.shape, axes, block)
    groups = g.split(x.astype(_F32))
    lo = np.min(groups, axis=-1, keepdims=True)
    hi = np.max(groups, axis=-1, keepdims=True)
    # [def] scale = ((max - min) + epsilon) / 15, in float32.
    with np.errstate(over="ignore"):
        scale = flush(((hi - lo).astype(_F32) + KERAS_EPSILON).astype(_F32) / _INT4_STEPS, ftz).astype(_F32)
    # [def] zero point = round(-min / scale) + qmin (half to even), clipped to [-8, 7], stored int8.
    zero = np.clip(np.round(flush((-lo / scale).astype(_F32), ftz)) + _INT4_LO, _INT4_LO, _INT4_HI)
    # [def] codes = round(x / scale) + zero point, clipped to [-8, 7].
    codes = np.clip(np.round(flush((groups / scale).astype(_F32), ftz)) + zero, _INT4_LO, _INT4_HI)
    return g.join(codes).astype(_INT4), {"block": scale[..., 0], "zero_point": zero[..., 0].astype(np.int8)}


_AFFINE_QMAX = _F32(255)  # [def] ejkernel affine, 8 bits: codes 0..2^8 - 1
_EASYDEL_GROUP = 64  # [def] EasyDeL QuantizationConfig(dtype=INT8)'s default group_size


def _int8_easydel(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool | Form,
                  uniforms: np.ndarray | None, block: int = _EASYDEL_GROUP):
    # [def] ejkernel 0.0.78 _quantize_affine (EasyDeL's INT8): per group of ``block`` along ``axes``, the group's
    # own min and max. [qcheck] a last partial group is zero-padded (ejkernel refuses the shape).
    g = _Groups(x.shape, axes, block)
    groups = g.split(x.astype(_F32))
    # [qcheck] a zero min is +0 (IEEE leaves the min of -0 and +0 open), so its zero point is -0 (ejkernel's, on +0s).
    lo = np.min(groups, axis=-1, keepdims=True)
    lo = np.where(lo == 0, _F32(0), lo).astype(_F32)
    hi = np.max(groups, axis=-1, keepdims=True)
    form = form_of(xla_reciprocal)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        span = flush((hi - lo).astype(_F32), ftz)
        # [def] scale = (max - min) / 255 ([XLA] or times the float32 reciprocal of 255); a zero scale is 1.
        scale = flush((span * (_F32(1) / _AFFINE_QMAX) if form.constant else span / _AFFINE_QMAX).astype(_F32), ftz)
        scale = np.where(scale == 0, _F32(1), scale).astype(_F32)
        # [def] zero point = -min / scale, a float32 fraction (an IEEE division: nothing broadcast to rewrite).
        zero = flush((-lo / scale).astype(_F32), ftz)
        # [def] codes = round(x / scale + zero point), half to even, clipped to 0..255.
        shifted = flush((flush(_divide(groups, scale, form.operand), ftz) + zero).astype(_F32), ftz)
        codes = np.clip(np.round(shifted), 0, _AFFINE_QMAX)
        # [def] the codes come from the float32 scale and zero point; both are stored float16 (rounded to nearest:
        # beyond float16's max, inf; below its subnormals, 0).
        return g.join(codes).astype(np.uint8), {"block": scale[..., 0].astype(np.float16),
                                                "zero_point": zero[..., 0].astype(np.float16)}


def _by_easydel_group(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...], fmt: str) -> np.ndarray:
    # [def] ejkernel dequantize, affine: x = (code - its group's zero point) · its group's scale, from the float16
    # values, here in float32 (the difference exact, the product rounded once). The group is read off the scales:
    # EasyDeL's group sizes are powers of two, the smallest one giving that many groups along the axes.
    k = math.prod(c.shape[a] for a in axes)
    n = scales["block"].shape[-1]
    block = next(2**e for e in range(max(k, 1).bit_length() + 1) if -(-k // 2**e) == n)
    g = _Groups(c.shape, axes, block)
    with np.errstate(over="ignore", invalid="ignore"):
        out = (g.split(c) - scales["zero_point"].astype(_F32)[..., None]) * scales["block"].astype(_F32)[..., None]
    return g.join(out.astype(_F32))


def _cast(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None, dtype: np.dtype):
    return _saturate(x, dtype), {}  # [def] the element type at scale 1, saturating


def _current(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None, dtype: np.dtype):
    # [def] TransformerEngine current scaling: one scale for the whole tensor, fmax / amax.
    amax = _F32(np.max(np.abs(x)))
    if amax > 0:
        with np.errstate(over="ignore"):
            # [qcheck] capped at CURRENT_MAX_SCALE (2^126) so 1 / scale stays normal.
            scale = min(_fmax(dtype) / amax, CURRENT_SCALE_CAP)
    else:
        scale = _F32(1)  # [qcheck] an all-zero tensor has scale 1
    scale = _F32(scale)
    return _saturate(flush(x * scale, ftz), dtype), {"tensor": np.asarray(scale, _F32)}


def _mxfp8(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None):
    b = Blocks(x.shape, axes, _MX_BLOCK, "mxfp8")
    blocks = b.split(x)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    _, e = np.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): floor(log2 amax) = e - 1, exactly
    # [def] X = 2^(floor(log2 amax) - emax_elem), clamped to e8m0's range.
    # [qcheck] a zero block (and a subnormal one) takes the smallest scale, 2^-127.
    exp = np.where(amax >= np.finfo(_F32).tiny, np.clip(e - 1 - _E4M3_EMAX, _E8M0_MIN, _E8M0_MAX), _E8M0_MIN)
    exp = exp.astype(np.int32)
    # [def] elements x / X, saturating to e4m3fn; ldexp by a power of two is exact.
    codes = _saturate(flush(np.ldexp(blocks, -exp).astype(_F32), ftz), _FP8["e4m3fn"])
    scale = (exp[..., 0] - _E8M0_MIN).astype(np.uint8).view(_E8M0)  # [def] e8m0 bits = exponent + 127
    return b.join(codes), {"block": scale}


def _nvfp4(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None):
    b = Blocks(x.shape, axes, _NVFP4_BLOCK, "nvfp4")
    blocks = b.split(x)
    amax = _F32(np.max(np.abs(blocks)))
    # [qcheck] per-tensor encode scale 6 · 448 / amax (NVIDIA's, as qcheck defines it). A
    # tensor whose amax is not above 6 · 448 / float32 max (rounded to float32) is flushed:
    # block scales 0, codes 0. At that amax itself the scale, 3.4028233e38, is still finite,
    # but qcheck's comparison is strict (formats.NVFP4_MIN_AMAX), and so is this one.
    min_amax = _F32(float(_E2M1_MAX) * float(_E4M3_MAX) / float(np.finfo(_F32).max))
    representable = bool(amax > min_amax)
    s_enc = _F32(_E2M1_MAX * _E4M3_MAX) / amax if representable else _F32(1)
    block_amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    # [def] block decode scale amax_b / 6 in tensor units, stored e4m3fn (saturating);
    # [qcheck] computed as amax_b · (s_enc / 6), in that order.
    s_block = _saturate(flush(block_amax * (s_enc / _E2M1_MAX), ftz), _FP8["e4m3fn"])
    if not representable:
        s_block = np.zeros_like(s_block)
    sb = s_block.astype(_F32)
    nonzero = sb > 0
    # [qcheck] encode = s_enc / s_block per block, decode = 1 / encode (not s_block / s_enc).
    encode = (s_enc / np.where(nonzero, sb, _F32(1))).astype(_F32)
    # [def] scaled elements clip to e2m1's ±6, then round to an e2m1 value.
    v = np.clip(flush(blocks * encode, ftz), -_E2M1_MAX, _E2M1_MAX)
    if uniforms is None:
        q = v.astype(_E2M1).astype(_F32)  # [def] round to nearest, ties to even
    else:
        q = _stochastic_e2m1(v, b.split(uniforms))
    q = np.where(nonzero, q, _F32(0))  # [qcheck] a block with scale 0 has codes 0
    scales = {"block": s_block[..., 0], "tensor": np.asarray(s_enc, _F32)}
    return b.join(q).astype(_E2M1), scales


# JAX's block formats: jax.nn.scaled_dot_general's `quantize` (jax/_src/cudnn/scaled_matmul_stablehlo.py,
# the same for float32 in jax 0.10.2 and 0.12.0.1), as XLA computes it.


def _e8m0_round_up(s: np.ndarray) -> np.ndarray:
    # [def: JAX cast_to_e8m0_with_rounding_up] the float32 exponent field, plus one when a mantissa bit is
    # set, except in the top binade (254) and for subnormals of at most half the smallest normal.
    bits = np.asarray(s, _F32).view(np.uint32)
    exp, mant = bits >> np.uint32(23), bits & np.uint32(0x7FFFFF)
    up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    return np.where(up, exp + 1, exp).astype(np.uint8)


def _mxfp8_jax(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None):
    b = Blocks(x.shape, axes, _MX_BLOCK, "mxfp8_jax")
    blocks = b.split(x)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    form = form_of(xla_reciprocal)
    # [def: JAX] amax / 448 ([XLA] or times float32(1 / 448), the constant division's rewrite).
    bits = _e8m0_round_up(flush(amax * (_F32(1) / _E4M3_MAX) if form.constant else amax / _E4M3_MAX, ftz))
    # [def: JAX e8m0_to_dtype] 2^(bits - 127); bits 0 read as 2^-127, a float32 subnormal.
    exp = bits.astype(np.int32) - 127
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if form.operand:
            # [XLA] x times float32(1 / 2^e) = 2^-e, a normal float32 for every code: ldexp, exact.
            scaled = np.ldexp(blocks, -exp).astype(_F32)
        else:
            # [def: JAX] x / 2^e; ftz flushes the 2^-127 of code 0 (an all-zero or tiny block) to 0, and the
            # division then gives 0 / 0 = NaN and x / 0 = inf (XLA's CPU backend, jax 0.12.1 under jit).
            scaled = (blocks / flush(np.ldexp(_F32(1), exp).astype(_F32), ftz)).astype(_F32)
    codes = _saturate(flush(scaled, ftz), _FP8["e4m3fn"])
    return b.join(codes), {"block": bits[..., 0].view(_E8M0)}


def jax_global_scale(x: np.ndarray) -> np.float32:
    # [qcheck] formats.jax_nvfp4_global_scale: the smallest power of two g with g · 2688 >= amax
    # (6 · 448 = 2688: NVIDIA's amax / 2688 rounded up), 1 for a zero tensor.
    amax = _F32(np.max(np.abs(x)))
    if not amax >= np.finfo(_F32).tiny:
        return _F32(1)
    k = int(math.ceil(math.log2(float(amax) / 2688.0)))  # float64: 2688 · 2^k is exact there
    k += 2688.0 * 2.0**k < float(amax)  # log2 rounded either way: the definition decides
    k -= 2688.0 * 2.0**(k - 1) >= float(amax)
    return _F32(2.0 ** max(min(k, 127), -126))


def _nvfp4_jax(x: np.ndarray, axes: tuple[int, ...], *, ftz: bool, xla_reciprocal: bool, uniforms: np.ndarray | None):
    g = jax_global_scale(x)
    b = Blocks(x.shape, axes, _NVFP4_BLOCK, "nvfp4_jax")
    blocks = b.split(flush((x / g).astype(_F32), ftz))  # [def] a power of two: exact
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    # [XLA] amax / 6 as amax times float32(1 / 6); [def: JAX] clipped to [0, 448], cast to e4m3fn.
    s_block = np.clip(flush(amax * (_F32(1) / _E2M1_MAX), ftz), 0, _E4M3_MAX).astype(_FP8["e4m3fn"])
    sb = s_block.astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.clip(flush((blocks / sb).astype(_F32), ftz), -_E2M1_MAX, _E2M1_MAX)  # [def: JAX] x / block
    v = np.where(np.isnan(v), _F32(-0.0), v)  # [XLA] 0 / 0 in a zero-scale block casts to e2m1 -0
    codes = v.astype(_E2M1)  # [def] round to nearest, ties to even
    return b.join(codes), {"block": s_block[..., 0], "tensor": np.asarray(g, _F32)}


def _stochastic_e2m1(v: np.ndarray, u: np.ndarray) -> np.ndarray:
    # [def] unbiased stochastic rounding: between the grid neighbours lo <= |v| <= hi, take
    # hi when u < (|v| - lo) / (hi - lo), u uniform in [0, 1); the sign is v's.
    a = np.abs(v)
    i = np.clip(np.searchsorted(_E2M1_GRID, a, side="right") - 1, 0, _E2M1_GRID.size - 1)
    lo, hi = _E2M1_GRID[i], _E2M1_GRID[np.minimum(i + 1, _E2M1_GRID.size - 1)]
    gap = hi - lo
    p_up = np.where(gap > 0, (a - lo) / np.where(gap > 0, gap, _F32(1)), _F32(0)).astype(_F32)
    return np.copysign(np.where(u < p_up, hi, lo), v).astype(_F32)


def _by_slice(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...], fmt: str) -> np.ndarray:
    # [def] x = code · scale; exact in float32 (8 × 24 bits) unless it overflows: int8_qwix's
    # code -128 times absmax / 127.5 is -inf for an absmax within 0.4% of float32's max.
    with np.errstate(over="ignore"):
        return c * scales["slice"]


def _by_slice_from_zero_point(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...],
                              fmt: str) -> np.ndarray:
    # [def] qwix: x = (code - zero point) · scale; the difference is exact, the product rounds once.
    with np.errstate(over="ignore"):
        return ((c - scales["zero_point"].astype(_F32)) * scales["slice"]).astype(_F32)


def _over_slice(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...], fmt: str,
                xla_reciprocal: bool | Form = False) -> np.ndarray:
    # [def] Keras: x = code / encode scale ([XLA] or code times the float32 reciprocal of the scale, as XLA
    # computes a division by a broadcast operand). A zero slice's scale 1.27e9 has a normal reciprocal.
    return _divide(c, scales["slice"], form_of(xla_reciprocal).operand)


def _by_group_from_zero_point(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...],
                              fmt: str) -> np.ndarray:
    # [def] Keras dequantize_with_sz_map: x = (code - its group's zero point) · its group's scale; the difference
    # is exact, the product rounds once.
    g = _Groups(c.shape, axes, _KERAS_GROUP)
    with np.errstate(over="ignore"):
        out = (g.split(c) - scales["zero_point"].astype(_F32)[..., None]) * scales["block"][..., None]
    return g.join(out.astype(_F32))


def _as_is(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...], fmt: str) -> np.ndarray:
    return c  # [def] scale 1


def _by_tensor(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...], fmt: str) -> np.ndarray:
    return c * (_F32(1) / scales["tensor"])  # [def] decode scale 1 / scale


def _by_e8m0_block(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...], fmt: str) -> np.ndarray:
    b = Blocks(c.shape, axes, _MX_BLOCK, fmt)
    exp = scales["block"].view(np.uint8).astype(np.int32) + _E8M0_MIN
    # [def] x = code · 2^e, exact; mxfp8_jax's rounded-up scale lets a block of values within a code's
    # rounding of float32's max come back inf (256 · 2^120 = 2^128), as JAX's dequantize gives too.
    with np.errstate(over="ignore"):
        return b.join(np.ldexp(b.split(c), exp[..., None]))


def _by_jax_nvfp4_scales(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...], fmt: str) -> np.ndarray:
    b = Blocks(c.shape, axes, _NVFP4_BLOCK, fmt)
    # [def: JAX] code · block scale, then (exact: a power of two) the global scale; a block within a code's
    # rounding of float32's max comes back inf, as JAX's dequantize gives too.
    with np.errstate(over="ignore"):
        return b.join(b.split(c) * scales["block"].astype(_F32)[..., None] * scales["tensor"])


def _by_nvfp4_scales(c: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...], fmt: str) -> np.ndarray:
    b = Blocks(c.shape, axes, _NVFP4_BLOCK, fmt)
    sb = scales["block"].astype(_F32)[..., None]
    nonzero = sb > 0
    # [qcheck] code · (1 / (s_enc / s_block)), the encode scale recomputed as quantize did.
    decode = _F32(1) / (scales["tensor"] / np.where(nonzero, sb, _F32(1)))
    return b.join(np.where(nonzero, b.split(c) * decode, _F32(0)))


class _Referee(NamedTuple):
    """One format's reference: ``quantize(x, axes, *, ftz, xla_reciprocal, uniforms)`` to (codes, scales),
    ``dequantize(codes as float32, scales, axes, name)`` back; ``stochastic``: whether it takes uniforms."""

    quantize: Callable[..., tuple[np.ndarray, dict[str, np.ndarray]]]
    dequantize: Callable[[np.ndarray, dict[str, np.ndarray], tuple[int, ...], str], np.ndarray]
    stochastic: bool = False
    #: The parameters its rule takes beside x (``block``: the group size), each with its default.
    parameters: tuple[str, ...] = ()


#: Every format the referee knows, written from its definition, under qcheck's names and in its order
#: (tests/test_referees.py holds the names to qcheck.formats' records).
_REFEREES: dict[str, _Referee] = {
    "int8": _Referee(_int8, _by_slice),
    **{name: _Referee(functools.partial(_cast, dtype=_FP8[name]), _as_is) for name in _FP8},
    "e4m3fn_current": _Referee(functools.partial(_current, dtype=_FP8["e4m3fn"]), _by_tensor),
    "e5m2_current": _Referee(functools.partial(_current, dtype=_FP8["e5m2"]), _by_tensor),
    "nvfp4": _Referee(_nvfp4, _by_nvfp4_scales, stochastic=True),
    "mxfp8": _Referee(_mxfp8, _by_e8m0_block),
    "nvfp4_jax": _Referee(_nvfp4_jax, _by_jax_nvfp4_scales),
    "mxfp8_jax": _Referee(_mxfp8_jax, _by_e8m0_block),
    "int8_aqt": _Referee(_int8_aqt, _by_slice),
    "int8_qwix": _Referee(_int8_qwix, _by_slice),
    "int8_keras": _Referee(_int8_keras, _over_slice),
    "int4_keras": _Referee(_int4_keras, _over_slice),
    "e3m4": _Referee(functools.partial(_cast, dtype=_E3M4), _as_is),
    "int8_qwix_minmax": _Referee(_int8_qwix_minmax, _by_slice_from_zero_point),
    "int4_keras_grouped": _Referee(_int4_keras_grouped, _by_group_from_zero_point, parameters=("block",)),
    "int8_easydel": _Referee(_int8_easydel, _by_easydel_group, parameters=("block",)),
}
_BUILTIN = tuple(_REFEREES)


def keeps_finite(x: np.ndarray, q: np.ndarray) -> bool:
    """Whether ``q`` (codes or values quantized from ``x``) is finite wherever ``x`` is. A form in which a rule
    makes NaN of a finite input (it divides by a scale the backend flushed to zero) computes the rule's defect:
    the checks hold no site to it."""
    x, q = np.asarray(x), np.asarray(q)
    if x.shape != q.shape:
        return True
    try:  # ml_dtypes' own isfinite on the codes: 8x faster than a float32 copy of every code first
        finite = np.isfinite(q)
    except TypeError:  # a code type without it
        finite = np.isfinite(q.astype(_F32))
    return bool(np.all(finite | ~np.isfinite(x)))


def referee_format_names() -> tuple[str, ...]:
    """The format names the referee knows: its own, then the plug-ins' (:func:`add_referee`)."""
    return tuple(_REFEREES)


def builtin_referee_names() -> tuple[str, ...]:
    """The format names the referee knows of its own, written here from their definitions."""
    return _BUILTIN


def add_referee(name: str, quantize: Callable[..., tuple[np.ndarray, dict[str, np.ndarray]]],
                dequantize: Callable[[np.ndarray, dict[str, np.ndarray], tuple[int, ...]], np.ndarray],
                stochastic: bool = False) -> None:
    """Consult a user's referee for plug-in format ``name`` (``qcheck.formats.register_format`` calls this).

    ``quantize(x, axes, *, ftz, xla_reciprocal)`` (and ``uniforms=`` where ``stochastic``; ``xla_reciprocal``
    a bool, or a :class:`Form` for a format whose record lists a mixed form) returns (codes,
    scales); ``dequantize(codes as float32, scales, axes)`` the values. Both are the user's, in numpy.
    """
    if name in _REFEREES:
        raise ValueError(f"the referee already knows a format named {name!r}; formats: {', '.join(_REFEREES)}")

    def q(x, axes, *, ftz, xla_reciprocal, uniforms):
        kw = {"uniforms": uniforms} if stochastic else {}
        # A bool where the form is one (every division as written, or every one by its reciprocal): what a user's
        # referee written for the two forms reads; a Form for the mixed ones, asked only where the format's record
        # lists them.
        form = form_of(xla_reciprocal)
        flag = form.constant if form.constant == form.operand else form
        codes, scales = quantize(x, axes, ftz=ftz, xla_reciprocal=flag, **kw)
        return np.asarray(codes), {k: np.asarray(v) for k, v in dict(scales).items()}

    _REFEREES[name] = _Referee(q, lambda c, scales, axes, fmt: dequantize(c, scales, axes), stochastic)


def remove_referee(name: str) -> None:
    """Stop consulting the plug-in referee of ``name``; the referee's own formats stay."""
    if name in _BUILTIN:
        raise ValueError(f"format {name!r} is one of the referee's own; plug-ins: "
                         f"{', '.join(n for n in _REFEREES if n not in _BUILTIN) or 'none'}")
    _REFEREES.pop(name, None)


def _check(x: np.ndarray, fmt: str, uniforms: np.ndarray | None) -> np.ndarray:
    choice("format", fmt, tuple(_REFEREES))
    x = np.asarray(x)
    if x.dtype != _F32:
        raise TypeError(f"x must be a float32 array (the referee computes in IEEE float32), got dtype {x.dtype}")
    if uniforms is not None:
        if not _REFEREES[fmt].stochastic:
            stochastic = " and ".join(name for name, r in _REFEREES.items() if r.stochastic)
            raise ValueError(f"uniforms is for {stochastic}'s stochastic rounding; format {fmt!r} rounds to nearest")
        if np.shape(uniforms) != x.shape:
            raise ValueError(f"uniforms must have x's shape {x.shape}, got {np.shape(uniforms)}")
    return x


def reference_quantize(
    x: np.ndarray,
    fmt: str,
    *,
    axis: int | tuple[int, ...] = -1,
    uniforms: np.ndarray | None = None,
    ftz: bool = False,
    xla_reciprocal: bool | str | Form = False,
    block: int | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``x`` (float32) in format ``fmt``: ``(codes, scales)``, laid out as ``qcheck.formats.quantize`` stores them.

    ``codes`` has ``x``'s shape in the format's element type (int8, a float8
    type, float4_e2m1fn for ``nvfp4``); ``scales`` has the same names, types and
    shapes as qcheck's (``slice``; ``tensor``; ``block`` and ``tensor``;
    ``block``). ``axis`` is the contraction axes (int8's slices, the block
    formats' blocks). ``uniforms`` (``x``'s shape, in [0, 1)) makes ``nvfp4``
    round stochastically: element i rounds up when ``uniforms[i]`` is below its
    distance to the lower neighbour. ``ftz`` and ``xla_reciprocal`` (a bool, a
    name in :data:`FORMS` or a :class:`Form`) model XLA (see the module
    docstring); both off is the definition. ``block``: the group size of a
    format whose rule takes one (``int4_keras_grouped``: 128 by default); None
    is its default.
    """
    x = _check(x, fmt, uniforms)
    axes = _axes(axis, x.ndim)
    uniforms = None if uniforms is None else np.asarray(uniforms, _F32)
    kw = {}
    if block is not None:
        if "block" not in _REFEREES[fmt].parameters:
            raise ValueError(f"block: format {fmt!r} takes no block size (formats that do: "
                             f"{', '.join(n for n, r in _REFEREES.items() if 'block' in r.parameters)})")
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        kw["block"] = int(block)
    return _REFEREES[fmt].quantize(flush(x, ftz), axes, ftz=ftz, xla_reciprocal=xla_reciprocal, uniforms=uniforms,
                                   **kw)


def reference_dequantize(
    codes: np.ndarray, scales: dict[str, np.ndarray], fmt: str, *, axis: int | tuple[int, ...] = -1, ftz: bool = False,
    xla_reciprocal: bool | str | Form = False,
) -> np.ndarray:
    """The float32 values ``codes`` and ``scales`` stand for; ``xla_reciprocal`` models XLA's rewrite of a
    division by the scale (``int8_keras``'s, the one format that divides) as a product with its reciprocal."""
    choice("format", fmt, tuple(_REFEREES))
    c = np.asarray(codes).astype(_F32)
    dequantize = _REFEREES[fmt].dequantize
    if dequantize is _over_slice:
        dequantize = functools.partial(_over_slice, xla_reciprocal=xla_reciprocal)
    out = dequantize(c, scales, _axes(axis, c.ndim), fmt)
    return flush(np.asarray(out, _F32), ftz)


def reference_qdq(
    x: np.ndarray,
    fmt: str,
    *,
    axis: int | tuple[int, ...] = -1,
    uniforms: np.ndarray | None = None,
    ftz: bool = False,
    xla_reciprocal: bool | str | Form = False,
) -> np.ndarray:
    """Quantize then dequantize ``x`` (float32) in ``fmt``, in float32; see :func:`reference_quantize`."""
    codes, scales = reference_quantize(x, fmt, axis=axis, uniforms=uniforms, ftz=ftz, xla_reciprocal=xla_reciprocal)
    return reference_dequantize(codes, scales, fmt, axis=axis, ftz=ftz, xla_reciprocal=xla_reciprocal)
