"""The public functions: the coverage map of a function, its table, and the assertion that all is quantized."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qcheck._errors import user_code
from qcheck._fingerprint import fingerprint
from qcheck._coverage._declaration import Declaration, judge, judged_once, weaker_holds
from qcheck._coverage._kernels import KernelRoles, as_kernel_roles
from qcheck._coverage._readers import resolve_declaration
from qcheck._coverage._records import MatmulRecord
from qcheck._coverage._scopes import ModuleScopes
from qcheck._coverage._skips import Skip, SkipArg, as_skips
from qcheck._coverage._values import NOT_RUN, Where, input_val
from qcheck._coverage._walk import Walker
from qcheck._coverage._weights import data_mask, marked_partial, stored_mask, unwrap


class CoverageMap(list):
    """The records of :func:`coverage` (a list of :class:`MatmulRecord`), and the declaration they were held to.

    ``declaration``: what every site was held to (None: nothing); ``declared_from``: one line saying what it
    is and where it was read (the layer's library, given by hand), or why nothing was held.
    """

    def __init__(self, records: Sequence[MatmulRecord] = (), declaration: Declaration | None = None,
                 declared_from: str = ""):
        super().__init__(records)
        self.declaration = declaration
        self.declared_from = declared_from


def _state_bits(module: Any) -> list[Any]:
    """A snapshot of the module's state, leaf by leaf, for :func:`_same_bits` after a trace."""
    from flax import nnx

    def bits(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            # A leaf with no value: EasyDeL 0.3.0's quantized linears keep abstract Rngs in their state
            # (to_quantized). It cannot change; its shape and type stand for it.
            return np.array(repr(x))
        if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        # A JAX array is immutable: itself is its snapshot (a copy of every weight cost 0.4 GB and a second at
        # emb 1024); a numpy leaf could change in place.
        return x if isinstance(x, jax.Array) else np.array(x, copy=True)

    return [bits(x) for x in jax.tree.leaves(nnx.state(module))]


def _same_bits(a: Any, b: Any) -> bool:
    if a is b:
        return True
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.reshape(-1).view(np.uint8),
                                                                        b.reshape(-1).view(np.uint8))


def graph_paths(module: Any) -> frozenset[tuple[Any, ...]]:
    """Every node's and variable's path in an NNX module: a call that changes them built something."""
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
    before = graph_paths(module)
    grown: list[bool] = []

    def call(state, args, kwargs):
        m = nnx.merge(graphdef, state)
        m(*args, **kwargs)
        grown.append(graph_paths(m) != before)
        return nnx.split(m)[1]

    jax.eval_shape(call, state, args, kwargs)  # tracing only: is the module lazy?
    return after_first_call(module, *args, **kwargs) if grown[0] else module


def after_first_call(module: Any, *args: Any, **kwargs: Any) -> Any:
    """A copy of the NNX ``module`` as one call on ``args`` leaves it: one compiled program, ``module`` unchanged.

    What :func:`warmed_up` returns for a module it found lazy; for a caller that
    found it so itself (by tracing it), without tracing it once more to ask.
    """
    from flax import nnx

    graphdef, state = nnx.split(module)
    made: list[Any] = []

    def call(state, args, kwargs):
        m = nnx.merge(graphdef, state)
        m(*args, **kwargs)
        new_graphdef, new_state = nnx.split(m)
        made.append(new_graphdef)
        return new_state

    # The values the creating call gives the new variables (their initializers, its RNG draws).
    new_state = jax.jit(call)(state, args, kwargs)
    return nnx.merge(made[-1], new_state)


def _pure(fn: Callable[..., Any], args: tuple, kwargs: dict, warm: bool = True
          ) -> tuple[Callable[..., Any], tuple, Any]:
    """A pure function of pytrees and its inputs; an NNX module's state (RNG streams included) is an input.

    An NNX module is traced as it will run (:func:`warmed_up`; ``warm=False``:
    as it is, its caller having warmed it up), each submodule's matmuls under
    the named scope of its path.
    """
    from flax import nnx

    # Arguments marked qcheck.weights(...): JAX sees their leaves, the function receives the trees themselves.
    if isinstance(fn, nnx.Module):
        graphdef, state = nnx.split(warmed_up(fn, *unwrap(args), **unwrap(kwargs)) if warm else fn)

        def call(state, args, kwargs):
            module = nnx.merge(graphdef, state)
            with ModuleScopes(module):
                return module(*unwrap(args), **unwrap(kwargs))

        return call, (state, args, kwargs), fn
    if (bound := marked_partial(fn)) is not None:  # marked arguments bound (a function check_layer checks)
        fn, before, more = bound
        args, kwargs = before + tuple(args), {**more, **kwargs}
    return (lambda args, kwargs: fn(*unwrap(args), **unwrap(kwargs))), (args, kwargs), None


def _data_mask(inputs: tuple, module: Any) -> list[bool]:
    """Per input leaf: True for the call's arguments, False for a module's state (parameters and the rest) and
    for arguments marked ``qcheck.weights``."""
    if module is None:
        return data_mask(inputs)
    state, args, kwargs = inputs
    return [False] * len(jax.tree.leaves(state)) + data_mask((args, kwargs))


def _stored_mask(inputs: tuple, module: Any) -> list[Any]:
    """Per input leaf: the float source of stored codes marked ``qcheck.weights(codes, source=...)``, else None."""
    if module is None:
        return stored_mask(inputs)
    state, args, kwargs = inputs
    return [None] * len(jax.tree.leaves(state)) + stored_mask((args, kwargs))


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
    order = [i for i, d in enumerate(inexact) if d] + [i for i, d in enumerate(inexact) if not d]
    return both, (diff, held, np.float32(1.0)), len(jax.tree.leaves((diff, held))), order


def machinery_tuple(machinery: Any, entry: str) -> tuple[str, ...]:
    if isinstance(machinery, str) or not all(isinstance(m, str) and m for m in machinery):
        raise ValueError(f"{entry}: machinery must be a sequence of package names or paths, got {machinery!r}")
    return tuple(machinery)


def coverage(fn: Callable[..., Any], *args: Any, errors: bool = False, backward: bool = False,
             machinery: Sequence[str] = (), declared: Any = None,
             kernels: KernelRoles | Sequence[KernelRoles] | None = None, **kwargs: Any) -> CoverageMap:
    """One :class:`MatmulRecord` per matrix multiplication ``fn(*args, **kwargs)`` performs, in program order.

    ``fn`` is a function of arrays (pytrees) or an ``flax.nnx.Module``, which is
    split as ``nnx.jit`` would split it so that tracing mutates nothing (checked:
    its state, RNG counts included, is bitwise unchanged afterwards). Tracing
    only, unless ``errors``: then the function runs once more as one compiled
    program that also computes each quantized matmul's ``error`` (see
    :class:`MatmulRecord` for where it is None). Python scalars and other
    non-array arguments are traced as arrays; close over static ones.
    A matmul inside a ``scan`` or ``while`` body is one record whatever the
    trip count, its ``error`` the worst over the iterations (NaN if any is);
    inside a ``cond``, each branch's matmuls are records, the taken branch's
    with figures; ``no_error`` names a branch not taken or a loop that ran no
    iteration. Inside ``shard_map`` bodies there are no figures.

    ``backward``: trace a vjp of ``fn`` too (with respect to every inexact
    input, an NNX module's state included, of its inexact outputs), still
    tracing only; the matmuls of the backward pass come after the forward
    pass's, with ``backward=True``. Not with ``errors``.

    ``machinery``: packages (names or paths) whose frames are quantization
    machinery besides the registered libraries' (``qcheck.libraries``), so records point at their callers.
    A module whose first call creates submodules is traced after a warm-up
    call on a copy (:func:`warmed_up`).

    An exception of ``fn``'s own code, tracing or running, is one
    :class:`qcheck.UserCodeError` (a ``ValueError``), the original chained.

    ``declared``: what the matmuls' operands are meant to be. By default
    (None) it is read from ``fn`` where it states one (its ``qcheck_declaration()``:
    qcheck's layers) or its library does (a registered library's reader: MaxText's config,
    gemma's wrapper, haliax's ops, qwix's rules, Keras's quantize mode); True reads it and fails where nothing is
    read; False holds nothing; or give it: a recipe or format name, a ``qcheck.Recipe``,
    or a mapping of roles to formats (:mod:`qcheck._coverage._declaration`).
    Each record then carries its operands' declared formats, how strongly
    each was held (``lhs_hold``/``rhs_hold``: bitwise, type or none, and why)
    and its ``findings``, from one compiled run that also hands back each
    quantizer's input and codes, inside calls, ``scan`` and ``shard_map``
    bodies and the backward pass too. The returned :class:`CoverageMap` says
    what was held and where it was read (``declared_from``).

    ``kernels``: the roles of opaque kernels (``pallas_call``, FFI calls) by
    name, one :class:`qcheck.KernelRoles` or a list: which of a kernel's inputs
    are its lhs, its rhs and their scales. Kernels qcheck knows (MaxText's
    megablox ``gmm``/``tgmm`` and tokamax's TPU ``ragged_dot``: a registered
    library's ``kernels``) need none; any other kernel is recorded with its roles unknown. Where
    its roles say which axes it contracts, a kernel's code inputs are held bitwise like any matmul's.
    """
    machinery = machinery_tuple(machinery, "coverage")
    if backward and errors:
        raise ValueError("coverage: errors=True needs values, which the backward trace does not compute; "
                         "pass errors=False with backward=True")
    declaration, read = resolve_declaration(fn, declared, "coverage", "fn")
    records = _coverage(fn, args, kwargs, errors=errors, backward=backward, machinery=machinery,
                        declaration=declaration, entry="coverage", what="fn",
                        kernels=as_kernel_roles(kernels, "coverage"))
    return CoverageMap(records, declaration, read)


@dataclasses.dataclass
class Prepared:
    """A walk with values, traced and not yet run: ``evaluate`` of ``leaves`` computes its error figures and
    its quantizers' evidence, in a program of its own (:func:`_coverage`) or inside another: check_layer
    compiles it into the layer's own step, so it costs no compile of its own."""

    closed: Any  # the walked program (a ClosedJaxpr); its constants stay constants
    ins: list  # its inputs as the walk sees them
    leaves: list  # the flat inputs ``evaluate`` takes: the call's, in the walked program's order
    outer: Where
    machinery: tuple[str, ...]
    kernels: dict[str, KernelRoles] | None
    errors: bool
    declaration: Any
    entry: str
    walker: Walker | None = None  # the last trace's: its records, quantizers and operands

    def key(self) -> Any:
        """What the program ``evaluate`` traces to depends on, besides its inputs' shapes (None: unhashable)."""
        try:
            # A marked source is judged from the walk's records: another source's walk is not this one's.
            ins = tuple((v.data, v.grad, getattr(v.quant, "stored", None)) for v in self.ins)
            key = (fingerprint(self.closed), ins, self.machinery,
                   tuple(sorted((self.kernels or {}).items())), self.errors, self.declaration is not None)
            hash(key)
        except TypeError:
            return None
        return key

    def evaluate(self, flat: Sequence[Any]) -> tuple[list, list]:
        # A fresh walk each trace: a program traced again (a cached one's walk redone) holds no stale records.
        self.walker = Walker(self.machinery, self.kernels, self.entry)
        vals = [dataclasses.replace(v, actual=x, shadow=x) for v, x in zip(self.ins, flat)]
        self.walker.run(self.closed.jaxpr, self.closed.consts, vals, self.outer, values=True)
        # Only what is asked for: unreturned, the error figures' full-precision shadow computation is not compiled.
        return ([e for _, e in self.walker.errors] if self.errors else [],
                self.walker.quantizers if self.declaration is not None else [])

    def records(self, out: tuple[list, list]) -> list[MatmulRecord]:
        """The walk's records, with the figures and the judgment of one run's outputs ``out``."""
        _misdeclared(self.walker, self.entry)
        figures, quantizers = out
        records = list(self.walker.records)
        if not self.errors:
            records = [dataclasses.replace(r, no_error=r.no_error or "not computed (errors=False)") for r in records]
        else:
            for (i, _), e in zip(self.walker.errors, figures):
                e = float(e)
                records[i] = dataclasses.replace(records[i], error=e) if e not in NOT_RUN else (
                    dataclasses.replace(records[i], no_error=NOT_RUN[e]))
        if self.declaration is None:
            return records
        return judge(records, self.declaration, _evidence(quantizers, self.walker), self.walker.operands,
                     self.walker.zero_points)


def prepare(fn: Callable[..., Any], args: tuple, kwargs: dict, *, errors: bool, backward: bool,
            machinery: tuple[str, ...], declaration: Any, entry: str, what: str,
            kernels: dict[str, KernelRoles] | None = None, warm: bool = True) -> Prepared | list[MatmulRecord]:
    """``fn`` traced for :func:`coverage` (an error of ``fn``, named ``what``, is a UserCodeError of ``entry``):
    its records where it runs without values (no figure, no declaration), else the walk to run."""
    if not callable(fn):
        raise ValueError(f"{entry}: {what} must be callable or an flax.nnx.Module, got {type(fn).__name__}")
    with user_code(entry, what):
        pure, inputs, module = _pure(fn, args, kwargs, warm)
    before = _state_bits(module) if module is not None else None
    data, stored = _data_mask(inputs, module), _stored_mask(inputs, module)
    seed_at = None
    if backward:
        pure, inputs, seed_at, order = _with_backward(pure, inputs)
        data, stored = [data[i] for i in order], [stored[i] for i in order]
    with user_code(entry, what):
        closed = jax.make_jaxpr(pure)(*inputs)
    if module is not None:
        after = _state_bits(module)
        if len(before) != len(after) or not all(_same_bits(a, b) for a, b in zip(before, after)):
            raise RuntimeError(f"{entry}: tracing changed the module's state ({what}); it must not mutate its inputs")
    # With a declaration the program runs with values (its quantizers' codes) even where no figure is asked for.
    outer = Where(no_values=None if errors or declaration is not None else "not computed (errors=False)")
    ins = [input_val(v.aval, data=d) for v, d in zip(closed.jaxpr.invars, data + [False] * len(closed.jaxpr.invars))]
    for v, source in zip(ins, stored):
        if source is not None and v.quant is not None:  # its codes carry their source to each matmul
            v.quant = dataclasses.replace(v.quant, stored=source)
    for v in ins:
        v.ident = object()
    if seed_at is not None:
        ins[seed_at].grad = True
    if not errors and declaration is None:
        walker = Walker(machinery, kernels, entry)
        walker.run(closed.jaxpr, closed.consts, ins, outer, values=False)
        _misdeclared(walker, entry)
        return walker.records
    return Prepared(closed, ins, jax.tree.leaves(inputs), outer, machinery, kernels, errors, declaration, entry)


def _coverage(fn: Callable[..., Any], args: tuple, kwargs: dict, *, errors: bool, backward: bool,
              machinery: tuple[str, ...], declaration: Any, entry: str, what: str,
              kernels: dict[str, KernelRoles] | None = None, warm: bool = True,
              prepared: tuple[Prepared, Any, Sequence[Any]] | None = None,
              also_out: list | None = None) -> list[MatmulRecord]:
    """:func:`coverage` for the public call ``entry``: an error of ``fn`` (named ``what``) is a UserCodeError.

    ``prepared``: the walk already run by the caller, inside a program of its own, as ``(walk, its outputs on
    the call's arguments, its outputs on other arguments of the same shapes)``; ``also_out`` then gets each
    other run's records judged against the declaration, after the call's own.
    """
    if prepared is None:
        walk = prepare(fn, args, kwargs, errors=errors, backward=backward, machinery=machinery,
                       declaration=declaration, entry=entry, what=what, kernels=kernels, warm=warm)
        if not isinstance(walk, Prepared):
            return walk
        with user_code(entry, what):
            out = jax.jit(walk.evaluate)(walk.leaves)
        prepared = (walk, out, ())
    walk, out, others = prepared
    with judged_once():  # the other runs' unchanged quantizers (the weights) are judged once
        records = walk.records(out)
        if also_out is not None and walk.declaration is not None:
            also_out += [records] + [walk.records(o) for o in others]
    return records


def judged_runs(walk: Prepared, outs: Iterable[Any]) -> list[list[MatmulRecord]]:
    """Each run's records of the walk ``walk`` (its outputs ``outs``, read one at a time), judged against its
    declaration: check_layer's edge rows run on a slice of x, by a walk of the slice's shape of their own."""
    with judged_once():  # the runs' unchanged quantizers (the weights) are judged once
        return [walk.records(o) for o in outs]


def _evidence(quantizers: Sequence[tuple[Any, Any, Any]], walker: Walker) -> list[tuple[Any, ...]]:
    """The walk's quantizers as numpy values, each with its scale's form and what its leading axes enumerate."""
    return [(np.asarray(x), np.asarray(c), None if d is None else (np.asarray(d), mul), stacked)
            for (x, c, d), mul, stacked in zip(quantizers, walker.multiplied, walker.stacked)]


def _misdeclared(walker: Walker, entry: str) -> None:
    if walker.misdeclared:
        raise ValueError(f"{entry}: kernels: {walker.misdeclared[0]}")


def format_coverage(records: Sequence[MatmulRecord], *, stack: bool = False) -> str:
    """A table of the records, one line per matmul.

    Columns: primitive (an opaque kernel's name beside it), location,
    function, the scope (module path and named scopes) when any record has
    one, both operands, quantized (``skipped`` where a skip rule spared a
    full-precision matmul, ``opaque`` for a kernel the walk cannot enter,
    ``roles unknown`` for one whose roles qcheck cannot read: its data
    operands then fill the operand columns), the error figure, and a
    ``pass`` column when any record is from a backward pass. ``stack``: under each row, the user's
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
        if r.roles_unknown:
            return "NO (opaque, roles unknown)"
        return "NO (opaque)" if r.opaque else "NO"

    def operands(r: MatmulRecord) -> tuple[str, str]:
        if r.roles_unknown:
            return "roles unknown", "data: " + (", ".join(r.operands) or "(none)")
        return (f"{r.lhs_shape} {r.lhs_dtype} {r.lhs}" + (f" {r.lhs_block}" if r.lhs_block else ""),
                f"{r.rhs_shape} {r.rhs_dtype} {r.rhs}" + (f" {r.rhs_block}" if r.rhs_block else ""))

    rows = [header] + [
        (r.primitive + (f" {r.kernel}" if r.kernel else ""), r.location, r.function,
         *((r.scope or "-",) if with_scope else ()), *operands(r), state(r),
         "-" if r.error is None else f"{r.error:.4g}")
        for r in records
    ]
    if any(r.lhs_hold is not None or r.rhs_hold is not None for r in records):
        rows = [rows[0] + ("held",)] + [row + (_held(r),) for row, r in zip(rows[1:], records)]
    if any(r.backward for r in records):
        rows = [rows[0] + ("pass",)] + [
            row + ("backward" if r.backward else "forward",) for row, r in zip(rows[1:], records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(rows[0], widths)).rstrip()]
    for row, r in zip(rows[1:], records):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        for side in ("lhs", "rhs"):
            hold = getattr(r, f"{side}_hold")
            if hold is not None and not hold.bitwise and hold.reason:
                lines.append(f"    {side} held by {hold.strength}: {hold.reason}"
                             + (f" (accepted by {hold.accepted_by})" if hold.accepted_by else ""))
        if stack:
            lines += [f"    from {loc} ({fn})" for loc, fn in r.stack]
    if getattr(records, "declared_from", ""):
        lines.append(f"declared: {records.declared_from}")
    return "\n".join(lines)


def _held(r: MatmulRecord) -> str:
    """Both operands' holds in one cell: ``bitwise``, or each side's strength (``lhs type, rhs bitwise``)."""
    holds = [(side, h) for side in ("lhs", "rhs") if (h := getattr(r, f"{side}_hold")) is not None]
    if not holds:
        return "-"
    if all(h.bitwise for _, h in holds):
        return "bitwise"
    return ", ".join(f"{side} {h.strength}{' (accepted)' if h.accepted_by else ''}" for side, h in holds)


def _unquantized_line(r: MatmulRecord) -> str:
    which = " and ".join(side for side, q in (("lhs", r.lhs), ("rhs", r.rhs)) if not q.quantized)
    scope = f", in {r.scope}" if r.scope else ""
    kind = f" (opaque kernel {r.kernel}; roles: {r.kernel_roles})" if r.opaque else ""
    return (f"  {r.primitive} at {r.location} ({r.function}): lhs {r.lhs_shape} {r.lhs_dtype} [{r.lhs}], "
            f"rhs {r.rhs_shape} {r.rhs_dtype} [{r.rhs}]: {which} unquantized{kind}{scope}")


def _unreadable_line(r: MatmulRecord) -> str:
    scope = f", in {r.scope}" if r.scope else ""
    return (f"  {r.primitive} at {r.location} ({r.function}), kernel {r.kernel}{scope}: data operands "
            f"{', '.join(r.operands) or '(none)'}")


def _declared_lines(r: MatmulRecord) -> str:
    scope = f", in {r.scope}" if r.scope else ""
    head = f"  {r.primitive} at {r.location} ({r.function}){scope}: lhs {r.lhs_shape} [{r.lhs}], rhs {r.rhs_shape} [{r.rhs}]"
    return head + "".join(f"\n    {f}" for f in r.findings)


def _declaration_bites(twin: Sequence[MatmulRecord], declaration: Any, rules: Sequence[Skip]) -> bool:
    """Whether the unquantized control fails the declaration somewhere no skip rule spares (types alone)."""
    for r in judge(twin, declaration, [], []):
        if r.findings and not any(rule(r) for rule in rules):
            return True
    return False


def _spared(rule: Skip, records: Sequence[MatmulRecord]) -> list[int]:
    return [i for i, r in enumerate(records) if not r.quantized and rule(r)]


def assert_quantized(
    fn: Callable[..., Any],
    *args: Any,
    skip: SkipArg = None,
    control: Callable[..., Any] | None = None,
    machinery: Sequence[str] = (),
    declared: Any = None,
    kernels: KernelRoles | Sequence[KernelRoles] | None = None,
    backward: bool = False,
    accept_weaker: Any = None,
    **kwargs: Any,
) -> CoverageMap:
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

    ``declared``: hold each matmul to a declared quantization instead of
    "quantized somehow" (:func:`coverage`'s ``declared``: by default read from
    ``fn`` where its library states one, ``False`` for none): a site fails with
    each of its findings (the wrong type, codes other than the referee's,
    full precision where a format is declared, codes that could not be held
    bitwise and why), a role the declaration leaves out is not checked, and
    one declared full precision may stay so. Its control: the ``control`` twin
    must not satisfy a declaration that declares a format.

    ``accept_weaker``: accept a hold below bitwise where the codes cannot be
    read: True for every site, or rules like ``skip`` (:func:`skip_at`,
    :func:`skip_modules`, ...) for the sites they match; each accepted site
    says so in its hold, and a rule that matches no weaker-held site is an
    error. ``backward``: the backward pass's matmuls too, a ``grads`` role
    held on them as on the forward pass's.

    ``kernels``: the roles of opaque kernels (:func:`coverage`'s ``kernels``).
    A kernel whose roles qcheck cannot read never passes: it fails, listed
    with its data operands, until its roles are declared or a skip rule
    spares it; a declared kernel name that matches no kernel fails (stale).

    Fails with one ``AssertionError`` listing each offending matmul with its
    primitive, location, shapes and the operand that arrives unquantized, and
    each failed rule.
    """
    __tracebackhide__ = True
    return quantized_records(fn, args, kwargs, skip=skip, control=control, machinery=machinery, declared=declared,
                             kernels=kernels, backward=backward, accept_weaker=accept_weaker)


def _accept(records: list[MatmulRecord], accept_weaker: Any, entry: str, stale_ok: bool = False
            ) -> list[MatmulRecord]:
    """``records`` with each weaker hold accepted by ``accept_weaker`` marked, and the rest a finding each."""
    if accept_weaker is None or accept_weaker is False:
        rules: list[Skip] = []
    elif accept_weaker is True:
        rules = [Skip("accept_weaker=True", lambda r: True)]
    else:
        try:
            rules = as_skips(accept_weaker, f"{entry}: accept_weaker")
        except TypeError as e:
            raise ValueError(str(e)) from None
    used: set[str] = set()
    out = []
    for r in records:
        weaker = weaker_holds(r)
        rule = next((rule for rule in rules if rule(r)), None) if weaker else None
        if rule is not None:
            used.add(rule.name)
            r = dataclasses.replace(r, **{f"{side}_hold": dataclasses.replace(h, accepted_by=rule.name)
                                          for side in ("lhs", "rhs") if (h := getattr(r, f"{side}_hold")) is not None
                                          and not h.bitwise})
        elif weaker:
            r = dataclasses.replace(r, findings=r.findings + tuple(weaker))
        out.append(r)
    for rule in rules:
        if rule.name not in used and not stale_ok:
            raise ValueError(f"{entry}: accept_weaker: {rule.name} matches no site held less than bitwise "
                             f"(every site it matches is held bitwise, or none matches): drop it")
    return out


def quantized_records(fn: Callable[..., Any], args: tuple, kwargs: dict, *, skip: SkipArg = None,
                      control: Callable[..., Any] | None = None, machinery: Sequence[str] = (), declared: Any = None,
                      kernels: KernelRoles | Sequence[KernelRoles] | None = None, warm: bool = True,
                      backward: bool = False, accept_weaker: Any = None, entry: str = "assert_quantized",
                      declaration: Declaration | None = None, declared_from: str | None = None,
                      stale_ok: bool = False, prepared: tuple[Prepared, Any, Sequence[Any]] | None = None,
                      also_out: list | None = None) -> CoverageMap:
    """:func:`assert_quantized` of ``fn(*args, **kwargs)``; ``warm=False``: ``fn`` and ``control``, NNX modules,
    are traced as they are, their caller having warmed them up (:func:`after_first_call`) where they were lazy.
    ``declared_from`` given: ``declaration`` is already resolved (the caller read it from its own layer).
    ``prepared``, ``also_out``: :func:`_coverage`'s, a walk the caller ran inside its own program."""
    __tracebackhide__ = True
    rules = as_skips(skip, entry)
    if declared_from is None:
        declaration, declared_from = resolve_declaration(fn, declared, entry, "fn")
    if accept_weaker not in (None, False) and declaration is None:
        raise ValueError(f"{entry}: accept_weaker accepts weaker holds of a declaration, and none is held "
                         f"({declared_from})")
    machinery = machinery_tuple(machinery, entry)
    declared_kernels = as_kernel_roles(kernels, entry)
    records = _coverage(fn, args, kwargs, errors=False, backward=backward, machinery=machinery,
                        declaration=declaration, entry=entry, what="fn", kernels=declared_kernels,
                        warm=warm, prepared=prepared, also_out=also_out)
    if declaration is not None:
        records = _accept(records, accept_weaker, entry, stale_ok)
    for i, r in enumerate(records):
        if not r.quantized:
            rule = next((rule for rule in rules if rule(r)), None)
            if rule is not None:
                records[i] = dataclasses.replace(r, skipped_by=rule.name)
    problems: list[str] = []
    unreadable = [r for r in records if r.roles_unknown and r.skipped_by is None]
    if unreadable:
        names = sorted({r.kernel for r in unreadable})
        problems.append(
            f"{len(unreadable)} opaque kernel(s) whose roles qcheck cannot read (roles unknown): declare which "
            f"inputs are lhs, rhs and their scales (kernels=qcheck.KernelRoles({names[0]!r}, lhs=..., rhs=...)) "
            f"or spare them with a skip rule:\n" + "\n".join(_unreadable_line(r) for r in unreadable))
    if declaration is None:
        bad = [r for r in records if not r.quantized and r.skipped_by is None and not r.roles_unknown]
        if bad:
            problems.append(f"{len(bad)} of {len(records)} matmuls reach full precision:\n" +
                            "\n".join(_unquantized_line(r) for r in bad))
    else:
        bad = [r for r in records if r.findings and r.skipped_by is None and not r.roles_unknown]
        if bad:
            problems.append(f"{len(bad)} of {len(records)} matmuls differ from the declared quantization "
                            f"({declaration}):\n" + "\n".join(_declared_lines(r) for r in bad))
    for rule in rules:
        if not _spared(rule, records):
            matched = sum(1 for r in records if rule(r))
            problems.append(f"skip rule {rule.name} spares none of the {len(records)} matmuls "
                            f"({'it matches only quantized ones' if matched else 'it matches none'}): "
                            f"drop it or fix it")
    seen = {r.kernel for r in records if r.kernel_roles == "declared"}
    for name in sorted(set(declared_kernels) - seen):
        kernels_here = sorted({r.kernel for r in records if r.opaque})
        problems.append(f"kernels: KernelRoles({name!r}) names no kernel of fn (its opaque kernels: "
                        f"{', '.join(kernels_here) or 'none'}): drop it or fix its name")
    if control is not None:
        twin = _coverage(control, args, kwargs, errors=False, backward=backward, machinery=machinery,
                         declaration=None, entry=entry, what="control", kernels=declared_kernels,
                         warm=warm)
        formats_declared = declaration is not None and declaration.any_format
        if formats_declared and not _declaration_bites(twin, declaration, rules):
            problems.append(f"the declaration ({declaration}) holds on the unquantized control as well: it "
                            f"declares no quantized format for any operand of its matmuls, so it checks nothing")
        for rule in rules:
            hidden = sorted(set(_spared(rule, twin)) - set(_spared(rule, records)))
            if hidden:
                problems.append(
                    f"skip rule {rule.name} spares {len(hidden)} more matmul(s) in the unquantized control than "
                    f"in the layer; at their positions a full-precision matmul of the layer would pass unseen:\n" +
                    "\n".join(f"  #{i}: {twin[i].describe()}" for i in hidden))
    if problems:
        raise AssertionError("assert_quantized: " + "\n".join(problems) + f"\ndeclared: {declared_from}")
    return CoverageMap(records, declaration, declared_from)
