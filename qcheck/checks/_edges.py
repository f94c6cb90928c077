"""Inputs where quantizers break: ``x`` with one token row replaced by a zero row, tiny values, a huge value or
values at the format's saturation edge, and ``x`` made a whole tensor of tiny values.

A normal draw never holds them, and the bugs live there: an all-zero row whose
scale is 0 (then 0 / 0 = NaN), a tiny amax slipping past an ``== 0`` guard, a
value beyond the format's range cast without saturation (NaN in e4m3fn), codes
at the largest finite value. A per-tensor scale (NVFP4's tensor scale, current
scaling's) sees only the tensor's amax, which one edge row inside a normal
tensor never brings near a guard: the tiny tensor, ``x`` scaled by a power of
two below every format's smallest guarded amax (``Format.guarded_below``),
does. (Delayed scaling records that amax in its history and takes the scale
from it in the next step, which no edge runs.) ``check_layer`` runs its
compiled program again on each (the same shapes: no compile) and holds
outputs, gradients and state finite, and, under a declaration, each site's
codes bitwise. From ``SLICE_FROM`` token rows of ``x`` on, it runs them on a
slice of x's first token rows (:func:`token_slice`) by one program of that
shape, where the layer's step traces at it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from qcheck import formats
from qcheck._choices import require_choice

#: Each edge kind, as a failure names it: the token rows, then the whole tensor.
EDGE_ROWS = {
    "zeros": "token row of zeros",
    "tiny": "token row of tiny values (around float32's smallest normal, and below it)",
    "huge": "token row with one value far beyond the format's range (1e5)",
    "saturation": "token row at the format's saturation edge (its largest finite value, both signs)",
    "tiny_tensor": "whole tensor of tiny values (x scaled by a power of two below every format's smallest guarded "
                   "amax)",
}
#: Far beyond e4m3's 448 (and e4m3fnuz's 240, e5m2's 57344) at a fresh layer's scale of 1.
HUGE = 1e5
#: From this many token rows of x on, the edges run on a slice of x's first token rows, SLICE_ROWS of them, by
#: one more compiled step of the slice's shape: five runs of the layer's whole batch cost more than that compile
#: and six runs of the slice (at emb 1024, tokens = emb, the five took about 70 of the check's 128 s). Below it a
#: layer pays no compile more. The edge row is x's first token row on the slice as on x, among ordinary rows, and
#: a per-tensor amax over the slice still holds it.
SLICE_FROM = 512
SLICE_ROWS = 64


def token_slice(shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The index of the first token rows of an ``x`` of ``shape`` that the edges run on (about SLICE_ROWS of them,
    x's first row first: the row the edge kinds replace), or None where x has fewer than SLICE_FROM rows."""
    if len(shape) < 2 or math.prod(shape[:-1]) < SLICE_FROM:
        return None
    # Along the token axis (the one before the features) first, then whole sequences of the leading axis.
    seq = min(SLICE_ROWS, shape[-2])
    lead = [slice(0, 1)] * (len(shape) - 2)
    if lead:
        lead[0] = slice(0, min(shape[0], max(1, SLICE_ROWS // seq)))
    return (*lead, slice(0, seq), slice(None))


def rows_of(shape: tuple[int, ...]) -> int:
    """How many token rows an ``x`` of ``shape`` holds (every axis but the features')."""
    return math.prod(shape[:-1])


def check_skip_edges(skip_edges: Any) -> dict[str, str | None]:
    """``check_layer``'s ``skip_edges``: each edge kind with None (run it) or the user's reason not to."""
    if skip_edges is None:
        return dict.fromkeys(EDGE_ROWS)
    if not isinstance(skip_edges, Mapping):
        raise ValueError(f"check_layer: skip_edges must map edge kinds ({', '.join(EDGE_ROWS)}) to reasons, got "
                         f"{type(skip_edges).__name__}")
    for kind, reason in skip_edges.items():
        require_choice("edge kind", kind, EDGE_ROWS, where="check_layer: skip_edges")
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"check_layer: skip_edges[{kind!r}] needs a reason (a non-empty str), got {reason!r}")
    return {kind: (f"skipped: {skip_edges[kind]}" if kind in skip_edges else None) for kind in EDGE_ROWS}


def _saturation(declaration: Any) -> float | None:
    """The largest finite value of the activations' declared fp8 cast format, if one is declared."""
    if declaration is None:
        return None
    fmt = declaration.roles.get("activations")
    if fmt is None or formats.get_format(fmt.format).kind != "cast":
        return None
    return largest_code(fmt.format)


def largest_code(fmt: str) -> float:
    """The largest finite value of format ``fmt``'s element type (448 for e4m3fn, 127 for int8, 6 for nvfp4's e2m1).

    At a fixed scale of 1 (the fp8 casts) it is the saturation edge; where the
    format scales each slice, block or tensor to its own amax, a row of it is
    that amax (the rest of the input being smaller) and is coded as the
    largest code.
    """
    element = np.dtype(formats.get_format(fmt).element)
    # jax.numpy's subdtype: numpy's sees no integer in ml_dtypes' int4 (int4_keras's codes).
    return float(ml_dtypes.iinfo(element).max if jax.numpy.issubdtype(element, jax.numpy.integer)
                 else ml_dtypes.finfo(element).max)


def smallest_guarded_amax() -> float:
    """The smallest ``guarded_below`` of every format known, qcheck's and the registered ones: the whole tensor of
    tiny values stays below it."""
    return min(g for name in formats.format_names() if (g := formats.get_format(name).guarded_below) is not None)


def tiny_tensor(x: np.ndarray) -> np.ndarray | str:
    """``x`` times the power of two that puts its amax in [g / 2, g), ``g`` the :func:`smallest_guarded_amax`, in
    x's own type; or why it is not run (a type with no normal value that small).

    Just below the lowest guard, so an off-by-a-little guard is reached as well as a missing one. The values
    that come out below float32's smallest normal are zeros, as a backend that flushes subnormals (XLA's CPU)
    reads them: every backend gets the same tensor, and a scale that overflows meets a 0 (inf · 0 = NaN).
    """
    below = smallest_guarded_amax()
    if float(ml_dtypes.finfo(x.dtype).smallest_normal) > below / 2:
        return f"not run: {x.dtype} has no normal value below the smallest guarded amax ({below:.3g})"
    wide = np.asarray(x, np.float64)
    amax = float(np.max(np.abs(wide), initial=0.0))
    if amax == 0:
        return np.zeros_like(x)
    k = math.frexp(amax / below)[1]  # amax / below in [2^(k-1), 2^k), up to the division's rounding
    while amax * 2.0**-k >= below:
        k += 1
    tiny = wide * 2.0**-k  # exact: a power of two, the values that fall below float32's normals zeroed next
    return np.where(np.abs(tiny) < np.finfo(np.float32).tiny, 0.0, tiny).astype(x.dtype)


def edge_rows(x: jax.Array, declaration: Any, kinds: Mapping[str, str | None],
              keep: tuple[slice, ...] | None = None) -> dict[str, Any]:
    """Each edge kind's ``x`` (its first token row replaced, or the whole tensor), or why it is not run; ``keep``:
    only the token rows of x it indexes (:func:`token_slice`), made from the whole x (the tiny tensor's power of
    two is x's)."""
    top = _saturation(declaration)
    return _rows(x, "not run: no fp8 cast format declared for the activations" if top is None else top, kinds,
                 keep)


def format_edge_rows(x: jax.Array, fmt: str | None, kinds: Mapping[str, str | None]) -> dict[str, Any]:
    """:func:`edge_rows` for a layer whose activations are quantized in format ``fmt``: the saturation row at
    its :func:`largest_code`, whatever its kind (None: no format known, that row not run)."""
    return _rows(x, "not run: no activation format declared, so no largest code to sit at" if fmt is None
                 else largest_code(fmt), kinds)


def _rows(x: jax.Array, top: float | str, kinds: Mapping[str, str | None],
          keep: tuple[slice, ...] | None = None) -> dict[str, Any]:
    """Each edge kind's ``x``, the saturation row at ``top`` (or ``top`` says why it is not run), of the rows
    ``keep`` indexes (None: all)."""
    keep = keep or (...,)
    flat = np.array(x, dtype=np.asarray(x).dtype).reshape(-1, np.shape(x)[-1])
    n = flat.shape[1]
    # Beyond every fp8 format's range, yet finite in x's own type (float16 tops out at 65504).
    huge = min(HUGE, float(ml_dtypes.finfo(flat.dtype).max) / 2)
    tiny = float(np.finfo(np.float32).tiny)
    rows = {
        "zeros": np.zeros(n),
        "tiny": np.where(np.arange(n) % 2 == 0, 4 * tiny, tiny / 8) * np.where(np.arange(n) % 4 < 2, 1, -1),
        "huge": np.concatenate([[huge], flat[0, 1:]]),
        "saturation": top if isinstance(top, str) else np.where(np.arange(n) % 2 == 0, top, -top),
    }
    out: dict[str, Any] = {}
    for kind, skipped in kinds.items():
        if skipped is not None:
            out[kind] = skipped
        elif kind == "tiny_tensor":
            whole = tiny_tensor(flat)
            out[kind] = whole if isinstance(whole, str) else jax.device_put(whole.reshape(np.shape(x))[keep])
        elif isinstance(rows[kind], str):
            out[kind] = rows[kind]
        else:
            edged = flat.copy()
            edged[0] = rows[kind].astype(flat.dtype)
            out[kind] = jax.device_put(edged.reshape(np.shape(x))[keep])
    return out
