"""A layer as check_layer runs it: an NNX module, a Linen module with its variables, an Equinox module, a Keras
layer or model, or a function of x, each as pure functions of its parameters, the rest of its state and x; and
what of its output is compared."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx

from qcheck._coverage import after_first_call, graph_paths, unmarked, warmed_up
from qcheck._errors import user_code
from qcheck.libraries.equinox import equinox_of
from qcheck.libraries.haliax import named_array_type, overwritten_state_types
from qcheck.libraries.keras import keras_of


def path_name(path: tuple[Any, ...]) -> str:
    parts = []
    for k in path:
        k = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        parts.append(str(k))
    return "/".join(parts)


def _leaf_name(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path)


@dataclasses.dataclass
class Form:
    """A layer as ``apply(params, rest, x) -> (out, rest_after)`` with its parameters and other state."""

    kind: str
    params: Any
    rest: Any
    apply: Callable[[Any, Any, jax.Array], tuple[Any, Any]]
    key: Any  # what the compiled program is cached on (None: not hashable, no cache)
    probe: Any  # what coverage traces: an NNX module or a function of x
    #: The layer's variables that are state, not parameters, by the names its parameters have: where the other
    #: layer has a parameter of that name, it is frozen on this side (a Keras kernel quantize() stored as codes).
    state_names: frozenset[str] = frozenset()

    def state_leaves(self) -> dict[str, Any]:
        """The layer's state but its parameters by path, as its parameters are named (a stored kernel's codes)."""
        if self.kind == "nnx":  # state may hold more than arrays (MaxText keeps tuples): taken as it is
            return {path_name(p): v.get_value() for p, v in nnx.to_flat_state(self.rest)}
        if self.kind == "keras":
            return dict(self.rest)
        if self.kind == "linen":  # its frozen parameters named as parameters are, without their collection
            other = {k: v for k, v in self.rest.items() if k != "params"}
            return {path_name(p): v for tree in (other, self.rest.get("params")) if tree is not None
                    for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
        return {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(self.rest)[0]}

    def param_leaves(self, tree: Any) -> dict[str, Any]:
        if self.kind == "nnx":
            return {path_name(p): v[...] for p, v in nnx.to_flat_state(tree)}
        if self.kind == "equinox":
            return equinox_param_leaves(tree)
        return {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _is_linen_pair(layer: Any) -> bool:
    return (isinstance(layer, tuple) and len(layer) == 2 and isinstance(layer[0], linen.Module)
            and isinstance(layer[1], Mapping))


def equinox_split(eqx: Any, module: Any) -> tuple[Any, Any]:
    """An Equinox module as ``(parameters, the rest)``: its inexact-array leaves but haliax's quantization state
    and, beside a module's integer arrays (stored codes), the float ``scale`` and ``zero_point`` they are kept
    with: state, as :func:`_frozen_params` splits an NNX module's."""
    overwritten = overwritten_state_types()

    def is_leaf(v: Any) -> bool:
        return isinstance(v, overwritten)

    flat, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=is_leaf)
    stored = {p[:-1] for p, v in flat if eqx.is_array(v) and jnp.issubdtype(v.dtype, jnp.integer)}

    def trained(p: tuple[Any, ...], v: Any) -> bool:
        beside = p[:-1] in stored and getattr(p[-1], "name", None) in ("scale", "zero_point")
        return not is_leaf(v) and eqx.is_inexact_array(v) and not beside

    spec = jax.tree_util.tree_unflatten(treedef, [trained(p, v) for p, v in flat])
    return eqx.partition(module, spec, is_leaf=is_leaf)


def equinox_param_leaves(params: Any) -> dict[str, Any]:
    """The leaves of ``equinox_split``'s parameters by path; a NamedArray named as its field, not its ``.array``."""
    named = named_array_type()
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda v: isinstance(v, named))[0]
    leaves = ((p, v.array if isinstance(v, named) else v) for p, v in flat)
    return {path_name(p): v for p, v in leaves if v is not None}


def _call(module: Any, x: jax.Array) -> Any:
    return module(x)


class _Called(nnx.Module):
    """An NNX module called as ``call(module, x)``: what the warm-up and coverage call.

    The module sits under its class's name, so that coverage scopes read as a
    Linen module's and an Equinox module's do (``Block/proj``).
    """

    def __init__(self, module: nnx.Module, call: Callable[[Any, jax.Array], Any]):
        self.called = type(module).__name__ + ("_" if type(module).__name__ in ("called", "fn", "module") else "")
        self.fn = call
        setattr(self, self.called, module)

    @property
    def module(self) -> nnx.Module:
        return getattr(self, self.called)

    def __call__(self, x: jax.Array) -> Any:
        return self.fn(self.module, x)


