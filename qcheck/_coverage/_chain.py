"""How the walk follows a value on its way to a matmul: the quantizer it started at (a cast, a rounding, a table
lookup), the scale divided out or multiplied in, straight-through estimators, and what each op keeps of it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from qcheck._coverage._records import OperandQuant, ROUNDING, VALUE_PRESERVING
from qcheck._coverage._values import SAME_VALUE, Val, map_axes, named_dtype, narrow_bits, widest_float

class QuantizerChains:
    """The walk's methods that follow quantized chains (mixed into :class:`qcheck._coverage._walk.Walker`)."""

    @staticmethod
    def data_of(eqn: jcore.JaxprEqn, ins: list[Val]) -> bool:
        """Whether the output depends on the call's inputs; indices into a weight (gather, dynamic_slice) do not count."""
        if eqn.primitive.name in ("gather", "dynamic_slice") and ins:
            return ins[0].data
        return any(v.data for v in ins)

    def straight_through(self, eqn: jcore.JaxprEqn, ins: list[Val], actual: Any) -> Val | None:
        """A straight-through estimator's forward value read as the quantized value it stands for.

        ``(x - stop_gradient(x)) + stop_gradient(q)`` is ``0 + q``, exactly q;
        ``x + stop_gradient(q - x)`` is q up to one rounding, and is read as q.
        """
        name = eqn.primitive.name
        if name in SAME_VALUE and ins and (ins[0].ste_zero or ins[0].ste_delta is not None):
            return dataclasses.replace(ins[0], actual=actual, shadow=actual)
        if name == "sub" and len(ins) == 2:
            a, b = ins
            if a.ident is not None and a.ident is b.ident:
                return Val(const=a.const, actual=actual, shadow=actual, grad=a.grad, data=a.data, ste_zero=True,
                            ident=eqn.outvars[0])
            if a.quant is not None and b.quant is None and b.ident is not None:
                return Val(actual=actual, shadow=actual, grad=a.grad or b.grad, data=a.data or b.data,
                            ste_delta=(a, b.ident), ident=eqn.outvars[0])
            return None
        if name != "add" or len(ins) != 2:
            return None
        for q, other in ((ins[0], ins[1]), (ins[1], ins[0])):
            if q.ste_zero:
                kept = other
            elif q.ste_delta is not None and q.ste_delta[1] is other.ident:
                kept = q.ste_delta[0]
            else:
                continue
            if kept.quant is None:
                return None
            return dataclasses.replace(kept, actual=actual, shadow=actual if kept.shadow is kept.actual else kept.shadow,
                                       grad=ins[0].grad or ins[1].grad, data=ins[0].data or ins[1].data,
                                       ident=eqn.outvars[0])
        return None

    def chain(self, eqn: jcore.JaxprEqn, ins: list[Val], quant: OperandQuant | None, out: Val) -> None:
        """Carry, with values, what the declared-quantization check needs: the quantizer's input and codes."""
        if quant is None:
            self.toward_quantizer(eqn, ins, out)
        elif not any(quant is v.quant for v in ins):  # a quantizing step: its codes start here
            self.quantizer_starts(eqn, ins, out)
        elif eqn.primitive.name == "select_n":
            self.select(eqn, ins, out)
        else:
            self.codes_carried(eqn, ins, quant, out)

    def toward_quantizer(self, eqn: jcore.JaxprEqn, ins: list[Val], out: Val) -> None:
        """On the way to a quantizer: a scale divided out (or multiplied in), a zero point added, a saturation."""
        name = eqn.primitive.name
        first = ins[0] if ins else Val()
        scale_at = [i for i, (v, var) in enumerate(zip(ins, eqn.invars))
                    if v.scale or v.const or getattr(var.aval, "size", 0) < getattr(eqn.outvars[0].aval, "size", 0)]
        if name in ("div", "mul") and len(ins) == 2 and len(scale_at) == 1 and (name == "mul" or scale_at == [1]):
            x = ins[1 - scale_at[0]]
            # A literal factor (haliax's weight * 1.0 reparametrisation) is the layer's arithmetic, not a
            # quantizer's scale: the value after it is what a later scale divides, so it starts afresh.
            if x.divisor is None and not ins[scale_at[0]].const:
                out.prescale = x.prescale if x.prescale is not None else x.actual
                out.divisor, out.multiplied = ins[scale_at[0]].actual, name == "mul"
            elif x.divisor is not None and ins[scale_at[0]].const:
                # After the scale, a literal factor is the quantizer's own arithmetic (e2m1's half steps).
                out.prescale, out.divisor, out.multiplied = x.prescale, x.divisor, x.multiplied
            elif x.divisor is not None and name == "div" and not x.multiplied:
                # A second scale divided out (NVFP4's block scale after its global one): the quantizer's input
                # is still the value before the first, divided by both.
                out.prescale, out.divisor, out.multiplied = x.prescale, x.divisor * ins[1].actual, False
        elif name in ("add", "sub") and len(ins) == 2:
            # x / scale plus a zero point (qwix's minmax int8 adds its int8 zero point, one per slice): the
            # quantizer's input is still x, divided by the scale; the zero point's codes are recorded as such.
            # Only integer codes are a zero point: a literal (x / s + 0.5 before a floor) or a float offset (a
            # bias) is the layer's arithmetic, and the value after it starts afresh.
            for i in ((0, 1) if name == "add" else (0,)):
                x, z, zvar = ins[i], ins[1 - i], eqn.invars[1 - i]
                small = z.scale or getattr(zvar.aval, "size", 0) < getattr(eqn.outvars[0].aval, "size", 0)
                codes = z.quant is not None and np.issubdtype(np.dtype(z.quant.dtype or "float32"), np.integer)
                if x.divisor is not None and small and codes and not z.const and z.divisor is None:
                    out.prescale, out.divisor, out.multiplied = x.prescale, x.divisor, x.multiplied
                    out.zero_point = self.zero_point_seen(z)
                    break
        elif name in ("clamp", "max", "min", "convert_element_type", "stop_gradient", "copy", "copy_p", "abs",
                      "neg"):  # abs, neg: a symmetric grid's magnitudes, the sign put back later
            x = ins[1] if name == "clamp" else next((v for v in ins if not v.const), first)
            out.prescale, out.divisor, out.multiplied = x.prescale, x.divisor, x.multiplied
            out.zero_point = x.zero_point

    def quantizer_starts(self, eqn: jcore.JaxprEqn, ins: list[Val], out: Val) -> None:
        """A quantizing step (a cast, a rounding): its codes start here, of the value before the scale."""
        name = eqn.primitive.name
        first = ins[0] if ins else Val()
        if name in ("gather", "sign"):
            return  # values from a table, or signs: not the codes of a value the walk can name
        src = first
        if src.live and src.qid is not None and src.axis_map != tuple(range(len(src.axis_map))):
            # Codes rounded in another layout (NVFP4's blocks), laid back and cast to their type: the same
            # quantizer, whose codes stay where its axes are known.
            out.qid, out.live, out.axis_map = src.qid, True, map_axes(eqn, src.axis_map, ())
            return
        if src.quant is not None and src.qid is not None and not self.own(src.qid):
            # A caller's codes (or a body's, stacked) cast in this body: still that quantizer's codes, whose values
            # are not this trace's to start a quantizer of; dequantized and rounded again, they are no one's.
            if src.live:
                out.qid, out.live, out.axis_map = src.qid, True, map_axes(eqn, src.axis_map, self.qshape(src.qid))
            return
        origin = src.prescale if src.prescale is not None else src.actual
        divisor, multiplied = src.divisor, src.multiplied
        qid = len(self.quantizers)
        if src.quant is not None and src.qid is not None:  # round, then cast to int8: the same chain
            origin, divisor = self.quantizers[src.qid][0], self.quantizers[src.qid][2]
            multiplied = self.multiplied[src.qid]
            self.zero_points = {z: qid if q == src.qid else q for z, q in self.zero_points.items()}
        elif src.zero_point is not None:
            self.zero_points[src.zero_point] = qid
        self.quantizers.append((origin, out.actual, divisor))
        self.multiplied.append(multiplied)
        self.stacked.append(())
        self.code_shadows[qid] = out.shadow
        out.qid, out.live = qid, True
        out.axis_map = tuple(range(len(getattr(eqn.outvars[0].aval, "shape", ()))))

    def codes_carried(self, eqn: jcore.JaxprEqn, ins: list[Val], quant: OperandQuant, out: Val) -> None:
        """An op on codes already made: they stay the quantizer's codes (laid out anew, saturated) or are
        dequantized (times their scale)."""
        name = eqn.primitive.name
        first = ins[0] if ins else Val()
        carrier = next((v for v in ins if quant is v.quant), first)
        if carrier.qid is None:
            return
        out.qid = carrier.qid
        out.axis_map = map_axes(eqn, carrier.axis_map, self.qshape(carrier.qid))
        if carrier.live and name in ("mul", "div"):
            out.live = False  # codes times their scale: dequantized
        elif carrier.live:
            out.live = True
            if name in ("clamp", "max", "min", "round", "floor", "ceil"):
                # Saturation of the codes themselves: the quantizer's codes are these. A caller's codes saturated
                # in a body are not the codes its quantizer made (and not this trace's to rewrite): no link.
                if not self.own(carrier.qid):
                    out.qid, out.live, out.axis_map = None, False, ()
                elif out.axis_map == tuple(range(len(out.axis_map))):
                    o, _, d = self.quantizers[carrier.qid]
                    self.quantizers[carrier.qid] = (o, out.actual, d)

    def select(self, eqn: jcore.JaxprEqn, ins: list[Val], out: Val) -> None:
        """``select_n`` on codes: one quantizer's codes (a sign put back, zeros where a block's scale is zero)
        are its codes still; the roundings of one value on each piece of a non-uniform grid (e2m1's steps of
        1/2, 1 and 2) are together the codes of a quantizer of that value."""
        cases = [v for v in ins[1:] if not v.const]
        if not cases or any(v.qid is None for v in cases):
            return
        qids = sorted({v.qid for v in cases})
        identity = tuple(range(len(getattr(eqn.outvars[0].aval, "shape", ()))))
        if not all(self.own(q) for q in qids):
            return  # a caller's codes picked among in a body: not the codes its quantizer made
        if len(qids) == 1:
            maps = {v.axis_map for v in cases}
            if len(maps) != 1:
                return
            out.qid, out.axis_map, out.live = qids[0], maps.pop(), all(v.live for v in cases)
            if out.live and out.axis_map == identity:
                o, _, d = self.quantizers[out.qid]
                self.quantizers[out.qid] = (o, out.actual, _guarded(d, ins))
            return
        origins = {id(self.quantizers[q][0]) for q in qids}
        divisors = {id(self.quantizers[q][2]) for q in qids}
        if len(origins) != 1 or len(divisors) != 1 or any(v.axis_map != identity for v in cases):
            return
        origin, _, divisor = self.quantizers[qids[0]]
        self.quantizers.append((origin, out.actual, divisor))
        self.multiplied.append(self.multiplied[qids[0]])
        self.stacked.append(())
        out.qid, out.live, out.axis_map = len(self.quantizers) - 1, True, identity

    @staticmethod
    def align(ins: list[Val], invars: Sequence[Any]) -> list[Val]:
        if len(ins) == len(invars):
            return [Val(v.quant, v.const, v.scale, grad=v.grad, casts=v.casts, data=v.data, ident=v.ident or object())
                    for v in ins]
        grad, data = any(v.grad for v in ins), any(v.data for v in ins)
        return [Val(grad=grad, data=data, ident=object()) for _ in invars]

    @staticmethod
    def scale_like(eqn: jcore.JaxprEqn, ins: list[Val]) -> bool:
        name = eqn.primitive.name
        if name == "broadcast_in_dim":
            return eqn.invars[0].aval.size < eqn.outvars[0].aval.size
        return name in ("convert_element_type", "reshape", "copy", "copy_p") and ins[0].scale

    @staticmethod
    def repeated_like(eqn: jcore.JaxprEqn, ins: list[Val]) -> bool:
        """Whether the eqn's result repeats fewer values by index: per-group scales or zero points taken by a
        group index (Keras's ``dequantize_with_sz_map`` by ``g_idx``, quantizers.py:1196-1240), as a broadcast
        spreads a scale. Read as a scale by :meth:`propagate` only (a MoE's dispatch gathers tokens so too; the
        quantizer chains' evidence does not take it for a scale)."""
        name = eqn.primitive.name
        if name == "gather":
            return eqn.invars[0].aval.size < eqn.outvars[0].aval.size
        return name in ("convert_element_type", "reshape", "copy", "copy_p", "broadcast_in_dim") and ins[0].repeated

    def propagate(self, eqn: jcore.JaxprEqn, ins: list[Val]) -> OperandQuant | None:
        """The quantization of the eqn's (first) output; see the module docstring."""
        name = eqn.primitive.name
        if name == "convert_element_type":
            new, old = np.dtype(eqn.params["new_dtype"]), np.dtype(eqn.invars[0].aval.dtype)
            new_bits, old_bits = narrow_bits(new), narrow_bits(old)
            if new_bits and new != old and not (old_bits and old_bits <= new_bits):
                return OperandQuant("cast", str(new), "convert_element_type")
            # Codes widened to a float or a wider integer keep their grid; float -> int32 does not.
            if jnp.issubdtype(new, jnp.floating) or jnp.issubdtype(old, jnp.integer):
                return ins[0].quant
            return None
        if name in ROUNDING or name == "sign":  # sign: onto {-1, 0, 1}
            return OperandQuant("emulated", None, name)
        if name == "gather" and (ins[0].const or ins[0].closed) and getattr(eqn.invars[0].aval, "size", 257) <= 256:
            # A lookup into a constant table of at most 256 values (a codebook, a grid's neighbours): its
            # results take no other values, whatever the indices.
            return OperandQuant("emulated", None, "gather")
        if name == "reduce_precision":
            if 1 + eqn.params["exponent_bits"] + eqn.params["mantissa_bits"] <= 8:
                return OperandQuant("emulated", None, "reduce_precision")
            return ins[0].quant
        if name not in VALUE_PRESERVING:
            return None
        rule, which, _ = VALUE_PRESERVING[name]
        data = ins[which] if isinstance(which, slice) else [ins[i] for i in which]
        if rule == "first":
            return data[0].quant
        if rule == "all":
            if all(v.quant or v.const for v in data) and any(v.quant for v in data):
                return next(v.quant for v in data if v.quant)
            return None
        size = eqn.outvars[0].aval.size
        scale = [v.scale or v.const or v.repeated or var.aval.size < size for v, var in zip(ins, eqn.invars)]
        if rule == "shift":
            # Integer codes and their zero point (one per slice, or a constant): an affine grid, as a GEMM on the
            # codes computes it with a correction term. A float format has no zero point: fp8 values plus 1.0 are
            # no fp8 operand; nor are two full-size values (x + (q - x)) a shift.
            def integer(v: Val) -> bool:
                return v.quant is not None and jnp.issubdtype(named_dtype(v.quant.dtype or "float32"), jnp.integer)

            if integer(ins[0]) and scale[1]:
                return ins[0].quant
            return ins[1].quant if name == "add" and integer(ins[1]) and scale[0] else None
        if name == "div":
            return ins[0].quant if scale[1] or ins[1].quant else None
        (lhs, rhs), (lhs_scale, rhs_scale) = ins, scale
        if lhs.quant and rhs.quant and lhs.quant.step == "sign":
            return rhs.quant  # a sign times magnitudes on a grid: the grid is the quantization
        if lhs.quant and (rhs.quant or rhs_scale):
            return lhs.quant
        if rhs.quant and lhs_scale:
            return rhs.quant
        return None

    @staticmethod
    def shadow(eqn: jcore.JaxprEqn, ins: list[Val], quant: OperandQuant) -> Any:
        name = eqn.primitive.name
        if name in ("gather", "sign") and not any(quant is v.quant for v in ins):
            return None  # a table's values or signs: no value before quantization to name
        if name in ROUNDING or (name in ("convert_element_type", "reduce_precision") and quant is not ins[0].quant):
            return ins[0].shadow  # a quantizing step: its input is the value before quantization
        if all(v.shadow is v.actual for v in ins):
            return None  # quantized from the start (narrow inputs): no earlier value
        if name == "convert_element_type":
            x, new = ins[0].shadow, np.dtype(eqn.params["new_dtype"])
            return x.astype(new) if widest_float([x.dtype, new]) == new != x.dtype else x
        # An index (a gather's, a slice's start) is the same before quantization: its actual value, whatever
        # chain it came by (codes used as indices have a float shadow).
        values = {"gather": 1, "dynamic_slice": 1, "dynamic_update_slice": 2}.get(name, len(ins))
        vals = [v.shadow for v in ins[:values]] + [v.actual for v in ins[values:]]
        if name in ("add", "sub", "mul", "div", "max", "min", "select_n", "concatenate", "pad", "dynamic_update_slice",
                    "clamp"):
            # One type for the values before quantization: the widest float among them. Integer codes meet
            # integers (a zero point, a bound, c + 128) whose shadow is the float the codes were rounded from.
            start = 1 if name == "select_n" else 0
            dtype = widest_float([x.dtype for x in vals[start:values]])
            vals = [x.astype(dtype) if dtype and start <= i < values and x.dtype != dtype and (
                jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)) else x
                for i, x in enumerate(vals)]
        out = eqn.primitive.bind(*vals, **eqn.params)
        return out[0] if eqn.primitive.multiple_results else out  # one output, bound as a list (split)


def _guarded(divisor: Any, ins: list[Val]) -> Any:
    """The scale a guard leaves in use: where ``select_n`` picks a literal code (``where(scale > 0, x / scale, 0)``),
    the scale there divided nothing that reached the matmul, so it reads as 1 and is not held finite and nonzero."""
    which = ins[0].actual
    literal = [i for i, v in enumerate(ins[1:]) if v.const]
    if divisor is None or which is None or not literal:
        return divisor
    # jnp, not numpy: the walk runs traced inside the layer's step, where the values are tracers.
    d = jnp.asarray(divisor)
    picked = jnp.isin(jnp.asarray(which).astype(jnp.int32), jnp.asarray(literal))
    if d.ndim != picked.ndim or any(a not in (1, b) for a, b in zip(d.shape, picked.shape)):
        return divisor
    # A scale broadcast along an axis is unused only where every element it scales took the literal.
    picked = jnp.all(picked, axis=tuple(i for i, n in enumerate(d.shape) if n == 1 and picked.shape[i] != 1),
                     keepdims=True)
    return jnp.where(picked, jnp.ones_like(d), d)
