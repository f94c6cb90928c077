"""The unquantized call site: the ``none`` recipe's, and the reference twin of every layer.

Its ops are :class:`~qcheck.recipes.SiteOps` with nothing quantized, so it
computes what a quantized site computes around its quantizers (the same dtype
promotion, the same ``jnp.einsum`` / ``jax.lax.ragged_dot``), in two shells.
:class:`UnquantizedSite` is a plain NNX module, what the ``none`` layer holds:
an interception library can walk it, where qwix 0.1.8 cannot walk a model
holding an ``nnx.bridge.ToNNX`` (it sets attributes on every module, which
ToNNX turns into Linen variables: "Cannot infer collection name from value").
:class:`PlainSite` is the same site as a Linen module, the ``none`` recipe's
``site_module``, for a :class:`~qcheck.layers.bridge.QuantSite`.
"""

from __future__ import annotations

import jax
from flax import linen as nn
from flax import nnx

from qcheck.recipes._sites import SiteOps


class PlainSite(SiteOps, nn.Module):
    """The unquantized site as a Linen module."""


class UnquantizedSite(SiteOps, nnx.Module):
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
