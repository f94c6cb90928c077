"""Interception recipes: the layer is the built unquantized (``none``) layer, transformed.

Libraries such as qwix quantize a model by intercepting ``jnp.einsum`` /
``jax.lax.ragged_dot`` while it runs rather than by supplying a module per call
site. An :class:`InterceptRecipe` gets qcheck's ``none`` layer (whose call
sites are plain NNX modules, :class:`qcheck.recipes._plain.UnquantizedSite`) and
returns the quantized layer; ``qcheck.build_moe`` builds it that way, so the
case table, the sharded twin, the train step and golden cases treat it like
any other recipe.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import linen as nn
from flax import nnx

from qcheck.recipes._base import ApplyRngs, Recipe
from qcheck.recipes._declarations import Expect, Reference

#: ``transform(layer, sample_input) -> layer``: ``layer`` is a freshly built ``none``
#: layer (the caller's to change or replace), ``sample_input`` a ``[batch, seq, emb]``
#: array to run it on once, as libraries that initialize by running the model need.
Transform = Callable[[nnx.Module, jax.Array], nnx.Module]


class InterceptRecipe(Recipe):
    """A recipe whose layer is ``transform(none_layer, sample_input)``.

    ``lhs``/``rhs`` declare the qcheck formats the transformed sites' operand
    codes coincide with, bitwise (the ``exact`` invariant holds them to the
    referee); leave them out where no qcheck format matches. ``reference`` and
    ``expect`` replace the class's (``InterceptRecipe.expect``: no backward paths).
    """

    # An interception library computes gradients its own way, which a qcheck
    # backward referee models only where a subclass says how (QwixRecipe: the
    # dense path, g against the original operands) and widens this.
    expect = Expect(backward_paths=())

    def __init__(
        self,
        name: str,
        transform: Transform,
        *,
        lhs: str | None = None,
        rhs: str | None = None,
        reference: Reference | None = None,
        expect: Expect | None = None,
    ):
        if not callable(transform):
            raise TypeError(f"transform must be a callable (layer, sample_input) -> layer, got {transform!r}")
        super().__init__(name, lhs=lhs, rhs=rhs, apply_rngs=ApplyRngs.NONE, reference=reference, expect=expect)
        self._transform = transform

    def transform(self, layer: nnx.Module, sample_input: jax.Array) -> nnx.Module:
        """The quantized layer made from the fresh ``none`` layer ``layer``."""
        out = self._transform(layer, sample_input)
        if not isinstance(out, nnx.Module):
            raise TypeError(
                f"InterceptRecipe {self.name!r}: transform returned {type(out).__name__}, not an nnx.Module")
        return out

    def site_module(self, name: str) -> nn.Module:
        raise TypeError(
            f"InterceptRecipe {self.name!r} has no site module: its layer is the `none` layer transformed; "
            "build it with qcheck.build_moe (or recipe.transform on a built `none` layer)")
