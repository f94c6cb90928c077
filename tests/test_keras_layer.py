"""A Keras layer or model as a layer form of ``qcheck.check_layer``: its trainable variables are its parameters.

Runs in Keras's own environment (.ci/keras.sh, ``tox -e keras``, the keras stage of .ci/run) with
``KERAS_BACKEND=jax``; skipped, naming how to install and run it, where Keras is not importable on JAX.
Measured on Keras 3.15.1 (jax 0.12.0.1, Python 3.12), on the CPU.

check_layer runs a Keras layer statelessly, as ``layer.stateless_call(trainable values, non-trainable values, x)``
does (keras/src/layers/layer.py:1089-1200: its variables mapped to values in Keras's ``StatelessScope``), but
calling ``layer(x)`` there, as the layer computes when called (stateless_call skips ``Layer.__call__`` and its
autocast), under plain ``jax.value_and_grad``: its parameters are its trainable variables by ``variable.path``;
non-trainable variables (an int8 kernel's codes, its scale) and the float8 scales and amax histories Keras
overwrites with their "gradient" are state.

* int8: ``quantize("int8")`` stores the kernel as int8 codes, a non-trainable variable of the kernel's path, while
  the float twin's kernel is a parameter. check_layer compares the gradients both have (the bias, the input) and
  names the kernel in ``LayerFigures.frozen``; a planted bug in a Dense subclass's int8 call (its custom
  gradient forgets the kernel's scale; its forward drops the input's scale) fails, naming the gradient or output;
* float8: the kernel stays a trainable float32 variable, so its gradient is compared; a planted float8 Dense
  whose kernel quantize-dequantize has no straight-through gradient fails naming ``qdense/kernel``;
* a model's twin made by the same constructor has its layers named anew by Keras (``dense_2`` for ``dense``): its
  variables pair with the layer's by place and take the layer's paths;
* sites: Keras is machinery, so a stock Dense's site is its own line in Keras (dense.py), a subclass's its line here.
"""

from __future__ import annotations

import inspect
import os
import re

import numpy as np
import pytest

import qcheck
from tests.helpers import keras_on_jax

NAME = "qdense"
UNITS, IN = 16, 32
X = np.random.default_rng(0).normal(size=(8, IN)).astype(np.float32)
FP8 = {"weights": "e4m3fn", "activations": "e4m3fn"}
#: Keras 3.15.1's ``Variable.__array__`` takes no ``copy`` keyword, which numpy 2.5 warns of on every
#: ``get_weights()``; the suite turns warnings into errors.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
RUN = ("run its tests with KERAS_BACKEND=jax: .ci/keras.sh run VENV/bin/python python -m pytest "
       "tests/test_keras_layer.py (tox -e keras)")


@pytest.fixture(scope="module")
def keras():
    """Keras on its JAX backend, once: skipped, naming how to install or run it, where it is absent or elsewhere;
    its tests run with rank promotion allowed (Dense adds its bias by rank broadcasting)."""
    yield from keras_on_jax(RUN)


def _init(keras, seed: int) -> dict:
    return dict(kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
                bias_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=seed + 1))


def _pair(keras, mode: str, cls=None):
    """A Dense (or subclass ``cls``) quantized to ``mode`` and its float32 twin, the twin made the Keras way."""
    cls = cls or keras.layers.Dense
    layer = cls(UNITS, name=NAME, **_init(keras, 0))
    layer.build((None, IN))
    twin = keras.layers.Dense(UNITS, name=NAME, **_init(keras, 7))  # other weights: set_weights makes them the same
    twin.build((None, IN))
    twin.set_weights(layer.get_weights())
    layer.quantize(mode, type_check=cls is keras.layers.Dense)
    return layer, twin


@pytest.fixture(scope="module")
def int8_pair(keras):
    return _pair(keras, "int8")


@pytest.fixture(scope="module")
def float8_pair(keras):
    return _pair(keras, "float8")


def _message(failure) -> str:
    return str(failure.value).replace(os.sep, "/")


# -- int8: the kernel frozen into codes on one side --------------------------------------------------------------

