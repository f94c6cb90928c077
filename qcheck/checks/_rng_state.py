"""RNG state a step carries, across layer counts: flat, or a stream per layer.

A bridge that gives every wrapped quantizer its own forked RNG stream (MaxText
#5160; MaxText 0.2.5's ``fp8_gpu`` path wraps each Flax fp8 op in a ``ToNNX``
holding ``parent_rngs.fork()``) costs nothing per call and everything per
layer: the compiled step of an unrolled model takes every fork's key and count
as parameters (1,351 u32 entry parameters against 7 on llama3-8b). Nothing
numerical shows it; counting shows it. The check lowers the user's own step at
several layer counts and counts what enters it: its u32 entry parameters (a
typed PRNG key lowers to u32, so keys count there) and the model's RNG state
leaves (``nnx.RngState``, a Linen ``rngs`` collection, key-typed and uint32
leaves of a plain pytree). A step needs only lowering, not XLA's compilation,
to show its parameters: JAX prunes the arguments a program does not read
when it lowers, as XLA's dump shows them.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen, nnx

from qcheck._errors import user_code
from qcheck.checks._assertion import assertion
from qcheck.checks._layer_forms import path_name
from qcheck.checks._programs import lowered_entry_params

#: The layer counts the check compiles the step at, unless told.
LAYERS = (1, 2, 8)

#: How many growing variables a failure lists (the rest are counted).
_SHOWN = 12


@dataclasses.dataclass(frozen=True)
class StepRngState:
    """What enters one step at one layer count: its entry parameters by element type, the model's RNG leaves."""

    entry_params: Mapping[str, int]  # {"f32": 40, "u32": 12, "total": 52}, as ``entry_params`` counts them
    rng_leaves: tuple[str, ...]  # the path of each RNG state leaf of the model ("decoder/layers_0/rngs/key")
    #: An NNX model's RNG leaves as a pytree flattens it (``jax.jit`` over the module): one per reference,
    #: so a stream every layer shares is there once per layer.
    rng_references: tuple[str, ...] = ()

    @property
    def u32(self) -> int:
        """u32 entry parameters, typed PRNG keys among them."""
        return self.entry_params.get("u32", 0)


@dataclasses.dataclass(frozen=True)
class RngStateFigures:
    """What :func:`assert_rng_state_flat` measured on a step whose RNG state stayed flat.

    ``u32``: the step's u32 entry parameters (typed PRNG keys among them) at every
    layer count; ``rng_leaves``: the model's RNG state leaves at every layer count;
    ``entry_params``: per layer count, every entry parameter of the step by element
    type (``{"f32": 40, "u32": 6, "total": 46}``): the parameters do grow.
    """

    u32: int
    rng_leaves: int
    entry_params: Mapping[int, Mapping[str, int]]


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_sig(leaf: Any) -> tuple[tuple[int, ...], str]:
    return tuple(np.shape(leaf)), str(leaf.dtype)


def _references(model: Any) -> tuple[str, ...]:
    """An NNX module's RNG leaves by the paths a pytree flattening gives them: a shared one at each reference."""
    if not isinstance(model, nnx.Module):
        return ()
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    return tuple(path_name(p) for p, v in flat if isinstance(v, nnx.RngState) or _is_key(v))


def _flat(model: Any) -> list[tuple[str, Any, bool]]:
    """``[(path, leaf, is_rng)]`` of the model's state: an NNX module, a Linen (module, variables), a pytree."""
    if isinstance(model, nnx.Module):
        return [(path_name(p), v[...], isinstance(v, nnx.RngState) or _is_key(v[...]))
                       for p, v in nnx.to_flat_state(nnx.state(model))]
    flat = jax.tree_util.tree_flatten_with_path(model[1] if _is_linen_pair(model) else model)[0]
    rows = []
    for p, leaf in flat:
        name = path_name(p)
        in_rngs = bool(p) and getattr(p[0], "key", None) == "rngs"
        rows.append((name, leaf, in_rngs or _is_key(leaf) or getattr(leaf, "dtype", None) == np.uint32))
    return rows


def _is_linen_pair(model: Any) -> bool:
    return (isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], linen.Module)
            and isinstance(model[1], Mapping))


def _step_args(model: Any) -> tuple[Any, ...]:
    """What the step takes before the user's inputs: the module, a Linen module and its variables, the pytree."""
    return tuple(model) if _is_linen_pair(model) else (model,)


