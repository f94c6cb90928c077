"""What the walk carries for each value of a traced program (its quantized chain, its role, its values), and
the helpers that read a primitive's axes, operands and liveness."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qcheck._coverage._records import OperandQuant, Part



def narrow_bits(dtype: Any) -> int | None:
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


def named_dtype(name: str) -> np.dtype:
    """The type a quantization's dtype name names: ``"int4"`` is ml_dtypes' 4-bit integer (numpy reads it as
    int32, 4 bytes), as are ``uint4``, ``int2``, ``uint2`` and the narrow floats."""
    kind = getattr(ml_dtypes, name, None)
    return np.dtype(kind) if isinstance(kind, type) else np.dtype(name)


def widest_float(dtypes: list[Any]) -> np.dtype | None:
    """The widest float type among ``dtypes``: shadows meet actual values without implicit promotion (fp8 has none)."""
    floats = [np.dtype(d) for d in dtypes if jnp.issubdtype(d, jnp.floating)]
    return max(floats, key=lambda d: jnp.finfo(d).bits) if floats else None


@dataclasses.dataclass
class Val:
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
    # The quantizer whose codes were added to the scaled value as its zero point (qwix's minmax: x / s + zp).
    zero_point: int | None = None
    # Straight-through estimators: x - x (exactly zero), or q - x (to be added back to the same x).
    ste_zero: bool = False
    ste_delta: tuple[Any, Any] | None = None  # (the quantized Val q, the identity of x)
    ident: Any = None  # what value this is: stop_gradient and copies keep their operand's
    closed: bool = False  # a constant of the program (closed over, or computed from constants only)
    # An integer's bits read by shifts and masks (packed codes, unpacked): one qcheck._coverage._fields.Bits per
    # form its elements take (the fields it holds, where), None where the walk does not know them. See
    # PackedFields.unpack.
    field: tuple[Any, ...] | None = None
    stored: bool = False  # an input or a constant of the program, or one moved: a stored word may pack codes
    known: Any = None  # a small integer constant's value (numpy), where the walk knows it: a shift count, a mask
    repeated: bool = False  # fewer values repeated by index (per-group scales taken by a group index)


def input_val(aval: Any, value: Any = None, const: bool = False, data: bool = False) -> Val:
    bits = narrow_bits(aval.dtype) if hasattr(aval, "dtype") else None
    quant = OperandQuant("cast", str(np.dtype(aval.dtype)), "input") if bits else None
    scale = getattr(aval, "size", 2) == 1
    return Val(quant, const, scale, value, value, casts=frozenset({quant.dtype}) if quant else frozenset(),
                data=data, stored=not const)


#: Layout ops whose output axes can be traced back to their operand's (the rest lose the map).
#: stop_gradient too: a straight-through estimator's codes reach the matmul through it.
AXIS_OPS = frozenset({"transpose", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "slice", "rev",
                       "dynamic_slice", "copy", "copy_p", "sharding_constraint", "optimization_barrier",
                       "stop_gradient", "convert_element_type", "reduce_precision", "neg", "abs", "clamp", "max",
                       "min", "mul", "div", "pvary", "pbroadcast", "reshard", "mesh_cast"})


def axis_atoms(old: tuple[int, ...], source: tuple[Any, ...], qshape: tuple[int, ...]) -> list[tuple[Any, int]]:
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


def atom_run(atoms: list[Any]) -> tuple[int, ...] | None:
    """The quantizer's consecutive axes a group of atoms is: plain axes in order, or every Part of one run."""
    if atoms and all(isinstance(a, Part) for a in atoms):
        first = atoms[0]
        if [(a.run, a.index, a.count) for a in atoms] == [(first.run, i, first.count) for i in range(first.count)]:
            return first.run
        return None
    if any(not isinstance(a, int) for a in atoms):
        return None
    return tuple(atoms) if list(atoms) == list(range(atoms[0], atoms[0] + len(atoms))) else None