def test_keras_int8_dense_against_its_float_twin_compares_what_both_have_should_pass(keras, int8_pair):
    """Keras 3.15.1: quantize('int8') turns qdense/kernel into a non-trainable int8 variable (its codes) and adds
    qdense/kernel_scale; the twin's kernel is a float32 parameter. The bias's and the input's gradients are compared;
    the kernel is named frozen on the layer's side, with what each holds, not a usage error. The site is the stock
    Dense's own line in Keras (Keras is machinery; no numpy.py)."""
    layer, twin = int8_pair
    assert [(v.path, v.trainable) for v in layer.variables] == [
        (f"{NAME}/bias", True), (f"{NAME}/kernel", False), (f"{NAME}/kernel_scale", False)]
    figures = qcheck.check_layer(layer, twin, X)
    assert sorted(figures.grad_rel_norms) == ["(input x)", f"{NAME}/bias"], figures.grad_rel_norms
    assert 0 < figures.worst_grad[1] < 0.05 and 0 < figures.rel_norm < 0.05, (figures.rel_norm, figures.worst_grad)
    assert dict(figures.frozen) == {f"{NAME}/kernel": "frozen in the layer (int8[32, 16], state: no gradient); a "
                                                       "parameter of the reference (float32[32, 16])"}
    (site,) = figures.coverage
    assert re.fullmatch(r"\S*keras/src/layers/core/dense\.py:\d+", site.location.replace(os.sep, "/")), site
    assert site.function == "Dense._int8_call.<locals>.matmul_with_inputs_gradient", site
    # call= runs in Keras's StatelessScope, as the layer itself does: the same figures.
    called = qcheck.check_layer(layer, twin, X, call=lambda m, x: m(x, training=False))
    assert called.grad_rel_norms == figures.grad_rel_norms and called.frozen == figures.frozen, called


def test_keras_int8_model_twin_named_anew_pairs_by_place_should_pass(keras):
    """Keras 3.15.1: a Sequential of two Dense and its twin from the same constructor, every layer named by Keras
    (the twin's are sequential_1/dense_2, ...): the twin's variables take the layer's paths, the kernels of
    both Dense are frozen in the layer, and the biases' gradients are compared."""
    def model(seed):
        return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(8, **_init(keras, seed)),
                                 keras.layers.Dense(4, **_init(keras, seed + 2))])

    layer, twin = model(0), model(10)
    twin.set_weights(layer.get_weights())
    assert {v.path for v in twin.variables}.isdisjoint(v.path for v in layer.variables)
    with pytest.warns(UserWarning, match="Layer InputLayer does not have a `quantize` method"):
        layer.quantize("int8")  # Keras warns of every leaf it cannot quantize, InputLayer too
    figures = qcheck.check_layer(layer, twin, X)
    paths = [v.path for v in layer.variables]
    assert sorted(figures.grad_rel_norms) == sorted(["(input x)", *(p for p in paths if p.endswith("/bias"))])
    assert sorted(figures.frozen) == sorted(p for p in paths if p.endswith("/kernel")), figures.frozen


class _Planted:
    """Dense subclasses with Keras 3.15.1's int8 call (keras/src/layers/core/dense.py:781-829, without LoRA)
    copied and one bug planted: ``bug`` None is the faithful copy, the control."""

    @staticmethod
    def dense(keras, bug: str | None):
        ops = keras.ops

        class PlantedDense(keras.layers.Dense):
            def _int8_call(self, inputs, training=None):
                @ops.custom_gradient
                def matmul_with_inputs_gradient(inputs, kernel, kernel_scale):
                    def grad_fn(*args, upstream=None):
                        if upstream is None:
                            (upstream,) = args
                        float_kernel = ops.cast(kernel, self.compute_dtype)
                        if bug != "grad":  # the plant: the kernel's codes taken for its values, unscaled
                            float_kernel = ops.divide(float_kernel, kernel_scale)
                        return ops.matmul(upstream, ops.transpose(float_kernel)), None, None

                    inputs, inputs_scale = self.inputs_quantizer(inputs, axis=-1)
                    output_scale = kernel_scale if bug == "scale" else ops.multiply(kernel_scale, inputs_scale)
                    x = ops.matmul(inputs, kernel)  # the int8 matmul: its site is this line
                    return ops.divide(ops.cast(x, self.compute_dtype), output_scale), grad_fn

                x = matmul_with_inputs_gradient(inputs, ops.convert_to_tensor(self._kernel),
                                                ops.convert_to_tensor(self.kernel_scale))
                return ops.add(x, self.bias)

        return PlantedDense


