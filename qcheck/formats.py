"""Number formats: saturating casts, quantize/dequantize with the codes, and qdq in a named format.

Everything here is plain ``jax.numpy`` on top of ml_dtypes types, so a user can
check values against a format without building a layer. The fp8 formats are the
raw element types at scale 1 — exactly what a freshly built delayed-scaling fp8
layer applies — and saturate, unlike a bare ``astype`` (ml_dtypes turns e4m3fn
overflow into NaN). ``e4m3fn_current`` and ``e5m2_current`` scale the whole
tensor by its own amax (TransformerEngine's Float8CurrentScaling); ``nvfp4`` and
``mxfp8`` are block formats. ``int8`` is symmetric absmax/127 (AQT with
``preserve_max_val=True``); ``int8_aqt`` and ``int8_qwix`` are the int8 that
AQT's and qwix's defaults compute, absmax/127.5; ``mxfp8_jax`` and ``nvfp4_jax`` are the block formats
``jax.nn.scaled_dot_general`` computes (see :mod:`qcheck.adapters`). :func:`quantize` returns the element codes and the
scales in their storage types, :func:`dequantize` maps them back, and
:func:`qdq` is the one after the other.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from qcheck._versions import require_supported

require_supported()  # before JAX's own import errors can read as qcheck's

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax import Array  # noqa: E402
from jax.typing import ArrayLike  # noqa: E402

__all__ = [
    "CURRENT_MAX_SCALE",
    "E2M1_GRID",
    "AXIS_FORMATS",
    "FP8_DTYPES",
    "FP8_SIBLINGS",
    "jax_nvfp4_global_scale",
    "block_size",
    "MX_BLOCK",
    "NVFP4_BLOCK",
    "Quantized",
    "dequantize",
    "format_names",
    "qdq",
    "quantize",
    "saturating_cast",
    "round_e2m1",
    "stochastic_round_e2m1",
]

#: fp8 element types qcheck knows, by the name ml_dtypes gives them.
FP8_DTYPES: dict[str, np.dtype] = {
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
}

#: Each fp8 format's sibling flavour (fnuz <-> not fnuz): what a wrong-flavour bug casts to instead.
FP8_SIBLINGS: dict[str, str] = {
    "e4m3fn": "e4m3fnuz",
    "e4m3fnuz": "e4m3fn",
    "e5m2": "e5m2fnuz",
    "e5m2fnuz": "e5m2",
}

INT8_MAX = 127
#: AQT v2's default int8 (``preserve_max_val=False``) and qwix's int8 both map a
#: slice's absmax onto the edge of the last int8 bucket, 127.5, not onto 127.
INT8_EDGE = 127.5

# Format name -> fp8 element type; int8 is handled separately (it needs a scale).
_FP8_FORMATS: dict[str, np.dtype] = {
    "e4m3fn": FP8_DTYPES["float8_e4m3fn"],
    "e4m3fnuz": FP8_DTYPES["float8_e4m3fnuz"],
    "e5m2": FP8_DTYPES["float8_e5m2"],
    "e5m2fnuz": FP8_DTYPES["float8_e5m2fnuz"],
}


#: NVFP4 (NVIDIA): float4_e2m1fn elements in blocks of 16 along the contraction
#: axis, a float8_e4m3fn scale per block, a float32 scale per tensor.
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: Below this tensor amax the NVFP4 tensor scale 6·448/amax would overflow float32.
NVFP4_MIN_AMAX = float(E2M1_MAX * E4M3_MAX / np.finfo(np.float32).max)
#: The non-negative values of float4_e2m1fn.
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)

#: MXFP8 (OCP Microscaling v1.0): float8_e4m3fn elements in blocks of 32 along
#: the contraction axes, one float8_e8m0fnu (power of two) scale per block. A
#: block whose amax is below 2^-119 takes the clamped scale 2^-127 and no longer
#: reaches 448. XLA on CPU reads subnormal float32 as zero, so a subnormal x
#: comes back 0 there (a block of them is an all-zero block: scale 2^-127).
MX_BLOCK = 32
#: Exponent of e4m3's largest binade (448 = 1.75 · 2^8): a block's scale is
#: 2^(floor(log2 amax) − 8), so its amax lands in [256, 512) and saturates above 448.
E4M3_EMAX = 8
#: The exponents float8_e8m0fnu encodes (bits 0..254; 255 is NaN).
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127

# Current-scaled formats: one float32 scale per tensor from the tensor's own amax.
_CURRENT_FORMATS: dict[str, np.dtype] = {
    "e4m3fn_current": FP8_DTYPES["float8_e4m3fn"],
    "e5m2_current": FP8_DTYPES["float8_e5m2"],
}
#: Cap on a current-scaled tensor's scale fmax / amax. Uncapped it would overflow
#: float32 for amax below fmax / float32 max (TransformerEngine clamps it to the
#: float32 max there); capped at 2^126 its inverse, the decode scale, stays a
#: normal float32 that XLA on CPU does not flush to zero. A tensor whose amax is
#: below fmax · 2^-126 (about 5e-36 for e4m3fn, 7e-34 for e5m2) so no longer
#: reaches the format's largest value; it is still quantized, not flushed.
CURRENT_MAX_SCALE = 2.0**126

_BLOCK_FORMATS = {"nvfp4": NVFP4_BLOCK, "mxfp8": MX_BLOCK, "nvfp4_jax": NVFP4_BLOCK, "mxfp8_jax": MX_BLOCK}


def format_names() -> tuple[str, ...]:
    """The format names :func:`qdq` and :func:`quantize` accept."""
    return ("int8", *_FP8_FORMATS, *_CURRENT_FORMATS, *_BLOCK_FORMATS, *_INT8_LIBRARY_FORMATS)


def block_size(fmt: str) -> int | None:
    """Elements per scale block along the quantized axes (``nvfp4*``: 16, ``mxfp8*``: 32); None for other formats."""
    _check_format(fmt)
    return _BLOCK_FORMATS.get(fmt)


def _check_format(fmt: str) -> None:
    if fmt not in format_names():
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(format_names())}")


def saturating_cast(x: ArrayLike, dtype: np.dtype | type) -> Array:
    """Clip ``x`` to ±finfo(dtype).max, then round to ``dtype`` (nearest even)."""
    dtype = np.dtype(dtype)
    x = jnp.asarray(x)
    bound = float(ml_dtypes.finfo(dtype).max)
    return jnp.clip(x, -bound, bound).astype(dtype)


def _normalize_axis(axis: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for an array of rank {ndim}")
        out.append(a % ndim)
    return tuple(sorted(set(out)))


def _to_blocks(x: Array, axes: tuple[int, ...], block: int, fmt: str):
    """Move ``axes`` last and flatten them into blocks: ``[..., n_blocks, block]``, plus the inverse."""
    rest = [a for a in range(x.ndim) if a not in axes]
    moved = jnp.transpose(x, (*rest, *axes))
    lead = moved.shape[: len(rest)]
    k = math.prod(moved.shape[len(rest):])
    if k % block:
        where = (f"axis {axes[0]} has {k} elements" if len(axes) == 1 else
                 f"axes {axes} have {' x '.join(str(x.shape[a]) for a in axes)} = {k} elements")
        raise ValueError(
            f"{fmt} needs whole blocks of {block} along the contraction axis, but {where}, "
            f"which is not a multiple of {block}"
        )
    blocks = moved.reshape(*lead, k // block, block)

    def restore(y: Array) -> Array:
        return jnp.transpose(y.reshape(moved.shape), np.argsort((*rest, *axes)))

    return blocks, restore


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


@dataclasses.dataclass(frozen=True)
class Quantized:
    """``x`` in a format: the element codes and the scales, each in its storage type.

    ``codes`` has ``x``'s shape, in the format's element type: int8 for
    ``int8``, the float8 type for the fp8, current-scaled and ``mxfp8`` formats,
    float4_e2m1fn for ``nvfp4``. ``scales`` by format (a block format's
    ``[..., n_blocks]`` is the non-contraction axes of ``x`` in order, then one
    entry per block along the flattened contraction axes):

    - ``int8``, ``int8_aqt``, ``int8_qwix``: ``"slice"``, float32 (float64
      for a float64 ``x``), ``x``'s shape with ``axis`` kept as 1:
      x ≈ codes · slice.
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
    which :func:`dequantize` returns. A pytree, so it crosses ``jax.jit``.
    """

    format: str
    codes: Array
    scales: dict[str, Array]
    axis: tuple[int, ...]
    dtype: np.dtype


jax.tree_util.register_dataclass(Quantized, data_fields=["codes", "scales"], meta_fields=["format", "axis", "dtype"])

_Codes = tuple[Array, dict[str, Array]]


def _int8_quantize(x: Array, axes: tuple[int, ...]) -> _Codes:
    # absmax/127, which is AQT v2 with preserve_max_val=True (not AQT's default,
    # absmax/127.5: see int8_aqt): symmetric, scale from the absolute max over the
    # contraction axes, round half to even, clip to ±127. An all-zero slice keeps scale 1 so
    # zeros stay zeros instead of becoming NaN. Arithmetic stays in x's dtype, as
    # it always has; the scale is stored widened, which is exact.
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    # Test the scale, not amax: XLA on CPU flushes subnormals, so a slice whose
    # amax/127 is subnormal would otherwise divide by zero and come back NaN.
    scale = amax / INT8_MAX
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    codes = jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX)
    return codes.astype(jnp.int8), {"slice": scale.astype(jnp.promote_types(x.dtype, jnp.float32))}


def _int8_aqt_quantize(x: Array, axes: tuple[int, ...]) -> _Codes:
    # AQT v2's default int8 (aqtp 0.9.0: quantizer_make(8), as config_v4 builds
    # it), op for op: AbsMaxCalibration turns an all-zero absmax into 1, the scale
    # is absmax / 127.5 (IntSymmetric with preserve_zero and not preserve_max_val),
    # QTensor.quant multiplies by reciprocal(scale), an infinite reciprocal (a
    # scale flushed to zero) becoming 1, then IntSymmetric clips to ±127 and
    # rounds half to even. The same operations, so XLA rewrites them alike.
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    amax = jnp.where(amax == 0, jnp.ones_like(amax), amax)
    scale = amax / INT8_EDGE
    inv = jax.lax.reciprocal(scale)
    inv = jnp.where(jnp.isinf(inv), jnp.ones_like(inv), inv)
    codes = jax.lax.round(jnp.clip(x * inv, -INT8_MAX, INT8_MAX), jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    return codes.astype(jnp.int8), {"slice": scale.astype(jnp.promote_types(x.dtype, jnp.float32))}


def _int8_qwix_quantize(x: Array, axes: tuple[int, ...]) -> _Codes:
    # qwix 0.1.8's int8 (qarray.quantize, absmax calibration), op for op: scale
    # absmax / 127.5 (get_symmetric_bound: iinfo.max + 0.5), a scale below
    # sqrt(finfo.tiny) (2^-63 in float32: a slice with absmax below about 1.4e-17
    # comes back zero) replaced by 1, x / scale rounded half to even, then a
    # saturating cast: codes in [-128, 127], so -absmax -> -128 but +absmax -> 127.
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = amax / INT8_EDGE
    scale = jnp.where(scale < float(jnp.finfo(x.dtype).tiny) ** 0.5, jnp.ones_like(scale), scale)
    codes = jnp.clip(jnp.round(x / scale), -INT8_MAX - 1, INT8_MAX)
    return codes.astype(jnp.int8), {"slice": scale.astype(jnp.promote_types(x.dtype, jnp.float32))}


_INT8_LIBRARY_FORMATS = {"int8_aqt": _int8_aqt_quantize, "int8_qwix": _int8_qwix_quantize}

#: Formats whose quantization depends on the axes it runs along (a scale per slice or per block); the
#: plain fp8 and current-scaled formats treat the whole tensor alike along any axes.
AXIS_FORMATS: frozenset[str] = frozenset({"int8", *_INT8_LIBRARY_FORMATS, *_BLOCK_FORMATS})


def _int8_dequantize(q: Quantized) -> Array:
    # codes (7 bits) × scale (at most 24) is exact in float32, so the one rounding
    # is to q.dtype: the same bits as multiplying in x's dtype. int8 has no
    # negative zero, so a negative value that rounds to code 0 comes back +0.0
    # (qdq kept its codes in float before codes existed and returned -0.0 there).
    scale = q.scales["slice"]
    return (q.codes.astype(scale.dtype) * scale).astype(q.dtype)


def _fp8_quantize(x: Array, dtype: np.dtype) -> _Codes:
    return saturating_cast(x, dtype), {}


def _current_quantize(x: Array, dtype: np.dtype) -> _Codes:
    # TransformerEngine's Float8CurrentScaling: the scale maps this tensor's own
    # amax (over all of it, whatever the contraction axes) onto the format's max.
    # XLA rewrites a division by a broadcast operand into a multiplication by its
    # reciprocal, so both scale divisions are scalar/scalar.
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    fmax = jnp.float32(ml_dtypes.finfo(dtype).max)
    scale = jnp.where(amax > 0, jnp.minimum(fmax / amax, jnp.float32(CURRENT_MAX_SCALE)), jnp.float32(1.0))
    return saturating_cast(x.astype(jnp.float32) * scale, dtype), {"tensor": scale}


def _current_dequantize(q: Quantized) -> Array:
    # XLA on CPU flushes a product below 2^-126 to zero, so an x just above
    # float32's smallest normal whose code rounds down may come back 0.
    scale_inv = jnp.float32(1.0) / q.scales["tensor"]
    return (q.codes.astype(jnp.float32) * scale_inv).astype(q.dtype)


def _nvfp4_decode(s_block: Array, s_enc: Array) -> tuple[Array, Array, Array]:
    """``(nonzero, encode, decode)`` per block from the e4m3 block scales ``[..., n_blocks, 1]``."""
    # Shared by quantize and dequantize so that dequantize recomputes encode from
    # the stored scales by the very same operations (s_enc / s_block, then
    # 1 / encode) and so matches the historical qdq bit for bit; q · (block /
    # tensor), the textbook order, differs by an ulp.
    s_block = s_block.astype(jnp.float32)
    nonzero = s_block > 0
    encode = jnp.broadcast_to(s_enc, s_block.shape) / jnp.where(nonzero, s_block, 1.0)
    decode = jnp.ones_like(encode) / encode
    return nonzero, encode, decode


def _nvfp4_quantize(x: Array, axes: tuple[int, ...], rng: Array | None) -> _Codes:
    # XLA rewrites a division by a broadcast operand into a multiplication by its
    # reciprocal (one ulp off: 2688 / 448 -> 6.0000005), so every division here is
    # scalar/scalar or has a per-block divisor, and exact scales stay exact. Under
    # jit, fusion may still move a result by one ulp against eager execution.
    blocks, restore = _to_blocks(x.astype(jnp.float32), axes, NVFP4_BLOCK, "nvfp4")
    amax = jnp.max(jnp.abs(blocks))
    # Per-tensor encode scale maps the global amax onto e2m1 max × e4m3 max. A
    # tensor so small that this scale overflows float32 is flushed to zero: its
    # block scales are zero (they would round to zero in e4m3 anyway).
    representable = amax > NVFP4_MIN_AMAX
    s_enc = jnp.where(representable, jnp.float32(E2M1_MAX * E4M3_MAX) / amax, jnp.float32(1.0))
    block_amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    s_block = saturating_cast(block_amax * (s_enc / E2M1_MAX), _FP8_FORMATS["e4m3fn"])
    s_block = jnp.where(representable, s_block, jnp.zeros_like(s_block))
    nonzero, encode, _ = _nvfp4_decode(s_block, s_enc)
    v = jnp.clip(blocks * encode, -E2M1_MAX, E2M1_MAX)
    q = round_e2m1(v) if rng is None else stochastic_round_e2m1(v, rng)
    # The e2m1 values as float32; quantize stores them as float4_e2m1fn (exact).
    codes = restore(jnp.where(nonzero, q, jnp.zeros_like(q)))
    return codes, {"block": s_block[..., 0], "tensor": s_enc}


def _nvfp4_dequantize(q: Quantized) -> Array:
    blocks, restore = _to_blocks(q.codes.astype(jnp.float32), q.axis, NVFP4_BLOCK, "nvfp4")
    nonzero, _, decode = _nvfp4_decode(q.scales["block"][..., None], q.scales["tensor"])
    return restore(jnp.where(nonzero, blocks * decode, 0.0)).astype(q.dtype)


def _pow2(e: Array) -> Array:
    """2^e as float32, built from its bits so it is exact; ``e`` must lie in [-126, 127]."""
    return jax.lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)


def _mxfp8_quantize(x: Array, axes: tuple[int, ...]) -> _Codes:
    blocks, restore = _to_blocks(x.astype(jnp.float32), axes, MX_BLOCK, "mxfp8")
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    # floor(log2 amax) exactly: amax = m · 2^e with m in [0.5, 1). A zero block
    # (or a subnormal one, which XLA on CPU reads as zero anyway) takes the
    # smallest scale, as log2(0) = -inf clamped to the e8m0 range would.
    _, e = jnp.frexp(amax)
    normal = amax >= np.finfo(np.float32).tiny
    exp = jnp.where(normal, jnp.clip(e - 1 - E4M3_EMAX, E8M0_MIN_EXP, E8M0_MAX_EXP), E8M0_MIN_EXP)
    # Divide by multiplying by 2^-exp, exact: a float32 amax is below 2^128, so
    # exp <= 119 and 2^-exp lies in [2^-119, 2^127], normal.
    codes = saturating_cast(blocks * _pow2(-exp), _FP8_FORMATS["e4m3fn"])
    bits = (exp - E8M0_MIN_EXP).astype(jnp.uint8)
    return restore(codes), {"block": jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)[..., 0]}


def _mxfp8_dequantize(q: Quantized) -> Array:
    blocks, restore = _to_blocks(q.codes.astype(jnp.float32), q.axis, MX_BLOCK, "mxfp8")
    bits = jax.lax.bitcast_convert_type(q.scales["block"], jnp.uint8)[..., None]
    exp = bits.astype(jnp.int32) + E8M0_MIN_EXP
    # The smallest e8m0 scale, 2^-127, is subnormal in float32 and XLA on CPU
    # would flush it to zero, so the scale is applied in two normal halves. Each
    # product is exact; only a result below 2^-126 (a subnormal x) flushes.
    half = exp // 2
    return restore(blocks * _pow2(half) * _pow2(exp - half)).astype(q.dtype)


# -- JAX's block formats (jax.nn.scaled_dot_general, jax/_src/cudnn/scaled_matmul_stablehlo.py `quantize`,
# the same rule in jax 0.10.2 and 0.12.0.1 for float32 operands) -------------------------------------------

#: NVFP4's two-level range: e2m1's max times e4m3's max.
NVFP4_RANGE = E2M1_MAX * E4M3_MAX  # 2688


def jax_nvfp4_global_scale(x: ArrayLike) -> Array:
    """The power of two at or above ``max|x| / 2688`` (1 for an all-zero ``x``), a float32 scalar.

    JAX leaves the NVFP4 global scale to the caller (``get_scaled_dot_general_config("nvfp4",
    global_scale)``, default 1); NVIDIA's is ``amax / (6 · 448)``. Rounded up to a power of two, dividing
    by it is exact and JAX's rescaling of the product by both operands' global scales is exact too, so
    the product equals the einsum of the dequantized operands bit for bit. A scalar, not JAX's default
    shape (1,), which ``jax_numpy_rank_promotion="raise"`` refuses to broadcast against the operand. Exact, without a division:
    with amax = m · 2^e (m in [0.5, 1)) and 2688 = 0.65625 · 2^12, the scale is 2^(e - 12) when
    m <= 0.65625, else 2^(e - 11).
    """
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.max(jnp.abs(x))
    m, e = jnp.frexp(amax)
    k = jnp.clip(jnp.where(m <= 0.65625, e - 12, e - 11), E8M0_MIN_EXP + 1, E8M0_MAX_EXP)
    return jnp.where(amax >= np.finfo(np.float32).tiny, _pow2(k), jnp.float32(1.0))


def _e8m0_round_up_bits(s: Array) -> Array:
    # JAX's cast_to_e8m0_with_rounding_up, op for op: the float32 exponent, plus one when any mantissa bit
    # is set, except in the top binade (exponent 254) and for subnormals of at most half the smallest normal.
    bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
    exp, mant = bits >> 23, bits & 0x7FFFFF
    up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    return jnp.where(up, exp + 1, exp).astype(jnp.uint8)


def _e8m0_decode(bits: Array) -> Array:
    # JAX's e8m0_to_dtype: the bits as a float32 exponent; bits 0 (2^-127) as the float32 value 2^-127.
    v = jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 23, jnp.float32)
    return jnp.where(v == 0, jnp.float32(2.0**-127), v)


def _mxfp8_jax_quantize(x: Array, axes: tuple[int, ...]) -> _Codes:
    # JAX's mxfp8: scale amax / 448 (XLA: times float32(1 / 448)) rounded UP to a power of two, where
    # OCP MX v1.0 takes 2^(floor(log2 amax) - 8); codes x / scale clipped to ±448 and cast to e4m3fn.
    blocks, restore = _to_blocks(x.astype(jnp.float32), axes, MX_BLOCK, "mxfp8_jax")
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    bits = _e8m0_round_up_bits(amax * jnp.float32(1 / E4M3_MAX))
    codes = saturating_cast(blocks / _e8m0_decode(bits), _FP8_FORMATS["e4m3fn"])
    return restore(codes), {"block": jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)[..., 0]}


def _nvfp4_jax_quantize(x: Array, axes: tuple[int, ...]) -> _Codes:
    # JAX's nvfp4 with qcheck's power-of-two global scale g: x / g, block scale amax_b / 6 (XLA: times
    # float32(1 / 6)) clipped to [0, 448] and cast to e4m3fn, codes (x / g) / block clipped to ±6 and cast
    # to e2m1. One level below the global scale, where qcheck's nvfp4 divides s_enc / s_block first.
    g = jax_nvfp4_global_scale(x)
    blocks, restore = _to_blocks(x.astype(jnp.float32) / g, axes, NVFP4_BLOCK, "nvfp4_jax")
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    s_block = jnp.clip(amax * jnp.float32(1 / E2M1_MAX), 0, E4M3_MAX).astype(jnp.float8_e4m3fn)
    v = jnp.clip(blocks / s_block.astype(jnp.float32), -E2M1_MAX, E2M1_MAX)
    # A block whose scale rounds to 0 divides by 0: ±6, and 0 / 0 (NaN), which XLA's e2m1 cast makes -0.
    v = jnp.where(jnp.isnan(v), jnp.float32(-0.0), v)
    return restore(round_e2m1(v)), {"block": s_block[..., 0], "tensor": g}


def _mxfp8_jax_dequantize(q: Quantized) -> Array:
    # JAX's CPU lowering (jax 0.12): codes and scales to float32, multiplied per block.
    blocks, restore = _to_blocks(q.codes.astype(jnp.float32), q.axis, MX_BLOCK, "mxfp8_jax")
    bits = jax.lax.bitcast_convert_type(q.scales["block"], jnp.uint8)[..., None]
    exp = bits.astype(jnp.int32) + E8M0_MIN_EXP
    half = exp // 2  # 2^-127 is subnormal: applied in two normal halves (see _mxfp8_dequantize)
    return restore(blocks * _pow2(half) * _pow2(exp - half)).astype(q.dtype)


def _nvfp4_jax_dequantize(q: Quantized) -> Array:
    # codes times the e4m3 block scale, then the (power-of-two: exact) global scale.
    blocks, restore = _to_blocks(q.codes.astype(jnp.float32), q.axis, NVFP4_BLOCK, "nvfp4_jax")
    out = blocks * q.scales["block"].astype(jnp.float32)[..., None] * q.scales["tensor"]
    return restore(out).astype(q.dtype)


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
    scale is below 2^-63 (float32) come back zero. The fp8 formats are the element type at scale 1,
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
    if fmt in ("nvfp4", "nvfp4_jax"):
        q = dataclasses.replace(q, codes=q.codes.astype(jnp.float4_e2m1fn))
    return q


def _quantize(x: ArrayLike, fmt: str, axis: int | tuple[int, ...], rng: Array | None) -> Quantized:
    # quantize() without storing nvfp4's codes as e2m1: qdq() leaves the type out
    # of the program (round_e2m1 says why), with the same values.
    _check_format(fmt)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {x.dtype}")
    axes = _normalize_axis(axis, x.ndim)
    if rng is not None and fmt != "nvfp4":
        raise ValueError(f"format {fmt!r} has no stochastic rounding; only nvfp4 takes rng")
    if fmt == "int8":
        codes, scales = _int8_quantize(x, axes)
    elif fmt in _INT8_LIBRARY_FORMATS:
        codes, scales = _INT8_LIBRARY_FORMATS[fmt](x, axes)
    elif fmt == "nvfp4":
        codes, scales = _nvfp4_quantize(x, axes, rng)
    elif fmt == "mxfp8":
        codes, scales = _mxfp8_quantize(x, axes)
    elif fmt == "mxfp8_jax":
        codes, scales = _mxfp8_jax_quantize(x, axes)
    elif fmt == "nvfp4_jax":
        codes, scales = _nvfp4_jax_quantize(x, axes)
    elif fmt in _CURRENT_FORMATS:
        codes, scales = _current_quantize(x, _CURRENT_FORMATS[fmt])
    else:
        codes, scales = _fp8_quantize(x, _FP8_FORMATS[fmt])
    return Quantized(format=fmt, codes=codes, scales=scales, axis=axes, dtype=np.dtype(x.dtype))


_DEQUANTIZE: dict[str, Callable[[Quantized], Array]] = {
    "int8": _int8_dequantize,
    **{name: lambda q: q.codes.astype(q.dtype) for name in _FP8_FORMATS},
    **{name: _current_dequantize for name in _CURRENT_FORMATS},
    "nvfp4": _nvfp4_dequantize,
    "mxfp8": _mxfp8_dequantize,
    "mxfp8_jax": _mxfp8_jax_dequantize,
    "nvfp4_jax": _nvfp4_jax_dequantize,
    **{name: _int8_dequantize for name in _INT8_LIBRARY_FORMATS},
}


def dequantize(q: Quantized) -> Array:
    """The values ``q`` stands for, in the dtype of the array it was quantized from."""
    if q.format not in _DEQUANTIZE:
        raise ValueError(f"unknown format {q.format!r}; valid formats: {', '.join(format_names())}")
    return _DEQUANTIZE[q.format](q)


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
        _check_format(fmt)  # before it becomes a static argument, which must hash
        return _nested_qdq(x, fmt, _normalize_axis(axis, x.ndim), rng)
    return dequantize(_quantize(x, fmt, axis, rng))


# Inside a trace (a layer's forward pass or train step) qdq is a nested jit, so
# JAX traces it once per format, axes and operand type in a process, however
# many call sites, layers and programs share them: the matrix traces qdq 135
# times instead of 568. XLA inlines the call before it fuses anything, so
# the compiled program and its bits are the same (tests/test_formats.py
# compares the two). Eager calls stay op by op, as eager quantize and dequantize
# are: one fused program can round an NVFP4 value an ulp away from the same
# operations run one by one (see _nvfp4_quantize).
@functools.partial(jax.jit, static_argnums=(1, 2))
def _nested_qdq(x: Array, fmt: str, axes: tuple[int, ...], rng: Array | None) -> Array:
    return dequantize(_quantize(x, fmt, axes, rng))
