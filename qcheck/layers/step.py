"""Pure, jitted forward and train steps for any qcheck NNX module.

The module is split into a static graph and array state once; the jitted
functions take the state as arguments and return the updated state, as a real
training step does. Programs are cached on the graph definition, so layers of
the same structure share one compilation.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from qcheck.layers.bridge import Fp8Meta

__all__ = ["TRAINABLE", "StepOutput", "apply", "lower_train_step", "split_for_step", "train_step", "train_step_fn",
           "train_step_program"]

#: What a train step differentiates: the parameters, and the fp8 state whose gradient is its update.
TRAINABLE = nnx.Any(nnx.Param, Fp8Meta)


class StepOutput(NamedTuple):
    loss: jax.Array
    grads: Any  #: gradients of the Param state
    fp8_meta: Any  #: the next fp8 scales and amax histories (their "gradients")
    rest: Any  #: the rest of the non-parameter state after the step (RNG counts, ...)
    output: jax.Array  #: the forward output the loss was computed from
    fp8_meta_after_forward: Any  #: fp8 state as the module holds it after its forward pass


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, x):
    module = nnx.merge(graphdef, state, copy=True)
    y = module(x)
    return y, nnx.state(module)


def apply(module: nnx.Module, x: jax.Array) -> tuple[jax.Array, nnx.State]:
    """Run ``module(x)`` jitted; returns the output and the state after the call."""
    graphdef, state = nnx.split(module)
    return _apply(graphdef, state, x)


def split_for_step(module: nnx.Module):
    """``(graphdef, params, fp8_meta, rest)``: the arguments :func:`train_step` takes after the graph."""
    return nnx.split(module, nnx.Param, Fp8Meta, ...)


def _loss(graphdef, params, meta, rest, x):
    module = nnx.merge(graphdef, params, meta, rest, copy=True)
    y = module(x)
    # The forward's side effects ride along as aux: RNG counts it advanced, and
    # whatever it did to fp8 state (nothing, if the recipe is right).
    aux = (nnx.state(module, nnx.Not(TRAINABLE)), y, nnx.state(module, Fp8Meta))
    return jnp.mean(jnp.square(y.astype(jnp.float32))), aux


def train_step_fn(graphdef):
    """The pure step ``(params, fp8_meta, rest, x) -> StepOutput`` for ``graphdef``, unjitted."""

    def step(params, meta, rest, x):
        grad_fn = jax.value_and_grad(functools.partial(_loss, graphdef), argnums=(0, 1), has_aux=True)
        (loss, (new_rest, y, meta_after_forward)), (grads, new_meta) = grad_fn(params, meta, rest, x)
        return StepOutput(loss, grads, new_meta, new_rest, y, meta_after_forward)

    return step


@functools.partial(jax.jit, static_argnums=0)
def train_step_program(graphdef, params, meta, rest, x):
    """:func:`train_step_fn` under ``jax.jit``, on the parts :func:`split_for_step` gives: one program per graphdef."""
    return train_step_fn(graphdef)(params, meta, rest, x)


def train_step(module: nnx.Module, x: jax.Array, *, fp8_meta: nnx.State | None = None) -> StepOutput:
    """One jitted loss/gradient step on ``module``; the module itself is not changed.

    ``fp8_meta`` replaces the module's fp8 scales and histories, e.g. with the
    ``fp8_meta`` of a previous step, to run a second step.
    """
    graphdef, params, meta, rest = split_for_step(module)
    return train_step_program(graphdef, params, meta if fp8_meta is None else fp8_meta, rest, x)


def lower_train_step(graphdef, params, meta, rest, x) -> jax.stages.Lowered:
    """The lowering of exactly the program :func:`train_step` runs (shared trace and lowering caches)."""
    return train_step_program.lower(graphdef, params, meta, rest, x)
