"""A user's own training loops on real Flax fp8 modules, correct and broken, for tests/test_catalogue.py.

Each step is ``step(state, batch) -> state`` on a ``flax.training.train_state.TrainState``
whose ``params`` hold the whole Linen variable dict (``params`` and
``_overwrite_with_gradient``): its ``apply_gradients`` hands the fp8
collection's "gradients" (the next scales and histories) back unchanged and
runs the optimizer on the parameters only, as Flax intends. The broken loops
are the ones that reach large codebases (MaxText PR #672, marin #7659, Flax PR
#3623).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.linen import fp8_ops
from flax.training import train_state

from qcheck.layers.bridge import Fp8Meta

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
BATCH, FEATURES, HIDDEN, OUT = 8, 16, 32, 8
MICROBATCHES = 2
LR, CLIP, WD = 0.1, 0.1, 0.01


class Mlp(nn.Module):
    """Two fp8 dense layers, each with its own ``Fp8DirectDotGeneralOp`` (Flax's recommended op)."""

    op: type = fp8_ops.Fp8DirectDotGeneralOp

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(HIDDEN, dot_general_cls=self.op)(x))
        return nn.Dense(OUT, dot_general_cls=self.op)(h)


class Halves(nn.Module):
    """One fp8 dense layer; ``reuse=True`` calls it on each half of the batch (one op, two uses, as weight tying)."""

    op: type = fp8_ops.Fp8DirectDotGeneralOp
    reuse: bool = False

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(OUT, dot_general_cls=self.op)
        if not self.reuse:
            return dense(x)
        first, second = jnp.split(x, 2)
        return jnp.concatenate([dense(first), dense(second)])


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs whose halves have different ranges (so a sum of two amaxes is no max), and targets."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    x[:BATCH // 2] *= 3  # the first microbatch (and half) spans a wider range than the last
    return x, rng.standard_normal((BATCH, OUT)).astype(np.float32)


@functools.cache  # one init program per model; states are immutable, so sharing one is safe
def new_state(model: nn.Module, seed: int = 0) -> train_state.TrainState:
    x, _ = batch(seed)
    variables = jax.jit(model.init)(jax.random.key(seed), x)  # eagerly, init is some hundred small programs
    return train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(LR))


def _loss(variables, apply_fn, x, y, total, max_grad: bool = False):
    if max_grad:  # Flax's opt-in: autodiff takes the max of fp8 "gradients" instead of their sum
        variables = {**variables, OWG: jax.tree.map(
            lambda v: jax.lax.convert_element_type(v, fp8_ops.fp32_max_grad), variables[OWG])}
    # Normalized by the whole batch, so each microbatch's gradients are the batch's rows.
    return jnp.sum(jnp.square(apply_fn(variables, x) - y)) / total


# The loops below are plain Python around two jitted programs, as many real loops
# are; each program compiles once per model and microbatch shape.
@functools.partial(jax.jit, static_argnames="max_grad")
def grads(state, x, y, total, max_grad=False):
    """Gradients of the whole variable dict: the fp8 collection's are its next values."""
    return jax.grad(_loss)(state.params, state.apply_fn, x, y, total, max_grad)


@jax.jit
def apply_gradients(state, grads):
    return state.apply_gradients(grads=grads)


# -- one step on the whole batch: the reference ---------------------------------------------


def whole_batch(state, batch, *, max_grad: bool = False):
    """``max_grad``: the fp8 state in Flax's ``fp32_max_grad`` dtype inside the loss."""
    x, y = batch
    return apply_gradients(state, grads(state, x, y, len(x), max_grad=max_grad))


# -- gradient accumulation over microbatches ---------------------------------------------------

_add = functools.partial(jax.tree.map, jnp.add)
#: How a loop merges its microbatches' fp8 "gradients": the right way, and two wrong ones.
MERGE = {
    "max": lambda parts: functools.reduce(functools.partial(jax.tree.map, jnp.maximum), parts),
    "sum": lambda parts: functools.reduce(_add, parts),  # like a gradient
    "last": lambda parts: parts[-1],  # the last microbatch's only
}


