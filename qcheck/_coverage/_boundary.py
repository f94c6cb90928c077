"""Quantizer evidence across a body's boundary: a body walked with values has its records and quantizers taken
out of the walker and put back once out of its trace (stacked over its runs), and its inputs and outputs keep
their link to the caller's quantizers, so codes, scales and zero points made on one side of a body (a shard_map's,
a scan's, a while loop's, a cond's) and multiplied on the other are held to the quantizer that made them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore
import numpy as np

from qcheck._coverage._records import MatmulRecord
from qcheck._coverage._values import Val, Where


@dataclasses.dataclass
class Evidence:
    """What a body walked with values found of its quantizers: each one's (input, codes, divisor), whether its
    scale was multiplied in, its own stacking, which of the body's matmul operands (by record index within the
    body) reached which quantizer with which contraction axes, and which quantizers' codes are another's zero
    point (zero point, quantizer).

    A quantizer is named by its index in the walk's list while the body ran: from ``base`` on, the body's own
    (``quantizers[q - base]``); below it, a caller's, whose codes the body was handed (:meth:`index` maps both
    to the caller's list once the body's own are put back)."""

    quantizers: list[tuple[Any, Any, Any]]
    multiplied: list[bool]
    stacked: list[tuple[str, ...]]
    operands: list[tuple[int, str, int, tuple[int | None, ...]]]
    base: int = 0
    zero_points: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def index(self, q: int, first: int | None) -> int | None:
        """Quantizer ``q`` of the body in the caller's list, where the body's own start at ``first`` (None: the
        body's own were not kept, so only a caller's quantizer has an index)."""
        if q < self.base:
            return q
        return None if first is None else first + q - self.base


class Boundaries:
    """The walk's methods at a body's boundary (mixed into :class:`qcheck._coverage._walk.Walker`).

    A caller's quantizer is held whole, as it made its codes, from wherever they are multiplied: where a
    shard_map's specs split them, a shard sees its slice (:meth:`sharded` keeps its shape for the axis map), never
    a quantization of its own (a slice along the contraction axis would be a false alarm). A body's own quantizers
    are held run by run (their values stacked over its iterations or shards).
    """

    def evaluated(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], ins: list[Val],
                  where: Where) -> tuple[list[Val], list[MatmulRecord], list[tuple[int, Any]], Evidence]:
        """Walk a body with values, taking its records, figures and quantizer evidence out of the walker.

        The caller, tracing the body inside a loop, a branch or a shard_map of
        its own, puts them back with :meth:`put` once they are out of that
        trace: the evidence's values as the body's extra outputs, stacked over
        its runs (a scan's iterations, a shard_map's shards).
        """
        start, n_errors, n_quantizers, n_operands = (len(self.records), len(self.errors), len(self.quantizers),
                                                     len(self.operands))
        # The caller's quantizers, below base, are only linked to from the body (their values are the caller's).
        base, self.base = self.base, n_quantizers
        mirrors, self.mirrors = self.mirrors, {}
        try:
            outs = self.run(jaxpr, consts, ins, where, values=True)
            seen = self.mirrors
        finally:
            self.base, self.mirrors = base, mirrors
        records = self.records[start:]
        errors = [(i - start, e) for i, e in self.errors[n_errors:]]
        # A split caller's zero point is held, in the body, as the shard's slice it added (zero_point_seen).
        zero_points = {z: q for z, q in self.zero_points.items() if z >= n_quantizers or q >= n_quantizers}
        zero_points |= {z: zero_points[m] for z, m in seen.items() if m in zero_points}
        evidence = Evidence(self.quantizers[n_quantizers:], self.multiplied[n_quantizers:],
                            self.stacked[n_quantizers:],
                            [(i - start, side, seen.get(q, q), axes)
                             for i, side, q, axes in self.operands[n_operands:]],
                            n_quantizers, list(zero_points.items()))
        self.truncate(start, n_errors, n_quantizers, n_operands)
        return outs, records, errors, evidence

    def truncate(self, records: int, errors: int, quantizers: int, operands: int) -> None:
        del self.records[records:], self.errors[errors:], self.quantizers[quantizers:]
        del self.multiplied[quantizers:], self.stacked[quantizers:], self.operands[operands:]
        self.zero_points = {z: q for z, q in self.zero_points.items() if z < quantizers and q < quantizers}
        self.code_shadows = {q: s for q, s in self.code_shadows.items() if q < quantizers}

    def put(self, records: list[MatmulRecord], figures: list[tuple[int, Any]], evidence: Evidence | None = None,
            values: Sequence[tuple[Any, Any, Any]] = (), label: str = "", lost: str | None = None) -> int | None:
        """Records of a body walked with values, their figures, and its evidence with ``values`` stacked by ``label``;
        where the body's own quantizers start in the walk's list (None: not kept).

        ``lost``: why the body's quantizer values are not kept (its records then say so); its operands that
        reach a caller's quantizer are held to it all the same.
        """
        start, first = len(self.records), len(self.quantizers)
        if lost is not None:
            records = [r if r.no_values else dataclasses.replace(r, no_values=lost) for r in records]
            first = None
        self.records.extend(records)
        self.errors.extend((start + i, e) for i, e in figures)
        if evidence is None:
            return first
        if first is not None:
            for value, multiplied, stacked in zip(values, evidence.multiplied, evidence.stacked):
                self.quantizers.append(value)
                self.multiplied.append(multiplied)
                self.stacked.append((label, *stacked))
        for i, side, q, axes in evidence.operands:
            if (at := evidence.index(q, first)) is not None:
                self.operands.append((start + i, side, at, axes))
        for z, q in evidence.zero_points:
            at_z, at_q = evidence.index(z, first), evidence.index(q, first)
            if at_z is not None and at_q is not None:
                self.zero_points.setdefault(at_z, at_q)  # a caller's zero point shifting a caller's first
        return first

    def sharded(self, ins: list[Val], template: list[Val], eqn: jcore.JaxprEqn, specs: Sequence[Any],
                mesh_shape: dict[str, int]) -> tuple[list[Val], dict[int, tuple[int, ...]]]:
        """A shard_map body's inputs linked to the caller's quantizers, and each such quantizer's shape as one
        shard sees it (where the specs split an axis, the shard's slice of it)."""
        if len(template) != len(ins):
            return template, {}
        out, views = [], {}
        for v, t, spec, var in zip(ins, template, specs, eqn.invars):
            t = self.linked(v, t)
            split = splits(spec, mesh_shape, len(getattr(var.aval, "shape", ())))
            if t.qid is not None and any(n > 1 for n in split):
                shape, axis_map = list(self.qshape(t.qid)), list(t.axis_map)
                for d, n in enumerate(split[:len(axis_map)]):
                    if n > 1 and isinstance(axis_map[d], int) and shape[axis_map[d]] % n == 0:
                        shape[axis_map[d]] //= n
                    elif n > 1:
                        axis_map[d] = None  # a slice of what the walk cannot lay out in the quantizer's axes
                if views.setdefault(t.qid, tuple(shape)) != tuple(shape):
                    # The same codes split otherwise for another input: this one's split axes are not laid out.
                    axis_map = [None if n > 1 else a for a, n in zip(axis_map, split)]
                t = dataclasses.replace(t, axis_map=tuple(axis_map))
            out.append(t)
        return out, views

    def linked(self, caller: Val, inner: Val, drop: int = 0) -> Val:
        """``inner``, a body's input, keeping the link of ``caller`` (the caller's value it is, its first ``drop``
        axes sliced off: a scan's xs) to the quantizer whose codes it is: a matmul in the body on it is held to
        that quantizer, as it would be in the caller (codes made outside a shard_map, multiplied inside it).
        Its values stay the caller's (:meth:`own` keeps the body from writing them)."""
        if caller.qid is None or len(caller.axis_map) < drop:
            return inner
        return dataclasses.replace(inner, qid=caller.qid, axis_map=tuple(caller.axis_map[drop:]), live=caller.live)

    @staticmethod
    def lifted(out: Val, inner: Val, evidence: Evidence | None, first: int | None, lead: int = 0,
               cut: Sequence[int] = ()) -> Val:
        """``out``, a caller's value that is the body's output ``inner``, keeping its link to the quantizer
        ``inner`` reached (the body's own, put back from ``first``, or a caller's): codes made in a body and
        multiplied outside it. ``lead``: axes before the body's (a scan's iterations); ``cut``: axes that are
        the shards' values side by side. Neither is one of the quantizer's axes."""
        q = None if inner.qid is None or evidence is None else evidence.index(inner.qid, first)
        if q is None:
            return out
        axis_map = (None,) * lead + tuple(None if d in cut else a for d, a in enumerate(inner.axis_map))
        return dataclasses.replace(out, qid=q, axis_map=axis_map, live=inner.live)

    def own(self, qid: int) -> bool:
        """Whether quantizer ``qid`` is this body's own and unstacked: its values are in this trace, so the walk
        may read them into a new quantizer or write its codes anew. A caller's quantizer (handed to a body) and
        a body's (put back, its values stacked over its runs) are only linked to."""
        return qid >= self.base and not self.stacked[qid]

    def qshape(self, qid: int) -> tuple[int, ...]:
        """The shape of one run of quantizer ``qid``'s codes as this body sees them: a shard's slice of a caller's
        codes split by the shard_map's specs, one iteration's of a body's stacked ones."""
        if qid in self.views:
            return self.views[qid]
        return tuple(np.shape(self.quantizers[qid][1]))[len(self.stacked[qid]):]

    def zero_point_seen(self, z: Val) -> int | None:
        """The quantizer of zero point ``z`` as this run of a body sees it: where a shard_map splits a caller's
        zero point, the shard's slice of its codes, a quantizer of the body's own (held beside the codes they
        shift, shard by shard); else ``z``'s own. The body's matmul operands that reach the caller's zero point are
        held as reaching this one (:meth:`evaluated` maps them)."""
        if z.qid is None or z.qid not in self.views or not z.live or z.axis_map != tuple(range(len(z.axis_map))):
            return z.qid
        if z.qid not in self.mirrors:
            self.mirrors[z.qid] = len(self.quantizers)
            self.quantizers.append((z.actual, z.actual, None))
            self.multiplied.append(False)
            self.stacked.append(())
        return self.mirrors[z.qid]


def splits(spec: Any, mesh_shape: dict[str, int], ndim: int) -> list[int]:
    """How many shards each of an operand's ``ndim`` axes is split into by its shard_map ``spec``."""
    out = []
    for d in range(ndim):
        entry = spec[d] if spec is not None and d < len(spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(int(np.prod([mesh_shape.get(n, 1) for n in names])) if names else 1)
    return out
