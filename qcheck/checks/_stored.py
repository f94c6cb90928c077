"""Stored weights held bitwise against their float source: a layer that keeps a weight only as codes (Keras's
``quantize("int8")``, qwix's ``PtqProvider``) beside a twin that keeps the float parameter they were made from.

A reader names each stored weight (:class:`qcheck._coverage.Declaration` ``stored_params``: where its codes,
scale and zero point are, the float's contraction axes, int4 packing). check_layer pairs it with the twin's
parameter of the same path, as it pairs gradients, and holds the codes and every scale the layer keeps to the
declared format applied by the referee (numpy, on the host: no program of its own) to that float parameter.
The weight operands of the module's matmuls, which reach them as codes from the start, are then held bitwise,
saying against what; a mismatch is the site's finding, naming what differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from qcheck._coverage import Declaration, judge_stored


def unpack_int4(packed: np.ndarray, axis: int, size: int) -> np.ndarray:
    """Signed int4 codes packed two to a byte along ``axis`` (the first in the low nibble, Keras's ``pack_int4``),
    unpacked to ``size`` codes along it (a last odd one was padded)."""
    b = np.moveaxis(np.asarray(packed).view(np.uint8), axis, -1)
    nibbles = np.stack([b & 0xF, b >> 4], axis=-1).astype(np.int8)
    nibbles = np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.int8)
    out = nibbles.reshape(*b.shape[:-1], 2 * b.shape[-1])[..., :size]
    return np.moveaxis(out, -1, axis)


def unpack_bytes(words: np.ndarray, axis: int, size: int) -> np.ndarray:
    """8-bit codes packed into wider unsigned words along ``axis``, the first in the lowest byte (ejkernel 0.0.78's
    bitpack: four to a uint32), unpacked to ``size`` codes along it."""
    w = np.moveaxis(np.asarray(words), axis, -1)
    per = w.dtype.itemsize
    out = np.stack([(w >> (8 * i)) & 0xFF for i in range(per)], axis=-1).reshape(*w.shape[:-1], per * w.shape[-1])
    return np.moveaxis(out[..., :size].astype(np.uint8), -1, axis)


def held_stored(declaration: Declaration | None, state: Mapping[str, Any],
                twin_params: Mapping[str, np.ndarray]) -> Declaration | None:
    """``declaration`` with each stored weight it names held against the twin's float parameter of its path
    (``held``, by module path), those the twin has and whose role is declared a format; the rest left as read."""
    if declaration is None or not declaration.stored_params:
        return declaration
    held: dict[str, list[tuple[str, str | None]]] = {}
    for source, st in declaration.stored_params.items():
        known, fmt = declaration.for_operand("", "weight", None, st.scope)
        if not known or fmt is None:
            continue
        if source not in twin_params or st.codes not in state:
            # Read as stored, yet not held: a quiet acceptance of its type is what this module exists to end.
            missing = (f"the reference has no parameter {source}" if source not in twin_params
                       else f"the layer has no state {st.codes}")
            held.setdefault(st.scope, []).append(
                (source, f"stored {st.codes} cannot be held against its float source: {missing} "
                         f"(check_layer pairs them by path; build the twin with the layer's constructor, unquantized)"))
            continue
        x = np.asarray(twin_params[source])
        codes = np.asarray(state[st.codes])
        if st.packed is not None and codes.ndim == x.ndim:
            # Words wider than a byte hold 8-bit codes (EasyDeL's); a byte holds two int4 codes (Keras's).
            unpack = unpack_bytes if codes.dtype.itemsize > 1 and codes.dtype.kind == "u" else unpack_int4
            codes = unpack(codes, st.packed, x.shape[st.packed])
        scales = {k: np.asarray(state[p]) for k, p in (("scale", st.scale), ("zero_point", st.zero_point))
                  if p is not None and p in state}
        finding = judge_stored(x, codes, scales, fmt, st.axes,
                               what=f"stored {st.codes} against the reference's {source}")
        held.setdefault(st.scope, []).append((source, finding))
    return dataclasses.replace(declaration, held={k: tuple(v) for k, v in held.items()})
