"""check_layer and copy_params_into on Equinox modules: parameters by field path, each one's gradient compared.

Equinox is no dependency of qcheck's: these tests skip, naming how to install it, where it is absent (the
Levanter environment has it: the Levanter stage of .ci/run runs them). Levanter's own block, haliax's
NamedArrays and its fp8 state, is checked as a module in tests/test_levanter.py.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcheck
from qcheck import formats
from qcheck.checks._compiles import counting_compilations
from qcheck.checks._layer import INPUT_GRAD
from tests.helpers import CHECK_LAYER_X, import_extra

eqx = import_extra("equinox")

X = CHECK_LAYER_X[0]  # 32 tokens of 32 features
KEY = jax.random.key(0)
PATHS = {"up/weight", "up/bias", "down/weight"}

# e4m3 fake quantization with a straight-through gradient, as a quantized training step has it.
_e4m3 = jax.custom_vjp(lambda x: formats.qdq(x, "e4m3fn_current"))
_e4m3.defvjp(lambda x: (_e4m3(x), None), lambda _, g: (g,))


def _matmul(quantized: bool, x, w):
    return _e4m3(x) @ _e4m3(w).T if quantized else x @ w.T  # eqx.nn.Linear holds its weight as [out, in]


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    quantized: bool = eqx.field(static=True)

    def __init__(self, quantized: bool, key, *, hidden: int = 64, down_bias: bool = False):
        k_up, k_down = jax.random.split(key)
        self.up = eqx.nn.Linear(32, hidden, key=k_up)
        self.down = eqx.nn.Linear(hidden, 16, use_bias=down_bias, key=k_down)
        self.quantized = quantized

    def hidden(self, x):
        return jax.nn.gelu(_matmul(self.quantized, x, self.up.weight) + self.up.bias[None, :])

    def __call__(self, x):
        return _matmul(self.quantized, self.hidden(x), self.down.weight)


@jax.custom_vjp
def _gradient_lost(w):
    return w


# The bug: a custom_vjp that sends back zeros, as a quantizer's backward that forgot its straight-through does.
_gradient_lost.defvjp(lambda w: (w, None), lambda _, g: (jnp.zeros_like(g),))


class _LostGradientMLP(MLP):
    """The quantized MLP whose down projection's weight gets no gradient; its forward is the working one's."""

    def __call__(self, x):
        return _matmul(True, self.hidden(x), _gradient_lost(self.down.weight))


class _DictInput(MLP):
    """An Equinox module called on a mapping and a keyword, as library blocks are: not a function of x."""

    def __call__(self, inputs, *, key=None):
        return super().__call__(inputs["tokens"])


class _StoredLinear(eqx.Module):
    """A projection kept as int8 codes with one float scale per output row, as a served model stores it."""

    weight: jax.Array
    scale: jax.Array

    def __init__(self, w: jax.Array):
        self.scale = jnp.max(jnp.abs(w), axis=1, keepdims=True) / 127
        self.weight = jnp.round(w / self.scale).astype(jnp.int8)


class _StoredMLP(MLP):
    """MLP whose down projection is stored as codes; its twin is the float MLP it was made from."""

    def __init__(self, float_mlp: MLP):
        super().__init__(True, KEY)
        self.up = float_mlp.up
        self.down = _StoredLinear(float_mlp.down.weight)

    def __call__(self, x):
        return _matmul(True, self.hidden(x), self.down.weight.astype(x.dtype) * self.down.scale)


def test_check_layer_should_pass_on_an_equinox_module_storing_int8_codes_frozen_with_their_scale():
    # Its integer codes and the scale beside them get no gradient (grad refuses integers) and are named; every
    # float parameter's gradient is still compared.
    twin = MLP(False, KEY)
    figures = qcheck.check_layer(_StoredMLP(twin), twin, X)
    assert set(figures.frozen) == {"down/weight"}, figures.frozen
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, "up/weight", "up/bias"}


# -- each parameter's gradient, by path ------------------------------------------------------------------

def test_check_layer_should_pass_on_an_equinox_module_comparing_each_parameters_gradient():
    layer, twin = MLP(True, KEY), MLP(False, KEY)
    figures = qcheck.check_layer(layer, twin, X)
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, *PATHS}
    assert all(0 < f <= 0.5 for f in figures.grad_rel_norms.values()), figures.grad_rel_norms
    assert 0 < figures.rel_norm <= 0.22 and [r.quantized for r in figures.coverage] == [True, True]
    # The compiled program is cached on the module's structure: a second layer like it compiles nothing.
    with counting_compilations() as log:
        qcheck.check_layer(MLP(True, jax.random.key(1)), MLP(False, jax.random.key(1)), X)
    assert not any(k.startswith("jit(step)") for k in log), log


def test_check_layer_should_fail_on_a_lost_parameter_gradient_naming_its_path():
    with pytest.raises(AssertionError, match=r"^check_layer: 1 check\(s\) failed:\n  gradients: down/weight "
                                             r"\(float32\) has relative norm 1\.0000 against the reference's, "
                                             r"above the bound 0\.5\n(    flushed: [^\n]*\n)*declared: nothing read"):
        qcheck.check_layer(_LostGradientMLP(True, KEY), MLP(False, KEY), X)


def test_skip_grads_names_an_equinox_parameter_by_path_should_pass():
    # Control of the failure above: the lost gradient is the one thing wrong with that layer.
    figures = qcheck.check_layer(_LostGradientMLP(True, KEY), MLP(False, KEY), X, skip_grads=["down/weight"])
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, "up/weight", "up/bias"}


def test_check_layer_on_a_function_of_x_compares_only_the_input_gradient():
    # What check_layer saw of an Equinox module before it took one: the lost gradient passes unseen.
    layer, twin = _LostGradientMLP(True, KEY), MLP(False, KEY)
    figures = qcheck.check_layer(lambda x: layer(x), lambda x: twin(x), X)
    assert set(figures.grad_rel_norms) == {INPUT_GRAD}


@pytest.mark.parametrize("twin, skip_grads, error", [
    (lambda: MLP(False, KEY, down_bias=True), (),
     r"check_layer: reference has another structure than layer: parameters in reference only: down/bias "
     r"\(build the twin"),
    (lambda: MLP(False, jax.random.key(1)), (),
     r"check_layer: reference's weights differ from layer's: down/weight \(float32\[16, 64\]\) differs in 1024 of "
     r"1024 values; make the twin with qcheck.copy_params_into\(layer, twin\)"),
    (lambda: MLP(False, KEY), ["down.weight"],
     r"check_layer: skip_grads names \['down.weight'\], which are not parameters; parameter paths: down/weight, "
     r"up/bias, up/weight$"),
])
def test_check_layer_should_fail_on_a_twin_of_another_structure_naming_the_paths(twin, skip_grads, error):
    with pytest.raises(ValueError, match=error):
        qcheck.check_layer(MLP(True, KEY), twin(), X, skip_grads=skip_grads)


# -- call=: a module that is not a function of x ---------------------------------------------------------

def _call(module, x):
    return module({"tokens": x}, key=None)


def test_call_says_how_to_call_the_module_should_pass():
    figures = qcheck.check_layer(_DictInput(True, KEY), _DictInput(False, KEY), X, call=_call)
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, *PATHS} and len(figures.coverage) == 2


def test_without_call_the_module_cannot_be_called_on_x_should_fail():
    with pytest.raises(qcheck.UserCodeError, match=r"^check_layer: layer could not be traced and run on \w+: "):
        qcheck.check_layer(_DictInput(True, KEY), _DictInput(False, KEY), X)


# -- copy_params_into -----------------------------------------------------------------------------------

def _leaves(module) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(eqx.filter(module, eqx.is_array))[0]}


def test_copy_params_into_should_pass_returning_a_twin_with_the_layers_weights():
    layer, built = MLP(True, KEY), MLP(False, jax.random.key(1))
    before = _leaves(built)
    assert not any(np.array_equal(v, before[k]) for k, v in _leaves(layer).items())  # the control
    twin = qcheck.copy_params_into(layer, built)
    assert {k: v.tobytes() for k, v in _leaves(twin).items()} == {k: v.tobytes() for k, v in _leaves(layer).items()}
    assert twin.quantized is False  # what is not a parameter stays the twin's
    assert all(np.array_equal(v, before[k]) for k, v in _leaves(built).items())  # Equinox modules are immutable


@pytest.mark.parametrize("reference, error", [
    (lambda: MLP(False, KEY, hidden=48), r"copy_params_into: parameter down/weight is float32\[16, 64\] in layer but "
                                         r"float32\[16, 48\] in reference \(layer parameters: "),
    (lambda: MLP(False, KEY, down_bias=True), r"copy_params_into: reference parameter down/bias has no counterpart in "
                                              r"layer"),
    (lambda: qcheck.build_moe("mixtral", "none"), r"copy_params_into: layer and reference must both be NNX modules or "
                                                  r"both Equinox modules, got MLP \(equinox\) and MoE \(nnx\)"),
])
def test_copy_params_into_should_fail_naming_the_first_leaf(reference, error):
    with pytest.raises(ValueError, match=error):
        qcheck.copy_params_into(MLP(True, KEY), reference())


# -- Equinox stays optional --------------------------------------------------------------------------------

def test_check_layer_does_not_import_equinox_for_other_layers():
    code = """if True:
        import sys, jax, numpy as np, qcheck
        q = jax.custom_vjp(lambda x: qcheck.formats.qdq(x, "e4m3fn_current"))
        q.defvjp(lambda x: (q(x), None), lambda _, g: (g,))
        x, w = np.random.default_rng(0).normal(size=(2, 8, 8)).astype(np.float32)
        qcheck.check_layer(lambda x: q(x) @ q(w), lambda x: x @ w, x)
        assert "equinox" not in sys.modules, "check_layer imported equinox"
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
