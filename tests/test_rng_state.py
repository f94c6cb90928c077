"""assert_rng_state_flat: the RNG state entering a user's step, across layer counts (NNX, Linen, a pytree)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import linen, nnx

import qcheck
from qcheck.suite import cases, invariants
from tests.helpers import decoder_at, module_train_step

X = jnp.ones((2, 4), jnp.float32)


class Noisy(nnx.Module):
    """A layer that draws noise: from the caller's stream (``fork=False``) or from a fork of its own."""

    def __init__(self, rngs: nnx.Rngs, fork: bool):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.rngs = rngs.fork() if fork else rngs

    def __call__(self, x):
        return self.lin(x) + jax.random.normal(self.rngs.noise(), x.shape)


class Stack(nnx.Module):
    def __init__(self, layers: int, fork: bool = False):
        rngs = nnx.Rngs(0, noise=1)
        self.layers = nnx.List([Noisy(rngs, fork) for _ in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@nnx.jit
def forward(model, x):  # nnx.jit threads the module's state in and out
    return model(x)


def stack(fork: bool = False):
    return lambda n: Stack(n, fork)


def test_rng_state_flat_passes_a_shared_stream_should_pass():
    figures = qcheck.assert_rng_state_flat(stack(), forward, X, layers=(1, 2, 4))
    assert isinstance(figures, qcheck.RngStateFigures)
    assert (figures.u32, figures.rng_leaves) == (4, 4)  # two streams (default, noise), a key and a count each
    assert {n: c["u32"] for n, c in figures.entry_params.items()} == {1: 4, 2: 4, 4: 4}
    assert figures.entry_params[1]["total"] < figures.entry_params[4]["total"]  # the parameters did grow


def test_rng_state_flat_catches_a_forked_stream_per_layer_should_fail():
    with pytest.raises(AssertionError, match=r"(?s)^fork: assert_rng_state_flat: RNG state grows with the layers: "
                       r"u32 entry parameters of the step by layer count \{1: 4, 2: 8, 4: 16\}, RNG state leaves "
                       r"\{1: 4, 2: 8, 4: 16\}; .*\n  layers/\*/rngs \(default, noise\): \{1: 4, 2: 8, 4: 16\} "
                       r"\(e\.g\. layers/3/rngs\)$"):
        qcheck.assert_rng_state_flat(stack(fork=True), forward, X, layers=(1, 2, 4), label="fork")


@jax.jit
def forward_over_pytree(model, x):  # jax.jit flattens the module as a pytree: a shared stream once per reference
    y = model(x)
    return y, model


def test_rng_state_flat_names_a_shared_stream_passed_once_per_reference_should_fail():
    # The model holds one stream; the compiled step takes it once per layer that references it.
    with pytest.raises(AssertionError, match=r"(?s)by layer count \{1: 4, 2: 8\}, RNG state leaves \{1: 4, 2: 4\}; "
                       r"the model's RNG variables do not change, their references do: the step takes the module "
                       r"as a pytree \(jax\.jit\).*\n  layers/\*/rngs \(default, noise\): \{1: 4, 2: 8\}"):
        qcheck.assert_rng_state_flat(stack(), forward_over_pytree, X, layers=(1, 2))


# -- a pytree of arrays and a plain function ------------------------------------------------------------


def pytree_model(keys_per_layer: bool):
    def build(n):
        keys = [jax.random.key(i) for i in range(n)] if keys_per_layer else jax.random.key(0)
        return {"w": [jnp.eye(4)] * n, "keys": keys}

    return build


def pytree_step(state, x):
    keys = state["keys"] if isinstance(state["keys"], list) else [state["keys"]] * len(state["w"])
    for w, key in zip(state["w"], keys):
        x = x @ w + jax.random.normal(key, x.shape)
    return x, state


def test_rng_state_flat_passes_a_pytree_with_one_key_should_pass():
    figures = qcheck.assert_rng_state_flat(pytree_model(False), pytree_step, X, layers=(1, 3))
    assert (figures.u32, figures.rng_leaves) == (1, 1)


def test_rng_state_flat_catches_a_pytree_key_per_layer_should_fail():
    with pytest.raises(AssertionError, match=r"(?s)by layer count \{1: 1, 3: 3\}.*\n  keys/\*: \{1: 1, 3: 3\} "
                       r"\(e\.g\. keys/2\)"):
        qcheck.assert_rng_state_flat(pytree_model(True), pytree_step, X, layers=(1, 3))


# -- Linen: (module, variables), the module static -------------------------------------------------------


class LinenStack(linen.Module):
    layers: int
    key_per_layer: bool

    @linen.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = linen.Dense(4)(x)
            if self.key_per_layer:  # a key of its own per layer, in the ``rngs`` collection
                key = self.variable("rngs", f"key_{i}", lambda: jax.random.key_data(jax.random.key(0)))
                x = x + jax.random.normal(jax.random.wrap_key_data(key.value), x.shape)
        return x


def linen_model(key_per_layer: bool):
    def build(n):
        module = LinenStack(n, key_per_layer)
        return module, module.init(jax.random.key(0), X)

    return build


@functools.partial(jax.jit, static_argnums=0)
def linen_step(module, variables, x):
    return module.apply(variables, x, mutable=True)  # every collection back: the state out


def test_rng_state_flat_passes_a_linen_stack_without_rng_state_should_pass():
    figures = qcheck.assert_rng_state_flat(linen_model(False), linen_step, X, layers=(1, 2))
    assert (figures.u32, figures.rng_leaves) == (0, 0)


def test_rng_state_flat_catches_a_linen_rngs_collection_per_layer_should_fail():
    with pytest.raises(AssertionError, match=r"(?s)by layer count \{1: 1, 2: 2\}, RNG state leaves \{1: 1, 2: 2\}"
                       r".*\n  rngs/key_\*: \{1: 1, 2: 2\} \(e\.g\. rngs/key_1\)"):
        qcheck.assert_rng_state_flat(linen_model(True), linen_step, X, layers=(1, 2))


# -- what it refuses ----------------------------------------------------------------------------------------


def test_rng_state_flat_refuses_fewer_than_two_layer_counts():
    with pytest.raises(ValueError, match=r"^assert_rng_state_flat: layers: growth needs at least two layer counts, "
                       r"got \(2, 2\)$"):
        qcheck.assert_rng_state_flat(stack(), forward, X, layers=(2, 2))


def test_rng_state_flat_refuses_a_model_that_did_not_grow():
    with pytest.raises(ValueError, match=r"^assert_rng_state_flat: build: the model did not grow: build\(1\) and "
                       r"build\(2\) give the same 8 state leaves of the same shapes"):
        qcheck.assert_rng_state_flat(lambda n: Stack(2), forward, X, layers=(1, 2))


@jax.jit
def forward_without_state(model, x):
    return model(x)


def test_rng_state_flat_refuses_a_step_that_returns_no_state():
    # jax.jit drops the module's updates unless returned: JAX would prune the streams the step never reads.
    with pytest.raises(ValueError, match=r"^assert_rng_state_flat: step: returns no state: its outputs hold 0 of "
                       r"the 4 RNG state leaves of build\(1\)'s model"):
        qcheck.assert_rng_state_flat(stack(), forward_without_state, X, layers=(1, 2))


def test_rng_state_flat_names_the_build_that_raised():
    def build(n):
        raise RuntimeError("no such config")

    with pytest.raises(qcheck.UserCodeError, match=r"^assert_rng_state_flat: build could not be traced and run"):
        qcheck.assert_rng_state_flat(build, forward, X)


def test_rng_state_flat_refuses_a_build_that_is_not_a_function():
    with pytest.raises(TypeError, match=r"^assert_rng_state_flat: build: a function of the layer count that builds the "
                       r"model, not a Stack$"):
        qcheck.assert_rng_state_flat(Stack(1), forward, X)


# -- qcheck's own decoder, as the suite's rng invariant counts it -----------------------------------------


def test_rng_state_flat_counts_what_the_suites_rng_invariant_counts():
    # The public check on qcheck's decoder under a user's train step, and the suite's own count (one judgement).
    figures = qcheck.assert_rng_state_flat(decoder_at("nvfp4"), module_train_step, cases.layer_input("mixtral"),
                                           layers=(1, 2))
    suite = invariants.rng_states("mixtral", "nvfp4", depths=(1, 2))
    assert figures.u32 == suite[1].u32 == suite[2].u32


# -- docs/checking-your-training-loop.md --------------------------------------------------------------------


def test_the_guide_example_fails_on_a_fork_per_layer_and_passes_on_the_callers_streams():
    doc = (Path(__file__).parent.parent / "docs" / "checking-your-training-loop.md").read_text()
    (block,) = re.findall(r"<!-- training-loop: rng -->\n```python\n(.*?)```", doc, re.S)
    shown = re.search(r"```text\n(assert_rng_state_flat: .*?)\n```", doc, re.S).group(1)
    with pytest.raises(AssertionError) as info:
        exec(compile(block, "docs/checking-your-training-loop.md[rng]", "exec"), {"__name__": "doc_rng"})
    assert str(info.value) == shown  # the doc shows the message as it is
    fixed = block.replace("rngs.fork()  # a stream of its own, per layer", "rngs")
    assert fixed != block
    exec(compile(fixed, "docs/checking-your-training-loop.md[rng, fixed]", "exec"), {"__name__": "doc_rng"})
