"""A quantization coverage map of any JAX function: which matmuls really multiply quantized operands.

The silent fallback — a quantized path that quietly multiplies in full
precision — leaves the output close to the quantized one and passes a
tolerance check. Here the function is traced to a jaxpr (tracing only) and
every matrix multiplication in it, nested calls, custom derivatives and
control flow included, is reported with where it is and what its operands
went through.

An operand counts as quantized when it derives from a *quantizing step*
through value-preserving ops only:

* quantizing steps: a narrowing ``convert_element_type`` (any float to a type
  of at most 8 bits: int8/uint8/int4, float8_*, float4_e2m1fn, ...), or a
  rounding primitive with no narrow type in the program (emulation:
  ``round``/``floor``/``ceil``, or ``reduce_precision`` onto at most 8 bits);
  a jaxpr input or constant whose type is itself narrow counts too.
* value-preserving ops (the table :data:`VALUE_PRESERVING` below, with the
  operands whose quantization carries over): layout (reshape, transpose,
  broadcast, squeeze, expand_dims, slicing, gather, concatenate, pad, copies,
  sharding constraints), sign (neg, abs: the grids are symmetric), saturation
  against a constant (max/min/clamp), a conversion that does not narrow,
  multiplication or division by a scale (a scalar or a value broadcast from
  fewer elements: per-tensor, per-channel, per-block), ``select_n``, and the
  boundaries of jit/pjit, closed_call, remat, custom_jvp/custom_vjp (forward),
  scan, while and cond (inner invars map to outer values).
* anything else (``add``, a matmul, a reduction, ...) yields full precision.

Where several quantized values meet (``codes * scale`` when the scale was cast
too), the first operand's quantization is reported.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MATMUL_PRIMITIVES",
    "VALUE_PRESERVING",
    "MatmulRecord",
    "OperandQuant",
    "assert_quantized",
    "coverage",
    "format_coverage",
    "skip_functions",
]

#: Primitives that multiply matrices, as named in jax 0.10.2 (and 0.12):
#: ``jnp.einsum``/``matmul``/``dot`` -> dot_general; ``lax.ragged_dot`` ->
#: ragged_dot_general; ``jax.nn.scaled_matmul`` -> scaled_matmul_wrapper;
#: ``lax.scaled_dot`` -> scaled_dot. Operands 0 and 1 are lhs and rhs.
MATMUL_PRIMITIVES: frozenset[str] = frozenset(
    {"dot_general", "ragged_dot", "ragged_dot_general", "scaled_matmul_wrapper", "scaled_matmul", "scaled_dot"}
)
# The scaled matmuls take codes and scales separately; their "operands before
# quantization" are not the same product, so they get no error figure.
_ERROR_PRIMITIVES = frozenset({"dot_general", "ragged_dot", "ragged_dot_general"})

_ROUNDING = frozenset({"round", "floor", "ceil"})
_BLOCK_SCALED = frozenset({"scaled_matmul_wrapper", "scaled_matmul", "scaled_dot"})

#: The value-preserving ops: primitive -> (rule, data operands, why the grid survives).
#: Rules: "first": the output is quantized when the (first) data operand is;
#: "all": every data operand is quantized or a constant, one at least quantized;
#: "scale": a quantized operand times (or over) a scale, i.e. a value that
#: broadcasts: a scalar, fewer elements than the output, or broadcast from fewer
#: (per-tensor, per-channel, per-block scales). A conversion or
#: ``reduce_precision`` counts only when it does not quantize anew.
VALUE_PRESERVING: dict[str, tuple[str, tuple[int, ...] | slice, str]] = {
    **{p: ("first", (0,), "layout: moves, copies or repeats values") for p in (
        "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "slice", "rev",
        "dynamic_slice", "gather", "copy", "copy_p", "sharding_constraint", "optimization_barrier")},
    "neg": ("first", (0,), "the grids are symmetric"),
    "abs": ("first", (0,), "the grids are symmetric"),
    "convert_element_type": ("first", (0,), "to a float (or back from codes): no narrowing"),
    "reduce_precision": ("first", (0,), "onto more than 8 bits: no narrowing"),
    "clamp": ("first", (1,), "saturation at the grid's bounds"),
    "max": ("all", (0, 1), "saturation against a constant bound (jnp.clip)"),
    "min": ("all", (0, 1), "saturation against a constant bound (jnp.clip)"),
    "concatenate": ("all", slice(None), "quantized parts, constant padding"),
    "pad": ("all", (0, 1), "constant padding"),
    "dynamic_update_slice": ("all", (0, 1), "quantized parts"),
    "select_n": ("all", slice(1, None), "each case quantized or constant (masked zeros)"),
    "mul": ("scale", (0, 1), "dequantization: codes times their scale"),
    "div": ("scale", (0,), "dequantization: codes over their inverse scale"),
}

# Calls whose inner jaxpr takes exactly the eqn's operands and gives its results.
_CALLS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
}


@dataclasses.dataclass(frozen=True)
class OperandQuant:
    """How one matmul operand was quantized.

    ``kind``: "cast" (a narrowing cast to ``dtype``), "emulated" (rounded onto a
    grid by ``step`` with no narrow type), or "full" (full precision).
    """

    kind: Literal["cast", "emulated", "full"]
    dtype: str | None = None
    step: str | None = None

    @property
    def quantized(self) -> bool:
        return self.kind != "full"

    def __str__(self) -> str:
        if self.kind == "cast":
            return self.dtype if self.step != "input" else f"{self.dtype} input"
        if self.kind == "emulated":
            return f"emulated({self.step})"
        return "full precision"


_FULL = OperandQuant("full")


@dataclasses.dataclass(frozen=True)
class MatmulRecord:
    """One matrix multiplication of a traced function.

    ``location`` is ``path/to/file.py:LINE``, the innermost frame outside JAX,
    Flax, the standard library and qcheck's machinery (this module, the checks,
    and the quantization plumbing ``qcheck/recipes/``, ``bridge.py``,
    ``_plain_site.py``, ``formats.py``), so a quantized site's matmul is reported where the layer
    calls the site; ``function`` is that frame's qualified name. ``error`` is
    ``||out - ref|| / ||ref||`` against the same product of the operands before
    quantization; None when not computed: full-precision operands, scaled
    matmuls, matmuls inside scan/while/cond bodies (their bodies are walked
    for quantization only), operands narrow from the start (no earlier value),
    or ``errors=False``. ``backward``: the matmul belongs to the backward pass
    (it depends on the output gradient; only with ``coverage(..., backward=True)``).
    ``lhs_casts``/``rhs_casts``: every narrow type the operand's quantized chain
    was cast to (or arrived in), its scales' included (NVFP4's e4m3fn block
    scales beside its emulated e2m1 codes), where ``lhs``/``rhs`` report one.
    """

    primitive: str
    location: str
    function: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    lhs_dtype: str
    rhs_dtype: str
    lhs: OperandQuant
    rhs: OperandQuant
    error: float | None = None
    backward: bool = False
    lhs_casts: frozenset[str] = frozenset()
    rhs_casts: frozenset[str] = frozenset()
    #: A block-scaled matmul's (``jax.nn.scaled_matmul``, ``lax.scaled_dot``) block format per operand,
    #: from its codes and scales: e.g. "mxfp8 (float8_e4m3fn, float8_e8m0fnu scales per 32)"; None otherwise.
    lhs_block: str | None = None
    rhs_block: str | None = None

    @property
    def quantized(self) -> bool:
        """Both operands reach the matmul quantized."""
        return self.lhs.quantized and self.rhs.quantized


#: Block formats by (codes, scales, block size), as OCP MX and NVIDIA name them.
_BLOCK_FORMAT_NAMES = {
    ("float8_e4m3fn", "float8_e8m0fnu", 32): "mxfp8", ("float8_e5m2", "float8_e8m0fnu", 32): "mxfp8",
    ("float4_e2m1fn", "float8_e8m0fnu", 32): "mxfp4", ("float4_e2m1fn", "float8_e4m3fn", 16): "nvfp4",
}


def _block_format(codes: Any, scales: Any, primitive: str) -> str:
    c, sc = str(np.dtype(codes.dtype)), str(np.dtype(scales.dtype))
    # scaled_matmul's operands are (batch, rows, K) with scales (batch, rows, K / block).
    block = codes.shape[-1] // scales.shape[-1] if primitive != "scaled_dot" and scales.shape[-1] else None
    name = _BLOCK_FORMAT_NAMES.get((c, sc, block))
    per = f" per {block}" if block else ""
    return f"{name + ' ' if name else ''}({c}, {sc} scales{per})"


def skip_functions(*names: str) -> Callable[[MatmulRecord], bool]:
    """A ``skip`` predicate for :func:`assert_quantized`: matmuls whose ``function`` is one of ``names``.

    For matmuls meant to stay in full precision, e.g. qcheck's router:
    ``skip_functions("MoE.route")``. Names are qualified (``Class.method``).
    """
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"skip_functions needs one or more function names, got {names!r}")
    wanted = frozenset(names)
    return lambda record: record.function in wanted


# -- source locations ---------------------------------------------------------

def _package_dir(module: Any) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


@functools.cache
def _machinery_prefixes() -> tuple[str, ...]:
    import flax
    import jaxlib

    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    return (
        _package_dir(jax), _package_dir(jaxlib), _package_dir(flax),
        os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
        os.path.abspath(__file__), here + "checks.py", here + "recipes" + os.sep,
        here + "bridge.py", here + "_plain_site.py", here + "formats.py",
    )


@functools.cache
def _is_machinery(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_machinery_prefixes()) or filename.startswith("<")


def _display(filename: str) -> str:
    path = os.path.abspath(filename)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _user_location(eqn: jcore.JaxprEqn) -> tuple[str, str] | None:
    tb = eqn.source_info.traceback
    if tb is None:
        return None
    for code, lasti in zip(*tb.raw_frames()):
        if not _is_machinery(code.co_filename):
            return f"{_display(code.co_filename)}:{tb.code_addr2line(code, lasti)}", code.co_qualname
    return None


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


def _input_val(aval: Any, value: Any = None, const: bool = False) -> _Val:
    bits = _narrow_bits(aval.dtype) if hasattr(aval, "dtype") else None
    quant = OperandQuant("cast", str(np.dtype(aval.dtype)), "input") if bits else None
    scale = getattr(aval, "size", 2) == 1
    return _Val(quant, const, scale, value, value, casts=frozenset({quant.dtype}) if quant else frozenset())


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


class _Walker:
    def __init__(self):
        self.records: list[MatmulRecord] = []
        self.errors: list[tuple[int, Any]] = []  # (record index, traced error)

    def read(self, env: dict, v: Any) -> _Val:
        if isinstance(v, jcore.Literal):
            val = _input_val(v.aval, v.val, const=True)
            val.quant = None
            return val
        return env[v]

    def run(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], ins: list[_Val],
            outer: tuple[str, str], *, values: bool) -> list[_Val]:
        env: dict = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = _input_val(var.aval, c if values else None)
        for var, val in zip(jaxpr.invars, ins):
            env[var] = val
        for eqn in jaxpr.eqns:
            ins_e = [self.read(env, v) for v in eqn.invars]
            where = _user_location(eqn) or outer
            outs = self.eqn(eqn, ins_e, where, values=values)
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
        return [self.read(env, v) for v in jaxpr.outvars]

    def eqn(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: tuple[str, str], *, values: bool) -> list[_Val]:
        name = eqn.primitive.name
        if name in _CALLS and _CALLS[name] in eqn.params:
            inner = eqn.params[_CALLS[name]]
            jaxpr, consts = (inner.jaxpr, inner.consts) if isinstance(inner, jcore.ClosedJaxpr) else (inner, ())
            return self.run(jaxpr, consts, ins, where, values=values)
        if name in ("scan", "while", "cond"):
            return self.control(eqn, ins, where, values=values)
        actual = None
        if values:
            actual = eqn.primitive.bind(*[v.actual for v in ins], **eqn.params)
            actual = list(actual) if eqn.primitive.multiple_results else [actual]
        if name in MATMUL_PRIMITIVES:
            self.matmul(eqn, ins, where, actual[0] if values else None)
        elif any(jcore.jaxprs_in_params(eqn.params)):
            # Unknown higher-order primitive: its matmuls are still reported.
            for sub in jcore.jaxprs_in_params(eqn.params):
                self.run(sub, [None] * len(sub.constvars), self.align(ins, sub.invars), where, values=False)
        quant = self.propagate(eqn, ins)
        const = all(v.const for v in ins)
        grad = any(v.grad for v in ins)
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
                       casts=casts if i == 0 else frozenset())
            outs.append(val)
        if len(outs) == 1:
            outs[0].scale = outs[0].scale or self.scale_like(eqn, ins)
            if values and quant is not None:
                shadow = self.shadow(eqn, ins, quant)
                outs[0].shadow = outs[0].actual if shadow is None else shadow
        return outs

    @staticmethod
    def align(ins: list[_Val], invars: Sequence[Any]) -> list[_Val]:
        if len(ins) == len(invars):
            return [_Val(v.quant, v.const, v.scale, grad=v.grad, casts=v.casts) for v in ins]
        grad = any(v.grad for v in ins)
        return [_Val(grad=grad) for _ in invars]

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
        if name in _ROUNDING:
            return OperandQuant("emulated", None, name)
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
        if lhs.quant and (rhs.quant or rhs_scale):
            return lhs.quant
        if rhs.quant and lhs_scale:
            return rhs.quant
        return None

    @staticmethod
    def shadow(eqn: jcore.JaxprEqn, ins: list[_Val], quant: OperandQuant) -> Any:
        name = eqn.primitive.name
        if name in _ROUNDING or (name in ("convert_element_type", "reduce_precision") and quant is not ins[0].quant):
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
        return eqn.primitive.bind(*vals, **eqn.params)

    def matmul(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: tuple[str, str], out: Any) -> None:
        lhs, rhs = ins[0], ins[1]
        scales, blocks = (frozenset(), frozenset()), (None, None)
        if eqn.primitive.name in _BLOCK_SCALED and len(eqn.invars) >= 4:
            # Codes and their scales are separate operands: the scales' type is part of the operand's format.
            sv = eqn.invars[2:4]
            scales = tuple(v.casts | {str(np.dtype(x.aval.dtype))} for v, x in zip(ins[2:4], sv))
            blocks = tuple(_block_format(c.aval, x.aval, eqn.primitive.name) for c, x in zip(eqn.invars[:2], sv))
        self.records.append(MatmulRecord(
            primitive=eqn.primitive.name,
            location=where[0],
            function=where[1],
            lhs_shape=tuple(eqn.invars[0].aval.shape),
            rhs_shape=tuple(eqn.invars[1].aval.shape),
            lhs_dtype=str(np.dtype(eqn.invars[0].aval.dtype)),
            rhs_dtype=str(np.dtype(eqn.invars[1].aval.dtype)),
            lhs=lhs.quant or _FULL,
            rhs=rhs.quant or _FULL,
            backward=any(v.grad for v in ins),
            lhs_casts=lhs.casts | scales[0],
            rhs_casts=rhs.casts | scales[1],
            lhs_block=blocks[0],
            rhs_block=blocks[1],
        ))
        if out is None or eqn.primitive.name not in _ERROR_PRIMITIVES:
            return
        if lhs.shadow is lhs.actual and rhs.shadow is rhs.actual:
            return  # nothing quantized here, or narrow inputs with no earlier value to compare with
        a, b = lhs.shadow, rhs.shadow
        dtype = _widest([a.dtype, b.dtype, np.dtype(np.float32)])
        params = dict(eqn.params)
        if params.get("preferred_element_type") is not None:
            params["preferred_element_type"] = dtype
        ref = eqn.primitive.bind(a.astype(dtype), b.astype(dtype), *[v.actual for v in ins[2:]], **params)
        ref = ref.astype(jnp.float32)
        err = jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
        self.errors.append((len(self.records) - 1, err))

    def control(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: tuple[str, str], *, values: bool) -> list[_Val]:
        """scan / while / cond: the bodies are walked for quantization only (no values, so no errors)."""
        name, p = eqn.primitive.name, eqn.params
        if name == "cond":
            outs_per_branch = [self.run(b.jaxpr, b.consts, self.align(ins[1:], b.jaxpr.invars), where, values=False)
                               for b in p["branches"]]
            quants = [self.agree([o[i].quant for o in outs_per_branch]) for i in range(len(eqn.outvars))]
        else:
            if name == "scan":
                body = p["jaxpr"]
                consts, carry, xs = _scan_operands(p, ins)
                n_consts, n_carry = len(consts), len(carry)
            else:
                body, n_consts = p["body_jaxpr"], p["body_nconsts"]
                consts, carry, xs = ins[p["cond_nconsts"]:p["cond_nconsts"] + n_consts], ins[p["cond_nconsts"] + n_consts:], []
                n_carry = len(carry)
            carry_q = [v.quant for v in carry]
            # A carry is quantized only if every iteration leaves it so: iterate to a fixed point.
            for _ in range(len(carry_q) + 1):
                saved = len(self.records)
                # Gradient dependence is not iterated to a fixed point: any input's taints the whole body.
                grad = any(v.grad for v in ins)
                body_ins = [_Val(v.quant, v.const, v.scale, grad=grad) for v in consts]
                body_ins += [_Val(q, grad=grad) for q in carry_q] + [_Val(v.quant, grad=grad) for v in xs]
                outs = self.run(body.jaxpr, body.consts, body_ins, where, values=False)
                new_q = [q if q == o.quant else None for q, o in zip(carry_q, outs[:n_carry])]
                if new_q == carry_q:
                    break
                del self.records[saved:]
                carry_q = new_q
            quants = carry_q + [o.quant for o in outs[n_carry:]]
            if name == "while":
                quants = carry_q
        actual = None
        if values:
            actual = eqn.primitive.bind(*[v.actual for v in ins], **p)
        grad = any(v.grad for v in ins)
        return [_Val(q, False, False, None if actual is None else actual[i], None if actual is None else actual[i],
                     grad=grad) for i, q in enumerate(quants)]

    @staticmethod
    def agree(quants: list[OperandQuant | None]) -> OperandQuant | None:
        return quants[0] if all(q == quants[0] for q in quants) else None


# -- the public functions -------------------------------------------------------

def _state_bits(module: Any) -> list[np.ndarray]:
    from flax import nnx

    def bits(x: Any) -> np.ndarray:
        if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x, copy=True)  # a numpy leaf could change in place

    return [bits(x) for x in jax.tree.leaves(nnx.state(module))]


def _pure(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Callable[..., Any], tuple, Any]:
    """A pure function of pytrees and its inputs; an NNX module's state (RNG streams included) is an input."""
    from flax import nnx

    if isinstance(fn, nnx.Module):
        graphdef, state = nnx.split(fn)

        def call(state, args, kwargs):
            return nnx.merge(graphdef, state)(*args, **kwargs)

        return call, (state, args, kwargs), fn
    if not callable(fn):
        raise TypeError(f"coverage: fn must be callable or an flax.nnx.Module, got {type(fn).__name__}")
    return (lambda args, kwargs: fn(*args, **kwargs)), (args, kwargs), None


