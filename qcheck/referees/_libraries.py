"""Number formats a library computes under the name of a qcheck format, so the exact check can name them.

qwix 0.1.8 (qwix/_src/core/qarray.py ``calibrate``, ``compute_scale_zero_point``,
``quantize_with_scale_zero_point``; numerics.py ``get_symmetric_bound``,
``convert_to``): scale = absmax / bound (the element type's max: 448 for
e4m3fn and mxfp8, 6 for nvfp4), a scale below sqrt(float32 tiny) = 2^-63
becomes 1; its ``mxfp8`` rounds the block scale up to 2^ceil(log2 scale),
where OCP MX v1.0 takes 2^(floor(log2 amax) - 8); its ``nvfp4`` casts the block
scale to e4m3fn with no per-tensor scale (one level, where NVIDIA's NVFP4 has
two); codes = x / scale, clipped to the element type's range and cast.

XLA rewrites a division by a constant (absmax / bound) into a multiplication by
its float32 reciprocal, eager and jitted, and under jit x / scale too
(``xla_reciprocal``; eager divides there). qcheck's tests/test_qwix_formats.py
holds these functions bitwise to qwix itself, both ways, so a diagnosis made
with one is the library's, not a guess.

JAX before commit e1f12ba4 ("Correctly apply global scale in nvfp4
quantization", July 2025; jax 0.6.2): ``scaled_dot_general``'s nvfp4 divided
the block scales by the global scale but not the data, so codes came out the
global scale times too small, nearly all 0 (100 % on jax 0.6.2, CPU).

They are not qcheck formats (no JAX implementation, no recipe declares them):
they only name a failure of ``exact`` that equals one of them.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from qcheck.referees._formats import QWIX_MIN_SCALE, Blocks, Form, flush, form_of

_F32 = np.float32
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)


def qwix_divide(a: np.ndarray, b: np.ndarray, xla_reciprocal: bool) -> np.ndarray:
    """``a / b`` in float32 as XLA computes it: times the reciprocal where it rewrites the division."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return (a * (_F32(1) / b) if xla_reciprocal else a / b).astype(_F32)


def qwix_scale(amax: np.ndarray, bound: float, constant_reciprocal: bool = True) -> np.ndarray:
    """qwix's scale ``amax / bound`` (XLA: times 1/bound), 1 below 2^-63."""
    s = qwix_divide(amax, _F32(bound), constant_reciprocal)
    return np.where(s < QWIX_MIN_SCALE, _F32(1), s).astype(_F32)


def qwix_per_tensor_e4m3fn(x: np.ndarray, axes: tuple[int, ...], xla_reciprocal: bool | str | Form = True,
                           bound: float = 448.0) -> tuple[np.ndarray, np.ndarray]:
    """qwix's e4m3fn with one scale per slice over ``axes``: ``(codes, scales)`` in ``xla_reciprocal``'s form
    (``bound``: the element type's max, 448; another is the rule of another type)."""
    form = form_of(xla_reciprocal)
    scale = qwix_scale(np.max(np.abs(x), axis=axes, keepdims=True), bound, form.constant)
    return qwix_cast(qwix_divide(x, scale, form.operand), _E4M3), scale