def test_keras_int8_dense_subclass_faithful_copy_should_pass(keras):
    """Keras 3.15.1: the control of the plants below: the copy of Keras's int8 call passes, its site at its own
    line in this file (a subclass's code is the model's), with machinery=('keras',) given or not."""
    layer, twin = _pair(keras, "int8", _Planted.dense(keras, None))
    figures = qcheck.check_layer(layer, twin, X)
    assert sorted(figures.grad_rel_norms) == ["(input x)", f"{NAME}/bias"] and list(figures.frozen) == [
        f"{NAME}/kernel"], figures
    (site,) = figures.coverage
    assert re.fullmatch(r"\S*tests/test_keras_layer\.py:\d+", site.location.replace(os.sep, "/")), site
    assert site.function.endswith("PlantedDense._int8_call.<locals>.matmul_with_inputs_gradient"), site
    (explicit,) = qcheck.coverage(layer, X, machinery=("keras",))
    assert (explicit.location, explicit.function) == (site.location, site.function), explicit


@pytest.mark.parametrize("bug, expected", [
    ("grad", r"gradients: \(input x\) \(float32\) has relative norm \d+\.\d+ against the reference's, above the "
             r"bound 0\.5"),
    ("scale", r"tracks: assert_tracks: relative norm \d+\.\d+ exceeds the bound 0\.22"),
])
def test_keras_int8_dense_planted_bug_should_fail_naming_it(keras, bug, expected):
    """Keras 3.15.1: the plants. 'grad': the custom gradient multiplies by the kernel's int8 codes, not their
    dequantized values (the scale forgotten): the forward passes, the input's gradient is ~127/absmax too large.
    'scale': the forward divides by the kernel's scale only, the input's dropped: the output is off. Each fails,
    naming what it breaks; the frozen kernel is named as not compared."""
    layer, twin = _pair(keras, "int8", _Planted.dense(keras, bug))
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(layer, twin, X)
    message = _message(failure)
    assert re.search(expected, message), message
    if bug == "grad":
        assert "tracks" not in message and f"{NAME}/bias" not in message.split("not compared")[0], message
    assert (f"not compared: the gradient of {NAME}/kernel, frozen in the layer (int8[32, 16], state: no gradient)"
            in message), message


# -- float8: the kernel stays a parameter ----------------------------------------------------------------------------

def test_keras_float8_dense_compares_the_kernel_gradient_should_pass(keras, float8_pair):
    """Keras 3.15.1: quantize('float8') keeps the kernel a trainable float32 variable and adds six trainable
    scales and amax histories that Keras overwrites with their gradient (overwrite_with_gradient): those are state.
    The kernel's, the bias's and the input's gradients are compared; nothing is frozen."""
    layer, twin = float8_pair
    assert [v.path for v in layer.trainable_variables if not v.overwrite_with_gradient] == [
        f"{NAME}/kernel", f"{NAME}/bias"]
    figures = qcheck.check_layer(layer, twin, X)
    assert sorted(figures.grad_rel_norms) == ["(input x)", f"{NAME}/bias", f"{NAME}/kernel"], figures.grad_rel_norms
    assert 0 < figures.grad_rel_norms[f"{NAME}/kernel"] < 0.2, figures.grad_rel_norms
    assert dict(figures.frozen) == {}


