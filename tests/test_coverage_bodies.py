"""Records inside loop and branch bodies: a scanned stack of NNX layers keeps its module paths, and with
``errors=True`` a matmul inside a ``scan``/``while``/``cond`` body has its error figure.

The stack is two small layers, each an unquantized ``attention`` (``nnx.Linear``) and an ``mlp`` whose
matmul multiplies fp8 e4m3 operands (per-tensor scales: the input's a stored, delayed scale, the
kernel's from its amax), stacked with ``nnx.vmap`` and applied as a scan does: ``nnx.scan``, or
``jax.lax.scan`` over ``nnx.split``/``nnx.merge`` (MaxText's ``apply_scanned_layers``), with the body
under ``jax.checkpoint`` or not, or a ``jax.lax.while_loop`` over the layer index. Every one of these
rebuilds the layer from its state inside the body: the module the body calls is no object of the
stack's graph. The figures are held to a float64 numpy/ml_dtypes emulation of the same stack.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import qcheck
from qcheck import assert_quantized, coverage, format_coverage, skip_modules

D, LAYERS = 16, 2
E4M3_MAX = 448.0
#: The stored input scale of each layer's fp8 matmul: inputs up to 16 in magnitude fit e4m3's range (the
#: stack's stay under 9 on X), so nothing saturates.
X_SCALE = 16.0 / E4M3_MAX
X = np.random.default_rng(0).normal(size=(4, D)).astype(np.float32)


class Fp8Scale(nnx.Variable):
    """A stored (delayed) fp8 scale: state, not a parameter."""


def _fp8(x, scale):
    """``x`` onto e4m3's grid scaled by ``scale``; straight through in the backward pass."""
    q = jnp.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return x + jax.lax.stop_gradient(q - x)


class Fp8Dense(nnx.Module):
    """``x @ kernel``, both operands fp8 unless ``quantized`` is False (the unquantized twin)."""

    def __init__(self, rngs: nnx.Rngs, quantized: bool = True):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (D, D)) / np.sqrt(D))
        self.x_scale = Fp8Scale(jnp.float32(X_SCALE))
        self.quantized = quantized

    def __call__(self, x):
        kernel = self.kernel[...]
        if not self.quantized:
            return x @ kernel
        return _fp8(x, self.x_scale[...]) @ _fp8(kernel, jnp.max(jnp.abs(kernel)) / E4M3_MAX)


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, quantized: bool = True):
        self.attention = nnx.Linear(D, D, rngs=rngs)  # full precision by design
        self.mlp = Fp8Dense(rngs, quantized)

    def __call__(self, x):
        h = x + self.attention(x)
        return h + self.mlp(h)


HOWS = ("nnx.scan", "lax.scan", "lax.scan+checkpoint", "while_loop")


