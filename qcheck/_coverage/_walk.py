"""The walk over a traced program that finds every matmul and what its operands went through."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from qcheck._coverage._kernels import KernelRead, KernelRoles, read_kernel
from qcheck._coverage._records import BLOCK_SCALED, ERROR_PRIMITIVES, FULL, MATMUL_PRIMITIVES, MatmulRecord, OPAQUE, OperandQuant, Part, ROUNDING, UNKNOWN, VALUE_PRESERVING, block_format, call_body
from qcheck._coverage._scopes import machinery_prefixes, scope_names, user_frames


# -- the walk -------------------------------------------------------------------

def _narrow_bits(dtype: Any) -> int | None:
    """The width of a narrow (at most 8-bit) integer or float type; None otherwise."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None  # PRNG keys
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return None
    if jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    else:
        return None
    return bits if bits <= 8 else None


def _widest(dtypes: list[Any]) -> np.dtype | None:
    """The widest float type among ``dtypes``: shadows meet actual values without implicit promotion (fp8 has none)."""
    floats = [np.dtype(d) for d in dtypes if jnp.issubdtype(d, jnp.floating)]
    return max(floats, key=lambda d: jnp.finfo(d).bits) if floats else None


@dataclasses.dataclass
class _Val:
    quant: OperandQuant | None = None
    const: bool = False  # derives from literals only
    scale: bool = False  # a scalar, or broadcast from fewer elements
    actual: Any = None
    shadow: Any = None  # the value before quantization (actual when not on a quantized chain)
    grad: bool = False  # depends on the output gradient: part of the backward pass
    casts: frozenset[str] = frozenset()  # every narrow type on the quantized chain, codes and scales alike
    data: bool = False  # depends on the call's inputs (not only on parameters and state): an activation
    # With values, for the declared-quantization check: the quantizer this chain started at (its index in
    # Walker.quantizers), and for each axis of this value the quantizer's axis it came from (None: unknown).
    qid: int | None = None
    axis_map: tuple[int | None, ...] = ()
    live: bool = False  # the value still is the quantizer's codes (no scale applied since)
    # A full-precision value on its way to a quantizer: the value before it was divided by (or multiplied
    # with) a scale and saturated, and that scale (a divisor; None: no scale seen).
    prescale: Any = None
    divisor: Any = None
    multiplied: bool = False  # the scale was multiplied in (x · s), not divided out
    # Straight-through estimators: x - x (exactly zero), or q - x (to be added back to the same x).
    ste_zero: bool = False
    ste_delta: tuple[Any, Any] | None = None  # (the quantized _Val q, the identity of x)
    ident: Any = None  # what value this is: stop_gradient and copies keep their operand's
    closed: bool = False  # a constant of the program (closed over, or computed from constants only)


def input_val(aval: Any, value: Any = None, const: bool = False, data: bool = False) -> _Val:
    bits = _narrow_bits(aval.dtype) if hasattr(aval, "dtype") else None
    quant = OperandQuant("cast", str(np.dtype(aval.dtype)), "input") if bits else None
    scale = getattr(aval, "size", 2) == 1
    return _Val(quant, const, scale, value, value, casts=frozenset({quant.dtype}) if quant else frozenset(),
                data=data)


#: Layout ops whose output axes can be traced back to their operand's (the rest lose the map).
#: stop_gradient too: a straight-through estimator's codes reach the matmul through it.
_AXIS_OPS = frozenset({"transpose", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "slice", "rev",
                       "dynamic_slice", "copy", "copy_p", "sharding_constraint", "optimization_barrier",
                       "stop_gradient", "convert_element_type", "reduce_precision", "neg", "abs", "clamp", "max",
                       "min", "mul", "div", "pvary", "pbroadcast", "reshard", "mesh_cast"})


def _atoms(old: tuple[int, ...], source: tuple[Any, ...], qshape: tuple[int, ...]) -> list[tuple[Any, int]]:
    """The operand's axes as atoms ``(quantizer axis | Part | None, size)``, runs expanded, size-1 axes left out."""
    atoms: list[tuple[Any, int]] = []
    for j, d in enumerate(old):
        if d == 1:
            continue
        a = source[j] if j < len(source) else None
        run = (a,) if isinstance(a, int) else a if isinstance(a, tuple) else None
        if isinstance(a, Part):
            atoms.append((a, d))
        elif run is None or int(np.prod([qshape[r] for r in run])) != d:
            atoms.append((None, d))
        else:
            atoms.extend((r, qshape[r]) for r in run if qshape[r] != 1)
    return atoms


def _run_of(atoms: list[Any]) -> tuple[int, ...] | None:
    """The quantizer's consecutive axes a group of atoms is: plain axes in order, or every Part of one run."""
    if atoms and all(isinstance(a, Part) for a in atoms):
        first = atoms[0]
        if [(a.run, a.index, a.count) for a in atoms] == [(first.run, i, first.count) for i in range(first.count)]:
            return first.run
        return None
    if any(not isinstance(a, int) for a in atoms):
        return None
    return tuple(atoms) if list(atoms) == list(range(atoms[0], atoms[0] + len(atoms))) else None


