"""A layer's step (forward and backward pass, the state after the call) traced once and compiled once, ahead of
time, and kept for a layer of the same structure; coverage's walks with values compiled into it; and the edges'
program on a slice of x, which returns only what the edges read (:class:`_Lean`)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from qcheck._coverage import Prepared, debug_info_type
from qcheck._errors import user_code
from qcheck._fingerprint import fingerprint
from qcheck.checks._layer_forms import Form, Grown, NoOutput, form_of, hashable, path_name, select_output, traceable
from qcheck.checks._tracks import count_nonfinite


#: The key of the gradient with respect to the input ``x`` in ``LayerFigures.grad_rel_norms``.
INPUT_GRAD = "(input x)"


#: The step's loss is the sum of the compared outputs' squares times this: each output element's gradient is
#: its value times 2 ** -10, whatever the layer's size. A mean (this at 2048 elements, qcheck's usual probe)
#: shrank with the output (2 out / N): at emb 1024 it came to about 1e-6, which an fp8 layer's e5m2 cast at a
#: fresh scale of 1 flushes to zero (e5m2's smallest subnormal is 2^-16), and a correct layer failed. A plain sum
#: (gradients of about 1) would be too large: a gradient cast to e4m3 (a quantized einsum with no straight-through
#: rule, differentiated through its casts) keeps it, where at this scale, as a trained model's loss gradients,
#: it falls below e4m3's smallest subnormal (2^-9) and the bug shows.
LOSS_SCALE = 2.0 ** -11


def _loss(leaves: list[jax.Array]) -> jax.Array:
    # A fixed scalar of every compared output, so each element sends back a gradient (LOSS_SCALE: its size).
    return sum(jnp.sum(jnp.square(v.astype(jnp.float32))) * LOSS_SCALE for v in leaves)


_PROGRAMS: collections.OrderedDict[Any, Any] = collections.OrderedDict()


def _step(form: Form, output: Any, names: list[str]) -> Callable[..., Any]:
    """The layer's forward and backward pass as one function; tracing it fills ``names`` with the output's leaves."""

    def step(params, rest, x):
        def loss(params, x):
            out, after = form.apply(params, rest, x)
            # Selected on the output's shapes first, as on its values nothing fails: a tracer's index clamps.
            shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype) if hasattr(v, "shape") else v, out)
            names[:] = [n for n, _ in select_output(shapes, output)]
            leaves = select_output(out, output)
            return _loss([v for _, v in leaves]), ([v for _, v in leaves], after)

        (_, (leaves, after)), (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return leaves, g_params, g_x, after

    return step


@dataclasses.dataclass
class _Traced:
    """A layer's step, traced once: the one trace its program, its names and the uninitialized check read."""

    form: Form
    closed: Any  # the step as a ClosedJaxpr of the flat (params, rest, x)
    shapes: Any  # its output (leaves, parameter gradients, input gradient, state after) as ShapeDtypeStructs
    names: list[str]  # the compared output leaves


def _traced_step(what: str, form: Form, x: jax.Array, output: Any) -> _Traced:
    names: list[str] = []
    try:
        with user_code("check_layer", what, passthrough=(NoOutput, Grown)):
            closed, shapes = jax.make_jaxpr(_step(form, output, names), return_shape=True)(form.params, form.rest, x)
    except NoOutput as e:
        raise ValueError(f"check_layer: {what}'s {e}") from None
    return _Traced(form, closed, shapes, names)


def trace_step(what: str, layer: Any, x: jax.Array, call: Any, output: Any, like: Any = None) -> _Traced:
    """``layer`` as pure functions, its step traced: once, and for a lazy NNX module once more, on a copy after
    its first call (the first trace is what finds it lazy: nothing traces the layer only to ask). ``like``: the
    layer a twin is checked against (a Keras twin's variables take its names)."""
    form = traceable(what, lambda: form_of(layer, x, call, warm=False, like=like))
    try:
        return _traced_step(what, form, x, output)
    except Grown:
        form = traceable(what, lambda: form_of(layer, x, call, warm=True))
        return _traced_step(what, form, x, output)


def retrace_step(what: str, traced: _Traced, x: jax.Array, output: Any) -> _Traced:
    """The traced step's layer traced again on an ``x`` of another shape (the edges' slice of x's token rows)."""
    return _traced_step(what, traced.form, x, output)


