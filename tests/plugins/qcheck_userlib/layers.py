"""The library's stock layer: a dense layer whose matmul runs through its ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qcheck_userlib import ops


class QDense(nnx.Module):
    """``x @ w`` quantized as ``fmt`` configures it ("fp8"), through the library's op or (``kernel``) its kernel."""

    def __init__(self, w: jax.Array, fmt: str = "fp8", kernel: bool = False):
        self.w = nnx.Param(jnp.asarray(w))
        self.fmt = fmt
        self.kernel = kernel

    def __call__(self, x: jax.Array) -> jax.Array:
        return (ops.kernel_matmul if self.kernel else ops.qmatmul)(x, self.w[...])