class Grown(Exception):
    """Tracing an NNX module's step found that its call creates submodules or variables: it is lazy."""


def form_of(layer: Any, x: jax.Array, call: Callable[[Any, jax.Array], Any] | None = None,
          warm: bool | None = None, like: Any = None) -> Form:
    """``layer`` as pure functions; ``call(module, x)`` calls a module (NNX, Linen, Equinox, Keras), not a function
    of x.

    An NNX module whose first call creates submodules is taken as that call
    leaves it, on a copy. ``warm``: None asks whether it does by tracing one
    call (:func:`qcheck.warmed_up`); False takes the module as it is, and its
    ``apply`` raises ``Grown`` while being traced if the call builds
    something (the caller's own trace asks, and nothing is traced twice);
    True takes the copy after one call. ``like``: the layer a Keras twin is checked against, whose
    variables' names its own take (:func:`keras_names`).
    """
    if isinstance(layer, nnx.Module):
        probe = layer if call is None else _Called(layer, call)
        probe = warmed_up(probe, x) if warm is None else after_first_call(probe, x) if warm else probe
        module = probe if call is None else probe.module
        frozen = _frozen_params(module)
        trained = nnx.All(nnx.Param, lambda path, _: tuple(path) not in frozen) if frozen else nnx.Param
        graphdef, params, rest = nnx.split(module, trained, ...)
        fn = call or _call
        paths = graph_paths(module) if warm is False else None

        def apply(params, rest, x):
            m = nnx.merge(graphdef, params, rest, copy=True)
            out = fn(m, x)
            if paths is not None and graph_paths(m) != paths:
                raise Grown
            _, _, after = nnx.split(m, trained, ...)
            return out, after

        return Form("nnx", params, rest, apply, hashable(("nnx", graphdef, fn, frozenset(frozen))),
                     module if call is None else _Called(module, call), frozenset(map(path_name, frozen)))
    if _is_linen_pair(layer):
        module, variables = layer
        params, frozen = _linen_frozen(variables.get("params", {}))
        rest = {k: v for k, v in variables.items() if k != "params"}
        mutable = sorted(rest) or False
        if frozen is not None:  # stored codes and their scales: state, under "params" as the module reads them
            rest["params"] = frozen

        def apply(params, rest, x):
            kept = {k: v for k, v in rest.items() if k != "params"}
            whole = params if frozen is None else _combine(params, rest["params"])
            result = module.apply({"params": whole, **kept}, x, mutable=mutable, method=call)
            out, after = result if mutable else (result, {})
            return out, {**rest, **after}

        names = frozenset() if frozen is None else frozenset(
            path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(frozen)[0])
        return Form("linen", params, rest, apply, hashable(("linen", module, call, names)),
                     lambda x: apply(params, rest, x)[0], names)
    if (eqx := equinox_of(layer)) is not None:
        params, rest = equinox_split(eqx, layer)
        arrays, static = eqx.partition(rest, eqx.is_array)  # jit's arguments hold arrays only
        fn = call or _call

        def apply(params, arrays, x):
            return fn(eqx.combine(params, arrays, static), x), arrays

        key = ("equinox", jax.tree_util.tree_structure(static), tuple(jax.tree_util.tree_leaves(static)), fn)
        # Its integer arrays (stored codes) and the scales beside them are state: named, where the twin has a
        # float parameter there.
        codes = {path_name(p) for p, v in jax.tree_util.tree_flatten_with_path(arrays)[0]
                 if jnp.issubdtype(v.dtype, jnp.integer) or getattr(p[-1], "name", None) in ("scale", "zero_point")}
        return Form("equinox", params, arrays, apply, hashable(key), functools.partial(fn, layer), frozenset(codes))

    if (keras := keras_of(layer)) is not None:
        return _keras_form(keras, layer, call, like if keras_of(like) is not None else None)

    called = unmarked(layer)  # a partial binding qcheck.weights(...) marked arguments is called with their trees

    def apply_fn(params, rest, x):
        return called(x), rest

    return Form("function", {}, {}, apply_fn, hashable(("function", layer)), layer)


