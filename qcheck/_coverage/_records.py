"""What the coverage map records of each matmul, and the primitives it knows.

The map itself (:mod:`._walk`): a quantization coverage map of any JAX function: which matmuls really multiply quantized operands.

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
  fewer elements: per-tensor, per-channel, per-block), adding or subtracting
  a zero point to integer codes (asymmetric quantization), ``select_n``, and the
  boundaries of jit/pjit, closed_call, remat, custom_jvp/custom_vjp (forward),
  scan, while and cond (inner invars map to outer values).
* anything else (``add``, a matmul, a reduction, ...) yields full precision.

Where several quantized values meet (``codes * scale`` when the scale was cast
too), the first operand's quantization is reported.

Every higher-order primitive a program JAX runs may hold is walked: calls
(any primitive whose params hold a jaxpr taking exactly its operands and giving
its results: jit/pjit, closed_call, remat/checkpoint, custom_jvp/custom_vjp/
custom_vmap, custom_partitioning; :func:`call_body`), ``shard_map`` (its body
per shard), ``scan``/``while``/``cond``, and any other primitive carrying a
jaxpr (its body for quantization only, the record naming the primitive). Opaque kernels (a
``pallas_call``, an FFI or custom call) are reported as one record each, a
region that may multiply, read by their operands' roles (:mod:`._kernels`):
the inputs a declaration (``qcheck.KernelRoles``) or qcheck's table of known
kernels names as lhs, rhs and their scales, never a scalar-prefetch or index
operand; a kernel neither names is recorded with its roles unknown.

Only contractions are matmuls: a ``dot_general`` with no contracting
dimension (``jnp.einsum("...k,k->...k")``, RMSNorm's scale) multiplies
elementwise, is not recorded, and yields full precision like any other op.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np


#: Primitives that multiply matrices, as named in jax 0.10.2 (and 0.12):
#: ``jnp.einsum``/``matmul``/``dot`` -> dot_general; ``lax.ragged_dot`` ->
#: ragged_dot_general; ``jax.nn.scaled_matmul`` -> scaled_matmul_wrapper;
#: ``lax.scaled_dot`` -> scaled_dot. Operands 0 and 1 are lhs and rhs.
MATMUL_PRIMITIVES: frozenset[str] = frozenset(
    {"dot_general", "ragged_dot", "ragged_dot_general", "scaled_matmul_wrapper", "scaled_matmul", "scaled_dot"}
)
# The scaled matmuls take codes and scales separately; their "operands before
# quantization" are not the same product, so they get no error figure.
ERROR_PRIMITIVES = frozenset({"dot_general", "ragged_dot", "ragged_dot_general"})

ROUNDING = frozenset({"round", "floor", "ceil"})
#: The matmuls that take (lhs codes, rhs codes, lhs scales, rhs scales).
BLOCK_SCALED = frozenset({"scaled_matmul_wrapper", "scaled_matmul", "scaled_dot"})

#: Kernels whose bodies are not JAX ops the walk can follow: each is one record, read by its operands' roles.
OPAQUE = frozenset({"pallas_call", "ffi_call", "custom_call", "tpu_custom_call", "mosaic_gpu_call",
                     "triton_kernel_call"})

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
        "dynamic_slice", "gather", "copy", "copy_p", "sharding_constraint", "optimization_barrier",
        "stop_gradient")},
    # Collectives and casts between shardings that move values (an FSDP all-gather of fp8 weights), and
    # shard_map's marking of a replicated value as varying over manual axes.
    **{p: ("first", (0,), "collective or sharding cast: moves values") for p in (
        "pvary", "pbroadcast", "all_gather", "all_gather_invariant", "all_to_all", "ppermute", "reshard",
        "mesh_cast")},
    "neg": ("first", (0,), "the grids are symmetric"),
    "abs": ("first", (0,), "the grids are symmetric"),
    "convert_element_type": ("first", (0,), "to a float (or back from codes): no narrowing"),
    "reduce_precision": ("first", (0,), "onto more than 8 bits: no narrowing"),
    "clamp": ("first", (1,), "saturation at the grid's bounds"),
    "max": ("all", (0, 1), "saturation against a constant bound (jnp.clip)"),
    "min": ("all", (0, 1), "saturation against a constant bound (jnp.clip)"),
    "concatenate": ("all", slice(None), "quantized parts, constant padding"),
    "stack": ("all", slice(None), "quantized parts (jnp.stack: unpacked halves interleaved)"),
    "pad": ("all", (0, 1), "constant padding"),
    "dynamic_update_slice": ("all", (0, 1), "quantized parts"),
    "select_n": ("all", slice(1, None), "each case quantized or constant (masked zeros)"),
    "mul": ("scale", (0, 1), "dequantization: codes times their scale"),
    "div": ("scale", (0,), "dequantization: codes over their inverse scale"),
    # Asymmetric quantization (qwix's minmax calibration: (q - zp) · s): integer codes' zero point is a value
    # broadcast from fewer elements, like a scale; the codes stay on their grid, shifted per slice.
    "sub": ("shift", (0, 1), "dequantization: codes minus their zero point"),
    "add": ("shift", (0, 1), "dequantization: codes plus a per-slice offset"),
}

#: Primitives whose body is not a call on the eqn's own values, though its avals may match them: a shard_map's
#: body runs per shard (on a one-device mesh its shapes are the global ones, but its collectives need the mesh),
#: and the loops and the cond, whose bodies run per iteration or per branch.
NOT_CALLS = frozenset({"shard_map", "scan", "while", "cond"})


def _aval_key(aval: Any) -> tuple[Any, ...]:
    return tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", aval))


def call_body(eqn: Any) -> tuple[Any, list[Any]] | None:
    """``(jaxpr, consts)`` of the body an eqn calls on exactly its operands, giving exactly its results; else None.

    Found generically, from the eqn's params rather than from a table of names:
    the one jaxpr among them whose inputs and outputs have the eqn's own shapes
    and types. That opens jit/pjit, closed_call, remat, custom_jvp_call,
    custom_vjp_call, custom_vmap_call, custom_partitioning and any call JAX
    adds, wherever they sit; :data:`NOT_CALLS` are left to their own walks.
    """
    if eqn.primitive.name in NOT_CALLS:
        return None
    ins = [_aval_key(v.aval) for v in eqn.invars]
    outs = [_aval_key(v.aval) for v in eqn.outvars]
    for value in eqn.params.values():
        jaxpr, consts = (value.jaxpr, list(value.consts)) if hasattr(value, "consts") and hasattr(value, "jaxpr") \
            else (value, [])
        if not (hasattr(jaxpr, "eqns") and hasattr(jaxpr, "invars")):
            continue
        if [_aval_key(v.aval) for v in jaxpr.invars] == ins and [_aval_key(v.aval) for v in jaxpr.outvars] == outs:
            return jaxpr, consts
    return None


def jaxprs_in_params(params: dict[str, Any]) -> list[Any]:
    """The jaxprs among an eqn's params (a ClosedJaxpr's own jaxpr), in a tuple or alone.

    ``jax.extend.core.jaxprs_in_params`` from jax 0.10 on; jax 0.9.2 (EasyDeL 0.3.0's pin) has it only privately,
    so qcheck reads the params itself, as that function does.
    """
    from jax.extend import core as jcore

    found = []
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, jcore.Jaxpr):
                found.append(v)
            elif isinstance(v, jcore.ClosedJaxpr):
                found.append(v.jaxpr)
    return found


@dataclasses.dataclass(frozen=True)
class Part:
    """Axis ``index`` of ``count`` axes that together are the run ``run`` of a quantizer's axes (a block
    flattened over several axes and split back into them: NVFP4 blocks over a weight gradient's batch and
    sequence axes). What the walk maps such an axis to, for the declared-quantization check."""

    run: tuple[int, ...]
    index: int
    count: int


def whole_axes(axes: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``axes`` (a matmul's contraction axes in its quantizer's layout) with every :class:`Part` of one run
    present put back as that run; None where a run is cut (some of its Parts contracted, not all)."""
    out: list[Any] = []
    parts: dict[tuple[int, ...], set[int]] = {}
    counts: dict[tuple[int, ...], int] = {}
    for a in axes:
        if isinstance(a, Part):
            parts.setdefault(a.run, set()).add(a.index)
            counts[a.run] = a.count
        else:
            out.append(a)
    for run, seen in parts.items():
        if len(seen) != counts[run]:
            return None
        out.append(run if len(run) > 1 else run[0])
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class OperandQuant:
    """How one matmul operand was quantized.

    ``kind``: "cast" (a narrowing cast to ``dtype``), "emulated" (rounded onto a
    grid by ``step`` with no narrow type), "full" (full precision), or
    "unknown" (an opaque kernel whose roles qcheck cannot read: which of its
    operands this one is, is unknown; never counted as quantized).
    """

    kind: Literal["cast", "emulated", "full", "unknown"]
    dtype: str | None = None
    step: str | None = None
    #: Stored codes marked with their float source (``qcheck.weights(codes, source=...)``, a
    #: :class:`qcheck._coverage._weights.Source`): carried with the codes to every matmul they reach.
    stored: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def quantized(self) -> bool:
        return self.kind in ("cast", "emulated")

    def __str__(self) -> str:
        if self.kind == "cast":
            return self.dtype if self.step not in ("input", "unpack") else f"{self.dtype} {self.step}"
        if self.kind == "emulated":
            return f"emulated({self.step})"
        return "roles unknown" if self.kind == "unknown" else "full precision"


