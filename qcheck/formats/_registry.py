"""Plug-in formats: a user's :class:`Format` record and its own numpy referee, registered as a recipe is.

A registered format is a format like qcheck's own: :func:`~qcheck.formats.get_format`
and :func:`~qcheck.formats.quantize` take its name, a recipe may declare it
(``lhs=``, ``rhs=``, ``grad=``), and ``assert_quantized(..., declared="myfmt")``
holds a layer's codes to it. Its exact reference is the user's own referee,
which :func:`qcheck.referees.reference_quantize` consults where it consults
qcheck's; the referee must be written from the format's definition in numpy,
never by calling the record's JAX quantizer, or the check compares the code
with itself.
"""

from __future__ import annotations

import contextlib
import re
import typing
from collections.abc import Callable, Iterator

import numpy as np

from qcheck import referees
from qcheck._choices import require_choice
from qcheck.formats._record import Format, Kind
from qcheck.formats._table import add_record, builtin_format_names, format_names, restore_records

#: What a referee is: ``referee(x, axes, *, ftz, xla_reciprocal) -> (codes, scales)``.
Referee = Callable[..., tuple[np.ndarray, dict[str, np.ndarray]]]
_SIGNATURE = "referee(x, axes, *, ftz, xla_reciprocal) -> (codes, scales)"


def _by_slice(codes: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...]) -> np.ndarray:
    with np.errstate(over="ignore"):
        return codes * scales["slice"]


def _over_slice(codes: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...]) -> np.ndarray:
    return codes / scales["slice"]


def _as_is(codes: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...]) -> np.ndarray:
    return codes


def _over_tensor(codes: np.ndarray, scales: dict[str, np.ndarray], axes: tuple[int, ...]) -> np.ndarray:
    return codes * (np.float32(1) / scales["tensor"])


def _default_dequantize(record: Format) -> Callable | None:
    # The decode each kind's built-ins share: x = code · scale per slice (code / scale where the record
    # divides), the code itself at scale 1, code / the per-tensor encode scale. A block format has none.
    if record.kind == "int":
        return _over_slice if record.divides else _by_slice
    return {"cast": _as_is, "current": _over_tensor}.get(record.kind)


def register_format(record: Format, referee: Referee, *, dequantize: Callable | None = None) -> Format:
    """Add the user's format ``record``, checked against the user's numpy ``referee``; returns the record.

    ``referee(x, axes, *, ftz, xla_reciprocal)`` takes ``x`` (float32 numpy)
    and the contraction axes and returns ``(codes, scales)`` laid out as
    ``record.quantize`` returns them (``scales`` by the record's names). It
    models XLA where XLA moves bits: ``ftz`` (XLA's CPU backend flushes float32
    subnormals to zero) and ``xla_reciprocal`` (XLA computes a division by a
    constant, or by a broadcast operand, as a product with the float32
    reciprocal: ``amax / 100`` as ``amax * float32(1 / 100)``); the declared
    check accepts codes that one way gives over the whole tensor. A record whose
    ``forms`` list the mixed ones (``ALL_FORMS``) gets a ``qcheck.referees.Form``
    for those, a bool otherwise. A stochastic record's referee
    also takes ``uniforms=``. ``dequantize(codes as float32, scales, axes)``
    maps codes back; by default a code times its ``slice`` scale (``int``;
    divided where the record ``divides``), the code itself (``cast``), or the
    code over the ``tensor`` scale (``current``). A name qcheck defines, or one
    already registered, is a ValueError: registration never replaces a format.
    """
    where = "register_format"
    if not isinstance(record, Format):
        raise TypeError(f"{where}: record must be a qcheck.formats.Format, got {type(record).__name__}")
    if not isinstance(record.name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", record.name):
        raise ValueError(f"{where}: record.name must match [a-z][a-z0-9_]*, got {record.name!r}")
    if record.name in builtin_format_names():
        raise ValueError(f"{where}: record.name {record.name!r} is one of qcheck's own formats; choose another "
                         f"name than {', '.join(builtin_format_names())}")
    if record.name in format_names():
        raise ValueError(f"{where}: a format named {record.name!r} is already registered; registered formats: "
                         f"{', '.join(format_names())}")
    if not callable(referee):
        raise TypeError(f"{where}: referee must be a numpy function {_SIGNATURE} for format {record.name!r} (a "
                        f"plug-in format is held to its own independent referee), got {type(referee).__name__}")
    require_choice("record.kind", record.kind, typing.get_args(Kind), where=where)
    lowest = 2 * float(np.finfo(np.float32).tiny)  # a tensor of normal float32 values fits below it
    g = record.guarded_below
    if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= lowest):
        raise ValueError(f"{where}: record.guarded_below must be None or a number of at least twice float32's "
                         f"smallest normal ({lowest:.4g}), got {g!r}")
    for sibling in (*record.siblings, *([record.grad] if record.grad else [])):
        require_choice("sibling or grad format", sibling, format_names(), where=f"{where}: {record.name!r}")
    dequantize = _default_dequantize(record) if dequantize is None else dequantize
    if not callable(dequantize):
        raise TypeError(f"{where}: dequantize must be given for format {record.name!r} of kind {record.kind!r} "
                        f"(kinds with a default: int, cast, current), as a numpy function "
                        f"dequantize(codes, scales, axes) -> values")
    referees.add_referee(record.name, referee, dequantize, stochastic=record.stochastic)
    add_record(record)
    return record


@contextlib.contextmanager
def registered_formats(*plugins: tuple[Format, Referee]) -> Iterator[tuple[Format, ...]]:
    """Register each ``(record, referee)`` (or ``(record, referee, dequantize)``) for the ``with`` block only.

    It yields the records. Whatever the block registers besides is gone after it too, also when the block
    raises; a bad plug-in is register_format's error, and none of them stays registered.
    """
    before = format_names()
    try:
        records = []
        for plugin in plugins:
            if not isinstance(plugin, tuple) or len(plugin) not in (2, 3):
                raise TypeError(f"registered_formats: each plug-in must be a tuple (record, referee) or (record, "
                                f"referee, dequantize), got {type(plugin).__name__}")
            record, referee, *rest = plugin
            records.append(register_format(record, referee, dequantize=rest[0] if rest else None))
        yield tuple(records)
    finally:
        for name in format_names():
            if name not in before:
                referees.remove_referee(name)
        restore_records(before)