def _frozen_params(module: nnx.Module) -> set[tuple[Any, ...]]:
    """The paths of the module's ``nnx.Param``s that hold stored codes, not trainable values: every integer one
    (qwix's ``PtqProvider`` keeps a weight as an int8 ``qvalue``), and beside each, the scales and zero points it
    is kept with (leaves of the same parent named ``scale`` or ``zero_point``). They get no gradient (JAX has
    none for an integer) and are state, as a Keras layer's non-trainable variables are."""
    flat = [(tuple(p), v[...]) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
    codes = {p for p, v in flat if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.integer)}
    parents = {p[:-1] for p in codes}
    return codes | {p for p, _ in flat if p[:-1] in parents and str(p[-1]) in ("scale", "zero_point")}


def _linen_frozen(params: Any) -> tuple[Any, Any]:
    """A Linen module's parameters split into those trained and those frozen (None where none is): every integer
    leaf (stored codes: a hand-written module's, qwix's PtqProvider ``WithAux(QArray(qvalue, scale))``) and the
    leaves beside it named ``scale`` or ``zero_point``, as :func:`_frozen_params` splits an NNX module's. Each
    tree keeps the other's leaves as None (:func:`_combine` puts them together)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    codes = {tuple(map(path_name, ((k,) for k in p))) for p, v in flat
             if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.integer)}
    if not codes:
        return params, None
    parents = {p[:-1] for p in codes}

    def is_frozen(path: Any) -> bool:
        names = tuple(path_name((k,)) for k in path)
        return names in codes or (names[:-1] in parents and names[-1] in ("scale", "zero_point"))

    trained = jax.tree_util.tree_map_with_path(lambda p, v: None if is_frozen(p) else v, params)
    frozen = jax.tree_util.tree_map_with_path(lambda p, v: v if is_frozen(p) else None, params)
    return trained, frozen


def _combine(trained: Any, frozen: Any) -> Any:
    """The whole parameter tree of :func:`_linen_frozen`'s two halves."""
    return jax.tree.map(lambda a, b: a if b is None else b, trained, frozen, is_leaf=lambda v: v is None)


def _keras_keys(layer: Any) -> dict[int, tuple[int, str, int]]:
    """Each variable of ``layer`` (by id) as what pairs it with its twin's: the place of the innermost sublayer
    holding it in the layer's flattened tree, its name, and its count among that sublayer's variables of that
    name. Not its path: a twin built by the same constructor has its sublayers named anew (``dense_2`` for the
    layer's ``dense``), and ``quantize`` keeps a kernel's name while it makes it another variable."""
    owner: dict[int, int] = {}
    # Pre-order, a sublayer after the layers holding it: the last to list a variable is the innermost.
    for i, sub in enumerate(layer._flatten_layers(include_self=True, recursive=True)):
        for v in sub.variables:
            owner[id(v)] = i
    counts: collections.Counter[tuple[int, str]] = collections.Counter()
    keys = {}
    for v in layer.variables:
        at = (owner.get(id(v), 0), v.name)
        keys[id(v)] = (*at, counts[at])
        counts[at] += 1
    return keys


def keras_names(layer: Any, like: Any = None) -> dict[int, str]:
    """Each variable of a Keras ``layer`` (by id) by the name check_layer gives it: its ``path`` (``dense/kernel``),
    or, given the layer ``like`` it is checked against, the path of the variable of ``like`` it pairs with
    (:func:`_keras_keys`), so a twin's parameters take the layer's names."""
    theirs = {}
    if like is not None:
        named = keras_names(like)
        theirs = {key: named[i] for i, key in _keras_keys(like).items()}
    keys = _keras_keys(layer)
    names: dict[int, str] = {}
    taken: set[str] = set()
    for v in layer.variables:
        name = theirs.get(keys[id(v)], v.path)
        while name in taken:  # two variables Keras gave one path: each keeps its own name
            name += "'"
        taken.add(name)
        names[id(v)] = name
    return names