FULL = OperandQuant("full")
UNKNOWN = OperandQuant("unknown")


@dataclasses.dataclass(frozen=True)
class MatmulRecord:
    """One matrix multiplication of a traced function.

    ``location`` is ``path/to/file.py:LINE``, the innermost frame outside the
    quantization machinery (the registered libraries': JAX, Flax, AQT, qwix, the
    standard library and qcheck's own plumbing, plus any packages passed as
    ``machinery=``), so a quantized matmul is reported at the line of the
    user's code that called the quantizer; ``function`` is that frame's
    qualified name. ``stack``: every frame outside the machinery, innermost
    first, as ``(location, function)``. ``scope``: the module path and
    ``jax.named_scope`` names the matmul was traced under, ``/``-separated
    (``"moe/gate"``; an NNX module's submodules by attribute path).

    ``error`` is ``||out - ref|| / ||ref||`` against the same product of the
    operands before quantization; None when not computed, and ``no_error``
    then says why (full-precision operands, a scaled matmul, a ``shard_map`` body
    walked for quantization only, a cond branch or loop body these inputs do
    not run, operands narrow from the start, ``errors=False``).
    ``backward``: the matmul belongs to the backward pass (it depends on the
    output gradient; only with ``coverage(..., backward=True)``).
    ``lhs_casts``/``rhs_casts``: every narrow type the operand's quantized chain
    was cast to (or arrived in), its scales' included (NVFP4's e4m3fn block
    scales beside its emulated e2m1 codes), where ``lhs``/``rhs`` report one.
    ``opaque``: a kernel the walk cannot look into (``pallas_call``, a custom
    call), reported as one record with the operands its roles name (``kernel``,
    ``kernel_roles``, ``operands``). ``skipped_by``:
    the skip rule that spared this full-precision matmul in
    :func:`assert_quantized`, else None.
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
    scope: str = ""
    stack: tuple[tuple[str, str], ...] = ()
    #: Why the walk had no values at this site (a body it walks for quantization only, ``errors=False`` without
    #: a declaration, a while loop's or cond's quantizers not kept); None: its operands' values were read.
    no_values: str | None = None
    opaque: bool = False
    no_error: str | None = None
    skipped_by: str | None = None
    #: A block-scaled matmul's (``jax.nn.scaled_matmul``, ``lax.scaled_dot``) block format per operand,
    #: from its codes and scales: e.g. "mxfp8 (float8_e4m3fn, float8_e8m0fnu scales per 32)"; None otherwise.
    lhs_block: str | None = None
    rhs_block: str | None = None
    #: Each operand's role, from the program's data flow: "weight" (derives from parameters and state only),
    #: "activation" (from the call's inputs), "grad" (from the output gradient, in a backward pass).
    lhs_role: str = "activation"
    rhs_role: str = "weight"
    #: With a declaration (``coverage(..., declared=...)``): what each operand was declared to be, and
    #: every way the site differs from it, one line each (empty: the site is as declared).
    lhs_declared: str | None = None
    rhs_declared: str | None = None
    findings: tuple[str, ...] = ()
    #: With a declaration: how strongly each declared operand was held (``qcheck.Hold``: bitwise, type, none,
    #: and why); None for an operand the declaration leaves out.
    lhs_hold: Any = None
    rhs_hold: Any = None
    #: An opaque kernel's name (what ``qcheck.KernelRoles`` matches), where its roles came from ("declared",
    #: or the library of the row of qcheck's table of known kernels; None: roles unknown, and ``lhs``/``rhs``
    #: are ``OperandQuant("unknown")``), and each of its data operands, ``"(shape) dtype [quantization]"``
    #: (its scalar-prefetch and index operands left out).
    kernel: str | None = None
    kernel_roles: str | None = None
    operands: tuple[str, ...] = ()

    @property
    def quantized(self) -> bool:
        """Both operands reach the matmul quantized (never for a kernel whose roles are unknown)."""
        return self.lhs.quantized and self.rhs.quantized

    @property
    def roles_unknown(self) -> bool:
        """An opaque kernel qcheck cannot read: neither declared nor in its table of known kernels."""
        return self.opaque and self.kernel_roles is None

    def describe(self) -> str:
        """One line: primitive, location, function, kernel, scope, both operands (or an unreadable kernel's data)."""
        scope = f" in {self.scope}" if self.scope else ""
        head = f"{self.primitive} at {self.location} ({self.function})"
        if self.kernel:
            head += f", kernel {self.kernel}"
        if self.roles_unknown:
            return f"{head}{scope}: roles unknown; data operands {', '.join(self.operands) or '(none)'}"
        return (f"{head}{scope}: lhs {self.lhs_shape} {self.lhs_dtype} [{self.lhs}], rhs {self.rhs_shape} "
                f"{self.rhs_dtype} [{self.rhs}]")

#: Block formats by (codes, scales, block size), as OCP MX and NVIDIA name them.
_BLOCK_FORMAT_NAMES = {
    ("float8_e4m3fn", "float8_e8m0fnu", 32): "mxfp8", ("float8_e5m2", "float8_e8m0fnu", 32): "mxfp8",
    ("float4_e2m1fn", "float8_e8m0fnu", 32): "mxfp4", ("float4_e2m1fn", "float8_e4m3fn", 16): "nvfp4",
}


def block_format(codes: Any, scales: Any, primitive: str) -> str:
    c, sc = str(np.dtype(codes.dtype)), str(np.dtype(scales.dtype))
    # scaled_matmul's operands are (batch, rows, K) with scales (batch, rows, K / block).
    block = codes.shape[-1] // scales.shape[-1] if primitive != "scaled_dot" and scales.shape[-1] else None
    name = _BLOCK_FORMAT_NAMES.get((c, sc, block))
    per = f" per {block}" if block else ""
    return f"{name + ' ' if name else ''}({c}, {sc} scales{per})"


