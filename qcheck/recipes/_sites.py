"""Linen modules for one quantized call site: quantize the operands, then einsum or ragged_dot.

Each recipe's site module inherits ``__call__`` and ``ragged_dot`` from
:class:`SiteOps`, so the dense (einsum) and sparse (grouped matmul) paths of a
layer quantize identically and differ only in the matmul itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from collections.abc import Callable
from functools import partial

from qcheck.recipes._base import RAGGED_AXES, MatmulAxes, einsum_axes


class SiteOps:
    """Mixin: the two matmul forms of a call site, built on :meth:`matmul`.

    The default :meth:`matmul` quantizes the operands, runs the op, and hands
    the output to :meth:`quantize_output`; a recipe that quantizes gradients
    itself overrides :meth:`matmul` instead.
    """

    def quantize_operands(self, lhs, rhs, axes: MatmulAxes):
        return lhs, rhs

    def quantize_output(self, y):
        return y

    def matmul(self, op: Callable, lhs: jax.Array, rhs: jax.Array, axes: MatmulAxes) -> jax.Array:
        lhs, rhs = self.quantize_operands(lhs, rhs, axes)
        return self.quantize_output(op(lhs, rhs))

    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        dtype = jnp.result_type(lhs, rhs)
        lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
        return self.matmul(partial(jnp.einsum, eqn), lhs, rhs, einsum_axes(eqn, lhs.ndim, rhs.ndim))

    def ragged_dot(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        dtype = jnp.result_type(lhs, rhs)
        lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
        return self.matmul(partial(jax.lax.ragged_dot, group_sizes=group_sizes), lhs, rhs, RAGGED_AXES)


class PlainSite(SiteOps, nn.Module):
    """The unquantized site: the ``none`` recipe and the reference twin of every layer."""