def _reshape_axes(old: tuple[int, ...], new: tuple[int, ...], source: tuple[Any, ...],
                  qshape: tuple[int, ...]) -> tuple[Any, ...]:
    """``source`` (for each axis of ``old``, the quantizer's axis it is, a run of them, a Part, or None) after a
    reshape.

    The operand's axes and the new ones are matched in the smallest groups of
    equal size. A new axis that is a whole group of the quantizer's axes maps
    to them (a run, a tuple, when several: a block split off its axis and
    merged back, NVFP4's ``[..., k] -> [..., k/16, 16] -> [..., k]``); several
    new axes that together are one run are its Parts; anything else is None.
    """
    atoms = _atoms(old, source, qshape)
    dims = [(i, d) for i, d in enumerate(new) if d != 1]
    out: list[Any] = [None] * len(new)
    a = n = 0
    while a < len(atoms) and n < len(dims):
        group_a, group_n = [atoms[a]], [dims[n]]
        pa, pn = atoms[a][1], dims[n][1]
        a, n = a + 1, n + 1
        while pa != pn:
            if pa < pn and a < len(atoms):
                pa *= atoms[a][1]
                group_a.append(atoms[a])
                a += 1
            elif pn < pa and n < len(dims):
                pn *= dims[n][1]
                group_n.append(dims[n])
                n += 1
            else:
                return tuple(out)
        run = _run_of([x for x, _ in group_a])
        if run is None:
            continue
        if len(group_n) == 1:
            out[group_n[0][0]] = run[0] if len(run) == 1 else run
        else:
            for k, (i, _) in enumerate(group_n):
                out[i] = Part(run, k, len(group_n))
    return tuple(out)


def _axis_map(eqn: jcore.JaxprEqn, source: tuple[Any, ...], qshape: tuple[int, ...]) -> tuple[Any, ...]:
    """``source`` (the operand's axis map) carried through one value-preserving op to its output."""
    name, out_aval = eqn.primitive.name, eqn.outvars[0].aval
    ndim = len(getattr(out_aval, "shape", ()))
    if name not in _AXIS_OPS:
        return (None,) * ndim
    if name == "transpose":
        return tuple(source[p] for p in eqn.params["permutation"])
    if name == "broadcast_in_dim":
        out: list[int | None] = [None] * ndim
        in_shape = eqn.invars[0].aval.shape
        for j, d in enumerate(eqn.params["broadcast_dimensions"]):
            out[d] = source[j] if in_shape[j] == out_aval.shape[d] else None
        return tuple(out)
    if name in ("reshape", "squeeze", "expand_dims"):
        return _reshape_axes(tuple(eqn.invars[0].aval.shape), tuple(out_aval.shape), source, qshape)
    return tuple(source) if len(source) == ndim else (None,) * ndim


def _scan_operands(params: dict, ins: list) -> tuple[list, list, list]:
    """A scan's inputs split into consts, carry and scanned xs.

    jax 0.10 states the split as ``num_consts`` / ``num_carry``; jax 0.12 as a
    tree of the three groups (``ft_in``) whose ``update(...).unpack()`` splits
    them (as its own ``_scan_impl`` does).
    """
    if "num_consts" in params:
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        return ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    consts, carry, xs = (list(group) for group in params["ft_in"].update(list(ins)).unpack())
    return consts, carry, xs


#: Error figures that stand for none: a matmul in a cond branch the inputs do not take, or in a loop body no
#: iteration of which ran. Worst-of over iterations (``max``) keeps a real figure over either.
NOT_RUN_COND, NOT_RUN_LOOP = -1.0, -2.0
NOT_RUN = {NOT_RUN_COND: "in a cond branch these inputs do not take",
           NOT_RUN_LOOP: "in a loop body these inputs run no iteration of"}


@dataclasses.dataclass(frozen=True)
class Where:
    """Where the walk is: the user's frames, the named scopes, and why values are unavailable (if they are)."""

    stack: tuple[tuple[str, str], ...] = ()
    scope: tuple[str, ...] = ()
    no_values: str | None = None


def _live(jaxpr: jcore.Jaxpr) -> list[bool]:
    """Per eqn, whether the jaxpr's results depend on it (or it has effects): a matmul whose result is dropped
    (a vjp's other cotangent, computed and never used) is no site of the program XLA runs."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    live = [False] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(v in needed for v in eqn.outvars):
            live[i] = True
            needed.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return live


@dataclasses.dataclass
class Evidence:
    """What a body walked with values found of its quantizers: each one's (input, codes, divisor), whether its
    scale was multiplied in, its own stacking, and which of the body's matmul operands (by record index within
    the body) reached which (by index within ``quantizers``) with which contraction axes."""

    quantizers: list[tuple[Any, Any, Any]]
    multiplied: list[bool]
    stacked: list[tuple[str, ...]]
    operands: list[tuple[int, str, int, tuple[int | None, ...]]]


def _eval_eqn(eqn: jcore.JaxprEqn, vals: list[Any]) -> list[Any]:
    """Evaluate one eqn on values, as ``jax.core.eval_jaxpr`` binds it (higher-order primitives included)."""
    invars, seen = [], set()
    for v in eqn.invars:
        if not isinstance(v, jcore.Literal) and v not in seen:
            seen.add(v)
            invars.append(v)
    env = {v: x for v, x in zip(eqn.invars, vals) if not isinstance(v, jcore.Literal)}
    debug = jcore.DebugInfo("qcheck.coverage", eqn.primitive.name, tuple(f"in{i}" for i in range(len(invars))),
                            tuple(f"out{i}" for i in range(len(eqn.outvars))))
    jaxpr = jcore.Jaxpr([], invars, eqn.outvars, [eqn], eqn.effects, debug)
    return list(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, []))(*[env[v] for v in invars]))


def _role(v: _Val) -> str:
    return "grad" if v.grad else "activation" if v.data else "weight"


def _contracting(eqn: jcore.JaxprEqn) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """The contracting axes of a matmul's lhs and rhs (None where the primitive states none qcheck reads)."""
    p = eqn.params
    if "dimension_numbers" in p and eqn.primitive.name == "dot_general":
        (lc, rc), _ = p["dimension_numbers"]
        return tuple(lc), tuple(rc)
    if eqn.primitive.name == "ragged_dot_general":
        (lc, rc), _ = p["ragged_dot_dimension_numbers"].dot_dimension_numbers
        return tuple(lc), tuple(rc)
    if eqn.primitive.name == "ragged_dot":  # lhs [m, k], rhs [groups, k, n]
        return (1,), (1,)
    if eqn.primitive.name in ("scaled_matmul_wrapper", "scaled_matmul"):  # codes [batch, rows, k], both sides
        return (2,), (2,)
    return None, None