def _program(traced: _Traced, output: Any, flat: list[Any], walks: Sequence[tuple[Prepared, list[int]]] = ()
             ) -> Any:
    """The traced step compiled for the flat arguments ``flat`` (``jax.jit``, ahead of time).

    Compiled from the one trace, and run by both calls of a layer whatever
    sharding the state its first call left comes with (plain ``jax.jit``
    would compile the step again for it). A compiled program is reused only
    for an equal form, an equal traced program and the same placement of the
    arguments: code changed between two checks (a monkeypatched helper, a
    rebuilt module) is never served the program of the old code.

    ``walks``: coverage's walks with values, each with where its inputs are among ``flat`` (past its end: one
    more argument). The one program also runs each and returns its outputs after the step's, so the
    quantizer evidence of the declared check costs no compile of its own; where the walk repeats the
    step's forward pass on the same arguments, XLA computes it once.
    """
    key = _program_key(traced, output, flat, walks)
    if key is not None and key in _PROGRAMS:
        for w, at in walks:  # the walks' records come from their trace: traced again, compiled never
            jax.eval_shape(w.evaluate, [flat[i] for i in at])
        return _PROGRAMS[key]
    # Every argument kept, used or not (stored codes a walk reads only on the host): a rerun places its arguments
    # by the compiled program's input shardings, one per argument.
    program = jax.jit(_walked_step(traced, walks), keep_unused=True).lower(*flat).compile()
    return _kept(key, program)


def _kept(key: Any, program: Any) -> Any:
    if key is not None:
        _PROGRAMS[key] = program
        while len(_PROGRAMS) > 64:
            _PROGRAMS.popitem(last=False)
    return program


def _walked_step(traced: _Traced, walks: Sequence[tuple[Prepared, list[int]]]) -> Callable[..., Any]:
    """The traced step of the flat arguments, then each walk's outputs on its own of them (none: the step's alone)."""
    run = jcore.jaxpr_as_fun(traced.closed)
    n = len(traced.closed.in_avals)

    def step(*leaves: Any) -> Any:  # the name JAX's compile log shows
        out = run(*leaves[:n])
        return (out, [w.evaluate([leaves[i] for i in at]) for w, at in walks]) if walks else out

    return step


def _program_key(traced: _Traced, output: Any, flat: list[Any], walks: Sequence[tuple[Prepared, list[int]]]
                 ) -> Any:
    """What a compiled program of the traced step and ``walks`` is kept under (None: not kept)."""
    # output=None (every leaf) is a key like any other: hashable's None means "not hashable" only for a form's key.
    key = hashable((traced.form.key, output)) if traced.form.key is not None else None
    if key is not None:  # what jax.jit's own cache would hold apart besides the program: placement, matmul precision
        key = hashable((key, fingerprint(traced.closed), tuple(getattr(v, "sharding", None) for v in flat),
                         jax.config.jax_default_matmul_precision))
    if key is not None and walks:
        walk_keys = tuple((w.key(), tuple(at)) for w, at in walks)
        key = hashable((key, walk_keys)) if all(k is not None for k, _ in walk_keys) else None
    return key


def _fits(traced: _Traced, program: Any, flat: list[Any], extra: Sequence[Any] = ()) -> list[Any] | None:
    """``flat`` placed as ``program`` takes its arguments, then ``extra`` as they were; None where their types
    are not the traced step's."""
    avals = traced.closed.in_avals
    if len(flat) != len(avals) or any((tuple(np.shape(v)), jnp.result_type(v)) != (tuple(a.shape), a.dtype)
                                      for v, a in zip(flat, avals)):
        return None
    shardings = jax.tree.leaves(program.input_shardings[0])
    if len(shardings) != len(flat) + len(extra):
        return None
    # A state the step constrained (MaxText's NamedSharding) is moved only where it differs in fact.
    return [jax.device_put(v, s) if isinstance(v, jax.Array) and v.committed
            and not v.sharding.is_equivalent_to(s, v.ndim) else v for v, s in zip(flat, shardings)] + list(extra)


def _count(v: jax.Array) -> jax.Array:
    """:func:`qcheck.checks._tracks.count_nonfinite` inside a program."""
    if not jnp.issubdtype(v.dtype, jnp.inexact):
        return jnp.zeros((), jnp.int32)
    return jnp.sum(~jnp.isfinite(v), dtype=jnp.int32)


@dataclasses.dataclass
class Outcome:
    """What a run left that the edges read: its output leaves by name, each gradient's count of values not finite
    and its size (a parameter's by path, the input's under INPUT_GRAD), and the state after."""

    out: dict[str, Any]
    nonfinite: dict[str, tuple[int, int]]
    after: Any