def reshape_axes(old: tuple[int, ...], new: tuple[int, ...], source: tuple[Any, ...],
                  qshape: tuple[int, ...]) -> tuple[Any, ...]:
    """``source`` (for each axis of ``old``, the quantizer's axis it is, a run of them, a Part, or None) after a
    reshape.

    The operand's axes and the new ones are matched in the smallest groups of
    equal size. A new axis that is a whole group of the quantizer's axes maps
    to them (a run, a tuple, when several: a block split off its axis and
    merged back, NVFP4's ``[..., k] -> [..., k/16, 16] -> [..., k]``); several
    new axes that together are one run are its Parts; anything else is None.
    """
    atoms = axis_atoms(old, source, qshape)
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
        run = atom_run([x for x, _ in group_a])
        if run is None:
            continue
        if len(group_n) == 1:
            out[group_n[0][0]] = run[0] if len(run) == 1 else run
        else:
            for k, (i, _) in enumerate(group_n):
                out[i] = Part(run, k, len(group_n))
    return tuple(out)


def map_axes(eqn: jcore.JaxprEqn, source: tuple[Any, ...], qshape: tuple[int, ...]) -> tuple[Any, ...]:
    """``source`` (the operand's axis map) carried through one value-preserving op to its output."""
    name, out_aval = eqn.primitive.name, eqn.outvars[0].aval
    ndim = len(getattr(out_aval, "shape", ()))
    if name not in AXIS_OPS:
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
        return reshape_axes(tuple(eqn.invars[0].aval.shape), tuple(out_aval.shape), source, qshape)
    return tuple(source) if len(source) == ndim else (None,) * ndim


def scan_operands(params: dict, ins: list) -> tuple[list, list, list]:
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


def live_eqns(jaxpr: jcore.Jaxpr) -> list[bool]:
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


@functools.cache
def debug_info_type() -> type:
    """JAX's DebugInfo type: ``jax.extend.core.DebugInfo`` from jax 0.10 on; jax 0.9.2 (EasyDeL 0.3.0's pin) does not
    export it, and warns of a jaxpr built without one, so it is taken from a traced jaxpr's own."""
    found = getattr(jcore, "DebugInfo", None)
    return found if found is not None else type(jax.make_jaxpr(lambda: None)().jaxpr.debug_info)


def eval_eqn(eqn: jcore.JaxprEqn, vals: list[Any]) -> list[Any]:
    """Evaluate one eqn on values, as ``jax.core.eval_jaxpr`` binds it (higher-order primitives included)."""
    invars, seen = [], set()
    for v in eqn.invars:
        if not isinstance(v, jcore.Literal) and v not in seen:
            seen.add(v)
            invars.append(v)
    env = {v: x for v, x in zip(eqn.invars, vals) if not isinstance(v, jcore.Literal)}
    debug = debug_info_type()("qcheck.coverage", eqn.primitive.name, tuple(f"in{i}" for i in range(len(invars))),
                          tuple(f"out{i}" for i in range(len(eqn.outvars))))
    jaxpr = jcore.Jaxpr([], invars, eqn.outvars, [eqn], eqn.effects, debug)
    return list(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, []))(*[env[v] for v in invars]))


def operand_role(v: Val) -> str:
    return "grad" if v.grad else "activation" if v.data else "weight"


def contracting_dims(eqn: jcore.JaxprEqn) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
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


def is_contraction(eqn: jcore.JaxprEqn) -> bool:
    """Whether a matmul primitive contracts a dimension: with none (``...k,k->...k``) it multiplies elementwise."""
    lhs, _ = contracting_dims(eqn)
    return lhs is None or len(lhs) > 0


#: Ops whose output is their operand's value itself (for telling ``x - stop_gradient(x)`` from other subtractions).
SAME_VALUE = frozenset({"stop_gradient", "copy", "copy_p", "optimization_barrier", "sharding_constraint"})
