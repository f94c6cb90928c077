"""Weights passed as arguments: ``qcheck.weights(tree)`` marks an argument's leaves as weights for roles.

The walk tells a weight from an activation by data flow: an operand that derives
from a module's state is a weight, one that derives from the call's arguments an
activation. A function handed its weights as arguments (Keras's
``stateless_call(trainable, non_trainable, x)``, post-training-quantized codes
and scales passed in) would have them all read as activations, and a role
declaration would misfire. Wrapped in :func:`weights`, the argument's leaves
count as weights; the function still receives the tree itself.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class Weights:
    """An argument tree whose leaves are weights (a pytree node: JAX sees its leaves)."""

    def __init__(self, tree: Any):
        self.tree = tree

    def __repr__(self) -> str:
        return f"qcheck.weights({self.tree!r})"


jax.tree_util.register_pytree_node(Weights, lambda w: ((w.tree,), None), lambda _, children: Weights(children[0]))


def weights(tree: Any) -> Weights:
    """``tree`` (arrays, or a pytree of them) marked as weights, for ``coverage``, ``assert_quantized`` and
    ``check_layer``'s roles and declarations: ``coverage(fn, qcheck.weights(params), x)``."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in leaves:
        if not isinstance(leaf, (np.ndarray, jax.Array)) and not hasattr(leaf, "__jax_array__"):
            where = jax.tree_util.keystr(path) or "the tree itself"
            raise ValueError(f"qcheck.weights: {where} is a {type(leaf).__name__}, not an array (numpy or JAX); "
                             f"mark arrays only")
    return Weights(tree)


def _is_weights(node: Any) -> bool:
    return isinstance(node, Weights)


def unwrap(tree: Any) -> Any:
    """``tree`` with each :class:`Weights` replaced by the tree it marks (what the function receives)."""
    return jax.tree.map(lambda n: n.tree if isinstance(n, Weights) else n, tree, is_leaf=_is_weights)


def data_mask(tree: Any) -> list[bool]:
    """Per leaf of ``tree`` (as ``jax.tree.leaves`` orders them): False inside a :class:`Weights`, else True."""
    mask: list[bool] = []
    for node in jax.tree.leaves(tree, is_leaf=_is_weights):
        if isinstance(node, Weights):
            mask += [False] * len(jax.tree.leaves(node.tree))
        else:
            mask.append(True)
    return mask