def test_keras_float8_dense_without_a_straight_through_kernel_gradient_should_fail_naming_the_kernel(keras):
    """Keras 3.15.1: a float8 Dense whose call quantize-dequantizes the kernel under stop_gradient (Keras's own
    forward, its e5m2 output-gradient path left out): the output and the input's gradient track the twin, the
    kernel's gradient is zero. Declared e4m3fn (no grads role: the plant has none), check_layer fails on the
    gradients alone, naming qdense/kernel."""
    ops = keras.ops
    qdq = keras.quantizers.quantize_and_dequantize

    class NoStraightThrough(keras.layers.Dense):
        def _float8_call(self, inputs, training=None):
            x = qdq(inputs, self.inputs_scale, "float8_e4m3fn", self.compute_dtype)
            kernel = ops.stop_gradient(qdq(self._kernel, self.kernel_scale, "float8_e4m3fn", self.compute_dtype))
            return ops.add(ops.matmul(x, kernel), self.bias)

    layer, twin = _pair(keras, "float8", NoStraightThrough)
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(layer, twin, X, declared=FP8)
    message = _message(failure)
    assert re.search(rf"gradients: {NAME}/kernel \(float32\) has relative norm 1\.0000 against the reference's",
                     message), message
    assert "1 check(s) failed" in message, message


# -- what runs: the layer as called ---------------------------------------------------------------------------------

def test_keras_mixed_bfloat16_dense_is_checked_as_it_computes_when_called_should_pass(keras):
    """Keras 3.15.1: ``stateless_call`` runs a bare layer's ``call`` without ``Layer.__call__``'s autocast, so a
    Dense(dtype="mixed_bfloat16") computes float32 that way, bitwise its float32 twin's output, and bfloat16 when
    called. check_layer runs ``layer(x)`` in Keras's StatelessScope (stateless_call's own mechanics): the
    bfloat16 output tracks the twin's and differs from it. Through stateless_call it would equal the twin's
    bitwise, and tracks would fail a correct layer ("equal to the reference")."""
    layer = keras.layers.Dense(UNITS, name=NAME, dtype="mixed_bfloat16", **_init(keras, 0))
    layer.build((None, IN))
    twin = keras.layers.Dense(UNITS, name=NAME, **_init(keras, 7))
    twin.build((None, IN))
    twin.set_weights(layer.get_weights())
    stateless, _ = layer.stateless_call([v.value for v in layer.trainable_variables], [], X)
    assert str(stateless.dtype) == "float32" and np.array_equal(stateless, twin(X))  # the Keras fact
    assert str(layer(X).dtype) == "bfloat16"
    figures = qcheck.check_layer(layer, twin, X, declared=False, skip=qcheck.skip_modules(NAME))
    assert 0 < figures.rel_norm < 0.02, figures.rel_norm
    assert sorted(figures.grad_rel_norms) == ["(input x)", f"{NAME}/bias", f"{NAME}/kernel"], figures.grad_rel_norms


# -- sites: Keras is machinery ----------------------------------------------------------------------------------------

def test_keras_sites_point_at_the_model_line_without_machinery_given_should_pass(keras):
    """Keras 3.15.1: a subclassed model's Dense and its own ops.matmul are located at the model's lines here (its
    call), not in Keras, with no machinery= given and with machinery=('keras',) alike; a functional model's
    ops.einsum, which runs in Keras's plumbing alone (no line of a layer's on its stack), at Keras's op."""

    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.proj = keras.layers.Dense(UNITS, name="proj")
            self.other = self.add_weight(shape=(UNITS, 4), name="other")

        def call(self, x):
            h = self.proj(x)  # the Dense's site
            return keras.ops.matmul(h, self.other)  # the model's own matmul

    model = Model()
    model(X[:1])
    source, first = inspect.getsourcelines(Model.call)
    lines = {name: first + next(i for i, text in enumerate(source) if text.rstrip().endswith(mark))
             for name, mark in (("proj", "# the Dense's site"), ("own", "# the model's own matmul"))}
    for machinery in ((), ("keras",)):
        proj, own = qcheck.coverage(model, X, machinery=machinery)
        for record, at in ((proj, lines["proj"]), (own, lines["own"])):
            assert record.location.replace(os.sep, "/").endswith(f"tests/test_keras_layer.py:{at}"), record
            assert record.function.endswith("Model.call"), record

    inputs = keras.Input((IN,))
    weighted = keras.ops.einsum("bd,dh->bh", inputs, np.ones((IN, UNITS), np.float32))
    (combine,) = qcheck.coverage(keras.Model(inputs, weighted), X)
    assert re.fullmatch(r"\S*keras/src/backend/jax/numpy\.py:\d+", combine.location.replace(os.sep, "/")), combine


