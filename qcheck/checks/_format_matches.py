"""The check that holds ``qcheck.formats`` to its independent numpy referee, bit for bit."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from qcheck import formats, referees
from qcheck.checks._assertion import assertion
from qcheck.checks._bits import bits

#: Named exclusion: the ulps XLA's reordering of NVFP4's decode under jit may move its qdq output (its
#: record's ``decode_ulps``, where the measurement is told); codes and scales are always bitwise.
NVFP4_JIT_DECODE_ULPS = formats.get_format("nvfp4").decode_ulps


def nvfp4_uniforms(key: jax.Array, shape: tuple[int, ...], axis: int | tuple[int, ...] = -1) -> np.ndarray:
    """The uniforms ``formats.quantize(x, "nvfp4", axis=axis, rng=key)`` draws, laid out as ``x`` (``shape``).

    qcheck's stochastic rounding draws ``jax.random.uniform(key, blocks.shape)``
    for the blocked array: the non-contraction axes in order, then the
    contraction axes flattened into ``[n_blocks, 16]``. This draws the same
    array and moves each uniform back to the element it rounds.
    """
    ndim = len(shape)
    axes = sorted({a % ndim for a in ((axis,) if isinstance(axis, int) else axis)})
    perm = (*[a for a in range(ndim) if a not in axes], *axes)
    moved = tuple(shape[a] for a in perm)
    k = math.prod(shape[a] for a in axes)
    blocked = (*moved[: ndim - len(axes)], k // formats.NVFP4_BLOCK, formats.NVFP4_BLOCK)
    u = np.asarray(jax.random.uniform(key, blocked, np.float32))
    return np.transpose(u.reshape(moved), np.argsort(perm))


@functools.cache  # by record too: a plug-in format registered again under its name is another record
def _programs(fmt: str, axis: tuple[int, ...] | int, record: formats.Format):
    # Two programs per format and axes (and, inside jax.jit, per shape and key):
    # quantize and qdq each alone, as a caller runs them. Together in one program
    # XLA reorders NVFP4's decode differently again (measured).
    quantize = jax.jit(lambda x, k: formats.quantize(x, fmt, axis=axis, rng=k))
    qdq = jax.jit(lambda x, k: formats.qdq(x, fmt, axis=axis, rng=k))
    return lambda x, k: (quantize(x, k), qdq(x, k))


def _eager(x, fmt, axis, rng):
    q = formats.quantize(x, fmt, axis=axis, rng=rng)
    return q, formats.qdq(x, fmt, axis=axis, rng=rng)


def _first_difference(fmt: str, what: str, got, want, allowed_ulps: int = 0) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(
            f"{fmt}: {what} is {got.dtype}{list(got.shape)}, the referee's {want.dtype}{list(want.shape)}"
        )
    g, w = bits(got), bits(want)
    if allowed_ulps:
        off = np.abs(g.astype(np.int64) - w.astype(np.int64)) > allowed_ulps
    else:
        off = g != w
    if got.dtype == np.float32:
        # A float32 NaN's sign and payload belong to no format (fnuz NaN decodes to
        # 0x7fc00000 in XLA, 0xffc00000 in ml_dtypes); codes' NaNs stay bitwise.
        off &= ~(np.isnan(got) & np.isnan(want))
    if not off.any():
        return
    i = tuple(int(j) for j in np.argwhere(off)[0])
    width = 2 * got.dtype.itemsize
    raise AssertionError(
        f"{fmt}: {what} differs from the referee at index {i}: "
        f"jax 0x{int(g[i]):0{width}x} ({got[i]!r}) vs referee 0x{int(w[i]):0{width}x} ({want[i]!r}); "
        f"{int(off.sum())} of {off.size} differ ({got.dtype}"
        f"{f', {allowed_ulps} ulp allowed' if allowed_ulps else ''})"
    )


@assertion
def assert_format_matches_referee(
    x: np.ndarray,
    fmt: str,
    *,
    axis: int | tuple[int, ...] = -1,
    rng: jax.Array | None = None,
    jit: bool = True,
    label: str = "",
) -> str:
    """``formats.quantize`` and ``formats.qdq`` of float32 ``x`` equal :mod:`qcheck.referees`' bit for bit; returns
    the referee's form (``qcheck.referees.FORMS``) they matched in.

    Codes, every named scale (names, types, shapes and bits) and the qdq output
    are compared. With ``rng`` (nvfp4 only) the referee gets the uniforms the
    key draws (:func:`nvfp4_uniforms`). ``jit=True`` runs quantize and qdq as one
    jitted program (once per format, axes and shape), ``False`` op by op.

    Named exclusions, each one documented where it is defined:
    XLA's CPU backend flushes float32 subnormals (read and written), so on CPU
    the referee runs with ``ftz=True``; XLA computes int8's amax / 127 as amax ·
    float32(1/127) and may compute x / scale as x · float32(1/scale), each on
    its own, so the referee runs in each form the format's record admits
    (``Format.forms``), one at a time over the whole array (see
    :mod:`qcheck.referees` for both); and
    :data:`NVFP4_JIT_DECODE_ULPS` for nvfp4's dequantized output under jit.
    """
    record = formats.get_format(fmt)
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"x must be a float32 array, got dtype {x.dtype}")
    if rng is not None and not record.stochastic:
        stochastic = " and ".join(f for f in formats.format_names() if formats.get_format(f).stochastic)
        raise ValueError(f"rng is for {stochastic}'s stochastic rounding; format {fmt!r} takes none")
    axis = axis if isinstance(axis, int) else tuple(axis)
    if jit:
        q, out = _programs(fmt, axis, record)(x, rng)
    else:
        q, out = _eager(x, fmt, axis, rng)
    uniforms = None if rng is None else nvfp4_uniforms(rng, x.shape, axis)
    ftz = jax.default_backend() == "cpu"
    ulps = record.decode_ulps if jit else 0
    failures = []
    for form in record.forms:  # held in one form at a time, the whole tensor
        codes, scales = referees.reference_quantize(x, fmt, axis=axis, uniforms=uniforms, ftz=ftz, xla_reciprocal=form)
        want = referees.reference_dequantize(codes, scales, fmt, axis=axis, ftz=ftz, xla_reciprocal=form)
        try:
            _first_difference(fmt, "codes", q.codes, codes)
            if set(q.scales) != set(scales):
                raise AssertionError(f"{fmt}: scales {sorted(q.scales)}, the referee's {sorted(scales)}")
            for name in sorted(scales):
                _first_difference(fmt, f"scale {name!r}", q.scales[name], scales[name])
            _first_difference(fmt, "qdq output", out, want, ulps)
        except AssertionError as e:
            failures.append((form, e))
            continue
        return form
    (form, first), *others = failures
    if not others:
        raise first
    raise AssertionError(f"{first} (with its divisions {form}); in its other admissible forms too: "
                         + "; ".join(f"with its divisions {f}: {e}" for f, e in others))
