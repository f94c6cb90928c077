"""No stale verdicts: code changed between two checks in one process is what the second check judges.

Each test checks a healthy fp8 layer (the control: it passes), changes the
code (a monkeypatched helper or method, a module rebuilt with another
setting) so that it silently stops quantizing, and checks again: the second
verdict must be the new code's. The last pair pins where a stale trace comes
from JAX itself: a ``jax.jit`` inside the layer keeps its own trace cache
until ``jax.clear_caches()`` (docs/checking-your-layer.md says so).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck

X = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(4, 8)
BOUNDS = {"max_rel_norm": 0.5, "max_grad_rel_norm": 1.0}
STOPPED = r"(?s)coverage: assert_quantized: 1 of 1 matmuls reach full precision.*tracks: assert_tracks: actual is bitwise equal"


def quantize(v: jax.Array) -> jax.Array:
    # Saturating, as a cast to e4m3fn must be, and straight through (check_layer's edge rows hold a value of 1e5
    # to it: a cast's own transpose would cast the gradient to e4m3fn too, unsaturated).
    q = jnp.clip(v, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return v + jax.lax.stop_gradient(q - v)


def no_quantization(v: jax.Array) -> jax.Array:
    return v


class Linear(nnx.Module):
    def __init__(self, quantized: bool):
        self.w = nnx.Param(jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8))
        self.quantized = quantized

    def __call__(self, x):
        w = self.w[...]
        if self.quantized:
            x, w = quantize(x), quantize(w)
        return x @ w


def _inner_jit_matmul(x, w):
    return quantize(x) @ quantize(w)


_INNER = jax.jit(_inner_jit_matmul)


class InnerJit(Linear):
    def __call__(self, x):
        return _INNER(x, self.w[...])


def test_a_monkeypatched_helper_is_judged_afresh(monkeypatch):
    qcheck.check_layer(Linear(True), Linear(False), X, **BOUNDS)
    monkeypatch.setattr(sys.modules[__name__], "quantize", no_quantization)
    with pytest.raises(AssertionError, match=STOPPED):
        qcheck.check_layer(Linear(True), Linear(False), X, **BOUNDS)


def test_a_monkeypatched_method_is_judged_afresh(monkeypatch):
    layer, twin = Linear(True), Linear(False)
    qcheck.check_layer(layer, twin, X, **BOUNDS)
    monkeypatch.setattr(Linear, "__call__", lambda self, x: x @ self.w[...])
    with pytest.raises(AssertionError, match=STOPPED):
        qcheck.check_layer(layer, twin, X, **BOUNDS)


def test_a_rebuilt_module_is_judged_afresh():
    qcheck.check_layer(Linear(True), Linear(False), X, **BOUNDS)
    with pytest.raises(AssertionError, match=STOPPED):
        qcheck.check_layer(Linear(False), Linear(False), X, **BOUNDS)


def test_coverage_reads_the_patched_code(monkeypatch):
    assert qcheck.coverage(Linear(True), X)[0].quantized
    monkeypatch.setattr(sys.modules[__name__], "quantize", no_quantization)
    assert not qcheck.coverage(Linear(True), X)[0].quantized


def test_a_jit_inside_the_layer_keeps_jax_s_own_trace_until_its_caches_are_cleared(monkeypatch):
    # The trace qcheck makes is new; the one JAX cached for _INNER on its first call is not.
    qcheck.check_layer(InnerJit(True), Linear(False), X, **BOUNDS)
    monkeypatch.setattr(sys.modules[__name__], "quantize", no_quantization)
    qcheck.check_layer(InnerJit(True), Linear(False), X, **BOUNDS)  # JAX's stale trace: still quantized
    jax.clear_caches()
    with pytest.raises(AssertionError, match=STOPPED):
        qcheck.check_layer(InnerJit(True), Linear(False), X, **BOUNDS)
