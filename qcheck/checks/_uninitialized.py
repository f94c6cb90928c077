"""Reads of memory a program never wrote: each buffer whose contents JAX leaves unspecified, filled twice.

``jax.lax.empty`` binds the ``empty`` primitive (jax 0.10 to 0.12), and from
jax 0.11 ``jnp.empty``, ``jnp.empty_like`` and ``jnp.pad(mode="empty")`` bind
it too (in 0.10 they are zeros). On CPU it lowers to zeros; on GPU and TPU to
XLA's ``AllocateBuffer``, whose contents are whatever the memory held. Code
that leaves part of such a buffer unwritten and reads it (maxtext#4905: an
``unpermute`` that copies its rows into one and leaves the last rows unwritten)
passes every test on CPU and computes garbage on an accelerator; a comparison
with an unquantized twin cannot see it when both run that code.

The check traces the program to a jaxpr, rebuilds it with every ``empty`` eqn
(at any depth: pjit, custom_jvp/vjp, scan, while, cond, shard_map, remat)
replaced by a filled buffer, runs it with NaN and with a large finite value,
and compares each output bitwise with the normal run. Nothing of JAX is
patched. A program without such a buffer is not run again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from qcheck._coverage import machinery_prefixes, user_frames
from qcheck._errors import user_code
from qcheck.checks._assertion import assertion
from qcheck.checks._figures import Figures

#: The primitives whose result JAX leaves unspecified, and the call a message names for each.
UNSPECIFIED: dict[str, str] = {"empty": "jax.lax.empty"}

#: The two fills, by what a message calls them.
_FILLS = ("NaN", "a large finite value")

_CPU_VS_ACCELERATOR = "on CPU it reads as zeros, on GPU and TPU as whatever the memory held"


@dataclasses.dataclass(frozen=True)
class UnspecifiedBuffer:
    """One source line that creates buffers of unspecified contents (every eqn traced from it)."""

    op: str  # the call, "jax.lax.empty"
    location: str  # the user's "file.py:31", past the machinery's frames
    function: str
    avals: tuple[str, ...]  # "float32[4, 3]", one per distinct buffer
    eqns: frozenset[int] = dataclasses.field(repr=False, compare=False)  # id() of each eqn

    def describe(self) -> str:
        named = f" ({self.function})" if self.function else ""
        return f"{self.op} {', '.join(self.avals)} at {self.location}{named}"


# -- finding them -----------------------------------------------------------------


def _sub_jaxprs(params: dict) -> list[jcore.Jaxpr]:
    found = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jcore.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, jcore.Jaxpr):
                found.append(v)
    return found


def _aval(eqn: jcore.JaxprEqn) -> str:
    aval = eqn.outvars[0].aval
    extended = jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
    return f"{aval.dtype if extended else np.dtype(aval.dtype).name}{list(aval.shape)}"


def unspecified_buffers(jaxpr: jcore.Jaxpr | jcore.ClosedJaxpr, machinery: Collection[str] = ()
                        ) -> list[UnspecifiedBuffer]:
    """Every eqn of ``jaxpr``, at any depth, whose result JAX leaves unspecified, grouped by the user's line."""
    prefixes: tuple[str, ...] | None = None
    groups: dict[tuple[str, str, str], tuple[list[str], set[int]]] = {}
    seen: set[int] = set()

    def where(eqn: jcore.JaxprEqn, outer: tuple[jcore.JaxprEqn, ...]) -> tuple[str, str]:
        nonlocal prefixes
        prefixes = prefixes if prefixes is not None else machinery_prefixes(tuple(machinery))
        # A body traced apart from its caller (a custom_vjp's) may lack the caller's frames: the eqns around it.
        for e in (eqn, *reversed(outer)):
            if frames := user_frames(e, prefixes):
                return frames[0]
        return "a line JAX did not record", ""

    def walk(j: jcore.Jaxpr, outer: tuple[jcore.JaxprEqn, ...]) -> None:
        if id(j) in seen:  # one inner jaxpr may serve many calls
            return
        seen.add(id(j))
        for eqn in j.eqns:
            if eqn.primitive.name in UNSPECIFIED:  # source lines are read only here: the walk stays cheap
                location, function = where(eqn, outer)
                avals, ids = groups.setdefault((UNSPECIFIED[eqn.primitive.name], location, function), ([], set()))
                if _aval(eqn) not in avals:
                    avals.append(_aval(eqn))
                ids.add(id(eqn))
            for sub in _sub_jaxprs(eqn.params):
                walk(sub, (*outer, eqn))

    walk(jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr, ())
    return [UnspecifiedBuffer(op, location, function, tuple(avals), frozenset(ids))
            for (op, location, function), (avals, ids) in groups.items()]


