"""The walk over a traced program that finds every matmul and what its operands went through."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from qcheck._coverage._boundary import Boundaries
from qcheck._coverage._chain import QuantizerChains
from qcheck._coverage._control import ControlFlow
from qcheck._coverage._fields import PackedFields
from qcheck._coverage._kernels import KernelRead, KernelRoles, read_kernel
from qcheck._coverage._records import (BLOCK_SCALED, ERROR_PRIMITIVES, FULL, MATMUL_PRIMITIVES, OPAQUE, UNKNOWN,
                                       MatmulRecord, block_format, call_body, jaxprs_in_params)
from qcheck._coverage._scopes import machinery_prefixes, scope_names, user_frames
from qcheck._coverage._values import (SAME_VALUE, Val, Where, contracting_dims, eval_eqn, input_val, is_contraction,
                                      live_eqns, narrow_bits, operand_role, widest_float)
from qcheck._errors import UserCodeError, first_line, raised_by_qcheck


class Walker(QuantizerChains, PackedFields, ControlFlow, Boundaries):
    """The walk over a traced program: every matmul as a record, each operand's quantized chain, with values where
    it runs inside a program of its own."""

    def __init__(self, machinery: tuple[str, ...] = (), kernels: dict[str, KernelRoles] | None = None,
                 entry: str = "coverage"):
        self.entry = entry  # the public call, named where a step of the walk fails
        self.records: list[MatmulRecord] = []
        self.errors: list[tuple[int, Any]] = []  # (record index, traced error)
        # With values: each quantizer's (input before scaling, codes, divisor or None), and each matmul
        # operand that reached a quantizer's codes: (record index, side, quantizer, its contraction axes
        # in the quantizer's layout, None where one cannot be traced back).
        self.quantizers: list[tuple[Any, Any, Any]] = []
        self.operands: list[tuple[int, str, int, tuple[int | None, ...]]] = []
        self.multiplied: list[bool] = []  # per quantizer: its scale was multiplied in
        # Per quantizer started by a cast or a rounding: its codes' value before quantization (their shadow), for
        # codes that come back unpacked from a packed word (PackedFields.unpack).
        self.code_shadows: dict[int, Any] = {}
        # Per quantizer: what its values' leading axes enumerate ("iteration" of a scan, "shard" of a shard_map,
        # outermost first): one quantizer of a body, its values stacked over the body's runs.
        self.stacked: list[tuple[str, ...]] = []
        # Zero points: the quantizer whose codes are another quantizer's zero point (x / s + zp, rounded: qwix's
        # minmax int8), to the quantizer they shift (a body's put back with its evidence).
        self.zero_points: dict[int, int] = {}
        # Inside a body walked with values: where its own quantizers start (those below are a caller's, linked to
        # only), and the shape a shard sees of each caller's quantizer whose codes its shard_map splits.
        self.base = 0
        self.views: dict[int, tuple[int, ...]] = {}
        self.mirrors: dict[int, int] = {}  # a split caller's zero point: the body's quantizer of its slice
        self.machinery = machinery_prefixes(machinery)
        self.kernels = kernels or {}  # declared roles of opaque kernels, by kernel name
        self.misdeclared: list[str] = []  # declared roles that do not fit their kernel (the caller raises)

    def read(self, env: dict, v: Any) -> Val:
        if isinstance(v, jcore.Literal):
            val = input_val(v.aval, v.val, const=True)
            val.quant, val.known = None, self.known_constant(v.aval, v.val)
            return val
        return env[v]

    def run(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], ins: list[Val],
            outer: Where, *, values: bool) -> list[Val]:
        env: dict = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = input_val(var.aval, c if values else None)
            env[var].ident = var
            env[var].closed = True
            env[var].known = self.known_constant(var.aval, c)
        for var, val in zip(jaxpr.invars, ins):
            env[var] = val
        live = live_eqns(jaxpr)
        for eqn, keep in zip(jaxpr.eqns, live):
            if not keep:
                continue
            ins_e = [self.read(env, v) for v in eqn.invars]
            # An inner jaxpr's name stack is relative to the eqn that holds it; its traceback is whole.
            frames = user_frames(eqn, self.machinery)
            # A custom_vjp's body may be traced apart from its caller: its frames then lack the caller's.
            if not frames or (outer.stack and outer.stack[-1] not in frames):
                frames = frames + outer.stack
            where = Where(frames, outer.scope + scope_names(eqn), outer.no_values)
            outs = self.step(eqn, ins_e, where, values=values)
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
        return [self.read(env, v) for v in jaxpr.outvars]

    def step(self, eqn: jcore.JaxprEqn, ins: list[Val], where: Where, *, values: bool) -> list[Val]:
        """One eqn walked; where JAX refuses what the walk binds on the values it carries (a primitive that takes
        its operands' integer types only, given the float values before quantization), a UserCodeError naming the
        site, never a raw error. One raised in qcheck's own frames is a bug of qcheck's, and stays as it is."""
        try:
            return self.eqn(eqn, ins, where, values=values)
        except Exception as e:  # noqa: BLE001 - any refusal of JAX's, said once at the site, chained
            if isinstance(e, UserCodeError) or raised_by_qcheck(e):
                raise
            location, function = where.stack[0] if where.stack else ("<unknown>", "<unknown>")
            dtypes = ", ".join(str(getattr(v.aval, "dtype", "-")) for v in eqn.invars)
            raise UserCodeError(
                f"{self.entry}: the walk cannot follow {eqn.primitive.name} ({dtypes}) at {location} ({function}): "
                f"{type(e).__name__}: {first_line(e)}") from e

    def eqn(self, eqn: jcore.JaxprEqn, ins: list[Val], where: Where, *, values: bool) -> list[Val]:
        name = eqn.primitive.name
        if (body := call_body(eqn)) is not None:
            return self.run(body[0], body[1], ins, where, values=values)
        if name in ("scan", "while", "cond"):
            return self.control(eqn, ins, where, values=values)
        if name == "shard_map" and values and where.no_values is None:
            outs = self.shard(eqn, ins, where)
            if not isinstance(outs, str):
                return outs
            where = dataclasses.replace(where, no_values=outs)
        actual = None
        subs = jaxprs_in_params(eqn.params)
        if values:
            if subs or name in OPAQUE:
                actual = eval_eqn(eqn, [v.actual for v in ins])
            else:
                actual = eqn.primitive.bind(*[v.actual for v in ins], **eqn.params)
                actual = list(actual) if eqn.primitive.multiple_results else [actual]
        if name in MATMUL_PRIMITIVES and is_contraction(eqn):
            self.matmul(eqn, ins, where, actual[0] if values else None)
        elif name in OPAQUE:
            caller, location = where.stack[0][1] if where.stack else "", where.stack[0][0] if where.stack else "?"
            kernel = read_kernel(eqn, self.kernels, caller, location)
            if kernel.misfit is not None:  # raised by coverage after the walk, not as an error of the traced code
                self.misdeclared.append(kernel.misfit)
            self.matmul(eqn, ins, where, None, kernel=kernel)
        elif subs:
            # shard_map's body (per shard) and any other higher-order primitive: walked for quantization
            # only; where a body maps the eqn's operands to its results, their quantization carries over.
            inner = dataclasses.replace(
                where, no_values=where.no_values or f"inside {name}: its body is walked for quantization only")
            mapped = None
            for sub in subs:
                outs = self.run(sub, [None] * len(sub.constvars), self.align(ins, sub.invars), inner, values=False)
                if len(sub.invars) == len(ins) and len(outs) == len(eqn.outvars):
                    mapped = outs
            if mapped is not None:
                grad = any(v.grad for v in ins)
                return [Val(o.quant, False, False, actual[i] if values else None, actual[i] if values else None,
                             grad=grad, casts=o.casts, data=o.data) for i, o in enumerate(mapped)]
        if name == "optimization_barrier":  # each result is its operand, quantizer evidence and all
            kept = [v.shadow if values and v.shadow is not v.actual else None for v in ins]
            return [dataclasses.replace(v, actual=actual[i] if values else None,
                                        shadow=(actual[i] if kept[i] is None else kept[i]) if values else None)
                    for i, v in enumerate(ins)]
        if (ste := self.straight_through(eqn, ins, actual[0] if values and actual else None)) is not None:
            return [ste]
        if (unpacked := self.unpack(eqn, ins, actual[0] if values and actual else None)) is not None:
            return [unpacked]
        quant = self.propagate(eqn, ins)
        const = all(v.const for v in ins)
        closed = bool(ins) and all(v.const or v.closed for v in ins)
        grad = any(v.grad for v in ins)
        data = self.data_of(eqn, ins)
        casts = frozenset()
        if quant is not None:
            # Scales and codes meet here: the record reports one quantization, this keeps every cast.
            casts = frozenset().union(*(v.casts for v in ins))
            if quant.kind == "cast" and not any(quant is v.quant for v in ins):
                casts |= {quant.dtype}
        outs = []
        for i, var in enumerate(eqn.outvars):
            a = actual[i] if values else None
            val = Val(quant if i == 0 else None, const, getattr(var.aval, "size", 2) == 1, a, a, grad=grad,
                       casts=casts if i == 0 else frozenset(), data=data, ident=var, closed=closed)
            outs.append(val)
        if len(outs) == 1:
            outs[0].scale = outs[0].scale or self.scale_like(eqn, ins)
            outs[0].repeated = self.repeated_like(eqn, ins)
            self.integer_facts(eqn, ins, outs[0])
            if name in SAME_VALUE:
                outs[0].ident = ins[0].ident
            if values and quant is not None:
                shadow = self.shadow(eqn, ins, quant)
                outs[0].shadow = outs[0].actual if shadow is None else shadow
            if values:
                self.chain(eqn, ins, quant, outs[0])
        return outs

    def matmul(self, eqn: jcore.JaxprEqn, ins: list[Val], where: Where, out: Any, *,
               kernel: KernelRead | None = None) -> None:
        """Record one matmul; an opaque ``kernel`` by its roles (:mod:`._kernels`), its operands as they name."""
        opaque = kernel is not None
        unknown = opaque and kernel.source is None
        (lhs, lhs_var), (rhs, rhs_var), scales, blocks = _sides(eqn, ins, kernel)
        reason = _no_error(eqn, lhs, rhs, where, out, opaque, unknown)
        location, function = where.stack[0] if where.stack else ("<unknown>", "<unknown>")
        self.records.append(MatmulRecord(
            primitive=eqn.primitive.name,
            location=location,
            function=function,
            lhs_shape=_shape(lhs_var),
            rhs_shape=_shape(rhs_var),
            lhs_dtype=_dtype(lhs_var),
            rhs_dtype=_dtype(rhs_var),
            lhs=lhs.quant or FULL,
            rhs=rhs.quant or FULL,
            backward=any(v.grad for v in ins),
            lhs_casts=lhs.casts | scales[0],
            rhs_casts=rhs.casts | scales[1],
            lhs_block=blocks[0],
            rhs_block=blocks[1],
            scope="/".join(where.scope),
            stack=where.stack,
            no_values=where.no_values,
            opaque=opaque,
            no_error=reason,
            lhs_role=operand_role(lhs),
            rhs_role=operand_role(rhs),
            kernel=kernel.name if opaque else None,
            kernel_roles=kernel.source if opaque else None,
            operands=tuple(f"{_shape(eqn.invars[i])} {_dtype(eqn.invars[i])} [{ins[i].quant or FULL}]"
                           for i in kernel.data) if opaque else (),
        ))
        contracting = (None, None)
        if out is not None and not opaque:
            contracting = contracting_dims(eqn)
        elif opaque and not unknown and where.no_values is None:
            # A kernel's code inputs are held as any matmul's: to the referee's codes of their quantizer's input,
            # along the axes its roles say it contracts (unknown: one per operand axis, held by type alone).
            contracting = tuple(c if c is not None else (None,) for c in (kernel.lhs_contracting,
                                                                           kernel.rhs_contracting))
        if contracting != (None, None):
            for side, v, axes in (("lhs", lhs, contracting[0]), ("rhs", rhs, contracting[1])):
                if v.qid is not None and axes is not None:
                    mapped = tuple(v.axis_map[a] if a is not None and a < len(v.axis_map) else None for a in axes)
                    self.operands.append((len(self.records) - 1, side, v.qid, mapped))
        if reason is None:
            self.errors.append((len(self.records) - 1, _error(eqn, ins, lhs, rhs, out)))


def _shape(var: Any) -> tuple[int, ...]:
    return tuple(var.aval.shape) if var is not None else ()


def _dtype(var: Any) -> str:
    return str(np.dtype(var.aval.dtype)) if var is not None and hasattr(var.aval, "dtype") else "-"


def _sides(eqn: jcore.JaxprEqn, ins: list[Val], kernel: KernelRead | None) -> tuple[Any, Any, tuple, tuple]:
    """A matmul's (lhs, its var), (rhs, its var), the narrow types of each side's scales, and each side's block
    format: an opaque kernel's by its roles; one whose roles are unknown has neither side quantized."""
    scales, blocks = (frozenset(), frozenset()), (None, None)
    if kernel is not None and kernel.source is None:
        return (Val(UNKNOWN), None), (Val(UNKNOWN), None), scales, blocks
    if kernel is not None:
        lhs, rhs = ((ins[i], eqn.invars[i]) for i in (kernel.lhs, kernel.rhs))
        # A narrow scale's type is part of the operand's format (as for the block-scaled matmuls below).
        scales = tuple(frozenset() if i is None else ins[i].casts | (
            {_dtype(eqn.invars[i])} if narrow_bits(eqn.invars[i].aval.dtype) else set())
            for i in (kernel.lhs_scale, kernel.rhs_scale))
        return lhs, rhs, scales, blocks
    lhs, rhs = zip(ins[:2], eqn.invars[:2])
    if eqn.primitive.name in BLOCK_SCALED and len(eqn.invars) >= 4:
        # Codes and their scales are separate operands: the scales' type is part of the operand's format.
        sv = eqn.invars[2:4]
        scales = tuple(v.casts | {str(np.dtype(x.aval.dtype))} for v, x in zip(ins[2:4], sv))
        blocks = tuple(block_format(c.aval, x.aval, eqn.primitive.name) for c, x in zip(eqn.invars[:2], sv))
    return lhs, rhs, scales, blocks


def _no_error(eqn: jcore.JaxprEqn, lhs: Val, rhs: Val, where: Where, out: Any, opaque: bool,
              unknown: bool) -> str | None:
    """Why a matmul gets no error figure (None: it gets one)."""
    if opaque and (unknown or (lhs.quant and rhs.quant)):
        return f"an opaque kernel ({eqn.primitive.name}): its body is not walked"
    if not (lhs.quant and rhs.quant):
        return "full-precision operands"
    if eqn.primitive.name not in ERROR_PRIMITIVES:
        return "a scaled matmul: codes and scales enter separately"
    if out is None:
        return where.no_values or "not computed (errors=False)"
    if lhs.shadow is lhs.actual and rhs.shadow is rhs.actual:
        return "operands narrow from the start: no value before quantization"
    return None


def _error(eqn: jcore.JaxprEqn, ins: list[Val], lhs: Val, rhs: Val, out: Any) -> Any:
    """The matmul's relative error against the same matmul of its operands before quantization."""
    a, b = lhs.shadow, rhs.shadow
    dtype_ = widest_float([a.dtype, b.dtype, np.dtype(np.float32)])
    params = dict(eqn.params)
    if params.get("preferred_element_type") is not None:
        params["preferred_element_type"] = dtype_
    ref = eqn.primitive.bind(a.astype(dtype_), b.astype(dtype_), *[v.actual for v in ins[2:]], **params)
    ref = ref.astype(jnp.float32)
    return jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