def _with_backward(pure: Callable[..., Any], inputs: tuple) -> tuple[Callable[..., Any], tuple, int]:
    """``pure`` and its vjp as one function of (differentiable leaves, other leaves, seed); the seed's position.

    Differentiated: every inexact leaf of the inputs (parameters and fp8 state
    alike, as a train step does); keys and integers are held. The output
    gradient is ``seed`` times ones, so the seed is the one input the backward
    pass (and only it) depends on; a product keeps it from looking like a
    broadcast scale to the walk.
    """
    leaves, treedef = jax.tree.flatten(inputs)
    inexact = [jnp.issubdtype(getattr(x, "dtype", np.float32), jnp.inexact)
               and not jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.extended) for x in leaves]

    def forward(diff, held):
        diff_it, held_it = iter(diff), iter(held)
        merged = [next(diff_it) if d else next(held_it) for d in inexact]
        out = pure(*jax.tree.unflatten(treedef, merged))
        return [o for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.inexact)]

    def both(diff, held, seed):
        out, pull = jax.vjp(lambda d: forward(d, held), diff)
        return out, pull([jnp.ones(o.shape, o.dtype) * seed.astype(o.dtype) for o in out])

    diff = [x for x, d in zip(leaves, inexact) if d]
    held = [x for x, d in zip(leaves, inexact) if not d]
    return both, (diff, held, np.float32(1.0)), len(jax.tree.leaves((diff, held)))