# -- filling them ------------------------------------------------------------------


def _fill_value(dtype: np.dtype, fill: int) -> Any:
    """NaN (fill 0) or a large finite value (fill 1) of ``dtype``; integers their largest, then their most negative."""
    if dtype == np.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.max if fill == 0 or info.min == 0 else info.min
    info = jnp.finfo(dtype)
    if fill == 1:
        return info.max
    has_nan = bool(np.isnan(np.asarray(np.nan).astype(dtype)))
    return np.nan if has_nan else info.min  # float4_e2m1fn has no NaN: its most negative value instead


def _filled_eqns(eqn: jcore.JaxprEqn, fill: int) -> tuple[list[jcore.JaxprEqn], Any] | None:
    """Eqns that compute ``eqn``'s buffer filled, and the atom holding it; None for a type that cannot be filled."""
    aval = eqn.outvars[0].aval
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return None  # PRNG keys: no value to fill with
    dtype = np.dtype(aval.dtype)
    value = np.asarray(_fill_value(dtype, fill)).astype(dtype)
    # Traced afresh per eqn: its variables are new, so no two places of one program share them.
    closed = jax.make_jaxpr(lambda: jnp.full(aval.shape, value, dtype))()
    if closed.consts or closed.jaxpr.constvars:
        return None
    return list(closed.jaxpr.eqns), closed.jaxpr.outvars[0]


def _rewrite(jaxpr: jcore.Jaxpr, eqns: frozenset[int], fill: int, memo: dict[int, Any]) -> jcore.Jaxpr:
    if id(jaxpr) in memo:
        return memo[id(jaxpr)]
    new_eqns: list[jcore.JaxprEqn] = []
    subst: dict[Any, Any] = {}  # an empty eqn's result -> the atom now holding the filled buffer
    changed = False

    def atom(v: Any) -> Any:
        return subst.get(v, v) if not isinstance(v, jcore.Literal) else v

    for eqn in jaxpr.eqns:
        if id(eqn) in eqns and (replacement := _filled_eqns(eqn, fill)) is not None:
            body, out = replacement
            new_eqns += body
            subst[eqn.outvars[0]] = out
            changed = True
            continue
        params = _rewrite_params(eqn.params, eqns, fill, memo)
        invars = [atom(v) for v in eqn.invars]
        if params is not eqn.params or any(a is not b for a, b in zip(invars, eqn.invars)):
            eqn = eqn.replace(params=params, invars=invars)
            changed = True
        new_eqns.append(eqn)
    out = jaxpr.replace(eqns=new_eqns, outvars=[atom(v) for v in jaxpr.outvars]) if changed else jaxpr
    memo[id(jaxpr)] = out
    return out


def _rewrite_params(params: dict, eqns: frozenset[int], fill: int, memo: dict[int, Any]) -> dict:
    def one(v: Any) -> Any:
        if isinstance(v, jcore.ClosedJaxpr):
            inner = _rewrite(v.jaxpr, eqns, fill, memo)
            return v if inner is v.jaxpr else v.replace(jaxpr=inner)
        if isinstance(v, jcore.Jaxpr):
            return _rewrite(v, eqns, fill, memo)
        return v

    new = {}
    for k, value in params.items():
        if isinstance(value, (tuple, list)):
            items = [one(v) for v in value]
            new[k] = type(value)(items) if any(a is not b for a, b in zip(items, value)) else value
        else:
            new[k] = one(value)
    return params if all(new[k] is params[k] for k in params) else new