# -- bad input -------------------------------------------------------------------------------------------------------

def test_keras_unbuilt_layer_is_a_one_line_error_naming_the_argument(keras, int8_pair):
    """A Keras layer never built has no variables to run stateless: one ValueError line naming the argument."""
    layer, _ = int8_pair
    with pytest.raises(ValueError) as error:
        qcheck.check_layer(layer, keras.layers.Dense(UNITS), X)
    message = str(error.value)
    assert message.startswith("check_layer: reference is a Keras Dense not built yet"), message
    assert "\n" not in message, message


def test_keras_twin_with_other_weights_is_a_one_line_error_naming_set_weights(keras, int8_pair):
    """A twin not made from the layer's weights (no set_weights): one ValueError line naming the differing
    parameter and the Keras way to make the twin."""
    layer, _ = int8_pair
    other = keras.layers.Dense(UNITS, name=NAME, **_init(keras, 7))
    other.build((None, IN))
    with pytest.raises(ValueError) as error:
        qcheck.check_layer(layer, other, X)
    message = str(error.value)
    assert re.fullmatch(rf"check_layer: reference's weights differ from layer's: {NAME}/bias \(float32\[16\]\) "
                        r"differs in 16 of 16 values; make the twin with twin\.set_weights\(layer\.get_weights\(\)\) "
                        r"before layer\.quantize\(\.\.\.\)", message), message


def test_keras_copy_params_into_is_a_one_line_error_naming_the_keras_way(keras, int8_pair):
    """copy_params_into takes NNX and Equinox modules; on a Keras layer it names Keras's own way to make the twin."""
    layer, twin = int8_pair
    with pytest.raises(ValueError) as error:
        qcheck.copy_params_into(layer, twin)
    message = str(error.value)
    assert message == ("copy_params_into: layer must be an flax.nnx.Module or an equinox.Module, got Dense (a Keras "
                       "layer's twin is made the Keras way: twin.set_weights(layer.get_weights()) before "
                       "layer.quantize(...))"), message


# -- stored kernels held bitwise against the twin's float kernel ------------------------------------------------------

WIDE = 256  # inputs: four groups of 64, two of 128, so the two group sizes part
XW = np.random.default_rng(3).normal(size=(8, WIDE)).astype(np.float32)


def _stored_pair(keras, mode: str, config=None, cls=None):
    """A Dense (or subclass ``cls``) of WIDE inputs quantized to ``mode`` (with ``config``) and its float twin."""
    cls = cls or keras.layers.Dense
    layer = cls(UNITS, name=NAME, **_init(keras, 0))
    layer.build((None, WIDE))
    twin = keras.layers.Dense(UNITS, name=NAME, **_init(keras, 7))
    twin.build((None, WIDE))
    twin.set_weights(layer.get_weights())
    if config is None:
        layer.quantize(mode, type_check=cls is keras.layers.Dense)
    else:
        layer.quantize(mode, config=config, type_check=cls is keras.layers.Dense)
    return layer, twin


STOCK = [("int8", None, "Keras quantize('int8') on 1 layer(s) (Dense)"),
         ("int4", -1, "Keras quantize('int4', per channel, weight-only) on 1 layer(s) (Dense)"),
         ("int4", 128, "Keras quantize('int4', grouped by 128 with zero points, weight-only) on 1 layer(s) (Dense)"),
         ("int4", 64, "Keras quantize('int4', grouped by 64 with zero points, weight-only) on 1 layer(s) (Dense)")]