def coverage(fn: Callable[..., Any], *args: Any, errors: bool = False, backward: bool = False,
             **kwargs: Any) -> list[MatmulRecord]:
    """One :class:`MatmulRecord` per matrix multiplication ``fn(*args, **kwargs)`` performs, in program order.

    ``fn`` is a function of arrays (pytrees) or an ``flax.nnx.Module``, which is
    split as ``nnx.jit`` would split it so that tracing mutates nothing (checked:
    its state, RNG counts included, is bitwise unchanged afterwards). Tracing
    only, unless ``errors``: then the function runs once more as one compiled
    program that also computes each quantized matmul's ``error`` (see
    :class:`MatmulRecord` for where it is None). Python scalars and other
    non-array arguments are traced as arrays; close over static ones.

    ``backward``: trace a vjp of ``fn`` too (with respect to every inexact
    input, an NNX module's state included, of its inexact outputs), still
    tracing only; the matmuls of the backward pass come after the forward
    pass's, with ``backward=True``. Not with ``errors``.
    """
    if backward and errors:
        raise ValueError("coverage: errors=True needs values, which the backward trace does not compute; "
                         "pass errors=False with backward=True")
    pure, inputs, module = _pure(fn, args, kwargs)
    before = _state_bits(module) if module is not None else None
    seed_at = None
    if backward:
        pure, inputs, seed_at = _with_backward(pure, inputs)
    closed = jax.make_jaxpr(pure)(*inputs)
    if module is not None:
        after = _state_bits(module)
        if len(before) != len(after) or not all(
            a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(before, after)
        ):
            raise RuntimeError("coverage: tracing changed the module's state; it must not mutate its inputs")
    outer = ("<unknown>", "<unknown>")
    ins = [_input_val(v.aval) for v in closed.jaxpr.invars]
    if seed_at is not None:
        ins[seed_at].grad = True
    if not errors:
        walker = _Walker()
        walker.run(closed.jaxpr, closed.consts, ins, outer, values=False)
        return walker.records

    walker = _Walker()

    def evaluate(flat):
        vals = [dataclasses.replace(v, actual=x, shadow=x) for v, x in zip(ins, flat)]
        walker.run(closed.jaxpr, closed.consts, vals, outer, values=True)
        return [e for _, e in walker.errors]

    figures = jax.jit(evaluate)(jax.tree.leaves(inputs))
    records = list(walker.records)
    for (i, _), e in zip(walker.errors, figures):
        records[i] = dataclasses.replace(records[i], error=float(e))
    return records