def _filled_program(closed: jcore.ClosedJaxpr, eqns: frozenset[int], fill: int) -> jcore.ClosedJaxpr:
    """``closed`` with the buffers of ``eqns`` filled: with NaN (``fill=0``) or a large finite value (1)."""
    return closed.replace(jaxpr=_rewrite(closed.jaxpr, eqns, fill, {}))


# -- comparing -----------------------------------------------------------------------


def _bits(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _differ(a: np.ndarray, b: np.ndarray) -> int:
    """How many elements of two arrays of one shape and type differ in their bits."""
    if a.size == 0:
        return 0
    bytes_a, bytes_b = (np.ascontiguousarray(x).reshape(x.size, 1).view(np.uint8) for x in (a, b))
    return int(np.count_nonzero(np.any(bytes_a != bytes_b, axis=1)))


def _evaluate(programs: Sequence[jcore.ClosedJaxpr], flat_args: Sequence[Any]) -> list[list[np.ndarray]]:
    """Each program's outputs on ``flat_args``, all compiled as one (one compile instead of one each)."""
    runs = [jcore.jaxpr_as_fun(p) for p in programs]

    def uninitialized_check(*args: Any) -> Any:  # the name JAX's compile log shows
        return [run(*args) for run in runs]

    return [[_bits(o) for o in outs] for outs in jax.jit(uninitialized_check)(*flat_args)]


def _changes(runs: Sequence[Sequence[np.ndarray]], base: Sequence[np.ndarray]) -> dict[int, list[int]]:
    """Per output that changed in any of ``runs`` (one per fill), how many of its values changed in each."""
    found = {i: [_differ(outs[i], b) for outs in runs] for i, b in enumerate(base)}
    return {i: counts for i, counts in found.items() if any(counts)}


def uninitialized_reads(closed: jcore.ClosedJaxpr, flat_args: Sequence[Any], names: Sequence[str],
                        buffers: Sequence[UnspecifiedBuffer]) -> str | None:
    """What of ``closed``'s outputs changes when the unspecified ``buffers`` are filled; None if nothing does.

    ``names``: what a message calls each output. The normal run and the two
    filled copies are one compiled program, so what does not depend on a
    buffer is computed once and cannot differ by compilation. Where a change
    is found and there is more than one buffer, each is filled alone to name
    the ones read.
    """
    if not buffers:
        return None
    fills = range(len(_FILLS))
    every = frozenset().union(*(b.eqns for b in buffers))
    programs = [_filled_program(closed, every, fill) for fill in fills]
    base, *runs = _evaluate([closed, *programs], flat_args)
    changed = _changes(runs, base)
    if not changed:
        return None
    read = list(buffers)
    if len(buffers) > 1:  # each filled alone, all in one more program
        alone = _evaluate([_filled_program(closed, b.eqns, fill) for b in buffers for fill in fills], flat_args)
        n = len(_FILLS)
        read = [b for j, b in enumerate(buffers) if _changes(alone[j * n:(j + 1) * n], base)] or read
    leaves = [f"{names[i]} in {' and '.join(map(str, counts))} of its {base[i].size} values"
              for i, counts in changed.items()]
    shown = ", ".join(leaves[:4]) + (f" and {len(leaves) - 4} more outputs" if len(leaves) > 4 else "")
    return (f"{names[next(iter(changed))]} reads memory the layer never wrote, the buffer of "
            f"{'; '.join(b.describe() for b in read)}: filled with {', then with '.join(_FILLS)}, it changes "
            f"{shown} ({_CPU_VS_ACCELERATOR})")


# -- the check --------------------------------------------------------------------


def _leaf_names(head: str, tree: Any) -> list[str]:
    return [f"{head}{jax.tree_util.keystr(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and jnp.issubdtype(x.dtype, jnp.floating)


class _Meaningless(ValueError):
    """Inputs that make the check meaningless, found while tracing ``fn``: not an error of ``fn``'s."""


def _program(fn: Callable[..., Any], args: tuple, grads: bool) -> tuple[Callable[..., Any], Any]:
    """``fn`` as a function of the flat ``args``, returning its output and (``grads``) its gradients."""
    flat, tree = jax.tree_util.tree_flatten(args)
    if not grads:
        return lambda *leaves: fn(*jax.tree_util.tree_unflatten(tree, leaves)), flat
    wrt = [i for i, v in enumerate(flat) if _is_float(v)]
    if not wrt:
        raise _Meaningless("grads=True, but no argument holds a floating-point array to differentiate with respect "
                           "to")

    def program(*leaves):
        def loss(diff):
            full = list(leaves)
            for i, v in zip(wrt, diff):
                full[i] = v
            out = fn(*jax.tree_util.tree_unflatten(tree, full))
            floats = [v for v in jax.tree_util.tree_leaves(out) if _is_float(v)]
            if not floats:
                raise _Meaningless("grads=True, but the output holds no floating-point array to differentiate")
            # A fixed scalar of every floating-point output, so each element sends back a gradient.
            return sum(jnp.mean(jnp.square(v.astype(jnp.float32))) for v in floats), out

        (_, out), g = jax.value_and_grad(loss, has_aux=True)([leaves[i] for i in wrt])
        full = [None] * len(leaves)
        for i, v in zip(wrt, g):
            full[i] = v
        return out, jax.tree_util.tree_unflatten(tree, full)

    return program, flat


def _user_code() -> contextlib.AbstractContextManager[None]:
    """An error of ``fn`` as one UserCodeError naming this check (the wrapper leaves its message alone)."""
    return user_code("assert_no_uninitialized_reads", "fn", passthrough=(_Meaningless,))


@assertion
def assert_no_uninitialized_reads(
    fn: Callable[..., Any],
    *args: Any,
    grads: bool = False,
    machinery: Collection[str] = (),
    label: str = "",
) -> Figures:
    """Assert that ``fn(*args)`` reads no memory it never wrote.

    ``fn`` is traced to a jaxpr; every buffer whose contents JAX leaves
    unspecified (``jax.lax.empty``; from jax 0.11 ``jnp.empty``,
    ``jnp.empty_like`` and ``jnp.pad(mode="empty")``, which bind it), inside
    jitted, custom-gradient, scan, while, cond and shard_map bodies alike, is
    filled with NaN and then with a large finite value (integers: their largest
    and their most negative value), and each output must keep every bit of the
    normal run. On CPU such a buffer reads as zeros, on GPU and TPU as whatever
    the memory held, so a read of its unwritten part passes every CPU test.

    ``grads``: also compare the gradients of the sum of ``mean(leaf ** 2)``
    over the floating-point outputs with respect to every floating-point array
    of ``args``. ``machinery``: more packages whose frames are not the line a
    message names (as :func:`qcheck.coverage`'s).

    Fails naming each output that changed, by how many values, and the call
    and source line of the buffer it read. Returns the number of such buffers
    found (0: nothing to fill, nothing run again), with figure ``buffers``.
    """
    __tracebackhide__ = True
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(machinery, str) or not all(isinstance(m, str) for m in machinery):
        raise ValueError(f"machinery must be a collection of package names, got {machinery!r}")
    program, flat = _program(fn, args, grads)
    with _user_code():
        closed, shape = jax.make_jaxpr(program, return_shape=True)(*flat)
    buffers = unspecified_buffers(closed, machinery)
    if not buffers:
        return Figures(0, buffers=0)
    names = (_leaf_names("output", shape) if not grads else
             _leaf_names("output", shape[0]) + [f"gradient of {n}" for n in _leaf_names("args", shape[1])])
    with _user_code():
        message = uninitialized_reads(closed, flat, names, buffers)
    if message is not None:
        raise AssertionError(message)
    return Figures(len(buffers), buffers=len(buffers))
