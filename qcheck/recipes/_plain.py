"""The unquantized call site as a plain NNX module: what an interception library can walk.

The ``none`` recipe's sites used to be :class:`~qcheck.layers.bridge.QuantSite`, an
``nnx.bridge.ToNNX``; qwix 0.1.8 cannot walk a model holding one (it sets
attributes on every module, which ToNNX turns into Linen variables: "Cannot
infer collection name from value"). This site holds no state and computes the
same ops as :class:`qcheck.recipes.PlainSite` (same dtype promotion, same
``jnp.einsum`` / ``jax.lax.ragged_dot``), so the ``none`` layer's bits do not move.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["UnquantizedSite"]


class UnquantizedSite(nnx.Module):
    """``site(eqn, lhs, rhs)`` is ``jnp.einsum``; ``site.ragged_dot(lhs, rhs, group_sizes)`` is ``jax.lax.ragged_dot``.

    Both are looked up when called, so a library that intercepts them (qwix)
    sees every matmul of the layer's call sites.
    """

    def __init__(self, name: str, *, rngs: nnx.Rngs | jax.Array | None = None):
        # A QuantSite's construction forks the caller's streams (ToNNX does);
        # advancing them the same way keeps every weight drawn after this site
        # (a decoder's later layers) the same for `none` as for any recipe.
        if isinstance(rngs, nnx.Rngs):
            rngs.fork()
        self.site_name = name

    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        dtype = jnp.result_type(lhs, rhs)
        return jnp.einsum(eqn, jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype))

    def ragged_dot(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        dtype = jnp.result_type(lhs, rhs)
        return jax.lax.ragged_dot(jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), group_sizes=group_sizes)