class Stack(nnx.Module):
    """``LAYERS`` layers stacked (each variable with a leading layer axis), applied one after another by ``how``."""

    def __init__(self, how: str, quantized: bool = True):
        self.how = how
        keys = jax.random.split(jax.random.key(0), LAYERS)
        self.layers = nnx.vmap(lambda key: Layer(nnx.Rngs(key), quantized))(keys)

    def __call__(self, x):
        if self.how == "nnx.scan":
            return nnx.scan(lambda x, layer: layer(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.layers)
        graphdef, state = nnx.split(self.layers)
        if self.how == "while_loop":
            def body(carry):
                i, x = carry
                return i + 1, nnx.merge(graphdef, jax.tree.map(lambda v: v[i], state))(x)
            return jax.lax.while_loop(lambda carry: carry[0] < LAYERS, body, (0, x))[1]

        def step(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x), None
        if self.how == "lax.scan+checkpoint":
            step = jax.checkpoint(step)
        return jax.lax.scan(step, x, state)[0]


def _stack(how: str, plant_scale: float | None = None) -> Stack:
    """The stack; ``plant_scale``: the second layer's stored input scale."""
    stack = Stack(how)
    if plant_scale is not None:
        scale = stack.layers.mlp.x_scale
        scale[...] = scale[...].at[1].set(plant_scale)
    return stack


# -- module paths inside the bodies ---------------------------------------------------------------

@pytest.mark.parametrize("how", HOWS)
def test_records_inside_a_loop_body_carry_the_stacked_modules_path(how):
    records = coverage(_stack(how), X)
    # One record per matmul of the body (not one per iteration), each under the stack's module path.
    assert [r.scope for r in records] == ["layers/attention", "layers/mlp"], format_coverage(records)
    assert [r.quantized for r in records] == [False, True]


@pytest.mark.parametrize("how", HOWS)
def test_skip_modules_spares_attention_inside_a_scanned_stack_should_pass(how):
    records = assert_quantized(_stack(how), X, skip=skip_modules("attention"))
    assert [r.skipped_by for r in records] == ["skip_modules('attention')", None]


@pytest.mark.parametrize("how", HOWS)
def test_assert_quantized_inside_a_scanned_stack_should_fail_naming_attention_by_its_module_path(how):
    with pytest.raises(AssertionError, match=r"assert_quantized: 1 of 2 matmuls reach full precision:\n  dot_general "
                                             r".*: lhs and rhs unquantized, in layers/attention\ndeclared: "):
        assert_quantized(_stack(how), X)


_MESH = jax.make_mesh((1,), ("x",))


def _shard_map(fn, **kwargs):
    try:
        from jax import shard_map
    except ImportError:  # jax 0.10 keeps it under experimental only
        from jax.experimental.shard_map import shard_map
    return shard_map(fn, mesh=_MESH, **kwargs)


#: Bodies that rebuild one layer (not a stack) from its state: each calls it on x, and those with two
#: branches call it in both (a cond's records are its branches').
BODIES = {
    "jax.checkpoint": lambda g, s, x: jax.checkpoint(lambda s, x: nnx.merge(g, s)(x))(s, x),
    "lax.cond": lambda g, s, x: jax.lax.cond(x.sum() > 0, lambda s, x: nnx.merge(g, s)(x),
                                             lambda s, x: -nnx.merge(g, s)(x), s, x),
    "shard_map": lambda g, s, x: _shard_map(lambda s, x: nnx.merge(g, s)(x), in_specs=(P(), P()),
                                            out_specs=P())(s, x),
    "nnx.remat": lambda g, s, x: nnx.remat(lambda layer, x: layer(x))(nnx.merge(g, s), x),
    "nnx.jit": lambda g, s, x: nnx.jit(lambda layer, x: layer(x))(nnx.merge(g, s), x),
}


class _Wrapped(nnx.Module):
    def __init__(self, kind: str):
        self.kind = kind
        self.block = Layer(nnx.Rngs(0))

    def __call__(self, x):
        graphdef, state = nnx.split(self.block)
        return BODIES[self.kind](graphdef, state, x)


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_records_inside_each_kind_of_body_carry_the_module_path(kind):
    records = coverage(_Wrapped(kind), X)
    branches = 2 if kind == "lax.cond" else 1
    assert [r.scope for r in records] == ["block/attention", "block/mlp"] * branches, format_coverage(records)
    assert_quantized(_Wrapped(kind), X, skip=skip_modules("block/attention"))


class _Twins(nnx.Module):
    """Two identical layers (the same shapes), each rebuilt inside its own ``jax.checkpoint``."""

    def __init__(self):
        self.first, self.second = Layer(nnx.Rngs(0)), Layer(nnx.Rngs(1))

    def __call__(self, x):
        for layer in (self.first, self.second):
            graphdef, state = nnx.split(layer)
            x = jax.checkpoint(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)
        return x


def test_identical_layers_rebuilt_in_bodies_each_keep_their_own_path():
    # Both layers match a rebuilt one by structure; the Python stack tells which it was rebuilt from.
    records = coverage(_Twins(), X)
    assert [r.scope for r in records] == ["first/attention", "first/mlp", "second/attention", "second/mlp"]


# -- error figures inside the bodies ---------------------------------------------------------------

def _np_fp8(x: np.ndarray, scale: float) -> np.ndarray:
    return np.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


def _np_mlp_errors(stack: Stack) -> list[float]:
    """Per layer, in float64: ``||fp8(h) @ fp8(W) - h @ W|| / ||h @ W||`` for the mlp's input h on ``X``."""
    layers = stack.layers
    wa, ba = (np.asarray(v[...], np.float64) for v in (layers.attention.kernel, layers.attention.bias))
    w, scales = np.asarray(layers.mlp.kernel[...], np.float64), np.asarray(layers.mlp.x_scale[...], np.float64)
    x, errors = X.astype(np.float64), []
    for i in range(LAYERS):
        h = x + x @ wa[i] + ba[i]
        out = _np_fp8(h, scales[i]) @ _np_fp8(w[i], np.abs(w[i]).max() / E4M3_MAX)
        ref = h @ w[i]
        errors.append(float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))
        x = h + out
    return errors