def qwix_cast(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """qwix's ``convert_to``: clip to the type's finite range, then cast."""
    fmax = _F32(ml_dtypes.finfo(dtype).max)
    return np.clip(v, -fmax, fmax).astype(dtype)


def _ceil_log2(s: np.ndarray) -> np.ndarray:
    m, e = np.frexp(s)  # s = m · 2^e, m in [0.5, 1): ceil(log2 s) is e, or e - 1 at a power of two, exactly
    return np.where(m == 0.5, e - 1, e).astype(np.int32)


def quantize_qwix_mxfp8(x: np.ndarray, axes: tuple[int, ...], xla_reciprocal: bool | str | Form
                        ) -> tuple[np.ndarray, np.ndarray]:
    """qwix's mxfp8 along ``axes`` in blocks of 32: ``(e4m3fn codes shaped as x, float32 scales [..., blocks])``,
    its divisions in ``xla_reciprocal``'s form (:func:`qcheck.referees.form_of`)."""
    form = form_of(xla_reciprocal)
    b = Blocks(x.shape, axes, 32, "mxfp8")
    blocks = b.split(np.asarray(x, _F32))
    s = qwix_scale(np.max(np.abs(blocks), axis=-1, keepdims=True), 448.0, form.constant)
    scale = np.ldexp(_F32(1), _ceil_log2(s)).astype(_F32)  # qwix: 2 ** ceil(log2(scale))
    return b.join(qwix_cast(qwix_divide(blocks, scale, form.operand), _E4M3)), scale[..., 0]


def quantize_qwix_nvfp4(x: np.ndarray, axes: tuple[int, ...], xla_reciprocal: bool | str | Form
                        ) -> tuple[np.ndarray, np.ndarray]:
    """qwix's nvfp4 along ``axes`` in blocks of 16, one level: ``(e2m1 codes, e4m3fn block scales as float32)``,
    its divisions in ``xla_reciprocal``'s form."""
    form = form_of(xla_reciprocal)
    b = Blocks(x.shape, axes, 16, "nvfp4")
    blocks = b.split(np.asarray(x, _F32))
    s = qwix_scale(np.max(np.abs(blocks), axis=-1, keepdims=True), 6.0, form.constant)
    scale = qwix_cast(s, _E4M3).astype(_F32)  # qwix: the block scale cast to e4m3fn; no tensor scale
    return b.join(qwix_cast(qwix_divide(blocks, scale, form.operand), _E2M1)), scale[..., 0]


def quantize_jax_nvfp4_e1f12ba4(x: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """JAX's nvfp4 before e1f12ba4 with qcheck's global scale g: ``(e2m1 codes, block scales, g)``.

    Block scales amax_b / 6 / g (the global scale applied to them), codes x / block: the data was never
    divided by g. Decoded as JAX did: codes · block · g.
    """
    from qcheck.referees._formats import jax_global_scale

    g = jax_global_scale(x)
    b = Blocks(x.shape, axes, 16, "nvfp4_jax")
    blocks = b.split(np.asarray(x, _F32))
    s = np.max(np.abs(blocks), axis=-1, keepdims=True) * (_F32(1) / _F32(6)) / g
    scale = np.clip(s, 0, 448).astype(_E4M3).astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.clip(blocks / scale, -6, 6)
    v = np.where(np.isnan(v), _F32(-0.0), v)
    return b.join(v.astype(_E2M1)), scale[..., 0], g


def _jax_e1f12ba4(x: np.ndarray, axes: tuple[int, ...], ftz: bool) -> np.ndarray:
    codes, scale, g = quantize_jax_nvfp4_e1f12ba4(x, axes)
    b = Blocks(x.shape, axes, 16, "")
    return b.join(flush(b.split(codes.astype(_F32)) * scale[..., None] * g, ftz).astype(_F32))


def _dequantized(rule: Callable, block: int) -> Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]:
    def qdq(x: np.ndarray, axes: tuple[int, ...], ftz: bool) -> np.ndarray:
        # A jitted site (what exact checks) divides by the scale as XLA does under jit.
        codes, scale = rule(x, axes, True)
        b = Blocks(x.shape, axes, block, "")
        return b.join(flush(b.split(codes.astype(_F32)) * scale[..., None], ftz).astype(_F32))

    return qdq


#: For each qcheck format, ``(description, qdq(x, contraction_axes, ftz))`` of what a library computes
#: in its place: the exact check names a failing site that equals one of them.
LIBRARY_RULES: dict[str, tuple[tuple[str, Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]], ...]] = {
    "mxfp8": (("qwix's mxfp8 (block scale 2^ceil(log2(amax / 448)), not OCP MX's 2^(floor(log2 amax) - 8))",
               _dequantized(quantize_qwix_mxfp8, 32)),),
    "nvfp4": (("qwix's one-level nvfp4 (e4m3fn block scales of amax / 6, no per-tensor scale)",
               _dequantized(quantize_qwix_nvfp4, 16)),),
    "nvfp4_jax": (("JAX's nvfp4 before e1f12ba4 (the global scale divides the block scales but not the data, "
                   "so its e2m1 codes are mostly zero)", _jax_e1f12ba4),),
}