def _contracts(eqn: jcore.JaxprEqn) -> bool:
    """Whether a matmul primitive contracts a dimension: with none (``...k,k->...k``) it multiplies elementwise."""
    lhs, _ = _contracting(eqn)
    return lhs is None or len(lhs) > 0


#: Ops whose output is their operand's value itself (for telling ``x - stop_gradient(x)`` from other subtractions).
_SAME_VALUE = frozenset({"stop_gradient", "copy", "copy_p", "optimization_barrier", "sharding_constraint"})


class Walker:
    def __init__(self, machinery: tuple[str, ...] = (), kernels: dict[str, KernelRoles] | None = None):
        self.records: list[MatmulRecord] = []
        self.errors: list[tuple[int, Any]] = []  # (record index, traced error)
        # With values: each quantizer's (input before scaling, codes, divisor or None), and each matmul
        # operand that reached a quantizer's codes: (record index, side, quantizer, its contraction axes
        # in the quantizer's layout, None where one cannot be traced back).
        self.quantizers: list[tuple[Any, Any, Any]] = []
        self.operands: list[tuple[int, str, int, tuple[int | None, ...]]] = []
        self.multiplied: list[bool] = []  # per quantizer: its scale was multiplied in
        # Per quantizer: what its values' leading axes enumerate ("iteration" of a scan, "shard" of a shard_map,
        # outermost first): one quantizer of a body, its values stacked over the body's runs.
        self.stacked: list[tuple[str, ...]] = []
        self.machinery = machinery_prefixes(machinery)
        self.kernels = kernels or {}  # declared roles of opaque kernels, by kernel name
        self.misdeclared: list[str] = []  # declared roles that do not fit their kernel (the caller raises)

    def read(self, env: dict, v: Any) -> _Val:
        if isinstance(v, jcore.Literal):
            val = input_val(v.aval, v.val, const=True)
            val.quant = None
            return val
        return env[v]

    def run(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], ins: list[_Val],
            outer: Where, *, values: bool) -> list[_Val]:
        env: dict = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = input_val(var.aval, c if values else None)
            env[var].ident = var
            env[var].closed = True
        for var, val in zip(jaxpr.invars, ins):
            env[var] = val
        live = _live(jaxpr)
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
            outs = self.eqn(eqn, ins_e, where, values=values)
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
        return [self.read(env, v) for v in jaxpr.outvars]

    def eqn(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: Where, *, values: bool) -> list[_Val]:
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
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if values:
            if subs or name in OPAQUE:
                actual = _eval_eqn(eqn, [v.actual for v in ins])
            else:
                actual = eqn.primitive.bind(*[v.actual for v in ins], **eqn.params)
                actual = list(actual) if eqn.primitive.multiple_results else [actual]
        if name in MATMUL_PRIMITIVES and _contracts(eqn):
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
                return [_Val(o.quant, False, False, actual[i] if values else None, actual[i] if values else None,
                             grad=grad, casts=o.casts, data=o.data) for i, o in enumerate(mapped)]
        if name == "optimization_barrier":  # each result is its operand, quantizer evidence and all
            kept = [v.shadow if values and v.shadow is not v.actual else None for v in ins]
            return [dataclasses.replace(v, actual=actual[i] if values else None,
                                        shadow=(actual[i] if kept[i] is None else kept[i]) if values else None)
                    for i, v in enumerate(ins)]
        if (ste := self.straight_through(eqn, ins, actual[0] if values and actual else None)) is not None:
            return [ste]
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
            val = _Val(quant if i == 0 else None, const, getattr(var.aval, "size", 2) == 1, a, a, grad=grad,
                       casts=casts if i == 0 else frozenset(), data=data, ident=var, closed=closed)
            outs.append(val)
        if len(outs) == 1:
            outs[0].scale = outs[0].scale or self.scale_like(eqn, ins)
            if name in _SAME_VALUE:
                outs[0].ident = ins[0].ident
            if values and quant is not None:
                shadow = self.shadow(eqn, ins, quant)
                outs[0].shadow = outs[0].actual if shadow is None else shadow
            if values:
                self.chain(eqn, ins, quant, outs[0])
        return outs

    @staticmethod
    def data_of(eqn: jcore.JaxprEqn, ins: list[_Val]) -> bool:
        """Whether the output depends on the call's inputs; indices into a weight (gather, dynamic_slice) do not count."""
        if eqn.primitive.name in ("gather", "dynamic_slice") and ins:
            return ins[0].data
        return any(v.data for v in ins)

    def straight_through(self, eqn: jcore.JaxprEqn, ins: list[_Val], actual: Any) -> _Val | None:
        """A straight-through estimator's forward value read as the quantized value it stands for.

        ``(x - stop_gradient(x)) + stop_gradient(q)`` is ``0 + q``, exactly q;
        ``x + stop_gradient(q - x)`` is q up to one rounding, and is read as q.
        """
        name = eqn.primitive.name
        if name in _SAME_VALUE and ins and (ins[0].ste_zero or ins[0].ste_delta is not None):
            return dataclasses.replace(ins[0], actual=actual, shadow=actual)
        if name == "sub" and len(ins) == 2:
            a, b = ins
            if a.ident is not None and a.ident is b.ident:
                return _Val(const=a.const, actual=actual, shadow=actual, grad=a.grad, data=a.data, ste_zero=True,
                            ident=eqn.outvars[0])
            if a.quant is not None and b.quant is None and b.ident is not None:
                return _Val(actual=actual, shadow=actual, grad=a.grad or b.grad, data=a.data or b.data,
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

    def chain(self, eqn: jcore.JaxprEqn, ins: list[_Val], quant: OperandQuant | None, out: _Val) -> None:
        """Carry, with values, what the declared-quantization check needs: the quantizer's input and codes."""
        name = eqn.primitive.name
        first = ins[0] if ins else _Val()
        if quant is None:
            # On the way to a quantizer: a scale divided out (or multiplied in), a saturation.
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
            elif name in ("clamp", "max", "min", "convert_element_type", "stop_gradient", "copy", "copy_p", "abs",
                          "neg"):  # abs, neg: a symmetric grid's magnitudes, the sign put back later
                x = ins[1] if name == "clamp" else next((v for v in ins if not v.const), first)
                out.prescale, out.divisor, out.multiplied = x.prescale, x.divisor, x.multiplied
            return
        if not any(quant is v.quant for v in ins):  # a quantizing step: its codes start here
            if name in ("gather", "sign"):
                return  # values from a table, or signs: not the codes of a value the walk can name
            src = first
            if src.live and src.qid is not None and src.axis_map != tuple(range(len(src.axis_map))):
                # Codes rounded in another layout (NVFP4's blocks), laid back and cast to their type: the same
                # quantizer, whose codes stay where its axes are known.
                out.qid, out.live, out.axis_map = src.qid, True, _axis_map(eqn, src.axis_map, ())
                return
            origin = src.prescale if src.prescale is not None else src.actual
            divisor, multiplied = src.divisor, src.multiplied
            if src.quant is not None and src.qid is not None:  # round, then cast to int8: the same chain
                origin, divisor = self.quantizers[src.qid][0], self.quantizers[src.qid][2]
                multiplied = self.multiplied[src.qid]
            self.quantizers.append((origin, out.actual, divisor))
            self.multiplied.append(multiplied)
            self.stacked.append(())
            out.qid, out.live = len(self.quantizers) - 1, True
            out.axis_map = tuple(range(len(getattr(eqn.outvars[0].aval, "shape", ()))))
            return
        if name == "select_n":
            self.select(eqn, ins, out)
            return
        carrier = next((v for v in ins if quant is v.quant), first)
        if carrier.qid is None:
            return
        out.qid = carrier.qid
        out.axis_map = _axis_map(eqn, carrier.axis_map, tuple(np.shape(self.quantizers[carrier.qid][1])))
        if carrier.live and name in ("mul", "div"):
            out.live = False  # codes times their scale: dequantized
        elif carrier.live:
            out.live = True
            if name in ("clamp", "max", "min", "round", "floor", "ceil"):
                # Saturation of the codes themselves: the quantizer's codes are these.
                if out.axis_map == tuple(range(len(out.axis_map))):
                    o, _, d = self.quantizers[carrier.qid]
                    self.quantizers[carrier.qid] = (o, out.actual, d)

    def select(self, eqn: jcore.JaxprEqn, ins: list[_Val], out: _Val) -> None:
        """``select_n`` on codes: one quantizer's codes (a sign put back, zeros where a block's scale is zero)
        are its codes still; the roundings of one value on each piece of a non-uniform grid (e2m1's steps of
        1/2, 1 and 2) are together the codes of a quantizer of that value."""
        cases = [v for v in ins[1:] if not v.const]
        if not cases or any(v.qid is None for v in cases):
            return
        qids = sorted({v.qid for v in cases})
        identity = tuple(range(len(getattr(eqn.outvars[0].aval, "shape", ()))))
        if len(qids) == 1:
            maps = {v.axis_map for v in cases}
            if len(maps) != 1:
                return
            out.qid, out.axis_map, out.live = qids[0], maps.pop(), all(v.live for v in cases)
            if out.live and out.axis_map == identity:
                o, _, d = self.quantizers[out.qid]
                self.quantizers[out.qid] = (o, out.actual, d)
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
    def align(ins: list[_Val], invars: Sequence[Any]) -> list[_Val]:
        if len(ins) == len(invars):
            return [_Val(v.quant, v.const, v.scale, grad=v.grad, casts=v.casts, data=v.data, ident=v.ident or object())
                    for v in ins]
        grad, data = any(v.grad for v in ins), any(v.data for v in ins)
        return [_Val(grad=grad, data=data, ident=object()) for _ in invars]

    @staticmethod
    def scale_like(eqn: jcore.JaxprEqn, ins: list[_Val]) -> bool:
        name = eqn.primitive.name
        if name == "broadcast_in_dim":
            return eqn.invars[0].aval.size < eqn.outvars[0].aval.size
        return name in ("convert_element_type", "reshape", "copy", "copy_p") and ins[0].scale

    def propagate(self, eqn: jcore.JaxprEqn, ins: list[_Val]) -> OperandQuant | None:
        """The quantization of the eqn's (first) output; see the module docstring."""
        name = eqn.primitive.name
        if name == "convert_element_type":
            new, old = np.dtype(eqn.params["new_dtype"]), np.dtype(eqn.invars[0].aval.dtype)
            new_bits, old_bits = _narrow_bits(new), _narrow_bits(old)
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
        scale = [v.scale or v.const or var.aval.size < size for v, var in zip(ins, eqn.invars)]
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
    def shadow(eqn: jcore.JaxprEqn, ins: list[_Val], quant: OperandQuant) -> Any:
        name = eqn.primitive.name
        if name in ("gather", "sign") and not any(quant is v.quant for v in ins):
            return None  # a table's values or signs: no value before quantization to name
        if name in ROUNDING or (name in ("convert_element_type", "reduce_precision") and quant is not ins[0].quant):
            return ins[0].shadow  # a quantizing step: its input is the value before quantization
        if all(v.shadow is v.actual for v in ins):
            return None  # quantized from the start (narrow inputs): no earlier value
        if name == "convert_element_type":
            x, new = ins[0].shadow, np.dtype(eqn.params["new_dtype"])
            return x.astype(new) if _widest([x.dtype, new]) == new != x.dtype else x
        vals = [v.shadow for v in ins]
        if name in ("mul", "div", "max", "min", "select_n", "concatenate", "pad", "dynamic_update_slice", "clamp"):
            dtype = _widest([x.dtype for x in vals])
            start = 1 if name == "select_n" else 0
            vals = [x.astype(dtype) if dtype and i >= start and jnp.issubdtype(x.dtype, jnp.floating) else x
                    for i, x in enumerate(vals)]
        out = eqn.primitive.bind(*vals, **eqn.params)
        return out[0] if eqn.primitive.multiple_results else out  # one output, bound as a list (split)

    def matmul(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: Where, out: Any, *,
               kernel: KernelRead | None = None) -> None:
        """Record one matmul; an opaque ``kernel`` by its roles (:mod:`._kernels`), its operands as they name."""
        opaque = kernel is not None

        def shape(var: Any) -> tuple[int, ...]:
            return tuple(var.aval.shape) if var is not None else ()

        def dtype(var: Any) -> str:
            return str(np.dtype(var.aval.dtype)) if var is not None and hasattr(var.aval, "dtype") else "-"

        scales, blocks = (frozenset(), frozenset()), (None, None)
        unknown = opaque and kernel.source is None
        if unknown:  # which operand is which is unknown: neither side may count as quantized
            (lhs, lhs_var), (rhs, rhs_var) = (_Val(UNKNOWN), None), (_Val(UNKNOWN), None)
        elif opaque:
            (lhs, lhs_var), (rhs, rhs_var) = ((ins[i], eqn.invars[i]) for i in (kernel.lhs, kernel.rhs))
            # A narrow scale's type is part of the operand's format (as for the block-scaled matmuls below).
            scales = tuple(frozenset() if i is None else ins[i].casts | (
                {dtype(eqn.invars[i])} if _narrow_bits(eqn.invars[i].aval.dtype) else set())
                for i in (kernel.lhs_scale, kernel.rhs_scale))
        else:
            (lhs, lhs_var), (rhs, rhs_var) = zip(ins[:2], eqn.invars[:2])

        reason = None
        if opaque and (unknown or (lhs.quant and rhs.quant)):
            reason = f"an opaque kernel ({eqn.primitive.name}): its body is not walked"
        elif not (lhs.quant and rhs.quant):
            reason = "full-precision operands"
        elif eqn.primitive.name not in ERROR_PRIMITIVES:
            reason = "a scaled matmul: codes and scales enter separately"
        elif out is None:
            reason = where.no_values or "not computed (errors=False)"
        elif lhs.shadow is lhs.actual and rhs.shadow is rhs.actual:
            reason = "operands narrow from the start: no value before quantization"
        location, function = where.stack[0] if where.stack else ("<unknown>", "<unknown>")
        if eqn.primitive.name in BLOCK_SCALED and len(eqn.invars) >= 4:
            # Codes and their scales are separate operands: the scales' type is part of the operand's format.
            sv = eqn.invars[2:4]
            scales = tuple(v.casts | {str(np.dtype(x.aval.dtype))} for v, x in zip(ins[2:4], sv))
            blocks = tuple(block_format(c.aval, x.aval, eqn.primitive.name) for c, x in zip(eqn.invars[:2], sv))
        self.records.append(MatmulRecord(
            primitive=eqn.primitive.name,
            location=location,
            function=function,
            lhs_shape=shape(lhs_var),
            rhs_shape=shape(rhs_var),
            lhs_dtype=dtype(lhs_var),
            rhs_dtype=dtype(rhs_var),
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
            lhs_role=_role(lhs),
            rhs_role=_role(rhs),
            kernel=kernel.name if opaque else None,
            kernel_roles=kernel.source if opaque else None,
            operands=tuple(f"{shape(eqn.invars[i])} {dtype(eqn.invars[i])} [{ins[i].quant or FULL}]"
                           for i in kernel.data) if opaque else (),
        ))
        contracting = (None, None)
        if out is not None and not opaque:
            contracting = _contracting(eqn)
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
        if reason is not None:
            return
        a, b = lhs.shadow, rhs.shadow
        dtype_ = _widest([a.dtype, b.dtype, np.dtype(np.float32)])
        params = dict(eqn.params)
        if params.get("preferred_element_type") is not None:
            params["preferred_element_type"] = dtype_
        ref = eqn.primitive.bind(a.astype(dtype_), b.astype(dtype_), *[v.actual for v in ins[2:]], **params)
        ref = ref.astype(jnp.float32)
        err = jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
        self.errors.append((len(self.records) - 1, err))

    def shard(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: Where) -> list[_Val] | str:
        """A shard_map run again with its body walked with values, per shard, inside a shard_map of its own.

        Its figures and quantizer evidence come out as extra outputs, one per
        shard along a new leading axis (a figure the worst over the shards).
        Where the body cannot be run so, why not (its records then say so).
        """
        p = eqn.params
        body = p["jaxpr"]
        jaxpr, consts = (body.jaxpr, body.consts) if isinstance(body, jcore.ClosedJaxpr) else (body, [])
        mesh = p["mesh"]
        manual = next((p[k] for k in ("newly_manual_axes", "manual_axes", "axis_names") if p.get(k)),
                      frozenset(mesh.axis_names))
        per_shard = jax.sharding.PartitionSpec(tuple(a for a in mesh.axis_names if a in manual))
        template = self.align(ins, jaxpr.invars)
        kept: dict[str, Any] = {}

        def run(*args):
            body_ins = [dataclasses.replace(t, actual=a, shadow=a) for t, a in zip(template, args)]
            outs, records, figures, evidence = self.evaluated(jaxpr, consts, body_ins, where)
            kept.update(outs=outs, records=records, at=[i for i, _ in figures], evidence=evidence)
            return (tuple(o.actual for o in outs), tuple(jnp.asarray(e, jnp.float32)[None] for _, e in figures),
                    tuple(tuple(None if v is None else jnp.asarray(v)[None] for v in q) for q in evidence.quantizers))

        sizes = (len(self.records), len(self.errors), len(self.quantizers), len(self.operands))
        try:
            actual, figures, found = jax.shard_map(
                run, mesh=mesh, in_specs=tuple(p["in_specs"]), out_specs=(tuple(p["out_specs"]), per_shard, per_shard),
                axis_names=set(manual), check_vma=False)(*[v.actual for v in ins])
        except Exception as e:  # noqa: BLE001 -- the body walked without values instead, its records saying so
            self.truncate(*sizes)
            first = str(e).splitlines()[0][:160] if str(e) else ""
            return f"inside shard_map: its body could not be run per shard with values ({type(e).__name__}: {first})"
        self.put(kept["records"], [(i, jnp.max(e)) for i, e in zip(kept["at"], figures)], kept["evidence"],
                 found, "shard")
        grad = any(v.grad for v in ins)
        return [_Val(o.quant, False, False, a, a, grad=grad, casts=o.casts, data=o.data)
                for o, a in zip(kept["outs"], actual)]

    def control(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: Where, *, values: bool) -> list[_Val]:
        """scan / while / cond: the bodies walked for quantization and, with values, evaluated.

        With values (``errors=True``), a loop's body is walked with them inside
        a loop of its own (``lax.scan`` / ``lax.while_loop`` on the same
        trip count): one record per matmul of the body, its error the worst
        over the iterations (:data:`NOT_RUN` where none ran). A cond's
        branches are walked inside a ``lax.switch`` on its index: the taken
        branch's matmuls get figures, the others :data:`NOT_RUN`'s reason.
        """
        name, p = eqn.primitive.name, eqn.params
        evaluate = values and where.no_values is None
        walk = dataclasses.replace(
            where, no_values=where.no_values or f"inside {name}: its body is walked for quantization only")
        start = len(self.records)
        if name == "cond":
            outs_per_branch, counts = [], []
            for b in p["branches"]:
                before = len(self.records)
                outs_per_branch.append(self.run(b.jaxpr, b.consts, self.align(ins[1:], b.jaxpr.invars), walk,
                                                values=False))
                counts.append(len(self.records) - before)
            quants = [self.agree([o[i].quant for o in outs_per_branch]) for i in range(len(eqn.outvars))]
        else:
            if name == "scan":
                body = p["jaxpr"]
                consts, carry, xs = _scan_operands(p, ins)
                n_carry = len(carry)
            else:
                body, n_consts = p["body_jaxpr"], p["body_nconsts"]
                consts, carry, xs = ins[p["cond_nconsts"]:p["cond_nconsts"] + n_consts], ins[p["cond_nconsts"] + n_consts:], []
                n_carry = len(carry)
            carry_q = [v.quant for v in carry]
            # A carry is quantized only if every iteration leaves it so: iterate to a fixed point.
            for _ in range(len(carry_q) + 1):
                saved = len(self.records)
                body_ins = self.body_ins(ins, consts, carry_q, carry, xs)
                outs = self.run(body.jaxpr, body.consts, body_ins, walk, values=False)
                new_q = [q if q == o.quant else None for q, o in zip(carry_q, outs[:n_carry])]
                if new_q == carry_q:
                    break
                del self.records[saved:]
                carry_q = new_q
            quants = carry_q + [o.quant for o in outs[n_carry:]]
            if name == "while":
                quants = carry_q
        grad = any(v.grad for v in ins)
        data = any(v.data for v in ins)
        if evaluate:
            # The walk above settled each output's quantization; the same body walked again, with values, gives
            # the same records (one per matmul eqn) with their figures.
            count = len(self.records) - start
            del self.records[start:]
            if name == "cond":
                actual, shadow = self.cond_values(eqn, ins, counts, where)
            else:
                actual, shadow = self.loop_values(eqn, ins, carry_q, count, where)
            return [_Val(q, False, False, a, s, grad=grad, data=data) for q, a, s in zip(quants, actual, shadow)]
        actual = _eval_eqn(eqn, [v.actual for v in ins]) if values else None
        return [_Val(q, False, False, None if actual is None else actual[i], None if actual is None else actual[i],
                     grad=grad, data=data) for i, q in enumerate(quants)]

    @staticmethod
    def body_ins(ins: list[_Val], consts: list[_Val], carry_q: list[OperandQuant | None], carry: list[_Val],
                 xs: list[_Val]) -> list[_Val]:
        """A loop body's inputs as the walk sees them (no values): the loop's consts, carry and xs."""
        # Gradient dependence is not iterated to a fixed point: any input's taints the whole body.
        grad = any(v.grad for v in ins)
        # Each input is a value of its own (a straight-through estimator x + stop_gradient(q - x) inside the
        # body tells x by it); a const is the loop's operand itself.
        return ([_Val(v.quant, v.const, v.scale, grad=grad, data=v.data, ident=v.ident or object()) for v in consts]
                + [_Val(q, grad=grad, data=v.data, ident=object()) for q, v in zip(carry_q, carry)]
                + [_Val(v.quant, grad=grad, data=v.data, ident=object()) for v in xs])

    def evaluated(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], ins: list[_Val],
                  where: Where) -> tuple[list[_Val], list[MatmulRecord], list[tuple[int, Any]], Evidence]:
        """Walk a body with values, taking its records, figures and quantizer evidence out of the walker.

        The caller, tracing the body inside a loop, a branch or a shard_map of
        its own, puts them back with :meth:`put` once they are out of that
        trace: the evidence's values as the body's extra outputs, stacked over
        its runs (a scan's iterations, a shard_map's shards).
        """
        start, n_errors, n_quantizers, n_operands = (len(self.records), len(self.errors), len(self.quantizers),
                                                     len(self.operands))
        outs = self.run(jaxpr, consts, ins, where, values=True)
        records = self.records[start:]
        errors = [(i - start, e) for i, e in self.errors[n_errors:]]
        evidence = Evidence(self.quantizers[n_quantizers:], self.multiplied[n_quantizers:],
                            self.stacked[n_quantizers:],
                            [(i - start, side, q - n_quantizers, axes)
                             for i, side, q, axes in self.operands[n_operands:] if q >= n_quantizers])
        self.truncate(start, n_errors, n_quantizers, n_operands)
        return outs, records, errors, evidence

    def truncate(self, records: int, errors: int, quantizers: int, operands: int) -> None:
        del self.records[records:], self.errors[errors:], self.quantizers[quantizers:]
        del self.multiplied[quantizers:], self.stacked[quantizers:], self.operands[operands:]

    def put(self, records: list[MatmulRecord], figures: list[tuple[int, Any]], evidence: Evidence | None = None,
            values: Sequence[tuple[Any, Any, Any]] = (), label: str = "", lost: str | None = None) -> None:
        """Records of a body walked with values, their figures, and its evidence with ``values`` stacked by ``label``.

        ``lost``: why the body's quantizer values are not kept (its records then say so).
        """
        start, first = len(self.records), len(self.quantizers)
        if lost is not None:
            records = [r if r.no_values else dataclasses.replace(r, no_values=lost) for r in records]
        self.records.extend(records)
        self.errors.extend((start + i, e) for i, e in figures)
        if evidence is None:
            return
        for value, multiplied, stacked in zip(values, evidence.multiplied, evidence.stacked):
            self.quantizers.append(value)
            self.multiplied.append(multiplied)
            self.stacked.append((label, *stacked))
        self.operands.extend((start + i, side, first + q, axes) for i, side, q, axes in evidence.operands)

    def loop_values(self, eqn: jcore.JaxprEqn, ins: list[_Val], carry_q: list[OperandQuant | None], count: int,
                    where: Where) -> tuple[list[Any], list[Any]]:
        """A scan or while loop run again with the body walked with values; its outputs' values and shadows.

        Each of the body's ``count`` records keeps the worst figure over the
        iterations (``jnp.maximum``: a NaN in any iteration stays); a record
        no iteration reached keeps :data:`NOT_RUN`'s loop sentinel.
        """
        name, p = eqn.primitive.name, eqn.params
        if name == "scan":
            body = p["jaxpr"]
            consts, carry, xs = _scan_operands(p, ins)
        else:
            body, cn, bn = p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"]
            consts, carry, xs = ins[cn:cn + bn], ins[cn + bn:], []
        n_carry = len(carry)
        # A quantized carry's value before quantization travels beside it (in its own type) where it has one.
        track = [q is not None and v.shadow is not v.actual for q, v in zip(carry_q, carry)]
        track_x = [v.shadow is not v.actual for v in xs]
        template = self.body_ins(ins, consts, carry_q, carry, xs)
        const_ins = [dataclasses.replace(t, actual=v.actual, shadow=v.shadow) for t, v in zip(template, consts)]
        kept: dict[str, Any] = {}

        def step(state, x):
            c_act, c_sh, worst = state
            x_act, x_sh = x
            sh, shx = iter(c_sh), iter(x_sh)
            body_ins = const_ins + [
                dataclasses.replace(t, actual=a, shadow=next(sh) if k else a)
                for t, a, k in zip(template[len(consts):len(consts) + n_carry], c_act, track)] + [
                dataclasses.replace(t, actual=a, shadow=next(shx) if k else a)
                for t, a, k in zip(template[len(consts) + n_carry:], x_act, track_x)]
            outs, records, figures, evidence = self.evaluated(body.jaxpr, body.consts, body_ins, where)
            figures = [(i, e) for i, e in figures if i < count]
            kept["records"], kept["at"], kept["evidence"] = records, [i for i, _ in figures], evidence
            worst = list(worst)
            for i, e in figures:
                worst[i] = jnp.maximum(worst[i], e.astype(jnp.float32))
            new_sh = [o.shadow.astype(v.shadow.dtype) for o, v, k in zip(outs[:n_carry], carry, track) if k]
            ys = outs[n_carry:]
            kept["track_y"] = [o.shadow is not o.actual for o in ys]
            # A scan's quantizers come out as its outputs, one per iteration; a while loop has none to stack on.
            found = evidence.quantizers if name == "scan" else []
            return (([o.actual for o in outs[:n_carry]], new_sh, worst),
                    ([o.actual for o in ys], [o.shadow for o in ys if o.shadow is not o.actual], found))

        init = ([v.actual for v in carry], [v.shadow for v, k in zip(carry, track) if k],
                [jnp.float32(NOT_RUN_LOOP)] * count)
        if name == "scan":
            (c_act, c_sh, worst), (ys, ys_sh, found) = jax.lax.scan(
                step, init, ([v.actual for v in xs], [v.shadow for v, k in zip(xs, track_x) if k]),
                length=p["length"], reverse=p["reverse"])
        else:
            cond, cond_consts = p["cond_jaxpr"], [v.actual for v in ins[:p["cond_nconsts"]]]

            def test(state):
                return jcore.jaxpr_as_fun(cond)(*cond_consts, *state[0])[0]

            c_act, c_sh, worst = jax.lax.while_loop(test, lambda state: step(state, ([], []))[0], init)
            ys, ys_sh, found = [], [], []
        if name == "scan":
            self.put(kept["records"], [(i, worst[i]) for i in kept["at"]], kept["evidence"], found, "iteration")
        else:
            self.put(kept["records"], [(i, worst[i]) for i in kept["at"]],
                     lost="inside a while loop's body: its quantizers' values are not kept per iteration")
        sh, shy = iter(c_sh), iter(ys_sh)
        shadows = [next(sh) if k else a for a, k in zip(c_act, track)]
        shadows += [next(shy) if k else a for a, k in zip(ys, kept["track_y"])]
        return list(c_act) + list(ys), shadows

    def cond_values(self, eqn: jcore.JaxprEqn, ins: list[_Val], counts: list[int],
                    where: Where) -> tuple[list[Any], list[Any]]:
        """A cond run again with each branch walked with values inside ``lax.switch``; its outputs' values.

        Records of branches the index does not take keep :data:`NOT_RUN`'s
        cond sentinel. Outputs carry no value before quantization (the
        branches need not agree on one).
        """
        branches, ops = eqn.params["branches"], ins[1:]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        track = [v.shadow is not v.actual for v in ops]
        kept: dict[int, tuple[list[MatmulRecord], list[int]]] = {}

        def branch(i: int, b: jcore.ClosedJaxpr):
            def run(act, sh):
                shi = iter(sh)
                body_ins = [dataclasses.replace(t, actual=a, shadow=next(shi) if k else a)
                            for t, a, k in zip(self.align(ops, b.jaxpr.invars), act, track)]
                outs, records, figures, _ = self.evaluated(b.jaxpr, b.consts, body_ins, where)
                figures = [(j, e) for j, e in figures if j < counts[i]]
                kept[i] = records, [offsets[i] + j for j, _ in figures]
                figure = [jnp.float32(NOT_RUN_COND)] * sum(counts)
                for j, e in figures:
                    figure[offsets[i] + j] = e.astype(jnp.float32)
                return [o.actual for o in outs], figure
            return run

        actual, figure = jax.lax.switch(ins[0].actual, [branch(i, b) for i, b in enumerate(branches)],
                                        [v.actual for v in ops], [v.shadow for v, k in zip(ops, track) if k])
        records = [r for i in range(len(branches)) for r in kept[i][0]]
        self.put(records, [(j, figure[j]) for i in range(len(branches)) for j in kept[i][1]],
                 lost="inside a cond branch: its quantizers' values are not kept")
        return list(actual), list(actual)

    @staticmethod
    def agree(quants: list[OperandQuant | None]) -> OperandQuant | None:
        return quants[0] if all(q == quants[0] for q in quants) else None


