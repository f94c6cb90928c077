"""Probe operands: inputs chosen so that an exact check can tell its reference from every bug it exists for.

One module for every check's probes (forward fp8 casts, call sites on probes, gradients), so the checks
that share them import them from here and not from one another.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qcheck import formats

#: Where an fp8 flavour parts from its sibling only outside the probes' magnitudes (2^-4..2^10): the binade
#: [2^lo, 2^hi) that :func:`probe_site_operands` gives some contraction fibres of an operand in that format,
#: by format: each record's ``parting_binade`` (which says why).
PARTING_BINADES = {f.name: f.parting_binade for f in formats.FORMATS if f.parting_binade is not None}
#: The probes' magnitudes, log-uniform over [2^lo, 2^hi]; ``lo`` rises to a cast format's smallest normal.
_PROBE_BINADES = (-4.0, 10.0)
# The share of an operand's contraction fibres (at least one) the parting values fill: a whole fibre,
# so that its products are small too and the rounding of the sum keeps the flavours apart.
_PARTING_SHARE = 0.25


def fp8_dtype(cast_dtype: Any) -> np.dtype:
    """``cast_dtype`` as a numpy dtype, the element type of a cast format; a one-line ValueError listing them if not."""
    return formats.cast_format(cast_dtype).element


def part_fibres(x: np.ndarray, axes: tuple[int, ...], fmt: str | None, seed: tuple[int, int]) -> np.ndarray:
    """``x`` with some of its contraction fibres drawn log-uniform from ``fmt``'s parting binade, if it has one."""
    binade = None if fmt is None else formats.get_format(fmt).parting_binade
    if binade is None:
        return x
    lo, hi = binade
    rng = np.random.default_rng(seed)  # a stream of its own: the rest of the probe stays what it was
    axes = tuple(a % x.ndim for a in axes)
    fibres = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    pick = rng.random(fibres) < _PARTING_SHARE
    pick.flat[0] = True  # at least one
    small = np.exp2(rng.uniform(lo, hi, size=x.shape)) * rng.choice(np.array([-1.0, 1.0]), size=x.shape)
    return np.where(pick, small, x).astype(x.dtype)


def probe_operands(
    seed: int,
    *shapes: tuple[int, ...],
    dtype: Any = np.float32,
    cast_dtype: Any = None,
    contract: tuple[tuple[int, ...], ...] | None = None,
    normal_in: tuple[str | None, ...] | None = None,
) -> list[np.ndarray]:
    """Operands that make the fp8 exact checks sharp.

    Magnitudes are log-uniform over [2^-4, 2^10] with random signs: most values
    are not representable in any fp8 flavour (so quantization shows), some lie
    above every e4m3 maximum (so a missing clip, or e4m3fnuz's 240 for
    e4m3fn's 448, shows), and none is subnormal in ``cast_dtype`` (so the
    reference never leans on how a backend casts to fp8 subnormals): the low
    end rises to the smallest normal its format's record gives (e3m4's 2^-2;
    e4m3 and e5m2 are normal from 2^-6 and 2^-14, below 2^-4). e5m2 and
    e5m2fnuz round alike on all of them: for ``cast_dtype`` float8_e5m2 or
    float8_e5m2fnuz give ``contract``, each operand's contraction axes, and a
    quarter of each operand's contraction fibres come from [2^-15, 2^-14)
    instead, where e5m2 is subnormal and e5m2fnuz is not, and the two round
    apart (XLA's CPU backend casts those exactly, as ml_dtypes does).
    ``normal_in`` (one format name or None per shape) raises each shape's low
    end likewise to its cast format's smallest normal (a recipe's operand formats).
    """
    record = None if cast_dtype is None else formats.cast_format(fp8_dtype(cast_dtype))
    if normal_in is not None and len(normal_in) != len(shapes):
        raise ValueError(f"probe_operands: normal_in must name one format (or None) per shape ({len(shapes)}), "
                         f"got {normal_in!r}")
    records = ([record] * len(shapes) if normal_in is None
               else [record or (None if f is None else formats.get_format(f, where="probe_operands")) for f in normal_in])
    out = log_uniform(seed, shapes, records, dtype)
    if record is None or record.parting_binade is None:
        return out
    fmt = record.name
    if contract is None or len(contract) != len(shapes):
        raise ValueError(
            f"probe_operands: cast_dtype {record.element.name} parts from its sibling only in whole contraction fibres "
            f"below 2^-14, so give contract=, one tuple of contraction axes per shape ({len(shapes)}), "
            f"got {contract!r}")
    return [part_fibres(x, axes, fmt, (seed, i)) for i, (x, axes) in enumerate(zip(out, contract))]


