"""One policy for an error of the code under check: a UserCodeError from every entry point, the original chained.

A layer's own ``AssertionError`` (MaxText asserts its tile sizes on CPU) must
not read as a failed check, and its ``ValueError`` not as a misuse of qcheck.
Each should-fail row below has its should-pass twin: qcheck's own failures and
usage errors keep their types.
"""

from __future__ import annotations

import unittest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck.testing import QuantizationAssertions

X = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(4, 8)
W = np.linspace(-0.5, 0.5, 64, dtype=np.float32).reshape(8, 8)


def tile_assert(x):
    bv, s = 1024, x.shape[0]
    assert bv <= s, f"v=64 bv={bv} s={s}"  # MaxText's megablox tile check, failing as it does on CPU
    return x @ W


def static_value_error(x):
    raise ValueError("Found data on value of type State assigned to static attribute")


def run_time_error(x):
    def host(v):
        raise RuntimeError("the kernel's interpreter gave up")

    jax.debug.callback(host, x)  # effectful: the compiled run cannot drop it
    return x @ W


class Raising(nnx.Module):
    def __init__(self, fn):
        self.w = nnx.Param(jnp.asarray(W))
        self.fn = fn

    def __call__(self, x):
        return self.fn(x) + 0 * self.w[...].sum()


class Healthy(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.asarray(W))

    def __call__(self, x):
        return x @ self.w[...]


class _Case(QuantizationAssertions, unittest.TestCase):
    def runTest(self):  # unittest needs one to build an instance
        pass


ENTRIES = {
    "coverage": lambda fn: qcheck.coverage(fn, X),
    "coverage errors=True": lambda fn: qcheck.coverage(fn, X, errors=True),
    "assert_quantized": lambda fn: qcheck.assert_quantized(fn, X),
    "check_layer": lambda fn: qcheck.check_layer(Raising(fn), Healthy(), X),
    "check_layer reference": lambda fn: qcheck.check_layer(Healthy(), Raising(fn), X),
    "assertQuantized": lambda fn: _Case().assertQuantized(fn, X),
    "assertLayerChecks": lambda fn: _Case().assertLayerChecks(Raising(fn), Healthy(), X),
}
NAMES = {"coverage": "coverage: fn", "coverage errors=True": "coverage: fn", "assert_quantized": "assert_quantized: fn",
         "check_layer": "check_layer: layer", "check_layer reference": "check_layer: reference",
         "assertQuantized": "assert_quantized: fn", "assertLayerChecks": "check_layer: layer"}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("fn, original, text", [
    (tile_assert, AssertionError, "AssertionError: v=64 bv=1024 s=4"),
    (static_value_error, ValueError, "ValueError: Found data on value of type State"),
])
def test_an_error_of_the_code_under_check_is_one_user_code_error(entry, fn, original, text):
    with pytest.raises(qcheck.UserCodeError) as info:
        ENTRIES[entry](fn)
    message = str(info.value)
    assert message.startswith(f"{NAMES[entry]} could not be traced and run on {jax.default_backend()}: {text}")
    assert "\n" not in message
    assert isinstance(info.value, ValueError) and type(info.value.__cause__) is original


def test_an_error_of_the_compiled_run_is_a_user_code_error_too():
    # Tracing succeeds; the program fails when coverage(errors=True) runs it.
    qcheck.coverage(run_time_error, X)
    with pytest.raises(qcheck.UserCodeError, match=r"^coverage: fn could not be traced and run on \w+: "):
        qcheck.coverage(run_time_error, X, errors=True)


def test_qcheck_s_own_failures_and_usage_errors_keep_their_types():
    with pytest.raises(AssertionError, match="^assert_quantized: 1 of 1 matmuls reach full precision") as info:
        qcheck.assert_quantized(lambda x: x @ W, X)
    assert not isinstance(info.value, qcheck.UserCodeError)
    with pytest.raises(ValueError, match="^assert_quantized: machinery must be") as info:
        qcheck.assert_quantized(lambda x: x @ W, X, machinery="jax")
    assert not isinstance(info.value, qcheck.UserCodeError)
    with pytest.raises(ValueError, match="^check_layer: layer's output=5 does not index the output") as info:
        qcheck.check_layer(Healthy(), Healthy(), X, output=5)
    assert not isinstance(info.value, qcheck.UserCodeError)
    with pytest.raises(AssertionError, match=r"^check_layer: 2 check\(s\) failed:\n  coverage: assert_quantized: "):
        qcheck.check_layer(Healthy(), Healthy(), X)


def test_a_nested_user_code_error_names_the_innermost_call():
    def calls_coverage(x):
        qcheck.coverage(static_value_error, x)
        return x @ W

    with pytest.raises(qcheck.UserCodeError, match="^coverage: fn could not"):
        qcheck.assert_quantized(calls_coverage, X)


def test_a_checks_wrapper_names_a_user_code_error_once():
    with pytest.raises(qcheck.UserCodeError) as info:
        qcheck.assert_no_uninitialized_reads(static_value_error, X)
    assert str(info.value).startswith("assert_no_uninitialized_reads: fn could not be traced and run on ")
    assert str(info.value).count("assert_no_uninitialized_reads") == 1


def test_a_bug_in_qcheck_s_own_walk_is_not_blamed_on_the_code_under_check(monkeypatch):
    def fp8_matmul(x):
        return x.astype(jnp.float8_e4m3fn).astype(jnp.float32) @ W.astype(jnp.float8_e4m3fn).astype(jnp.float32)

    qcheck.coverage(fp8_matmul, X, errors=True)
    monkeypatch.setattr("qcheck._coverage._chain.widest_float", None)  # the walk itself now fails
    with pytest.raises(TypeError, match="'NoneType' object is not callable") as info:
        qcheck.coverage(fp8_matmul, X, errors=True)
    assert not isinstance(info.value, qcheck.UserCodeError)