def _lower_step(step: Callable[..., Any], *args: Any) -> jax.stages.Lowered:
    """``step`` lowered as its user jits it (``jax.jit``, ``nnx.jit``: its own ``lower``), else under ``jax.jit``."""
    lowered = step.lower(*args) if callable(getattr(step, "lower", None)) else jax.jit(step).lower(*args)
    if not isinstance(lowered, jax.stages.Lowered):
        lowered = getattr(lowered, "lowered", lowered)  # nnx.jit's Lowered holds JAX's
    if not isinstance(lowered, jax.stages.Lowered):
        raise TypeError(f"step: its lower(...) gave a {type(lowered).__name__}, not a jax.stages.Lowered")
    return lowered


def step_rng_state(lowered: jax.stages.Lowered, model: Any) -> StepRngState:
    """The RNG state entering ``lowered``, a step of ``model`` (what :func:`judge_rng_state_flat` compares)."""
    return _counted(lowered, model, _flat(model))


def _counted(lowered: jax.stages.Lowered, model: Any, rows: list[tuple[str, Any, bool]]) -> StepRngState:
    return StepRngState(lowered_entry_params(lowered), tuple(path for path, _, rng in rows if rng),
                        _references(model))


def _returns_state(lowered: jax.stages.Lowered, rows: list[tuple[str, Any, bool]], n: int) -> None:
    """Refuse a step whose outputs do not hold the model's RNG state (or, with none, any of its state).

    JAX prunes what a program does not read, so a step that drops the state
    would count only the streams it draws from, not what a training loop
    threads from one step to the next.
    """
    rng = [r for r in rows if r[2]]
    needed = rng or rows
    out = collections.Counter(_leaf_sig(s) for s in jax.tree_util.tree_leaves(lowered.out_info))
    held = collections.Counter(_leaf_sig(leaf) for _, leaf, _ in needed)
    missing = held - out
    # Every RNG leaf comes back; a model without any returns at least some of its state.
    if missing if rng else (held and missing == held):
        what = "RNG state leaves" if rng else "state leaves"
        lost = [path for path, leaf, _ in needed if missing[_leaf_sig(leaf)]]
        raise ValueError(
            f"step: returns no state: its outputs hold {sum(held.values()) - sum(missing.values())} of the "
            f"{len(needed)} {what} of build({n})'s model ({lost[0] if lost else 'every one'} is not among them); a "
            "step takes the "
            "state and returns it updated, as a training loop threads it, and JAX drops from a program "
            "what it does not return or read")


def _signature(rows: list[tuple[str, Any, bool]]) -> tuple:
    return tuple(sorted((path, *_leaf_sig(leaf)) for path, leaf, _ in rows))


def _pattern(path: str) -> str:
    """``path`` with each layer's number starred: a segment that is a number, or a name's ``_<number>`` suffix
    (``layers_3``, ``wi_0``); digits inside a name (``fp8``, ``dot_general0``) stay."""
    return "/".join(re.sub(r"^\d+$|(?<=_)\d+$", "*", part) for part in path.split("/"))


def _holder(path: str) -> tuple[str, str]:
    """``(holder, stream)``: an ``nnx.Rngs``'s leaf ``.../rngs/<stream>/key`` (or ``count``) is its holder's and
    stream's; any other RNG leaf is its own."""
    parts = path.split("/")
    if len(parts) > 2 and parts[-1] in ("key", "count"):
        return "/".join(parts[:-2]), parts[-2]
    return path, ""


def _growing(paths: Mapping[int, tuple[str, ...]]) -> list[str]:
    """One line per holder of RNG state whose leaves change in number with the layers: its path (``*`` for a
    layer's number), its streams, its leaves per layer count, and one of its paths at the most layers."""
    counts: dict[int, collections.Counter] = {}
    streams: dict[str, set[str]] = collections.defaultdict(set)
    examples: dict[str, str] = {}
    for n in sorted(paths):
        counts[n] = collections.Counter()
        for leaf in paths[n]:
            holder, stream = _holder(leaf)
            counts[n][_pattern(holder)] += 1
            streams[_pattern(holder)].add(stream)
            examples[_pattern(holder)] = holder  # the last one at the most layers: the deepest layer's
    lines = []
    for p in sorted(streams):
        per = {n: counts[n][p] for n in sorted(counts)}
        if len(set(per.values())) > 1:
            named = ", ".join(sorted(streams[p] - {""}))
            lines.append(f"{p}{f' ({named})' if named else ''}: {per}"
                         + (f" (e.g. {examples[p]})" if examples[p] != p else ""))
    return lines


def _listed(lines: list[str]) -> str:
    more = f"\n  ... and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
    return "\n  " + "\n  ".join(lines[:_SHOWN]) + more


