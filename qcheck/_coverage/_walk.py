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

Every higher-order primitive a program JAX runs may hold is walked: calls
(jit/pjit, closed_call, remat/checkpoint, custom_jvp/custom_vjp,
custom_partitioning), ``shard_map`` (its body per shard), ``scan``/``while``/
``cond``, and any other primitive carrying a jaxpr. Opaque kernels (a
``pallas_call``, an FFI or custom call) are reported as one record each, a
region that may multiply, with the quantization of its first two operands.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
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
    "MACHINERY",
    "OperandQuant",
    "Skip",
    "assert_quantized",
    "coverage",
    "format_coverage",
    "skip_at",
    "skip_functions",
    "skip_modules",
    "skip_where",
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

#: Kernels whose bodies are not JAX ops the walk can follow: each is one record.
_OPAQUE = frozenset({"pallas_call", "ffi_call", "custom_call", "tpu_custom_call", "mosaic_gpu_call",
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
    "remat2": "jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr", "custom_partitioning": "call",
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

    ``location`` is ``path/to/file.py:LINE``, the innermost frame outside the
    quantization machinery (:data:`MACHINERY`: JAX, Flax, AQT, qwix, the
    standard library and qcheck's own plumbing, plus any packages passed as
    ``machinery=``), so a quantized matmul is reported at the line of the
    user's code that called the quantizer; ``function`` is that frame's
    qualified name. ``stack``: every frame outside the machinery, innermost
    first, as ``(location, function)``. ``scope``: the module path and
    ``jax.named_scope`` names the matmul was traced under, ``/``-separated
    (``"moe/gate"``; an NNX module's submodules by attribute path).

    ``error`` is ``||out - ref|| / ||ref||`` against the same product of the
    operands before quantization; None when not computed, and ``no_error``
    then says why (full-precision operands, a scaled matmul, a body walked for
    quantization only, operands narrow from the start, ``errors=False``).
    ``backward``: the matmul belongs to the backward pass (it depends on the
    output gradient; only with ``coverage(..., backward=True)``).
    ``lhs_casts``/``rhs_casts``: every narrow type the operand's quantized chain
    was cast to (or arrived in), its scales' included (NVFP4's e4m3fn block
    scales beside its emulated e2m1 codes), where ``lhs``/``rhs`` report one.
    ``opaque``: a kernel the walk cannot look into (``pallas_call``, a custom
    call), reported as one record with its first two operands. ``skipped_by``:
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
    opaque: bool = False
    no_error: str | None = None
    skipped_by: str | None = None
    #: A block-scaled matmul's (``jax.nn.scaled_matmul``, ``lax.scaled_dot``) block format per operand,
    #: from its codes and scales: e.g. "mxfp8 (float8_e4m3fn, float8_e8m0fnu scales per 32)"; None otherwise.
    lhs_block: str | None = None
    rhs_block: str | None = None

    @property
    def quantized(self) -> bool:
        """Both operands reach the matmul quantized."""
        return self.lhs.quantized and self.rhs.quantized

    def describe(self) -> str:
        """One line: primitive, location, function, scope and both operands."""
        scope = f" in {self.scope}" if self.scope else ""
        return (f"{self.primitive} at {self.location} ({self.function}){scope}: lhs {self.lhs_shape} "
                f"{self.lhs_dtype} [{self.lhs}], rhs {self.rhs_shape} {self.rhs_dtype} [{self.rhs}]")

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



# -- skip rules -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Skip:
    """A rule sparing matmuls meant to stay in full precision, for :func:`assert_quantized` and ``check_layer``.

    ``name`` is how failures and the report name the rule; ``matches(record)``
    selects records. A rule spares a record it matches whose operands are not
    both quantized. Build one with :func:`skip_modules`, :func:`skip_functions`,
    :func:`skip_at` or :func:`skip_where`.
    """

    name: str
    matches: Callable[[MatmulRecord], bool]

    def __call__(self, record: MatmulRecord) -> bool:
        return bool(self.matches(record))

    def __str__(self) -> str:
        return self.name


def _names(what: str, names: tuple[Any, ...], noun: str = "names") -> tuple[str, ...]:
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{what} needs one or more {noun}, got {names!r}")
    return names


def skip_functions(*names: str) -> Skip:
    """Spare matmuls called from a function named in ``names`` anywhere on the user's stack.

    Names are qualified (``Class.method``, ``f.<locals>.g``); every frame of the
    record's ``stack`` counts, not only the innermost, so
    ``skip_functions("GateLogit.__call__")`` spares the router's matmul however
    deep in the layer's own helpers it happens.
    """
    wanted = frozenset(_names("skip_functions", names, "function names"))
    return Skip(f"skip_functions({', '.join(map(repr, names))})",
                lambda r: r.function in wanted or any(fn in wanted for _, fn in r.stack))


def _components(path: str) -> tuple[str, ...]:
    return tuple(c for c in path.split("/") if c)


def skip_modules(*paths: str) -> Skip:
    """Spare matmuls traced under a module path or ``jax.named_scope`` name in ``paths``.

    A path is ``/``-separated (``"gate"``, ``"moe/gate"``) and matches a
    contiguous run of the record's ``scope``: an NNX submodule by its attribute
    path, or a named scope the code opens around the matmul. Edits that move
    lines do not move a module path.
    """
    wanted = [_components(p) for p in _names("skip_modules", paths, "module paths or scope names")]

    def matches(record: MatmulRecord) -> bool:
        scope = _components(record.scope)
        return any(scope[i:i + len(w)] == w for w in wanted for i in range(len(scope) - len(w) + 1))

    return Skip(f"skip_modules({', '.join(map(repr, paths))})", matches)


def skip_at(file: str, function: str | None = None) -> Skip:
    """Spare matmuls called from ``file`` (a path suffix, ``"maxtext/layers/moe.py"``), in ``function`` if given.

    Any frame of the record's ``stack`` counts; no line number, so the rule
    survives edits that move code within the function.
    """
    (file,) = _names("skip_at", (file,), "file paths (a non-empty file)")
    if function is not None:
        _names("skip_at", (function,), "function names (function must be a non-empty name or None)")
    parts = _components(file.replace(os.sep, "/"))

    def matches(record: MatmulRecord) -> bool:
        for location, fn in record.stack or ((record.location, record.function),):
            path = _components(location.rsplit(":", 1)[0].replace(os.sep, "/"))
            if path[-len(parts):] == parts and (function is None or fn == function):
                return True
        return False

    return Skip(f"skip_at({file!r}" + (f", {function!r})" if function else ")"), matches)


def skip_where(predicate: Callable[[MatmulRecord], bool], description: str) -> Skip:
    """Spare matmuls for which ``predicate(record)`` holds, named ``description`` in reports.

    For matmuls known by their shapes or types, e.g. the router's:
    ``skip_where(lambda r: r.rhs_shape[-1] == num_experts, "the matmul producing expert logits")``.
    """
    if not callable(predicate):
        raise ValueError(f"skip_where: predicate must be a callable (record) -> bool, got {type(predicate).__name__}")
    (description,) = _names("skip_where", (description,), "descriptions (a non-empty description)")
    return Skip(f"skip_where({description!r})", predicate)


SkipArg = Skip | Callable[[MatmulRecord], bool] | Sequence[Skip | Callable[[MatmulRecord], bool]] | None


def as_skips(skip: SkipArg, who: str) -> tuple[Skip, ...]:
    """``skip`` as rules: one rule, a plain predicate (named by its function), or a sequence of them."""
    if skip is None:
        return ()
    items = list(skip) if isinstance(skip, (list, tuple)) else [skip]
    rules = []
    for item in items:
        if isinstance(item, Skip):
            rules.append(item)
        elif callable(item) and not isinstance(item, (str, bytes)):
            rules.append(Skip(getattr(item, "__qualname__", None) or repr(item), item))
        else:
            raise TypeError(f"{who}: skip must be a callable (record) -> bool, a qcheck skip rule or a list of them, "
                            f"got {type(item).__name__}")
    return tuple(rules)


# -- source locations ---------------------------------------------------------

#: Packages and modules whose frames are quantization machinery, never a user's
#: call site: a record's location is the innermost frame outside them (and
#: outside the standard library and qcheck's plumbing). JAX, Flax (its fp8 ops
#: and its Linen/NNX bridge), AQT and qwix, and MaxText's own copies of that
#: plumbing (its ``ToNNX`` bridge and its quantization wrappers), so a MaxText
#: matmul points at the MaxText layer line that asked for it. Pass more as
#: ``machinery=`` to :func:`coverage` and the checks built on it (a team's
#: own quantization library, say). A dotted module counts once its package is
#: imported (looking it up never imports it).
MACHINERY: tuple[str, ...] = ("jax", "jaxlib", "flax", "aqt", "qwix", "maxtext.layers.nnx_wrappers",
                              "maxtext.layers.quantizations")


def _prefix_of(package: str) -> str | None:
    """The directory (or file) of a package or module; None when it is not installed or not yet imported."""
    import importlib.util

    if os.sep in package or package.endswith(".py"):
        return os.path.abspath(package) + ("" if package.endswith(".py") or os.path.isfile(package) else os.sep)
    parent = package.rpartition(".")[0]
    if parent and parent not in sys.modules:
        return None  # finding a submodule would import its package
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.path.abspath(list(spec.submodule_search_locations)[0]) + os.sep
    return os.path.abspath(spec.origin) if spec.origin else None


def _machinery_prefixes(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep  # qcheck/_coverage/
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # qcheck/
    packages = [p for p in (_prefix_of(name) for name in (*MACHINERY, *extra)) if p]
    # qcheck's own layers of a call site (the checks, the recipes' sites, the bridge, the formats): a
    # matmul is located at the user's line that reached them, not inside them.
    return (
        *packages,
        os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
        here, root + "checks" + os.sep, root + "recipes" + os.sep,
        root + "layers" + os.sep + "bridge.py", root + "formats.py",
    )


@functools.lru_cache(maxsize=65536)
def _is_machinery(filename: str, prefixes: tuple[str, ...]) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(prefixes) or filename.startswith("<")


def _display(filename: str) -> str:
    path = os.path.abspath(filename)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _user_frames(eqn: jcore.JaxprEqn, prefixes: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    tb = eqn.source_info.traceback
    if tb is None:
        return ()
    return tuple((f"{_display(code.co_filename)}:{tb.code_addr2line(code, lasti)}", code.co_qualname)
                 for code, lasti in zip(*tb.raw_frames()) if not _is_machinery(code.co_filename, prefixes))


def _scope_names(eqn: jcore.JaxprEqn) -> tuple[str, ...]:
    """The named scopes of an eqn's name stack (relative to its jaxpr), without transformations (jvp, transpose)."""
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return tuple(s.name for s in stack if type(s).__name__ == "Scope" and getattr(s, "name", None))


# -- NNX module paths as named scopes ---------------------------------------------

class _ModuleScopes:
    """While tracing an NNX module, open a ``jax.named_scope`` named by each submodule's path as its methods run.

    A profile hook sees each Python call; a method of a module class in the
    graph whose ``self`` is one of the graph's modules opens the scope of that
    module's path (relative to the module whose method is running), and closes
    it when the method returns. Tracing only: nothing of JAX is patched.
    """

    def __init__(self, module: Any):
        from flax import nnx

        self.paths: dict[int, tuple[str, ...]] = {}
        self.codes: set[Any] = set()
        base = set(nnx.Module.__mro__)  # the module machinery itself: getattr, setattr, graph methods
        for path, node in nnx.iter_graph(module):
            if isinstance(node, nnx.Module) and id(node) not in self.paths:
                self.paths[id(node)] = tuple(str(k) for k in path)
                for cls in type(node).__mro__:
                    if cls in base:
                        continue
                    for value in vars(cls).values():
                        fn = getattr(value, "__func__", value)
                        if hasattr(fn, "__code__"):
                            self.codes.add(fn.__code__)
        self.active: list[tuple[Any, tuple[str, ...], Any]] = []
        self.previous: Any = None

    def enter(self, frame: Any) -> None:
        path = self.paths.get(id(frame.f_locals.get("self")))
        top = self.active[-1][1] if self.active else ()
        if path is not None and path != top:
            rel = path[len(top):] if path[:len(top)] == top else path
            scope = jax.named_scope("/".join(rel)) if rel else None
            if scope is not None:
                scope.__enter__()
            self.active.append((frame, path, scope))

    def leave(self, frame: Any) -> None:
        # Frames an exception unwound (no return event) close with the first caller that returns.
        for i in range(len(self.active) - 1, -1, -1):
            if self.active[i][0] is frame:
                while len(self.active) > i:
                    _, _, scope = self.active.pop()
                    if scope is not None:
                        scope.__exit__(None, None, None)
                return

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if self.previous is not None:
            self.previous(frame, event, arg)
        if event == "call" and frame.f_code in self.codes:
            self.enter(frame)
        elif event == "return" and frame.f_code in self.codes:
            self.leave(frame)

    def __enter__(self) -> _ModuleScopes:
        monitoring = getattr(sys, "monitoring", None)
        self.tool = None
        if monitoring is not None:  # Python 3.12+: events for the modules' own code objects only, nearly free
            self.tool = next((t for t in range(6) if monitoring.get_tool(t) is None), None)
        if self.tool is not None:
            events = monitoring.events
            monitoring.use_tool_id(self.tool, "qcheck.coverage")
            monitoring.register_callback(self.tool, events.PY_START, lambda code, offset: self.enter(sys._getframe(1)))
            monitoring.register_callback(self.tool, events.PY_RETURN,
                                         lambda code, offset, value: self.leave(sys._getframe(1)))
            for code in self.codes:
                monitoring.set_local_events(self.tool, code, events.PY_START | events.PY_RETURN)
            return self
        self.previous = sys.getprofile()
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.tool is not None:
            monitoring = sys.monitoring
            for code in self.codes:
                monitoring.set_local_events(self.tool, code, 0)
            monitoring.register_callback(self.tool, monitoring.events.PY_START, None)
            monitoring.register_callback(self.tool, monitoring.events.PY_RETURN, None)
            monitoring.free_tool_id(self.tool)
        else:
            sys.setprofile(self.previous)
        while self.active:
            _, _, scope = self.active.pop()
            if scope is not None:
                scope.__exit__(None, None, None)


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


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where the walk is: the user's frames, the named scopes, and why values are unavailable (if they are)."""

    stack: tuple[tuple[str, str], ...] = ()
    scope: tuple[str, ...] = ()
    no_values: str | None = None


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


class _Walker:
    def __init__(self, machinery: tuple[str, ...] = ()):
        self.records: list[MatmulRecord] = []
        self.errors: list[tuple[int, Any]] = []  # (record index, traced error)
        self.machinery = _machinery_prefixes(machinery)

    def read(self, env: dict, v: Any) -> _Val:
        if isinstance(v, jcore.Literal):
            val = _input_val(v.aval, v.val, const=True)
            val.quant = None
            return val
        return env[v]

    def run(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], ins: list[_Val],
            outer: _Where, *, values: bool) -> list[_Val]:
        env: dict = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = _input_val(var.aval, c if values else None)
        for var, val in zip(jaxpr.invars, ins):
            env[var] = val
        for eqn in jaxpr.eqns:
            ins_e = [self.read(env, v) for v in eqn.invars]
            # An inner jaxpr's name stack is relative to the eqn that holds it; its traceback is whole.
            frames = _user_frames(eqn, self.machinery)
            # A custom_vjp's body may be traced apart from its caller: its frames then lack the caller's.
            if not frames or (outer.stack and outer.stack[-1] not in frames):
                frames = frames + outer.stack
            where = _Where(frames, outer.scope + _scope_names(eqn), outer.no_values)
            outs = self.eqn(eqn, ins_e, where, values=values)
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
        return [self.read(env, v) for v in jaxpr.outvars]

    def eqn(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: _Where, *, values: bool) -> list[_Val]:
        name = eqn.primitive.name
        if name in _CALLS and _CALLS[name] in eqn.params:
            inner = eqn.params[_CALLS[name]]
            jaxpr, consts = (inner.jaxpr, inner.consts) if isinstance(inner, jcore.ClosedJaxpr) else (inner, ())
            if len(jaxpr.invars) == len(ins) and len(jaxpr.outvars) == len(eqn.outvars):
                return self.run(jaxpr, consts, ins, where, values=values)
        if name in ("scan", "while", "cond"):
            return self.control(eqn, ins, dataclasses.replace(
                where, no_values=where.no_values or f"inside {name}: its body is walked for quantization only"),
                values=values)
        actual = None
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if values:
            if subs or name in _OPAQUE:
                actual = _eval_eqn(eqn, [v.actual for v in ins])
            else:
                actual = eqn.primitive.bind(*[v.actual for v in ins], **eqn.params)
                actual = list(actual) if eqn.primitive.multiple_results else [actual]
        if name in MATMUL_PRIMITIVES:
            self.matmul(eqn, ins, where, actual[0] if values else None)
        elif name in _OPAQUE:
            self.matmul(eqn, ins, where, None, opaque=True)
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
                             grad=grad, casts=o.casts) for i, o in enumerate(mapped)]
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

    def matmul(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: _Where, out: Any, *,
               opaque: bool = False) -> None:
        arrays = [(v, var) for v, var in zip(ins, eqn.invars) if hasattr(var.aval, "shape")]
        (lhs, lhs_var), (rhs, rhs_var) = (arrays + [(_Val(), None)] * 2)[:2]

        def shape(var: Any) -> tuple[int, ...]:
            return tuple(var.aval.shape) if var is not None else ()

        def dtype(var: Any) -> str:
            return str(np.dtype(var.aval.dtype)) if var is not None and hasattr(var.aval, "dtype") else "-"

        reason = None
        if not (lhs.quant and rhs.quant):
            reason = "full-precision operands"
        elif opaque:
            reason = f"an opaque kernel ({eqn.primitive.name}): its body is not walked"
        elif eqn.primitive.name not in _ERROR_PRIMITIVES:
            reason = "a scaled matmul: codes and scales enter separately"
        elif out is None:
            reason = where.no_values or "not computed (errors=False)"
        elif lhs.shadow is lhs.actual and rhs.shadow is rhs.actual:
            reason = "operands narrow from the start: no value before quantization"
        location, function = where.stack[0] if where.stack else ("<unknown>", "<unknown>")
        scales, blocks = (frozenset(), frozenset()), (None, None)
        if eqn.primitive.name in _BLOCK_SCALED and len(eqn.invars) >= 4:
            # Codes and their scales are separate operands: the scales' type is part of the operand's format.
            sv = eqn.invars[2:4]
            scales = tuple(v.casts | {str(np.dtype(x.aval.dtype))} for v, x in zip(ins[2:4], sv))
            blocks = tuple(_block_format(c.aval, x.aval, eqn.primitive.name) for c, x in zip(eqn.invars[:2], sv))
        self.records.append(MatmulRecord(
            primitive=eqn.primitive.name,
            location=location,
            function=function,
            lhs_shape=shape(lhs_var),
            rhs_shape=shape(rhs_var),
            lhs_dtype=dtype(lhs_var),
            rhs_dtype=dtype(rhs_var),
            lhs=lhs.quant or _FULL,
            rhs=rhs.quant or _FULL,
            backward=any(v.grad for v in ins),
            lhs_casts=lhs.casts | scales[0],
            rhs_casts=rhs.casts | scales[1],
            lhs_block=blocks[0],
            rhs_block=blocks[1],
            scope="/".join(where.scope),
            stack=where.stack,
            opaque=opaque,
            no_error=reason,
        ))
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

    def control(self, eqn: jcore.JaxprEqn, ins: list[_Val], where: _Where, *, values: bool) -> list[_Val]:
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
        actual = _eval_eqn(eqn, [v.actual for v in ins]) if values else None
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


def _graph_paths(module: Any) -> frozenset[tuple[Any, ...]]:
    from flax import nnx

    return frozenset(path for path, _ in nnx.iter_graph(module))


def warmed_up(module: Any, *args: Any, **kwargs: Any) -> Any:
    """``module`` itself, or a copy after one call when calling it creates submodules or variables (lazy modules).

    MaxText creates its AQT einsums on a module's first call; traced as they
    are, such modules show the initializing call's matmuls and miss the state
    the next calls use. The warm-up call runs on a copy (one compiled program,
    plain ``jax.jit``), so ``module`` is left as it was.
    """
    from flax import nnx

    graphdef, state = nnx.split(module)
    before = _graph_paths(module)
    grown: list[Any] = []

    def call(state, args, kwargs):
        m = nnx.merge(graphdef, state)
        m(*args, **kwargs)
        if _graph_paths(m) != before:
            grown.append(True)
        new_graphdef, new_state = nnx.split(m)
        grown.append(new_graphdef)
        return new_state

    jax.eval_shape(call, state, args, kwargs)  # tracing only: is the module lazy?
    if grown[0] is not True:
        return module
    new_graphdef = grown[-1]
    # Traced once more: the values the creating call gives the new variables (their initializers, its RNG draws).
    new_state = jax.jit(lambda state, args, kwargs: call(state, args, kwargs))(state, args, kwargs)
    return nnx.merge(new_graphdef, new_state)


def _pure(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Callable[..., Any], tuple, Any]:
    """A pure function of pytrees and its inputs; an NNX module's state (RNG streams included) is an input.

    An NNX module is traced as it will run (:func:`warmed_up`), each submodule's
    matmuls under the named scope of its path.
    """
    from flax import nnx

    if isinstance(fn, nnx.Module):
        graphdef, state = nnx.split(warmed_up(fn, *args, **kwargs))

        def call(state, args, kwargs):
            module = nnx.merge(graphdef, state)
            with _ModuleScopes(module):
                return module(*args, **kwargs)

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
             machinery: Sequence[str] = (), **kwargs: Any) -> list[MatmulRecord]:
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

    ``machinery``: packages (names or paths) whose frames are quantization
    machinery besides :data:`MACHINERY`, so records point at their callers.
    A module whose first call creates submodules is traced after a warm-up
    call on a copy (:func:`warmed_up`).
    """
    if isinstance(machinery, str) or not all(isinstance(m, str) and m for m in machinery):
        raise ValueError(f"coverage: machinery must be a sequence of package names or paths, got {machinery!r}")
    machinery = tuple(machinery)
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
    outer = _Where(no_values=None if errors else "not computed (errors=False)")
    ins = [_input_val(v.aval) for v in closed.jaxpr.invars]
    if seed_at is not None:
        ins[seed_at].grad = True
    if not errors:
        walker = _Walker(machinery)
        walker.run(closed.jaxpr, closed.consts, ins, outer, values=False)
        return walker.records

    walker = _Walker(machinery)

    def evaluate(flat):
        vals = [dataclasses.replace(v, actual=x, shadow=x) for v, x in zip(ins, flat)]
        walker.run(closed.jaxpr, closed.consts, vals, outer, values=True)
        return [e for _, e in walker.errors]

    figures = jax.jit(evaluate)(jax.tree.leaves(inputs))
    records = list(walker.records)
    for (i, _), e in zip(walker.errors, figures):
        records[i] = dataclasses.replace(records[i], error=float(e))
    return records


def format_coverage(records: Sequence[MatmulRecord], *, stack: bool = False) -> str:
    """A table of the records, one line per matmul.

    Columns: primitive, location, function, the scope (module path and named
    scopes) when any record has one, both operands, quantized (``skipped``
    where a skip rule spared a full-precision matmul, ``opaque`` for a kernel
    the walk cannot enter), the error figure, and a ``pass`` column when any
    record is from a backward pass. ``stack``: under each row, the user's
    frames of its call, innermost first.
    """
    with_scope = any(r.scope for r in records)
    header = ("primitive", "location", "function", *(("scope",) if with_scope else ()), "lhs", "rhs", "quantized",
              "error")

    def state(r: MatmulRecord) -> str:
        if r.quantized:
            return "yes (opaque)" if r.opaque else "yes"
        if r.skipped_by:
            return f"skipped: {r.skipped_by}"
        return "NO (opaque)" if r.opaque else "NO"

    rows = [header] + [
        (r.primitive, r.location, r.function, *((r.scope or "-",) if with_scope else ()),
         f"{r.lhs_shape} {r.lhs_dtype} {r.lhs}" + (f" {r.lhs_block}" if r.lhs_block else ""),
         f"{r.rhs_shape} {r.rhs_dtype} {r.rhs}" + (f" {r.rhs_block}" if r.rhs_block else ""),
         state(r), "-" if r.error is None else f"{r.error:.4g}")
        for r in records
    ]
    if any(r.backward for r in records):
        rows = [rows[0] + ("pass",)] + [
            row + ("backward" if r.backward else "forward",) for row, r in zip(rows[1:], records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(rows[0], widths)).rstrip()]
    for row, r in zip(rows[1:], records):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if stack:
            lines += [f"    from {loc} ({fn})" for loc, fn in r.stack]
    return "\n".join(lines)


def _unquantized_line(r: MatmulRecord) -> str:
    which = " and ".join(side for side, q in (("lhs", r.lhs), ("rhs", r.rhs)) if not q.quantized)
    scope = f", in {r.scope}" if r.scope else ""
    kind = " (an opaque kernel: its operands)" if r.opaque else ""
    return (f"  {r.primitive} at {r.location} ({r.function}): lhs {r.lhs_shape} {r.lhs_dtype} [{r.lhs}], "
            f"rhs {r.rhs_shape} {r.rhs_dtype} [{r.rhs}]: {which} unquantized{kind}{scope}")


def _spared(rule: Skip, records: Sequence[MatmulRecord]) -> list[int]:
    return [i for i, r in enumerate(records) if not r.quantized and rule(r)]


def assert_quantized(
    fn: Callable[..., Any],
    *args: Any,
    skip: SkipArg = None,
    control: Callable[..., Any] | None = None,
    machinery: Sequence[str] = (),
    **kwargs: Any,
) -> list[MatmulRecord]:
    """Assert every matmul of ``fn(*args, **kwargs)`` multiplies quantized operands; return the records.

    ``skip`` spares matmuls meant to stay in full precision: one rule
    (:func:`skip_modules`, :func:`skip_functions`, :func:`skip_at`,
    :func:`skip_where`, or a plain predicate ``(record) -> bool``) or a list of
    them. Each rule must spare at least one matmul (a stale rule fails, named),
    and each spared record names its rule (``skipped_by``).

    ``control``: the unquantized twin, called on the same arguments. The same
    rules applied to it must not spare more matmuls (by position in the
    program) than they spare in ``fn``: a rule broad enough to spare every
    einsum of a function (``skip_functions("RoutedMoE.dense_matmul")``) would
    hide a site that falls back to full precision, and fails, naming the
    matmuls it hides.

    Fails with one ``AssertionError`` listing each offending matmul with its
    primitive, location, shapes and the operand that arrives unquantized, and
    each failed rule.
    """
    __tracebackhide__ = True
    rules = as_skips(skip, "assert_quantized")
    records = coverage(fn, *args, machinery=machinery, **kwargs)
    for i, r in enumerate(records):
        if not r.quantized:
            rule = next((rule for rule in rules if rule(r)), None)
            if rule is not None:
                records[i] = dataclasses.replace(r, skipped_by=rule.name)
    problems: list[str] = []
    bad = [r for r in records if not r.quantized and r.skipped_by is None]
    if bad:
        problems.append(f"{len(bad)} of {len(records)} matmuls reach full precision:\n" +
                        "\n".join(_unquantized_line(r) for r in bad))
    for rule in rules:
        if not _spared(rule, records):
            matched = sum(1 for r in records if rule(r))
            problems.append(f"skip rule {rule.name} spares none of the {len(records)} matmuls "
                            f"({'it matches only quantized ones' if matched else 'it matches none'}): "
                            f"drop it or fix it")
    if control is not None:
        twin = coverage(control, *args, machinery=machinery, **kwargs)
        for rule in rules:
            hidden = sorted(set(_spared(rule, twin)) - set(_spared(rule, records)))
            if hidden:
                problems.append(
                    f"skip rule {rule.name} spares {len(hidden)} more matmul(s) in the unquantized control than "
                    f"in the layer; at their positions a full-precision matmul of the layer would pass unseen:\n" +
                    "\n".join(f"  #{i}: {twin[i].describe()}" for i in hidden))
    if problems:
        raise AssertionError("assert_quantized: " + "\n".join(problems))
    return records