@dataclasses.dataclass
class Run:
    out: dict[str, np.ndarray]  # output leaf name -> value
    grads: dict[str, np.ndarray]  # parameter path -> gradient; INPUT_GRAD -> the input's
    params: dict[str, np.ndarray]
    traced: _Traced | None = None  # the step: the uninitialized check reads its traced program
    # The same program on another x of x's shape, from the same state (no compile): ((output leaves, parameter
    # gradients, input gradient, state after), each walk's outputs).
    rerun: Callable[[jax.Array], Any] | None = None
    after: Any = None  # the state the first call left
    walked: list = dataclasses.field(default_factory=list)  # each walk's outputs on x
    # A second call on x, from the state the first left: its output leaves (the determinism check's, run when
    # it asks, on this run or the edges' slice's).
    second: Callable[[], dict[str, np.ndarray]] | None = None
    # The edges' program on a slice (run_lean) keeps no gradient: each one's count of values not finite, and size.
    nonfinite: dict[str, tuple[int, int]] | None = None
    # run_lean's walk outputs that do not read x, computed once and handed to each run's walk (None: let go).
    fixed: list | None = None

    def outcome(self) -> Outcome:
        """This run as an edge run reads it."""
        nonfinite = self.nonfinite if self.nonfinite is not None else {
            path: (count_nonfinite(g), int(np.size(g))) for path, g in self.grads.items()}
        return Outcome(self.out, nonfinite, self.after)


def valued(what: str, traced: _Traced, args: Any) -> list[Any]:
    """The leaves of ``args`` (the step's ``(params, rest, x)``) as the compiled step takes them: an abstract leaf
    (a ``jax.ShapeDtypeStruct``, no value: EasyDeL 0.3.0's quantized linears keep the Rngs of the ``nnx.eval_shape``
    that built them) traces as an input but cannot be passed to a program. Where the step reads it nowhere (passed
    through to the state after at most), zeros of its shape and type stand for it and change nothing; a leaf the
    step reads has no value to read, a one-line error naming it."""
    pairs = jax.tree_util.tree_flatten_with_path(args)[0]
    if not any(isinstance(v, jax.ShapeDtypeStruct) for _, v in pairs):
        return [v for _, v in pairs]
    jaxpr = traced.closed.jaxpr
    read = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jcore.Var)}
    leaves = []
    for (path, v), var in zip(pairs, jaxpr.invars, strict=True):
        if isinstance(v, jax.ShapeDtypeStruct):
            if var in read:
                raise ValueError(f"check_layer: {what}'s state {path_name(path[1:])} is abstract (a "
                                 f"jax.ShapeDtypeStruct{v.shape} {v.dtype}, no value) and the layer's call reads it")
        leaves.append(_zeros(v))
    return leaves


def _zeros(v: Any) -> Any:
    return jnp.zeros(v.shape, v.dtype) if isinstance(v, jax.ShapeDtypeStruct) else v


def _placed(walks: Sequence[Prepared], flat: list[Any], x_at: int) -> tuple[list[tuple[Prepared, list[int]]], list]:
    """Where each walk's inputs are among the step's ``flat`` arguments (the same arrays: the same inputs), and
    the ones that are not, as more arguments. A walk must read x where the step does: the edge rows replace it."""
    at = {id(v): i for i, v in enumerate(flat)}
    extra: list[Any] = []
    placed = []
    for w in walks:
        where = []
        for leaf in w.leaves:
            if id(leaf) not in at:
                at[id(leaf)] = len(flat) + len(extra)
                extra.append(leaf)
            where.append(at[id(leaf)])
        if x_at not in where:
            raise RuntimeError("check_layer: qcheck's coverage walk does not read the layer's x (a bug of qcheck)")
        placed.append((w, where))
    return placed, extra