def format_coverage(records: Sequence[MatmulRecord]) -> str:
    """A table of the records, one line per matmul (with a ``pass`` column when any is from a backward pass)."""
    header = ("primitive", "location", "function", "lhs", "rhs", "quantized", "error")
    rows = [header] + [
        (r.primitive, r.location, r.function,
         f"{r.lhs_shape} {r.lhs_dtype} {r.lhs}" + (f" {r.lhs_block}" if r.lhs_block else ""),
         f"{r.rhs_shape} {r.rhs_dtype} {r.rhs}" + (f" {r.rhs_block}" if r.rhs_block else ""),
         "yes" if r.quantized else "NO", "-" if r.error is None else f"{r.error:.4g}")
        for r in records
    ]
    if any(r.backward for r in records):
        rows = [rows[0] + ("pass",)] + [
            row + ("backward" if r.backward else "forward",) for row, r in zip(rows[1:], records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def assert_quantized(
    fn: Callable[..., Any],
    *args: Any,
    skip: Callable[[MatmulRecord], bool] | None = None,
    **kwargs: Any,
) -> list[MatmulRecord]:
    """Assert every matmul of ``fn(*args, **kwargs)`` multiplies quantized operands; return the records.

    ``skip(record) -> bool`` selects matmuls meant to stay in full precision
    (a router: :func:`skip_functions`). Fails listing each offending matmul with
    its primitive, location, shapes and the operand that arrives unquantized.
    """
    if skip is not None and not callable(skip):
        raise TypeError(f"assert_quantized: skip must be a callable (record) -> bool, got {type(skip).__name__}")
    records = coverage(fn, *args, **kwargs)
    bad = [r for r in records if not r.quantized and not (skip is not None and skip(r))]
    if bad:
        lines = []
        for r in bad:
            which = " and ".join(side for side, q in (("lhs", r.lhs), ("rhs", r.rhs)) if not q.quantized)
            lines.append(
                f"  {r.primitive} at {r.location} ({r.function}): lhs {r.lhs_shape} {r.lhs_dtype} [{r.lhs}], "
                f"rhs {r.rhs_shape} {r.rhs_dtype} [{r.rhs}]: {which} unquantized"
            )
        raise AssertionError(
            f"assert_quantized: {len(bad)} of {len(records)} matmuls reach full precision:\n" + "\n".join(lines)
        )
    return records
