"""A stand-in for a user's MaxText-style MoE block, for docs/checking-your-layer.md and its tests.

The shape of MaxText's ``RoutedMoE``: a router (a ``DenseGeneral`` that is
quantized with the rest of the block), expert kernels ``wi_0``/``wi_1``/``wo``
multiplied over all experts by einsums fetched by name through
``get_einsum(name)``, and a combine weighted by the router. ``quant=None`` is
the unquantized constructor a user keeps for the twin. The quantized einsum is
qcheck's ``e4m3fn_current`` quantize-dequantize of both operands with a
straight-through gradient (without one, the cast's transpose would cast the
gradient to e4m3 as well).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from qcheck import formats

__all__ = ["Config", "MoeBlock", "quantized_einsum"]

EINSUM_NAMES = ("router", "wi_0", "wi_1", "wo")
_FORMATS = {"fp8": "e4m3fn_current", "int8": "int8"}


@dataclasses.dataclass(frozen=True)
class Config:
    emb: int = 32
    mlp: int = 64
    num_experts: int = 4
    top_k: int = 2


def _ste(fmt: str):
    @jax.custom_vjp
    def q(x):
        return formats.qdq(x, fmt)

    q.defvjp(lambda x: (q(x), None), lambda _, g: (g,))
    return q


def quantized_einsum(quant: str):
    """``einsum(eqn, lhs, rhs)`` on operands quantized to ``quant`` ("fp8" or "int8"), straight-through."""
    q = _ste(_FORMATS[quant])

    def einsum(eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return jnp.einsum(eqn, q(lhs), q(rhs))

    return einsum


class DenseGeneral(nnx.Module):
    """The router: one kernel, multiplied by whatever einsum the block hands it."""

    def __init__(self, emb: int, features: int, *, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (emb, features)) / math.sqrt(emb))

    def __call__(self, x: jax.Array, einsum) -> jax.Array:
        return einsum("BSM,ME->BSE", x, self.kernel[...])


class MoeBlock(nnx.Module):
    def __init__(self, config: Config, *, quant: str | None, rngs: nnx.Rngs):
        if quant is not None and quant not in _FORMATS:
            raise ValueError(f"quant must be None or one of {', '.join(_FORMATS)}, got {quant!r}")
        e, m, h = config.num_experts, config.emb, config.mlp
        self.config = config
        self.quant = quant
        self.gate = DenseGeneral(m, e, rngs=rngs)
        self.wi_0 = nnx.Param(jax.random.normal(rngs.params(), (e, m, h)) / math.sqrt(m))
        self.wi_1 = nnx.Param(jax.random.normal(rngs.params(), (e, m, h)) / math.sqrt(m))
        self.wo = nnx.Param(jax.random.normal(rngs.params(), (e, h, m)) / math.sqrt(h))

    def get_einsum(self, name: str):
        if name not in EINSUM_NAMES:
            raise ValueError(f"einsum name {name!r} is not registered; registered names: {', '.join(EINSUM_NAMES)}")
        return jnp.einsum if self.quant is None else quantized_einsum(self.quant)

    def _combine(self, out: jax.Array, weights: jax.Array) -> jax.Array:
        return jnp.einsum("BSEM,BSE->BSM", out, weights)

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        logits = self.gate(x, self.get_einsum("router"))
        top, idx = jax.lax.top_k(logits, c.top_k)
        weights = jnp.sum(jax.nn.one_hot(idx, c.num_experts) * jax.nn.softmax(top, axis=-1)[..., None], axis=2)
        h = jax.nn.silu(self.get_einsum("wi_0")("BSM,EMH->BSEH", x, self.wi_0[...]))
        h = h * self.get_einsum("wi_1")("BSM,EMH->BSEH", x, self.wi_1[...])
        return self._combine(self.get_einsum("wo")("BSEH,EHM->BSEM", h, self.wo[...]), weights)
