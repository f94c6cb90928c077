"""Decoder stacks of tiny MoE layers behind one caller ``Rngs``: unrolled or scanned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qcheck._choices import require_choice
from qcheck.layers.moe import MODELS, MoE, MoEConfig, transform_layer
from qcheck.recipes import ApplyRngs, InterceptRecipe, Recipe, get_recipe

__all__ = ["Decoder", "build_decoder"]


class Decoder(nnx.Module):
    """``layers`` residual MoE blocks; ``x + moe(x)`` each, ``[batch, seq, emb]`` in and out.

    Every layer is built from the caller's ``rngs``, which the decoder keeps as
    ``self.rngs``: under ``ApplyRngs.SHARED`` all call sites of all layers point
    at that one stream, so the compiled step carries it once. Scanned stacks
    build the layers under ``nnx.vmap`` with the streams split per layer and run
    them with ``nnx.scan``.
    """

    def __init__(
        self,
        config: MoEConfig,
        recipe: Recipe,
        *,
        layers: int,
        scan: bool = False,
        rngs: nnx.Rngs,
        apply_rngs: ApplyRngs | None = None,
        dtype: jnp.dtype = jnp.float32,
    ):
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be a positive integer, got {layers!r}")
        self.config = config
        self.num_layers = layers
        self.scan = scan
        self.rngs = rngs

        intercept = isinstance(recipe, InterceptRecipe)
        if intercept and scan:
            raise ValueError(
                f"recipe {recipe.name!r} is an InterceptRecipe: its layers are transformed after they are built, "
                "which a scanned stack (built under nnx.vmap) cannot do; use scan=False")

        def make(r: nnx.Rngs) -> MoE:
            if intercept:
                return transform_layer(MoE(config, get_recipe("none"), rngs=r, dtype=dtype), recipe)
            return MoE(config, recipe, rngs=r, apply_rngs=apply_rngs, dtype=dtype)

        if scan:
            # Each vmapped layer works on its own fork: nnx.vmap hands back the very
            # Rngs object it was given (unsplit again), so a SHARED site pointing at
            # it could not be scanned over. The forks come out stacked: one array
            # per stream, whatever the depth.
            per_layer = nnx.vmap(lambda r: make(r.fork()), in_axes=0, out_axes=0)
            self.layers = nnx.split_rngs(splits=layers)(per_layer)(rngs)
        else:
            self.layers = nnx.List([make(rngs) for _ in range(layers)])

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.scan:
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def body(layer: MoE, h: jax.Array) -> jax.Array:
                return h + layer(h)

            return body(self.layers, x)
        for layer in self.layers:
            x = x + layer(x)
        return x


def build_decoder(
    model: str,
    recipe: str | Recipe,
    *,
    layers: int,
    scan: bool = False,
    seed: int = 0,
    apply_rngs: ApplyRngs | str | None = None,
) -> Decoder:
    """A stack of ``layers`` MoE layers; ``apply_rngs`` overrides the recipe's RNG mode (e.g. force PRIVATE)."""
    config = MODELS[require_choice("model", model, tuple(MODELS))]
    if isinstance(apply_rngs, str):
        valid = tuple(m.value for m in ApplyRngs)
        apply_rngs = ApplyRngs(require_choice("apply_rngs mode", apply_rngs, valid))
    return Decoder(
        config, get_recipe(recipe), layers=layers, scan=scan, rngs=nnx.Rngs(seed), apply_rngs=apply_rngs
    )