def accumulated(merge: str):
    """Gradients summed over microbatches; the fp8 collection merged by ``MERGE[merge]``."""

    def step(state, batch):
        x, y = batch
        parts = [grads(state, xm, ym, len(x)) for xm, ym in zip(np.split(x, MICROBATCHES), np.split(y, MICROBATCHES))]
        params = functools.reduce(_add, [p["params"] for p in parts])
        return apply_gradients(state, {"params": params, OWG: MERGE[merge]([p[OWG] for p in parts])})

    return step


# -- the optimizer: clipping, weight decay ---------------------------------------------------


def clipped(fp8_too: bool):
    """Gradients clipped to a global norm of CLIP; ``fp8_too``: the whole gradient tree, fp8 collection included."""
    clip = optax.clip_by_global_norm(CLIP)
    clip_tree = jax.jit(lambda tree: clip.update(tree, clip.init(tree))[0])

    def step(state, batch):
        x, y = batch
        g = grads(state, x, y, len(x))
        if fp8_too:  # the bug: the fp8 state counts toward the norm and is rescaled with the gradients
            g = clip_tree(g)
        else:
            g = {**g, "params": clip_tree(g["params"])}
        return apply_gradients(state, g)

    return step


def weight_decayed(fp8_too: bool):
    """Weight decay WD added to the gradients; ``fp8_too``: to the whole tree, fp8 collection included."""
    decay = optax.add_decayed_weights(WD)
    decay_tree = jax.jit(lambda tree, values: decay.update(tree, decay.init(values), values)[0])

    def step(state, batch):
        x, y = batch
        g = grads(state, x, y, len(x))
        if fp8_too:  # the bug: the fp8 collection's next values get WD x their previous values added
            g = decay_tree(g, state.params)
        else:
            g = {**g, "params": decay_tree(g["params"], state.params["params"])}
        return apply_gradients(state, g)

    return step


def warm(state: train_state.TrainState, seed: int = 1) -> train_state.TrainState:
    """One whole-batch step on another batch, so histories hold an entry and the next step's scales move."""
    return whole_batch(state, batch(seed))


# -- the same model in NNX (Flax's Linen fp8 ops behind nnx.bridge.ToNNX), stepped in place ---------------------


def nnx_model(seed: int = 0) -> nnx.Module:
    model = nnx.bridge.ToNNX(Mlp(), rngs=nnx.Rngs(seed))
    _lazy_init(model, batch(seed)[0])
    return model


@nnx.jit  # eagerly, Linen's init is some hundred small programs
def _lazy_init(model, x):
    nnx.bridge.lazy_init(model, x)


@functools.partial(jax.jit, static_argnums=0)
def _nnx_grads(graphdef, params, fp8, rest, x, y, total):
    def loss(params, fp8):
        return jnp.sum(jnp.square(nnx.merge(graphdef, params, fp8, rest, copy=True)(x) - y)) / total

    return jax.grad(loss, argnums=(0, 1))(params, fp8)


@jax.jit
def _sgd(params, grads):
    return jax.tree.map(lambda p, d: p - LR * d, params, grads)


def nnx_accumulated(merge: str):
    """Microbatched SGD on an NNX model, updated in place; the fp8 state merged by ``MERGE[merge]``."""

    def step(model, batch):
        x, y = batch
        graphdef, params, fp8, rest = nnx.split(model, nnx.Param, Fp8Meta, ...)
        parts = [_nnx_grads(graphdef, params, fp8, rest, xm, ym, len(x))
                 for xm, ym in zip(np.split(x, MICROBATCHES), np.split(y, MICROBATCHES))]
        g = functools.reduce(_add, [p for p, _ in parts])
        nnx.update(model, _sgd(params, g), MERGE[merge]([f for _, f in parts]))

    return step
