"""Properties every number format must have, as predicates that raise AssertionError.

The hypothesis tests (test_format_properties.py) run them on qcheck.formats;
the failing twins run them on broken quantizers, so each property is shown to
be able to fail. References here are numpy/ml_dtypes arithmetic on the output,
never a second call into qcheck.formats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qcheck import formats

SHAPE = (4, 32)  # four slices of 32: two NVFP4 blocks or one MXFP8 block each; int8 scales per slice (axis -1)

# Magnitudes from far below every format's smallest value to beyond every
# maximum, so saturation and underflow are both exercised.
VALUES = hnp.arrays(
    np.float32,
    SHAPE,
    elements=st.floats(-1e5, 1e5, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False),
)


@dataclasses.dataclass(frozen=True)
class Format:
    """One row of the table: a format and what its properties may tolerate."""

    name: str
    block: int  #: values sharing one scale along the last axis
    #: A second qdq may move a value this far (a recomputed scale rounds). None: the
    #: format is not idempotent (absmax/127.5 shrinks the scale each time) but must
    #: keep each block's codes.
    idempotent_ulps: int | None
    dtype: np.dtype | None = None  #: element type for fp8-element formats
    fnuz: bool = False
    #: For fp8 elements under a scale: the decode scale of each block, ``[rows, n_blocks, 1]``,
    #: from the format's definition (numpy); None is scale 1.
    spec_scales: Callable[[np.ndarray, Format], np.ndarray] | None = None
    #: For integer formats: the lowest and highest code, and the figure a block's absmax
    #: maps onto (its scale is absmax / int_edge, from the definition).
    int_codes: tuple[int, int] | None = None
    int_edge: float = 127.0
    #: For integer formats: what the format adds to a block's absmax before scaling (Keras's epsilon).
    int_epsilon: float = 0.0
    #: Blocks whose absmax is below this come back zero (a limit with its own test).
    min_amax: float = 0.0
    #: An asymmetric integer format (a zero point per block): its step is (max - min) / int_edge over the block's
    #: min and max clipped around 0, and ``int_codes`` bound the codes minus their zero point.
    zero_point: bool = False
    #: Every block lifted to hold a value at most -straddle and one at least straddle (where it holds none), so its
    #: span is at least 2 · straddle and 0 lies inside it: EasyDeL's float16 scale flushes below a span of about
    #: 255 · 2^-24, and its float16 zero point overflows for a block far from 0 (tests/test_easydel.py pins both).
    straddle: float = 0.0
    #: The properties the format's rule does not keep, each with why: the test says so (a skip naming it).
    not_held: tuple[tuple[str, str], ...] = ()


def mx_spec_scales(x: np.ndarray, fmt: Format) -> np.ndarray:
    """OCP MX v1.0: 2^(floor(log2 block amax) − emax of the element type), clamped to e8m0's 2^±127.

    A zero block takes the smallest scale, as log2(0) = -inf clamped would.
    """
    amax = np.max(np.abs(_blocks(x, fmt)), axis=-1, keepdims=True)
    emax = np.frexp(float(ml_dtypes.finfo(fmt.dtype).max))[1] - 1  # 448 = 1.75 · 2^8 -> 8
    exp = np.where(amax > 0, np.clip(np.frexp(amax)[1] - 1 - emax, -127, 127), -127)
    return np.ldexp(np.ones(amax.shape, np.float32), exp.astype(np.int32))


def mx_jax_spec_scales(x: np.ndarray, fmt: Format) -> np.ndarray:
    """JAX's MXFP8 (jax.nn.scaled_dot_general): amax / 448 rounded up to a power of two (float64 here).

    A zero block takes 2^-127, as JAX's e8m0 bits 0 read.
    """
    amax = np.max(np.abs(_blocks(x, fmt)), axis=-1, keepdims=True).astype(np.float64)
    s = amax * float(np.float32(1) / np.float32(448))  # XLA's float32 reciprocal of 448, as JAX computes
    with np.errstate(divide="ignore"):
        exp = np.where(s > 0, np.ceil(np.log2(np.where(s > 0, s, 1.0))), -127)
    return np.ldexp(np.ones(amax.shape, np.float32), np.clip(exp, -127, 127).astype(np.int32))


def current_spec_scales(x: np.ndarray, fmt: Format) -> np.ndarray:
    """TransformerEngine's current scaling: decode scale 1 / (fmax / amax) over the whole tensor.

    The encode scale is capped at formats.CURRENT_MAX_SCALE, a documented limit.
    """
    amax = np.float32(np.max(np.abs(x)))
    fmax = np.float32(ml_dtypes.finfo(fmt.dtype).max)
    with np.errstate(over="ignore", divide="ignore"):
        scale = np.minimum(fmax / amax, np.float32(formats.CURRENT_MAX_SCALE)) if amax > 0 else np.float32(1)
    return np.full((x.shape[0], x.shape[1] // fmt.block, 1), np.float32(1) / scale, np.float32)


E4M3FN, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)

FORMATS = (
    Format("int8", block=32, idempotent_ulps=4, int_codes=(-127, 127)),
    # absmax/127.5: AQT's default flushes a slice whose scale is subnormal (XLA on CPU);
    # qwix replaces a scale below 2^-63 by 1.
    Format("int8_aqt", block=32, idempotent_ulps=None, int_codes=(-127, 127), int_edge=127.5,
           min_amax=2 * 127.5 * 2.0**-126),
    Format("int8_qwix", block=32, idempotent_ulps=None, int_codes=(-128, 127), int_edge=127.5,
           min_amax=2 * 127.5 * 2.0**-63),
    # Keras: an encode scale 127 / (absmax + 1e-7). Below an absmax of 254e-7 its top code is under 126.5, so a
    # second qdq takes another scale (tiny slices have their own test); above it, a second qdq keeps the codes.
    Format("int8_keras", block=32, idempotent_ulps=None, int_codes=(-127, 127), int_epsilon=1e-7, min_amax=1e-3),
    # Keras's int4: an encode scale 7 / (absmax + 1e-7), codes -8..7 (-8 unreached: the grid is symmetric).
    Format("int4_keras", block=32, idempotent_ulps=None, int_codes=(-7, 7), int_edge=7.0, int_epsilon=1e-7,
           min_amax=1e-3),
    # qwix's minmax int8: the step (max - min) / 255 with min <= 0 <= max, so codes minus their zero point lie in
    # ±255 (a whole zero point keeps the grid the step's multiples: sign symmetric, codes kept by a second qdq);
    # a step below 2^-63 becomes 1, as int8_qwix's.
    Format("int8_qwix_minmax", block=32, idempotent_ulps=None, int_codes=(-255, 255), int_edge=255.0,
           min_amax=2 * 255 * 2.0**-63, zero_point=True),
    # Keras's default int4: ((max - min) + 1e-7) / 15 per group of 128, a zero point, codes minus it in ±15. A row
    # of 32 is one partial group, which Keras zero-pads, so its min <= 0 <= max as qwix's minmax clips them: the
    # properties hold there. A full group of one sign far from 0 saturates (Keras's rule: the zero point clips to
    # -8), outside these rows; test_formats pins it to the referee. Below an absmax of 1e-3 the epsilon is a
    # visible part of the step, as int4_keras's.
    Format("int4_keras_grouped", block=32, idempotent_ulps=None, int_codes=(-15, 15), int_edge=15.0,
           int_epsilon=1e-7, min_amax=1e-3, zero_point=True),
    # EasyDeL's INT8 (ejkernel's affine): codes 0..255 over the group's own min and max, a float16 scale and a
    # float16 zero point that is never rounded. A row of 32 is one partial group of 64, zero-padded, so 0 is inside
    # its range.
    Format("int8_easydel", block=32, idempotent_ulps=None, int_codes=(-255, 255), int_edge=255.0, zero_point=True,
           straddle=1.0, not_held=(
               ("idempotent", "its codes are rounded at the float32 scale and zero point and decoded at their "
                              "float16 roundings, so a second qdq sees another min and max and moves codes"),
               ("sign_symmetric", "its grid, (k - zero point) · scale, is offset by a fractional zero point that "
                                  "-x does not mirror"),
               ("zero_stays_zero", "0 is no code: qdq(0) is (round(z) - z) · scale for the fractional zero point z"),
               ("on_grid", "its grid is offset by the fractional float16 zero point, not the step's multiples"),
               ("error_within_half_step", "it rounds at the float32 scale and zero point and decodes at their "
                                          "float16 roundings, which moves a value past half a step"))),
    Format("e4m3fn", block=32, idempotent_ulps=0, dtype=np.dtype(ml_dtypes.float8_e4m3fn)),
    Format("e4m3fnuz", block=32, idempotent_ulps=0, dtype=np.dtype(ml_dtypes.float8_e4m3fnuz), fnuz=True),
    Format("e5m2", block=32, idempotent_ulps=0, dtype=np.dtype(ml_dtypes.float8_e5m2)),
    Format("e5m2fnuz", block=32, idempotent_ulps=0, dtype=np.dtype(ml_dtypes.float8_e5m2fnuz), fnuz=True),
    Format("nvfp4", block=formats.NVFP4_BLOCK, idempotent_ulps=8),
    # One scale per tensor: the "block" is just the slice the per-block predicates walk.
    Format("e4m3fn_current", block=32, idempotent_ulps=4, dtype=E4M3FN, spec_scales=current_spec_scales),
    Format("e5m2_current", block=32, idempotent_ulps=4, dtype=E5M2, spec_scales=current_spec_scales),
    Format("mxfp8", block=formats.MX_BLOCK, idempotent_ulps=0, dtype=E4M3FN, spec_scales=mx_spec_scales),
    # JAX's rules (jax.nn.scaled_dot_general): NVFP4 under a power-of-two global scale, MXFP8 rounded up.
    Format("nvfp4_jax", block=formats.NVFP4_BLOCK, idempotent_ulps=8),
    Format("mxfp8_jax", block=formats.MX_BLOCK, idempotent_ulps=0, dtype=E4M3FN, spec_scales=mx_jax_spec_scales),
    Format("e3m4", block=32, idempotent_ulps=0, dtype=np.dtype(ml_dtypes.float8_e3m4)),
)
BY_NAME = {f.name: f for f in FORMATS}

Qdq = Callable[[np.ndarray], np.ndarray]
REL = 1e-5  # float32 slack for figures recomputed from the output


def _blocks(x: np.ndarray, fmt: Format) -> np.ndarray:
    return x.reshape(x.shape[0], -1, fmt.block)


#: An NVFP4 block scale is 448 · block_amax / tensor_amax rounded to e4m3, so a
#: block more than about 2^14.8 below the tensor's amax gets a subnormal (coarse)
#: or zero scale and is flushed: a limit of the format, pinned by its own test.
NVFP4_NORMAL_RANGE = 2.0**-14


def with_normal_block_scales(x: np.ndarray, fmt: Format) -> np.ndarray:
    """``x`` with every NVFP4 block lifted into the range where its e4m3 scale is normal.

    And every block of a format with a ``min_amax`` lifted to it; and, where the library rule a format is carries
    a defect on this version (:data:`FORMAT_DEFECTS`), every block lifted out of its reach: the defect is pinned
    where it shows (tests/test_format_edges.py's zero row, tests/test_adapters.py), the properties held elsewhere.
    """
    if fmt.name in FORMAT_DEFECTS and FORMAT_DEFECTS[fmt.name].seen_here:
        # Elements 1 and 2 of every block at least that large: zero_stays_zero zeroes every third element of a
        # row, and one of two neighbours survives it, so no block it leaves is all zeros again.
        blocks = _blocks(x, fmt).copy()
        for i in (1, 2):
            small = np.abs(blocks[..., i]) < _DEFECT_MIN_AMAX
            blocks[..., i] = np.where(small, np.float32(_DEFECT_MIN_AMAX), blocks[..., i])
        return blocks.reshape(x.shape)
    if fmt.straddle:
        blocks = _blocks(x, fmt).copy()
        low = np.min(blocks, axis=-1) > -fmt.straddle
        blocks[..., 0] = np.where(low, np.float32(-fmt.straddle), blocks[..., 0])
        high = np.max(blocks, axis=-1) < fmt.straddle
        blocks[..., 1] = np.where(high, np.float32(fmt.straddle), blocks[..., 1])
        return blocks.reshape(x.shape)
    if fmt.min_amax:
        blocks = _blocks(x, fmt).copy()
        low = np.max(np.abs(blocks), axis=-1) < fmt.min_amax
        blocks[..., 0] = np.where(low, np.float32(fmt.min_amax), blocks[..., 0])
        return blocks.reshape(x.shape)
    if fmt.name not in ("nvfp4", "nvfp4_jax") or not np.any(x):
        return x
    blocks = _blocks(x, fmt).copy()
    # nvfp4_jax's power-of-two global scale is up to twice NVIDIA's: its block scales up to a binade lower.
    floor = np.float32(np.max(np.abs(x)) * NVFP4_NORMAL_RANGE * (2 if fmt.name == "nvfp4_jax" else 1))
    low = np.max(np.abs(blocks), axis=-1) < floor
    blocks[..., 0] = np.where(low, floor, blocks[..., 0])
    return blocks.reshape(x.shape)


def assert_finite(qdq: Qdq, x: np.ndarray, fmt: Format) -> None:
    out = qdq(x)
    if bad := int(np.sum(~np.isfinite(out))):
        raise AssertionError(f"{fmt.name}: {bad} non-finite outputs from finite inputs (no saturation?)")


def assert_idempotent(qdq: Qdq, x: np.ndarray, fmt: Format) -> None:
    once = qdq(x)
    twice = qdq(once)
    if fmt.idempotent_ulps is None:
        _assert_codes_kept(x, once, twice, fmt)
        return
    ulps = np.abs(once.view(np.int32).astype(np.int64) - twice.view(np.int32).astype(np.int64))
    if ulps.max() > fmt.idempotent_ulps:
        i = np.unravel_index(np.argmax(ulps), ulps.shape)
        raise AssertionError(
            f"{fmt.name}: qdq(qdq(x)) moved {once[i]!r} to {twice[i]!r} ({ulps[i]} ulps, "
            f"allowed {fmt.idempotent_ulps})"
        )


def _assert_codes_kept(x: np.ndarray, once: np.ndarray, twice: np.ndarray, fmt: Format) -> None:
    """A second qdq rescales each block but keeps its codes.

    With an extra negative code (qwix's -128) the negative absmax's quotient is -127.5
    to within an ulp, so each qdq may put it on -127 or -128: those two may swap.
    """
    c1, c2 = (np.round(_codes(out, fmt, inp)[0]) for out, inp in ((once, x), (twice, once)))
    lo, hi = fmt.int_codes
    at_tie = (np.minimum(c1, c2) == lo) & (np.maximum(c1, c2) == lo + 1) & (lo != -hi)
    moved = (c1 != c2) & ~at_tie
    if moved.any():
        i = tuple(np.argwhere(moved)[0])
        raise AssertionError(f"{fmt.name}: qdq(qdq(x)) changed code {c1[i]:g} to {c2[i]:g} "
                             f"(value {_blocks(once, fmt)[i]!r} to {_blocks(twice, fmt)[i]!r})")


def assert_sign_symmetric(qdq: Qdq, x: np.ndarray, fmt: Format) -> None:
    pos, neg = qdq(x), qdq(-x)
    off = neg != -pos
    if fmt.int_codes is not None and fmt.int_codes[0] != -fmt.int_codes[1]:
        # An extra negative code (qwix's -128): the absmax tie goes to it on the
        # negative side and saturates to the top code on the positive side; nowhere else.
        lo, hi = fmt.int_codes
        cp, cn = (np.round(_codes(out, fmt, x)[0]).reshape(x.shape) for out in (pos, neg))
        off &= ~(((cp == hi) & (cn == lo)) | ((cp == lo) & (cn == hi)))
    if off.any():
        i = np.argwhere(off)[0]
        raise AssertionError(f"{fmt.name}: qdq(-x) != -qdq(x) at {tuple(i)}: {neg[tuple(i)]} vs {-pos[tuple(i)]}")
    if fmt.fnuz and np.any((pos == 0) & np.signbit(pos) | (neg == 0) & np.signbit(neg)):
        raise AssertionError(f"{fmt.name}: a negative zero, which fnuz formats do not have")


def assert_zero_stays_zero(qdq: Qdq, x: np.ndarray, fmt: Format) -> None:
    x = x.copy()
    x[:, ::3] = 0.0
    out = qdq(x)
    if np.any(out[:, ::3] != 0):
        raise AssertionError(f"{fmt.name}: zero inputs came back as {np.unique(out[:, ::3])}")


def assert_monotonic(qdq: Qdq, x: np.ndarray, fmt: Format) -> None:
    """Within values sharing one scale, order is preserved (ties allowed)."""
    ordered = np.sort(_blocks(x, fmt), axis=-1).reshape(x.shape)
    out = _blocks(qdq(ordered), fmt)
    if np.any(np.diff(out, axis=-1) < 0):
        raise AssertionError(f"{fmt.name}: qdq is not monotonic within a block")


def _decode_scales(out: np.ndarray, fmt: Format, x: np.ndarray) -> np.ndarray:
    """The per-block step: an integer format's from its definition, (absmax(x) + int_epsilon) / int_edge;
    NVFP4's read off the output itself, whose largest code is the format's max."""
    if fmt.zero_point:
        # From the definition: (max - min + int_epsilon) / int_edge over the block's min and max, clipped so
        # min <= 0 <= max.
        blocks = _blocks(x, fmt).astype(np.float64)
        lo = np.minimum(np.min(blocks, axis=-1, keepdims=True), 0.0)
        hi = np.maximum(np.max(blocks, axis=-1, keepdims=True), 0.0)
        return (hi - lo + fmt.int_epsilon) / fmt.int_edge
    if fmt.int_codes is not None:
        # Not read off the output: qwix's -absmax may land on -127 or -128 (its quotient
        # is within an ulp of -127.5), so the output does not say which code it is.
        amax = np.max(np.abs(_blocks(x, fmt)), axis=-1, keepdims=True).astype(np.float64)
        return (amax + fmt.int_epsilon) / fmt.int_edge
    top = np.max(np.abs(_blocks(out, fmt)), axis=-1, keepdims=True)
    return top / formats.E2M1_MAX


def _codes(out: np.ndarray, fmt: Format, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = _decode_scales(out, fmt, x)
    safe = np.where(scale > 0, scale, 1.0)
    return _blocks(out, fmt) / safe, scale


def _grid(fmt: Format) -> np.ndarray:
    if fmt.int_codes is not None:
        return np.arange(max(-fmt.int_codes[0], fmt.int_codes[1]) + 1, dtype=np.float32)
    return formats.E2M1_GRID


def _element_scales(x: np.ndarray, fmt: Format) -> tuple[np.ndarray, bool]:
    """An fp8-element format's decode scale per block, and whether all are powers of two (so exact)."""
    if fmt.spec_scales is None:
        return np.ones((x.shape[0], x.shape[1] // fmt.block, 1), np.float32), True
    scale = fmt.spec_scales(x, fmt)
    return scale, bool(np.all(np.frexp(scale)[0] == 0.5))


def assert_on_grid(qdq: Qdq, x: np.ndarray, fmt: Format) -> None:
    out = qdq(x)
    if fmt.dtype is not None:
        # codes = output / decode scale. A power-of-two scale divides out exactly;
        # any other leaves the rounding of code × scale, a few float32 ulps.
        scale, exact = _element_scales(x, fmt)
        codes = _blocks(out, fmt) / scale
        nearest = codes.astype(fmt.dtype).astype(np.float32)  # NaN or inf beyond the format's max
        tol = 0.0 if exact else REL * np.abs(nearest)
        if not np.all(np.abs(codes - nearest) <= tol):
            at = "" if fmt.spec_scales is None else " at its scale"
            raise AssertionError(f"{fmt.name}: outputs not representable in {fmt.dtype.name}{at}")
        return
    codes, _ = _codes(out, fmt, x)
    if fmt.int_codes is not None:
        nearest = np.round(codes)
        lo, hi = fmt.int_codes
        off = (np.abs(codes - nearest) > REL * np.maximum(np.abs(nearest), 1)) | (nearest < lo) | (nearest > hi)
        if off.any():
            i = tuple(np.argwhere(off)[0])
            raise AssertionError(f"{fmt.name}: outputs off the grid at their block's scale: code {codes[i]:.6g} "
                                 f"(codes {lo}..{hi})")
        return
    grid = _grid(fmt)
    nearest = grid[np.abs(np.abs(codes)[..., None] - grid).argmin(-1)]
    if np.any(np.abs(np.abs(codes) - nearest) > REL * grid[-1]):
        raise AssertionError(f"{fmt.name}: outputs off the grid at their block's scale")


def fp8_half_step(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    info = ml_dtypes.finfo(dtype)
    tiny = float(info.smallest_normal)
    exp = np.floor(np.log2(np.maximum(np.abs(y), tiny)))
    return np.where(np.abs(y) < tiny, float(info.smallest_subnormal), np.exp2(exp) * float(info.eps)) / 2


def _neighbours(v: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.minimum(np.abs(v), grid[-1])
    i = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, grid.size - 1)
    return grid[i], grid[np.minimum(i + 1, grid.size - 1)]


def assert_error_within_half_step(qdq: Qdq, x: np.ndarray, fmt: Format) -> None:
    """Round to nearest: each value moves at most half the grid step around it (after saturation)."""
    out = qdq(x)
    if fmt.dtype is not None:
        bound = float(ml_dtypes.finfo(fmt.dtype).max)
        scale, exact = _element_scales(x, fmt)
        v = _blocks(x, fmt) / scale
        y = np.clip(v, -bound, bound)
        # Beyond the format's max the value saturates (MXFP8 maps a block's amax into [256, 512)).
        allowed = (fp8_half_step(y, fmt.dtype) * (1 + REL) + (np.abs(v) - np.abs(y))) * scale
        if not exact:
            # Plus a few ulps of x for x · scale and code · (1 / scale) rounding in
            # float32, and XLA on CPU flushing a result below 2^-126 to zero.
            allowed = allowed + 4 * np.spacing(np.abs(_blocks(x, fmt))) + np.finfo(np.float32).tiny
        err = np.abs(_blocks(out, fmt) - _blocks(x, fmt))
    else:
        codes, scale = _codes(out, fmt, x)
        v = _blocks(x, fmt) / np.where(scale > 0, scale, 1.0)
        lo, hi = _neighbours(v, _grid(fmt))
        # Beyond the largest code (possible for NVFP4, whose block scale is itself
        # rounded to e4m3) the value saturates to it.
        clipped = np.maximum(np.abs(v) - _grid(fmt)[-1], 0)
        # Plus a few ulps of x: rebuilding code × scale in float32 rounds too.
        allowed = ((hi - lo) / 2 + clipped) * scale * (1 + REL) + 4 * np.spacing(np.abs(_blocks(x, fmt)))
        err = np.abs(_blocks(out, fmt) - _blocks(x, fmt))
    if np.any(err > allowed):
        i = tuple(np.argwhere(err > allowed)[0])
        raise AssertionError(f"{fmt.name}: error {err[i]:.3g} exceeds half a step ({allowed[i]:.3g})")


def nvfp4_spec_scales(x: np.ndarray, fmt: Format) -> np.ndarray:
    """Per-block decode scales from NVIDIA's definition, in numpy/ml_dtypes.

    Stochastic rounding may take a block's largest value down a grid point, so
    the scale cannot be read off the output as it is for round-to-nearest.
    """
    amax = np.float32(np.max(np.abs(x)))
    block_amax = np.max(np.abs(_blocks(x, fmt)), axis=-1, keepdims=True)
    if amax <= formats.NVFP4_MIN_AMAX:  # the tensor scale would overflow: flushed
        return np.zeros_like(block_amax)
    s_enc = np.float32(formats.E2M1_MAX * formats.E4M3_MAX) / amax
    s_block = np.clip(block_amax * (s_enc / np.float32(formats.E2M1_MAX)), -448, 448)
    return s_block.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / s_enc


def assert_stochastic_lands_on_neighbours(qdq: Qdq, x: np.ndarray, fmt: Format) -> None:
    """Stochastic rounding picks one of the two grid points around each value."""
    out = qdq(x)
    scale = nvfp4_spec_scales(x, fmt)
    codes = _blocks(out, fmt) / np.where(scale > 0, scale, 1.0)
    v = _blocks(x, fmt) / np.where(scale > 0, scale, 1.0)
    lo, hi = _neighbours(v, _grid(fmt))
    got = np.abs(codes)
    ok = (np.abs(got - lo) <= REL * hi) | (np.abs(got - hi) <= REL * hi) | (scale == 0)
    if not np.all(ok):
        i = tuple(np.argwhere(~ok)[0])
        raise AssertionError(f"{fmt.name}: stochastic rounding gave code {got[i]} for {np.abs(v)[i]:.4g}, "
                             f"not {lo[i]} or {hi[i]}")


PROPERTIES = (
    assert_finite,
    assert_idempotent,
    assert_sign_symmetric,
    assert_zero_stays_zero,
    assert_monotonic,
    assert_on_grid,
    assert_error_within_half_step,
)


def _format_defects() -> dict:
    from qcheck.adapters._jax import JAX_MXFP8_NAN_EDGES

    return {"mxfp8_jax": JAX_MXFP8_NAN_EDGES}


#: The library defect a format's rule carries, by format: ``mxfp8_jax`` is JAX's rule, which from jax 0.12.1 on CPU
#: divides an all-zero block by a flushed scale (its ``seen`` versions say where).
FORMAT_DEFECTS = _format_defects()
#: A block amax whose MXFP8 scale (amax / 448, rounded up to a power of two) is a normal float32: 448 · 2^-126.
_DEFECT_MIN_AMAX = 448.0 * 2.0**-126