@pytest.mark.parametrize("mode, block_size, source", STOCK, ids=["int8", "int4-per-channel", "int4-128", "int4-64"])
def test_keras_stock_stored_kernel_is_held_bitwise_against_the_twin_should_pass(keras, mode, block_size, source):
    """Keras 3.15.1: the kernel quantize() stored as codes (int8; int4 packed two to a byte) with its scale (and,
    grouped, zero point) is the referee's of the twin's float kernel, bitwise: the site's weight is held bitwise,
    saying against what, with no acceptance rule. Grouped by 64, the reader reads int4_keras_grouped at block 64."""
    config = None if block_size is None else keras.quantizers.Int4QuantizationConfig(block_size=block_size)
    layer, twin = _stored_pair(keras, mode, config)
    figures = qcheck.check_layer(layer, twin, XW)
    assert figures.declared_from == f"read from the layer: {source}", figures.declared_from
    (site,) = figures.coverage
    assert site.rhs_hold.bitwise and site.rhs_hold.accepted_by is None, site.rhs_hold
    assert str(site.rhs_hold) == f"bitwise: stored codes held bitwise against the reference's {NAME}/kernel"
    if block_size == 64:
        assert site.rhs_declared == "int4_keras_grouped at block 64", site.rhs_declared


def _requantized(keras, rule: str):
    """A Dense subclass whose quantize("int8") stores other codes than Keras's rule (the plants): ``one-scale``
    one encode scale for the whole kernel, ``floor`` each code rounded down."""
    class Requantized(keras.layers.Dense):
        def quantize(self, mode, **kwargs):
            kernel = np.asarray(self.kernel)
            super().quantize(mode, **kwargs)
            amax = np.max(np.abs(kernel), axis=None if rule == "one-scale" else 0)
            scale = (np.float32(127) / (amax + np.float32(1e-7))).astype(np.float32)
            rounded = np.floor if rule == "floor" else np.round
            self._kernel.assign(np.clip(rounded(kernel * scale), -127, 127).astype(np.int8))
            self.kernel_scale.assign(np.broadcast_to(scale, (self.units,)).astype(np.float32))

    return Requantized


@pytest.mark.parametrize("rule, what", [
    ("one-scale", "they match one scale for the whole tensor"),
    ("floor", "each code is the referee's or one below it: rounded down (floor), not to nearest"),
])
def test_keras_requantized_stored_kernel_fails_naming_the_site_and_what_differs_should_fail(keras, rule, what):
    """The plants: a Dense subclass whose quantize("int8") stores the kernel's codes under one scale for the whole
    kernel (Keras's rule: one per output channel), or rounded down. Each passes every other check (its output
    tracks the twin's); the stored kernel fails at the site, naming it and what its codes match."""
    layer, twin = _stored_pair(keras, "int8", cls=_requantized(keras, rule))
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(layer, twin, XW)
    message = _message(failure)
    assert f"rhs (weight): stored {NAME}/kernel against the reference's {NAME}/kernel: codes are not int8_keras's" \
        in message, message
    assert what in message and "tracks" not in message, message
    assert re.search(r"dot_general at \S+ \(Dense\._int8_call\S*\)", message), message


def test_keras_int4_grouped_by_64_declared_by_128_fails_naming_both_group_sizes_should_fail(keras):
    """The plant: a layer grouped by 64 declared int4_keras_grouped (128), or with block 128 said: the stored
    kernel fails naming both sizes. Its control, declared at block 64, passes."""
    layer, twin = _stored_pair(keras, "int4", keras.quantizers.Int4QuantizationConfig(block_size=64))
    for weights in ("int4_keras_grouped", {"format": "int4_keras_grouped", "block": 128}):
        with pytest.raises(AssertionError) as failure:
            qcheck.check_layer(layer, twin, XW, declared={"weights": weights, "activations": None})
        message = _message(failure)
        assert (f"stored {NAME}/kernel against the reference's {NAME}/kernel: its codes and scales are grouped by "
                f"64, where int4_keras_grouped groups by 128") in message, message
    figures = qcheck.check_layer(layer, twin, XW, declared={
        "weights": {"format": "int4_keras_grouped", "block": 64}, "activations": None})
    assert figures.coverage[0].rhs_hold.bitwise, figures.coverage[0]


def test_keras_block_on_a_format_without_one_is_a_one_line_error_naming_block(keras, int8_pair):
    layer, twin = int8_pair
    with pytest.raises(ValueError, match=r"^check_layer: declared: weights: block is no parameter of format "
                                         r"'int8_keras' .*formats that take one: int4_keras_grouped, int8_easydel$"):
        qcheck.check_layer(layer, twin, X, declared={"weights": {"format": "int8_keras", "block": 64},
                                                     "activations": "int8_keras"})