def run_step(what: str, traced: _Traced, x: jax.Array, output: Any, *, walks: Sequence[Prepared] = ()) -> Run:
    form, names = traced.form, traced.names
    leaves, tree = jax.tree.flatten((form.params, form.rest, x))
    placed, extra = _placed(walks, leaves, len(leaves) - 1)  # the walks read the same leaves, abstract ones too
    flat, extra = valued(what, traced, (form.params, form.rest, x)), [_zeros(v) for v in extra]
    out_tree = jax.tree.structure(traced.shapes)

    def split(result: Any) -> tuple[Any, list]:
        return (result if not walks else result[0]), (result[1] if walks else [])

    with user_code("check_layer", what):
        program = _program(traced, output, flat + extra, placed)
        result, walked = split(program(*flat, *extra))
        leaves, g_params, g_x, after = jax.tree.unflatten(out_tree, result)

    def second() -> dict[str, np.ndarray]:
        return _again(what, traced, program, lambda r: jax.tree.unflatten(out_tree, split(r)[0])[0], tree, after,
                      x, extra, output)
    grads = {p: np.asarray(v) for p, v in form.param_leaves(g_params).items()}
    grads[INPUT_GRAD] = np.asarray(g_x)
    params = {p: np.asarray(v) for p, v in form.param_leaves(form.params).items()}

    def rerun(x_other: jax.Array) -> tuple[Outcome, list]:
        flat_other = _fits(traced, program, valued(what, traced, (form.params, form.rest, x_other)), extra)
        with user_code("check_layer", what):
            result, walked_other = split(program(*flat_other))
        o, g_o, gx_o, after_o = jax.tree.unflatten(out_tree, result)
        nonfinite = {p: (count_nonfinite(v), int(np.size(v)))
                     for p, v in {**form.param_leaves(g_o), INPUT_GRAD: gx_o}.items()}
        return Outcome(dict(zip(names, o)), nonfinite, after_o), walked_other

    return Run(dict(zip(names, map(np.asarray, leaves))), grads, params, traced, rerun, after, walked, second)


def _again(what: str, traced: _Traced, program: Any, leaves_of: Callable[[Any], Any], tree: Any, after: Any,
           x: jax.Array, extra: list, output: Any) -> dict[str, np.ndarray]:
    """A second call on x by ``program``, from the state ``after`` the first left: its output leaves by name
    (``leaves_of``: the program's result's)."""
    form = traced.form
    flat_again, tree_again = jax.tree.flatten((form.params, after, x))
    fitted = _fits(traced, program, flat_again, extra) if tree_again == tree else None
    with user_code("check_layer", what):
        # A state of another structure or type than the one the step was traced with: its own program.
        again = (leaves_of(program(*fitted)) if fitted is not None
                 else jax.jit(_step(form, output, []))(form.params, after, x)[0])
    return dict(zip(traced.names, map(np.asarray, again)))


@dataclasses.dataclass
class _Lean:
    """The edges' program on a slice of x: the step's output leaves, each gradient's count of values not finite
    in its place, the state after, and of the walks' outputs only those that read x. A run on an edge row
    changes nothing else of them, and each was weight-sized (every quantizer's input, codes and divisor; every
    parameter's gradient): at emb 1024 a run of the whole took 1.1 s, and each was hashed and judged again.
    The walks' outputs that do not read x (the weights' quantizers: parameters and state alone) come from a
    program pruned to them (``fixed``: the equations that neither read x nor have an effect, so a
    layer's callbacks do not run once more for it), run once, and every run's walk is handed those same values."""

    program: Any
    fixed: Callable[..., list] | None  # None: every walk output reads x
    walk_tree: Any
    reads_x: list[bool]  # each walk output leaf
    sizes: dict[str, int]  # each gradient's, in the order the program's counts come (the parameters', then x's)

    def walked(self, kept: Sequence[Any], fixed: list | None) -> list | None:
        """The walks' outputs of a run (``kept``: its own), None where the fixed ones were let go."""
        if fixed is None:
            return None
        own, once = iter(kept), iter(fixed)
        return jax.tree.unflatten(self.walk_tree, [next(own) if r else next(once) for r in self.reads_x])

    def nonfinite(self, counts: Sequence[Any]) -> dict[str, tuple[int, int]]:
        return {p: (int(n), size) for (p, size), n in zip(self.sizes.items(), jax.device_get(list(counts)),
                                                          strict=True)}


def _reads(jaxpr: Any, at: int) -> tuple[list[bool], list]:
    """Which outputs of ``jaxpr`` read its input ``at``, and the equations that do not. An equation that reads it
    in any input passes it to all its outputs (a call, a loop or a kernel read whole: never too few). One with an
    effect (a callback, a print) counts as reading it: it runs where the layer's call runs, on each x, never once
    more for the outputs that do not read x."""
    reading, once = {jaxpr.invars[at]}, []
    for e in jaxpr.eqns:
        if e.effects or any(isinstance(v, jcore.Var) and v in reading for v in e.invars):
            reading.update(e.outvars)
        else:
            once.append(e)
    return [isinstance(v, jcore.Var) and v in reading for v in jaxpr.outvars], once