def _what_grows(by_layers: Mapping[int, StepRngState]) -> str:
    growing = _growing({n: s.rng_leaves for n, s in by_layers.items()})
    if growing:
        return ("; the RNG variables that change (a stream per wrapper per layer?), by module path (* a layer's "
                "number), their streams and leaves per layer count:" + _listed(growing))
    shared = _growing({n: s.rng_references for n, s in by_layers.items()})
    if shared:
        # NNX stores a variable once however many modules hold it; a pytree flattens it at every reference.
        return ("; the model's RNG variables do not change, their references do: the step takes the module as a "
                "pytree (jax.jit), which passes a shared variable once per reference (nnx.jit, or nnx.split "
                "outside the jit, passes it once); by module path (* a layer's number), streams and references per "
                "layer count:"
                + _listed(shared))
    return "; no RNG variable of the model changes: what grows enters the step beside the model"


def judge_rng_state_flat(by_layers: Mapping[int, StepRngState]) -> RngStateFigures:
    """The step's u32 entry parameters and the model's RNG state leaves are the same at every layer count."""
    __tracebackhide__ = True
    layers = sorted(by_layers)
    u32 = {n: by_layers[n].u32 for n in layers}
    leaves = {n: len(by_layers[n].rng_leaves) for n in layers}
    if len(set(u32.values())) > 1 or len(set(leaves.values())) > 1:
        grows = u32[layers[-1]] > u32[layers[0]] or leaves[layers[-1]] > leaves[layers[0]]
        raise AssertionError(
            f"RNG state {'grows with' if grows else 'changes with'} the layers: u32 entry parameters of the step "
            f"by layer count {u32}, RNG state leaves {leaves}"
            + _what_grows(by_layers))
    return RngStateFigures(u32[layers[0]], leaves[layers[0]],
                           {n: dict(by_layers[n].entry_params) for n in layers})


def _layers(layers: Any) -> tuple[int, ...]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"layers: a sequence of layer counts, e.g. (1, 2, 8), not a {type(layers).__name__}")
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in layers):
        raise ValueError(f"layers: layer counts are positive integers, got {tuple(layers)}")
    counts = tuple(sorted({int(n) for n in layers}))
    if len(counts) < 2:
        raise ValueError(f"layers: growth needs at least two layer counts, got {tuple(layers)}")
    return counts


@assertion
def assert_rng_state_flat(build: Callable[[int], Any], step: Callable[..., Any], *args: Any,
                          layers: Sequence[int] = LAYERS, label: str = "") -> RngStateFigures:
    """The RNG state entering ``step`` is the same at every layer count: no stream per layer.

    ``build(n)``: the model at ``n`` layers: an NNX module, a Linen module with
    its variables ``(module, variables)``, or a pytree of arrays (a model of plain
    functions). ``step``: the user's forward or train step, state in and state out,
    jitted as they run it (``jax.jit``, ``nnx.jit``; a plain function is put under
    ``jax.jit``), called ``step(model, *args)`` (a Linen model:
    ``step(module, variables, *args)``, the module static). At each of ``layers``
    the step is lowered and its u32 entry parameters (typed keys lower to u32) and
    the model's RNG state leaves counted; either changing with the layers fails,
    naming the counts and the RNG variables that change with their paths. Returns
    :class:`RngStateFigures`.

    Refuses (``ValueError``) fewer than two layer counts, a ``build`` whose model
    does not grow with ``n``, and a step that returns no state (JAX drops what a
    program does not read: the count would see only the streams drawn from).
    """
    __tracebackhide__ = True
    counts = _layers(layers)
    if isinstance(build, (nnx.Module, linen.Module)) or not callable(build):  # a module is callable, of x
        raise TypeError(f"build: a function of the layer count that builds the model, not a {type(build).__name__}")
    if not callable(step):
        raise TypeError(f"step: the step the model runs in, a function, not a {type(step).__name__}")
    by_layers, signatures = {}, {}
    for n in counts:
        with user_code("assert_rng_state_flat", "build"):
            model = build(n)
        rows = _flat(model)
        signatures[n] = _signature(rows)
        if signatures[n] == signatures[counts[0]] and n != counts[0]:
            raise ValueError(f"build: the model did not grow: build({counts[0]}) and build({n}) give the same "
                             f"{len(rows)} state leaves of the same shapes; build(n) builds the model at n layers")
        with user_code("assert_rng_state_flat", "step"):
            lowered = _lower_step(step, *_step_args(model), *args)
        _returns_state(lowered, rows, n)
        by_layers[n] = _counted(lowered, model, rows)
        del model, lowered
    return judge_rng_state_flat(by_layers)
