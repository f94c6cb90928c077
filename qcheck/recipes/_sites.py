"""Linen modules for one quantized call site: quantize the operands, then einsum or ragged_dot.

Each recipe's site module inherits ``__call__`` and ``ragged_dot`` from
:class:`SiteOps`, so the dense (einsum) and sparse (grouped matmul) paths of a
layer quantize identically and differ only in the matmul itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from qcheck.recipes._base import contraction_axes

# ragged_dot(lhs[m, k], rhs[g, k, n]) contracts lhs axis 1 with rhs axis 1.
RAGGED_AXES = ((1,), (1,))


class SiteOps:
    """Mixin: the two matmul forms of a call site, built on ``quantize_operands``."""

    def quantize_operands(self, lhs, rhs, lhs_axes, rhs_axes):
        return lhs, rhs

    def quantize_output(self, y):
        return y

    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        dtype = jnp.result_type(lhs, rhs)
        lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
        lhs_axes, rhs_axes = contraction_axes(eqn, lhs.ndim, rhs.ndim)
        lhs, rhs = self.quantize_operands(lhs, rhs, lhs_axes, rhs_axes)
        return self.quantize_output(jnp.einsum(eqn, lhs, rhs))

    def ragged_dot(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        dtype = jnp.result_type(lhs, rhs)
        lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
        lhs, rhs = self.quantize_operands(lhs, rhs, *RAGGED_AXES)
        return self.quantize_output(jax.lax.ragged_dot(lhs, rhs, group_sizes))


class PlainSite(SiteOps, nn.Module):
    """The unquantized site: the ``none`` recipe and the reference twin of every layer."""
