"""Linen modules for one quantized call site: quantize the operands, then einsum or ragged_dot.

Each recipe's site module inherits ``__call__`` and ``ragged_dot`` from
:class:`SiteOps`, so the dense (einsum) and sparse (grouped matmul) paths of a
layer quantize identically and differ only in the matmul itself.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from flax import linen as nn

from qcheck import formats
from qcheck.recipes._axes import RAGGED_AXES, MatmulAxes, einsum_axes

Quantizer = Callable[[jax.Array], jax.Array]


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


def straight_through(quantize: Quantizer) -> Quantizer:
    """``quantize`` in the forward pass, identity in the backward pass, bit for bit."""

    @jax.custom_vjp
    def f(x):
        return quantize(x)

    f.defvjp(lambda x: (quantize(x), None), lambda _, g: (g,))
    return f


def fake_quant_matmul(
    op: Callable[[jax.Array, jax.Array], jax.Array],
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    *,
    q_lhs: Quantizer,
    q_rhs: Quantizer,
    q_dgrad: Callable[[jax.Array, jax.Array | None], jax.Array],
    q_wgrad: Quantizer,
) -> jax.Array:
    """``op(q_lhs(lhs), q_rhs(rhs))`` whose backward pass quantizes the output gradient again.

    Each gradient matmul gets its own copy of the output gradient, quantized
    along the axes that matmul contracts: ``q_dgrad(g, key)`` for the input
    gradient (``key`` is there for stochastic rounding; a custom_vjp may not
    close over a traced key), ``q_wgrad(g)`` for the weight gradient. The
    operands reuse their forward quantization.
    """

    @jax.custom_vjp
    def f(lhs, rhs, key):
        return op(q_lhs(lhs), q_rhs(rhs))

    def fwd(lhs, rhs, key):
        ql, qr = q_lhs(lhs), q_rhs(rhs)
        return op(ql, qr), (ql, qr, key)

    def bwd(res, g):
        ql, qr, key = res
        _, vjp = jax.vjp(op, ql, qr)
        return vjp(q_dgrad(g, key))[0], vjp(q_wgrad(g))[1], None

    f.defvjp(fwd, bwd)
    return f(lhs, rhs, key)


class FormatSite(SiteOps, nn.Module):
    """A declarative recipe's site: operands (and optionally the output gradient) qdq'd in named formats.

    Without ``grad`` the gradients pass straight through the operand
    quantizers; with it, the output gradient is quantized for each gradient
    matmul along the axes that matmul contracts.
    """

    lhs: str
    rhs: str
    grad: str | None = None

    def matmul(self, op, lhs, rhs, axes):
        q_lhs = lambda x: formats.qdq(x, self.lhs, axis=axes.lhs)  # noqa: E731
        q_rhs = lambda x: formats.qdq(x, self.rhs, axis=axes.rhs)  # noqa: E731
        if self.grad is None:
            return op(straight_through(q_lhs)(lhs), straight_through(q_rhs)(rhs))
        return fake_quant_matmul(
            op, lhs, rhs, None,
            q_lhs=q_lhs,
            q_rhs=q_rhs,
            q_dgrad=lambda g, _: formats.qdq(g, self.grad, axis=axes.dgrad),
            q_wgrad=lambda g: formats.qdq(g, self.grad, axis=axes.wgrad),
        )
