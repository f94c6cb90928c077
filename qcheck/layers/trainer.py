"""qcheck's reference trainer: what a correct training loop does with fp8 scaling state.

A few steps of gradient descent on a qcheck layer (or any NNX module whose fp8
state is :class:`~qcheck.layers.bridge.Fp8Meta`), each step over M microbatches, with
an optax chain of global-norm clipping and AdamW's weight decay. The fp8 state
(amax histories and scales) travels as the "gradient" of its variables, and
the loop treats it as what it is, not as a gradient:

- each step's new fp8 state is the value the backward pass returns, never
  the old value plus an update;
- across microbatches it is merged by max (an amax is a max, and a delayed
  scale grows with the amax it is computed from), never summed and never the
  last microbatch's alone;
- it never reaches the optimizer: not clipped, not counted in the global
  norm, not decayed, not scaled by the learning rate.

The loss is normalised by the whole batch (each microbatch's mean over M), so
the output gradient every site sees, and the amax recorded from it, does not
depend on M. The invariant suite's ``train`` column holds this loop to the
relations that must hold (:func:`qcheck.assert_fp8_state_matches`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from qcheck.layers import step

__all__ = ["train"]


def _optimizer(max_norm, learning_rate, weight_decay) -> optax.GradientTransformation:
    # The hyperparameters are traced arguments of _update: one program serves every setting, clipped or not.
    return optax.chain(optax.clip_by_global_norm(max_norm),
                       optax.adamw(learning_rate, weight_decay=weight_decay))


# Neither program depends on the module's graph or its fp8 state: layers with the same parameters share them.
@jax.jit
def _init(params):
    return _optimizer(1.0, 1.0, 0.0).init(params)


@jax.jit
def _update(params, grads, opt_state, hyper):
    updates, opt_state = _optimizer(*hyper).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@functools.partial(jax.jit, static_argnums=(0, 1))
def _microbatch_step(graphdef, microbatches: int, params, meta, rest, x):
    """Gradients, fresh fp8 state and the rest of the state for one microbatch of ``microbatches``."""

    def loss(params, meta):
        module = nnx.merge(graphdef, params, meta, rest, copy=True)
        y = module(x)
        # The whole batch's mean: each microbatch's mean over M microbatches of equal size.
        return jnp.mean(jnp.square(y.astype(jnp.float32))) / microbatches, nnx.state(module, nnx.Not(step.TRAINABLE))

    (_, new_rest), (grads, new_meta) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, meta)
    return grads, new_meta, new_rest


def _host_merge(trees, op):
    return jax.tree.map(lambda *xs: functools.reduce(op, (np.asarray(x) for x in xs)), *trees)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"train: {name} must be a positive integer, got {value!r}")
    return value


def train(
    module: nnx.Module,
    batch: jax.Array,
    *,
    steps: int = 1,
    microbatches: int = 1,
    max_norm: float | None = 1.0,
    learning_rate: float = 1e-2,
    weight_decay: float = 0.1,
) -> nnx.Module:
    """``steps`` training steps of ``module`` on ``batch``; returns the trained copy (``module`` is not changed).

    Each step runs the loss ``mean(module(x) ** 2)`` over ``batch`` in
    ``microbatches`` equal parts along its first axis, sums the parameters'
    gradients, merges the fp8 state's fresh values by max, and updates the
    parameters (only) with ``clip_by_global_norm(max_norm)`` (``None``: no
    clipping) then ``adamw(learning_rate, weight_decay=weight_decay)``. The
    same batch is used at every step, so a step's amax histories roll once and
    record what the sites saw.

    With one microbatch a step is :func:`qcheck.layers.step.train_step`'s program;
    with M, one more program runs each microbatch. The optimizer's programs
    depend only on the parameters' shapes. Use it as either step of
    :func:`qcheck.assert_fp8_state_matches` (``functools.partial(train,
    microbatches=2)``), or read it as the loop to compare yours with.
    """
    steps, microbatches = _positive_int("steps", steps), _positive_int("microbatches", microbatches)
    if not isinstance(module, nnx.Module):
        raise TypeError(f"train: module must be an nnx.Module, got {type(module).__name__}")
    batch = np.asarray(batch)  # split on the host: no slicing programs
    if batch.ndim < 1 or batch.shape[0] % microbatches:
        raise ValueError(f"train: batch's first axis ({batch.shape[0] if batch.ndim else 'none'}) does not split "
                         f"into microbatches={microbatches} equal parts")
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"train: max_norm must be positive or None, got {max_norm!r}")
    hyper = np.array([math.inf if max_norm is None else max_norm, learning_rate, weight_decay], np.float32)

    graphdef, params, meta, rest = step.split_for_step(module)
    opt_state = _init(params)
    parts = np.split(batch, microbatches)
    for _ in range(steps):
        if microbatches == 1:
            out = step.train_step_program(graphdef, params, meta, rest, batch)
            grads, meta, rest = out.grads, out.fp8_meta, out.rest
        else:
            runs = [_microbatch_step(graphdef, microbatches, params, meta, rest, x) for x in parts]
            grads = _host_merge([g for g, _, _ in runs], np.add)
            meta = jax.device_put(_host_merge([m for _, m, _ in runs], np.maximum))  # no programs
            rest = runs[-1][2]
        params, opt_state = _update(params, grads, opt_state, hyper)
    return nnx.merge(graphdef, params, meta, rest)