def _pruned(closed: Any, outs: list[bool], eqns: list) -> Callable[..., list]:
    """``closed`` as a function of its inputs that computes only the outputs ``outs`` marks, by ``eqns`` alone."""
    jaxpr = closed.jaxpr
    kept = [v for v, o in zip(jaxpr.outvars, outs) if o]
    debug = debug_info_type()("qcheck.check_layer", "the weights' walk outputs",
                              tuple(f"in{i}" for i in range(len(jaxpr.invars))),
                              tuple(f"out{i}" for i in range(len(kept))))
    return jcore.jaxpr_as_fun(jcore.ClosedJaxpr(
        jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, kept, eqns, frozenset(), debug), closed.consts))


def _lean_program(traced: _Traced, output: Any, flat: list[Any], walks: Sequence[tuple[Prepared, list[int]]]
                  ) -> _Lean:
    """The edges' :class:`_Lean` program of the traced step and ``walks``, compiled for ``flat`` (kept as
    :func:`_program`'s are)."""
    key = _program_key(traced, output, flat, walks)
    key = hashable(("lean", key)) if key is not None else None
    if key is not None and key in _PROGRAMS:
        for w, at in walks:  # the walks' records come from their trace: traced again, compiled never
            jax.eval_shape(w.evaluate, [flat[i] for i in at])
        return _PROGRAMS[key]
    form = traced.form
    step = _walked_step(traced, walks)
    closed, (step_shapes, walk_shapes) = jax.make_jaxpr(
        step if walks else lambda *leaves: (step(*leaves), []), return_shape=True)(*flat)
    step_tree, n = jax.tree.structure(traced.shapes), len(step_shapes)  # the traced step's outputs come flat
    reads, once = _reads(closed.jaxpr, len(traced.closed.in_avals) - 1)
    reads_x = reads[n:]
    run, sizes = jcore.jaxpr_as_fun(closed), {}

    def lean(*leaves: Any) -> Any:
        outs = run(*leaves)
        out, g_params, g_x, after = jax.tree.unflatten(step_tree, outs[:n])
        grads = {**form.param_leaves(g_params), INPUT_GRAD: g_x}
        sizes.update({p: int(np.size(v)) for p, v in grads.items()})
        # A list, not a dict: a program's dict output comes back in its keys' sorted order.
        return out, [_count(v) for v in grads.values()], after, [v for v, r in zip(outs[n:], reads_x) if r]

    # The walk outputs that do not read x, by the equations that neither read x nor have an effect.
    fixed = _pruned(closed, [False] * n + [not r for r in reads_x], once)
    program = jax.jit(lean, keep_unused=True).lower(*flat).compile()
    return _kept(key, _Lean(program, None if all(reads_x) else jax.jit(fixed), jax.tree.structure(walk_shapes),
                            reads_x, sizes))


def run_lean(what: str, traced: _Traced, x: jax.Array, output: Any, *, walks: Sequence[Prepared] = ()) -> Run:
    """:func:`run_step` by the edges' :class:`_Lean` program (the edges' slice of x): its Run keeps no gradient
    (``nonfinite`` in their place), and its walks' outputs that do not read x are computed once (``fixed``)."""
    form, names = traced.form, traced.names
    leaves, tree = jax.tree.flatten((form.params, form.rest, x))
    placed, extra = _placed(walks, leaves, len(leaves) - 1)
    flat, extra = valued(what, traced, (form.params, form.rest, x)), [_zeros(v) for v in extra]
    with user_code("check_layer", what):
        lean = _lean_program(traced, output, flat + extra, placed)
        out, counts, after, kept = lean.program(*flat, *extra)
        # numpy once: the judge knows the same arrays again by identity, unhashed (_declaration._digest).
        fixed = [np.asarray(v) for v in lean.fixed(*flat, *extra)] if lean.fixed is not None else []
    run = Run(dict(zip(names, map(np.asarray, out))), {}, {}, traced, after=after, nonfinite=lean.nonfinite(counts),
              fixed=fixed)
    run.walked = lean.walked(kept, fixed)

    def rerun(x_other: jax.Array) -> tuple[Outcome, list | None]:
        flat_other = _fits(traced, lean.program, valued(what, traced, (form.params, form.rest, x_other)), extra)
        with user_code("check_layer", what):
            o, c, a, k = lean.program(*flat_other)
        return Outcome(dict(zip(names, o)), lean.nonfinite(c), a), lean.walked(k, run.fixed)

    run.rerun = rerun
    run.second = lambda: _again(what, traced, lean.program, lambda r: r[0], tree, after, x, extra, output)
    return run