def _keras_form(keras: Any, layer: Any, call: Callable[[Any, jax.Array], Any] | None, like: Any = None) -> Form:
    """A Keras layer or model run statelessly, as ``layer.stateless_call(trainable values, non-trainable values,
    x)`` runs it (keras/src/layers/layer.py:1089-1200, Keras 3.15.1), differentiated by plain JAX: its variables
    mapped to the values given in Keras's ``StatelessScope``, the non-trainable ones read back after the call.

    What runs in the scope is ``layer(x)`` (or ``call(layer, x)``), not ``stateless_call``'s own ``layer.call``
    / ``quantized_call``: that skips ``Layer.__call__``, and with it the layer's autocast, so a bare
    ``Dense(dtype="mixed_bfloat16")`` computes in float32 through ``stateless_call`` and in bfloat16 when called
    (measured, Keras 3.15.1, jax 0.12.0.1: outputs float32 against bfloat16, 0.0104 apart). check_layer
    checks what the layer computes when called, the program coverage traces. A model's layers run through
    their ``__call__`` either way.

    Its parameters are its trainable variables but those whose gradient Keras writes over them rather than
    trains them (``overwrite_with_gradient``: a float8 layer's scales and amax histories, which the optimizer
    replaces by their "gradient"); those and its non-trainable variables (an int8 kernel's codes, its scales,
    RNG seeds) are state. A forward call leaves the overwritten ones as they were: only an optimizer step writes
    them.
    """
    names = keras_names(layer, like)
    trainable = [names[id(v)] for v in layer.trainable_variables]
    frozen = [names[id(v)] for v in layer.non_trainable_variables]
    state = {names[id(v)] for v in layer.trainable_variables if getattr(v, "overwrite_with_gradient", False)}
    values = {names[id(v)]: v.value for v in layer.variables}
    params = {n: values[n] for n in trainable if n not in state}
    rest = {n: values[n] for n in (*trainable, *frozen) if n not in params}

    fn = call or _call

    def apply(params, rest, x):
        mine = [params[n] if n in params else rest[n] for n in trainable]
        theirs = [rest[n] for n in frozen]
        mapping = list(zip(layer.trainable_variables, mine)) + list(zip(layer.non_trainable_variables, theirs))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            out = fn(layer, x)
        after = [scope.get_current_value(v) for v in layer.non_trainable_variables]
        return out, {**rest, **dict(zip(frozen, after))}

    return Form("keras", params, rest, apply, hashable(("keras", layer, call, like)),
                layer if call is None else functools.partial(call, layer), frozenset(rest))


def equinox_params(module: Any) -> dict[str, jax.Array] | None:
    """An Equinox module's parameters by path, as check_layer names them (``experts/w1/weight``: a haliax
    NamedArray by its field, as its array; haliax's fp8 state left out); None where ``module`` is no Equinox module."""
    eqx = equinox_of(module)
    return None if eqx is None else equinox_param_leaves(equinox_split(eqx, module)[0])


def call_module(layer: Any, x: jax.Array, call: Callable[[Any, jax.Array], Any] | None = None) -> Any:
    """A module (NNX, a Linen pair, Equinox) run on ``x`` as check_layer runs it, forward only: ``call(module, x)``
    (default ``module(x)``) as one jitted program on a copy of its state, the module left as it was.

    Returns the output with each haliax NamedArray as its array.
    """
    form = form_of(layer, x, call)
    out = jax.jit(form.apply)(form.params, form.rest, x)[0]
    named = named_array_type()
    return jax.tree_util.tree_map(lambda v: v.array if isinstance(v, named) else v, out,
                                  is_leaf=lambda v: isinstance(v, named))


class NoOutput(Exception):
    pass


def select_output(out: Any, output: Any) -> list[tuple[str, jax.Array]]:
    """The floating-point leaves of ``out`` that ``output`` selects, by name."""
    if output is None:
        picked, prefix = out, ()
    elif callable(output):
        picked, prefix = output(out), ()
    else:
        try:
            picked = out[output]
        except (KeyError, IndexError, TypeError) as e:
            raise NoOutput(f"output={output!r} does not index the output ({type(e).__name__}: {e})") from None
        prefix = (jax.tree_util.SequenceKey(output) if isinstance(output, int) else jax.tree_util.DictKey(output),)
    named = named_array_type()  # a haliax NamedArray: its array, named by its place in the output
    flat = jax.tree_util.tree_flatten_with_path(picked, is_leaf=lambda v: isinstance(v, named))[0]
    leaves = [(_leaf_name(prefix + tuple(p)), v) for p, v in ((p, v.array if isinstance(v, named) else v)
                                                              for p, v in flat)
              if hasattr(v, "shape") and hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.floating)]
    if not leaves:
        raise NoOutput(f"output={output!r} selects no floating-point array of the output ({_describe(out)})")
    return leaves


def _describe(out: Any) -> str:
    leaves = jax.tree_util.tree_flatten_with_path(out, is_leaf=lambda v: v is None)[0]
    shown = [f"{_leaf_name(p) or 'the output'} {'None' if v is None else getattr(v, 'dtype', type(v).__name__)}"
             f"{list(v.shape) if hasattr(v, 'shape') else ''}" for p, v in leaves[:8]]
    return ", ".join(shown) or "no leaves"


def is_module(layer: Any) -> bool:
    return isinstance(layer, nnx.Module) or _is_linen_pair(layer) or equinox_of(layer) is not None


def traceable(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, the layer's own code: any error of it is one UserCodeError naming the argument."""
    with user_code("check_layer", what):
        return fn()