def log_uniform(seed: int, shapes, records, dtype: Any = np.float32) -> list[np.ndarray]:
    """Magnitudes log-uniform over the probes' binades, random signs, one array per shape; where a shape's format
    (its record, or None) is a cast format, never below the smallest normal its element type has."""
    rng = np.random.default_rng(seed)
    out = []
    for shape, record in zip(shapes, records):
        lo, hi = _PROBE_BINADES
        if record is not None and record.kind == "cast" and record.normal_range is not None:
            lo = max(lo, float(np.log2(record.normal_range[0])))
        mag = np.exp2(rng.uniform(lo, hi, size=shape))
        sign = rng.choice(np.array([-1.0, 1.0]), size=shape)
        out.append((mag * sign).astype(dtype))
    return out


def probe_grad(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """An output gradient that makes the backward checks sharp, float32.

    Magnitudes are log-uniform over [2^-17, 2^-1] with random signs: small
    gradients are where fp8 flavours part — e4m3 flushes most of them to zero
    (2^-9 is e4m3fn's smallest subnormal), e5m2 and e5m2fnuz differ only below
    2^-14, where e5m2 is subnormal and e5m2fnuz is not. Every value is a normal
    float32, so no backend's flushing of float32 subnormals can matter.
    """
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-17.0, -1.0, size=shape))
    return (mag * rng.choice(np.array([-1.0, 1.0]), size=shape)).astype(np.float32)


def probe_nvfp4(seed: int, shape: tuple[int, ...], *axis_sets: tuple[int, ...]) -> np.ndarray:
    """A float32 array whose NVFP4 blocks along each of ``axis_sets`` decode exactly, in any order.

    XLA may reorder NVFP4's decode ``code / (s_enc / s_block)`` under jit (up to
    2 ulps, :data:`qcheck.checks.NVFP4_JIT_DECODE_ULPS`), which no
    bitwise reference survives. Here the tensor amax is 6 and every block's amax
    is 6 · 2^-j (j in 0..3) along every axis set given, so each block's encode
    scale is 2^j: every decode order is exact. One element per block (where the
    flat indices over the axis sets sum to a multiple of 16) carries that amax;
    the others are log-uniform below the smaller amax of their blocks, so blocks
    along different axes differ and a wrong-axes quantization shows.
    """
    rng = np.random.default_rng(seed)
    ndim = len(shape)
    sets = [tuple(sorted({a % ndim for a in axes})) for axes in axis_sets]
    if not sets:
        raise ValueError("probe_nvfp4: give at least one axis set")
    idx = np.indices(shape)
    flat = [np.ravel_multi_index([idx[a] for a in axes], [shape[a] for a in axes]) for axes in sets]
    planted = sum(flat) % formats.NVFP4_BLOCK == 0
    amax = np.where(planted, 6.0 * np.exp2(-rng.integers(0, 4, shape)), 0.0)
    amax[np.unravel_index(np.argmax(planted), shape)] = 6.0  # the tensor amax, 6 exactly
    ceiling = np.min([block_max(amax, axes) for axes in sets], axis=0)
    mag = np.where(planted, amax, ceiling * np.exp2(rng.uniform(-8.0, -0.01, shape)))
    return (mag * rng.choice(np.array([-1.0, 1.0]), size=shape)).astype(np.float32)


def block_max(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Each element's block maximum, blocks of 16 along the flattened ``axes``."""
    rest = [a for a in range(x.ndim) if a not in axes]
    perm = (*rest, *axes)
    moved = np.transpose(x, perm)
    blocks = moved.reshape(*moved.shape[: len(rest)], -1, formats.NVFP4_BLOCK)
    top = np.broadcast_to(blocks.max(axis=-1, keepdims=True), blocks.shape)
    return np.transpose(top.reshape(moved.shape), np.argsort(perm))
