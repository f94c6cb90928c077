"""Weights passed as arguments: ``qcheck.weights(tree)`` marks an argument's leaves as weights for roles.

The walk tells a weight from an activation by data flow: an operand that derives
from a module's state is a weight, one that derives from the call's arguments an
activation. A function handed its weights as arguments (Keras's
``stateless_call(trainable, non_trainable, x)``, post-training-quantized codes
and scales passed in) would have them all read as activations, and a role
declaration would misfire. Wrapped in :func:`weights`, the argument's leaves
count as weights; the function still receives the tree itself.

Codes quantized once and stored (``qwix.quantize(w, jnp.int8, ...)``, an
``(int8 codes, scale)`` pair) reach the matmul as codes from the start: no
quantizer of the traced program made them, so a declared format holds them by
type only. ``source=`` gives the float weights they were made from; the codes
and scales are then held bitwise to the declared format applied by the referee
to it (on the host, the stored-weights judgement check_layer gives a layer's
stored kernels), at every site their codes reach.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(eq=False)  # compared by identity: it is a treedef's aux data
class Source:
    """Stored codes and the float weights they were made from, for the declared format's referee: ``codes_at``
    is the codes' index among the marked tree's leaves, ``scales`` what the library keeps beside them (``scale``,
    ``zero_point``), ``axes`` the axes their scale reduces (where it has one value for the codes' many)."""

    x: np.ndarray
    codes: np.ndarray
    codes_at: int
    scales: dict[str, np.ndarray]
    axes: tuple[int, ...]
    #: The declared format's finding, by format (None: held bitwise): each format judged once per call.
    judged: dict[Any, str | None] = dataclasses.field(default_factory=dict)


class Weights:
    """An argument tree whose leaves are weights (a pytree node: JAX sees its leaves, not ``source``)."""

    def __init__(self, tree: Any, source: Source | None = None):
        self.tree = tree
        self.source = source

    def __repr__(self) -> str:
        return f"qcheck.weights({self.tree!r}{'' if self.source is None else ', source=...'})"


jax.tree_util.register_pytree_node(Weights, lambda w: ((w.tree,), w.source),
                                   lambda source, children: Weights(children[0], source))


def weights(tree: Any, source: Any = None) -> Weights:
    """``tree`` (arrays, or a pytree of them) marked as weights, for ``coverage``, ``assert_quantized`` and
    ``check_layer``'s roles and declarations: ``coverage(fn, qcheck.weights(params), x)``.

    ``source``: the float weights stored codes were made from, where ``tree`` holds codes (a ``qwix.QArray``,
    or one integer array and its scale: ``(codes, scale)``). Its codes and scales are then held bitwise to the
    declared weights format applied by the referee to ``source``; without it, by their type only."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in leaves:
        if not _is_array(leaf):
            where = jax.tree_util.keystr(path) or "the tree itself"
            raise ValueError(f"qcheck.weights: {where} is a {type(leaf).__name__}, not an array (numpy or JAX); "
                             f"mark arrays only")
    return Weights(tree, None if source is None else _source(tree, [leaf for _, leaf in leaves], source))


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, jax.Array)) or hasattr(leaf, "__jax_array__")


def _source(tree: Any, leaves: list[Any], source: Any) -> Source:
    """What ``source`` holds ``tree``'s codes to; a one-line ValueError naming ``source`` where it cannot."""
    if not _is_array(source) or not np.issubdtype(np.asarray(source).dtype, np.floating):
        kind = f"an array of {np.asarray(source).dtype}" if _is_array(source) else f"a {type(source).__name__}"
        raise ValueError(f"qcheck.weights: source must be the float weights the codes were made from (a float "
                         f"array), got {kind}")
    x = np.asarray(source, np.float32)
    codes_at = [i for i, leaf in enumerate(leaves) if np.issubdtype(np.asarray(leaf).dtype, np.integer)
                and np.shape(leaf) == x.shape]
    if len(codes_at) != 1:
        shapes = ", ".join(f"{np.asarray(v).dtype}{list(np.shape(v))}" for v in leaves) or "no array"
        raise ValueError(f"qcheck.weights: source {list(x.shape)} must have the shape of the one integer array of "
                         f"stored codes it marks; the tree holds {shapes}")
    codes = np.asarray(leaves[codes_at[0]])
    zero = getattr(tree, "zero_point", None)
    scale = getattr(tree, "scale", None)
    if scale is None:  # a plain tree: its one other array is the scale
        rest = [leaf for i, leaf in enumerate(leaves) if i != codes_at[0]]
        if len(rest) != 1:
            raise ValueError(f"qcheck.weights: source needs the codes' one scale beside them (a qwix.QArray, or "
                             f"(codes, scale)); the tree holds {len(rest)} other arrays")
        scale = rest[0]
    scales = {"scale": np.asarray(scale)} | ({} if zero is None else {"zero_point": np.asarray(zero)})
    s = np.shape(scale)
    if len(s) > x.ndim or any(d not in (1, n) and n % d for d, n in zip(s[::-1], x.shape[::-1])):
        raise ValueError(f"qcheck.weights: the codes' scale {list(s)} does not broadcast onto source {list(x.shape)}")
    s = (1,) * (x.ndim - len(s)) + tuple(s)
    # The axes a scale value spans more than one code of: those its format reduces (a group of them, or all).
    axes = tuple(a for a in range(x.ndim) if s[a] < x.shape[a])
    return Source(x, codes, codes_at[0], scales, axes)


def _is_weights(node: Any) -> bool:
    return isinstance(node, Weights)


def unwrap(tree: Any) -> Any:
    """``tree`` with each :class:`Weights` replaced by the tree it marks (what the function receives)."""
    return jax.tree.map(lambda n: n.tree if isinstance(n, Weights) else n, tree, is_leaf=_is_weights)


def stored_mask(tree: Any) -> list[Source | None]:
    """Per leaf of ``tree`` (as ``jax.tree.leaves`` orders them): the :class:`Source` of stored codes marked with
    one, else None."""
    mask: list[Source | None] = []
    for node in jax.tree.leaves(tree, is_leaf=_is_weights):
        if isinstance(node, Weights):
            n = len(jax.tree.leaves(node.tree))
            mask += [node.source if node.source is not None and i == node.source.codes_at else None
                     for i in range(n)]
        else:
            mask.append(None)
    return mask


def marked_partial(fn: Any) -> tuple[Any, tuple, dict] | None:
    """``(function, args, kwargs)`` of a ``functools.partial`` that binds arguments marked :func:`weights` (a
    function checked by ``check_layer``, of ``x`` alone, given its stored weights so), else None."""
    if not isinstance(fn, functools.partial):
        return None
    bound = (fn.args, fn.keywords)
    if not any(isinstance(n, Weights) for n in jax.tree.leaves(bound, is_leaf=_is_weights)):
        return None
    return fn.func, fn.args, dict(fn.keywords)


def unmarked(fn: Any) -> Any:
    """``fn`` as it is called: a partial binding marked arguments, binding the trees they mark."""
    bound = marked_partial(fn)
    if bound is None:
        return fn
    func, args, kwargs = bound
    return functools.partial(func, *unwrap(args), **unwrap(kwargs))


def data_mask(tree: Any) -> list[bool]:
    """Per leaf of ``tree`` (as ``jax.tree.leaves`` orders them): False inside a :class:`Weights`, else True."""
    mask: list[bool] = []
    for node in jax.tree.leaves(tree, is_leaf=_is_weights):
        if isinstance(node, Weights):
            mask += [False] * len(jax.tree.leaves(node.tree))
        else:
            mask.append(True)
    return mask