# The program computes in float32 (and XLA's CPU flushes e4m3 subnormals), the reference in float64.
RTOL = 1e-2


@pytest.mark.parametrize("how", HOWS)
def test_errors_inside_a_loop_body_are_the_worst_iteration_should_pass(how):
    stack = _stack(how)
    attention, mlp = coverage(stack, X, errors=True)
    expected = _np_mlp_errors(stack)
    assert min(expected) > 1e-3  # the quantization shows, so the figure can tell
    assert mlp.no_error is None and mlp.error is not None and np.isfinite(mlp.error), mlp
    np.testing.assert_allclose(mlp.error, max(expected), rtol=RTOL)
    assert attention.error is None and attention.no_error == "full-precision operands"


@pytest.mark.parametrize("how", HOWS)
def test_errors_inside_a_loop_body_should_fail_on_one_layers_stale_scale(how):
    # Layer 1's stored input scale is a million times too large: every code of its fp8 input underflows to
    # zero, so its product is zero (figure 1); layer 0 is as before.
    control, planted = _stack(how), _stack(how, plant_scale=X_SCALE * 1e6)
    (_, fine), (_, stale) = coverage(control, X, errors=True), coverage(planted, X, errors=True)
    expected = _np_mlp_errors(planted)
    assert expected[1] > 0.5 > 10 * expected[0]  # the plant spoils the second iteration only
    np.testing.assert_allclose(stale.error, expected[1], rtol=RTOL)  # the worst iteration's figure
    assert stale.error > 10 * fine.error


def _q(x):
    return x.astype(jnp.float8_e4m3fn).astype(jnp.float32)


A = np.random.default_rng(1).normal(size=(8, D)).astype(np.float32)
W = np.random.default_rng(2).normal(size=(D, D)).astype(np.float32)


def _in_cond(a, w):
    return jax.lax.cond(a[0, 0] > 0, lambda a: _q(a) @ _q(w), lambda a: _q(a) @ _q(2 * w), a)


def _np_rel(a: np.ndarray, w: np.ndarray) -> float:
    a, w = a.astype(np.float64), w.astype(np.float64)
    q = lambda x: x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)  # noqa: E731
    return float(np.linalg.norm(q(a) @ q(w) - a @ w) / np.linalg.norm(a @ w))


@pytest.mark.parametrize("sign", [1, -1], ids=["true branch", "false branch"])
def test_cond_gives_the_taken_branchs_matmul_its_figure(sign):
    a = np.abs(A) * sign
    false, true = coverage(_in_cond, a, W, errors=True)  # a cond's branches: the false one first
    taken, other, w = (true, false, W) if sign > 0 else (false, true, 2 * W)
    np.testing.assert_allclose(taken.error, _np_rel(a, w), rtol=1e-3)
    assert other.error is None and other.no_error == "in a cond branch these inputs do not take"


def test_a_loop_that_runs_no_iteration_says_so():
    def never(a, w):
        return jax.lax.while_loop(lambda c: c[0] < 0, lambda c: (c[0] + 1, _q(c[1]) @ _q(w)), (0, a))[1]

    (record,) = coverage(never, A, W, errors=True)
    assert record.error is None and record.no_error == "in a loop body these inputs run no iteration of"


def test_a_nan_in_one_iteration_is_the_worst_figure():
    # The second row of xs is NaN: that iteration's figure is NaN, and a NaN is worse than any figure.
    xs = np.stack([A, np.full_like(A, np.nan)])
    records = coverage(lambda xs, w: jax.lax.scan(lambda c, a: (c, _q(a) @ _q(w)), 0.0, xs)[1], xs, W, errors=True)
    (record,) = records
    assert record.no_error is None and np.isnan(record.error), format_coverage(records)


def test_coverage_table_shows_the_scanned_figure():
    shown = format_coverage(coverage(_stack("lax.scan"), X, errors=True))
    (row,) = [line for line in shown.splitlines() if "layers/mlp" in line]
    assert re.search(r"\byes\s+0\.\d+$", row), shown


@pytest.mark.parametrize("how", ["nnx.scan", "lax.scan+checkpoint"])
def test_check_layer_passes_on_the_scanned_stack_with_its_parameters_gradients(how):
    figures = qcheck.check_layer(_stack(how), Stack(how, quantized=False), X, skip=skip_modules("attention"))
    assert 0 < figures.rel_norm < 0.22
    assert set(figures.grad_rel_norms) == {"(input x)", "layers/attention/bias", "layers/attention/kernel",
                                           "layers/mlp/kernel"}, figures.grad_rel_norms
