"""Keras 3's quantized ``Dense`` (on its JAX backend) as a pinned client of qcheck.

Runs in Keras's own environment (.ci/keras.sh, ``tox -e keras``, the keras stage of
.ci/run), with ``KERAS_BACKEND=jax``; skipped, naming how to install and run it, where
Keras is not installed or its backend is not JAX. Measured on Keras 3.15.1 (jax 0.12.0.1,
jaxlib 0.12.0.1, ml_dtypes 0.7.0, Python 3.12), on the CPU.

A Keras layer is a callable of ``x``: ``qcheck.check_layer(layer, twin, x)`` and
``qcheck.assert_quantized(layer, x)`` take it with no glue. check_layer runs it statelessly
(Keras's ``StatelessScope``) and compares its trainable variables' gradients by path
(tests/test_keras_layer.py); coverage traces it as a function of ``x``, its weights
closed over, so the backward pass it walks has one gradient matmul (the input's). The twin
is made the Keras way: the same ``Dense``, ``twin.set_weights(layer.get_weights())``
before ``layer.quantize("float8")``.

``Dense.quantize("float8")`` (keras/src/layers/core/dense.py, ``_float8_call``):
quantize-dequantize of the input and of the kernel to e4m3fn, one scale per tensor
(delayed scaling: ``x / scale``, clipped to ±448, cast, cast back, times ``scale``), a
float32 ``dot_general`` (``ops.matmul``, keras/src/backend/jax/numpy.py), and in the
backward pass the output gradient quantize-dequantized the same way to e5m2.

* the grads role (the issue's plant "e4m3 output gradients declared e5m2, or the
  reverse"): declared e5m2 gradients pass, held bitwise; declared e4m3fn they fail at the
  backward site, "is cast to float8_e5m2; declared e4m3fn";
* a wrong fp8 flavour: Keras has no fnuz type, so no Keras layer can plant it; declared
  e4m3fnuz, the stock float8 Dense fails, "is cast to float8_e4m3fn; declared e4m3fnuz",
  and declared e4m3fn (the control) it passes;
* the Keras reader: undeclared (or ``declared=True``), a quantized layer is held to the mode
  ``quantize()`` recorded on it (float8: e4m3fn, e5m2 gradients; int8: ``int8_keras``, Keras's
  own rule with its 1e-7 epsilon, the stored int8 kernel held by its type, accepted by the reader);
  an unquantized one reads nothing (``declared=True`` a one-line ValueError naming the readers);
* int8 on small activations (absmax near 1e-5): declared ``int8``, the correct layer fails naming
  ``int8_keras``; a quantizer without the epsilon, read as Keras int8, fails naming ``int8``;
* raw ``keras.ops.einsum`` experts on ``add_weight`` kernels (keras-hub's MoE experts) stay
  float32 under ``model.quantize("int8")`` and fail the read declaration, named; the all-
  ``EinsumDense`` control passes.

Keras is machinery (qcheck._coverage's MACHINERY): a bare stock Dense's sites are located at its own
line in Keras (``keras/src/layers/core/dense.py``, ``Dense._float8_call``), never Keras's backend
``numpy.py``; a model's own layer at the model's line. Scoped by the layer's name.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re

import jax
import numpy as np
import pytest

import qcheck
from tests.helpers import keras_on_jax

#: The version the traced structure and the messages were checked on.
KERAS_VERSION = "3.15.1"
NAME = "qdense"  # the layer's name: its sites' scope
UNITS, IN = 16, 32
X = np.random.default_rng(0).normal(size=(8, IN)).astype(np.float32)
FP8 = {"weights": "e4m3fn", "activations": "e4m3fn"}
E5M2_GRADS = {**FP8, "grads": "e5m2"}  # what Keras computes
E4M3_GRADS = {**FP8, "grads": "e4m3fn"}  # the plant: the gradients declared in the forward's type
FNUZ = {"weights": "e4m3fnuz", "activations": "e4m3fnuz"}
#: Where Keras's matmul sits: every site, forward and backward, is this line of the stock Dense, in the layer's scope.
KERAS_SITE = r"dot_general at \S*keras/src/layers/core/dense\.py:\d+ \(Dense\._float8_call\), in " + NAME
#: Scales other than the fresh layer's 1.0, as delayed scaling leaves them after some steps: input, kernel,
#: output gradient (Keras divides by its scale: x / scale is what is cast).
SCALES = {"fresh": None, "scaled": (0.01, 0.001, 1e-4)}
#: Keras 3.15.1's ``Variable.__array__`` (keras/src/backend/common/variables.py) takes no ``copy`` keyword, which
#: numpy 2.5 warns of on every ``get_weights()``; the suite turns warnings into errors.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
RUN = "run its tests with KERAS_BACKEND=jax: .ci/keras.sh run VENV/bin/python pytest tests/test_keras.py (tox -e keras)"


@pytest.fixture(scope="module")
def keras():
    """Keras on its JAX backend, once: skipped, naming how to install or run it, where it is absent or elsewhere;
    its tests run with rank promotion allowed."""
    yield from keras_on_jax(RUN)


def _pinned() -> None:
    installed = importlib.metadata.version("keras")
    if installed != KERAS_VERSION:
        pytest.fail(f"keras {installed} is installed; this was checked on keras {KERAS_VERSION}: recheck it, then "
                    f"update this test")


def _dense(keras, mode: str = "float8", scales=None):
    """A quantized ``Dense`` and its unquantized twin, with the same weights (copied before ``quantize``)."""
    layer = keras.layers.Dense(UNITS, name=NAME)
    layer.build((None, IN))
    twin = keras.layers.Dense(UNITS, name=NAME)
    twin.build((None, IN))
    twin.set_weights(layer.get_weights())
    layer.quantize(mode)
    if scales is not None:
        for variable, value in zip((layer.inputs_scale, layer.kernel_scale, layer.outputs_grad_scale), scales):
            variable.assign(value)
    return layer, twin


def _message(failure) -> str:
    return str(failure.value).replace(os.sep, "/")


def test_keras_float8_dense_is_one_fp8_matmul_with_e5m2_gradients(keras):
    """Keras 3.15.1, jax 0.12.0.1: the structure the tests below rely on, read by qcheck undeclared."""
    _pinned()
    layer, _ = _dense(keras)
    assert [v.path for v in layer.variables] == [
        f"{NAME}/{v}" for v in ("kernel", "bias", "inputs_scale", "inputs_amax_history", "kernel_scale",
                                "kernel_amax_history", "outputs_grad_scale", "outputs_grad_amax_history")]
    (site,) = qcheck.coverage(layer, X)
    assert (site.primitive, site.function, site.scope, site.quantized) == ("dot_general", "Dense._float8_call", NAME,
                                                                           True)
    assert site.lhs.dtype == site.rhs.dtype == "float8_e4m3fn", qcheck.format_coverage([site])
    records = qcheck.assert_quantized(layer, X, backward=True)
    (backward,) = [r for r in records if r.backward]
    assert (backward.lhs_role, backward.lhs.dtype) == ("grad", "float8_e5m2"), qcheck.format_coverage(records)


# -- 1. the grads role: Keras's e5m2 output gradients ----------------------------------------------------

@pytest.mark.parametrize("scales", list(SCALES))
def test_keras_float8_gradients_declared_e5m2_are_held_bitwise_should_pass(keras, scales):
    """Keras 3.15.1, jax 0.12.0.1: the control. Declared as Keras computes them (e4m3fn forward, e5m2 output
    gradients), check_layer passes, and the one gradient operand of the backward pass (the output gradient,
    lhs of the input's gradient matmul) is held BITWISE, not by type: Keras's quantize-dequantize is traced
    in the backward pass (the custom gradient's ``upstream / scale``, clipped, cast to e5m2), so qcheck finds
    the cast's input and holds its codes to the referee's e5m2 codes of it, at the fresh layer's scale 1 and
    at other scales alike. The weight operand of that matmul is not held there (check_layer holds only the
    grads role on the backward pass: its hold is None); assert_quantized(backward=True) holds it too."""
    layer, twin = _dense(keras, scales=SCALES[scales])
    figures = qcheck.check_layer(layer, twin, X, declared=E5M2_GRADS)
    print(qcheck.format_coverage(figures.backward))
    print([(r.lhs_role, str(r.lhs_hold), r.rhs_role, str(r.rhs_hold)) for r in figures.backward])
    # The parameters by path (tests/test_keras_layer.py); the scales are state: Keras overwrites them.
    assert sorted(figures.grad_rel_norms) == ["(input x)", f"{NAME}/bias", f"{NAME}/kernel"], figures.grad_rel_norms
    (site,) = figures.backward  # the input's gradient matmul: output gradient x kernel
    assert (site.lhs_role, site.rhs_role) == ("grad", "weight"), site
    assert (site.lhs.dtype, site.rhs.dtype) == ("float8_e5m2", "float8_e4m3fn"), site
    assert site.lhs_hold.strength == "bitwise" and site.rhs_hold is None, (site.lhs_hold, site.rhs_hold)
    (forward,) = figures.coverage
    assert forward.lhs_hold.strength == forward.rhs_hold.strength == "bitwise", (forward.lhs_hold, forward.rhs_hold)

    records = qcheck.assert_quantized(layer, X, declared=E5M2_GRADS, backward=True)
    assert [r.backward for r in records] == [False, True]
    held = [h for r in records for h in (r.lhs_hold, r.rhs_hold)]
    assert [h.strength for h in held] == ["bitwise"] * 4, held


def test_keras_float8_gradients_declared_e4m3fn_should_fail_at_the_backward_site(keras):
    """Keras 3.15.1, jax 0.12.0.1: the plant. Declared in the forward's type, Keras's e5m2 output gradients fail
    at the backward site, through check_layer and through assert_quantized(backward=True)."""
    layer, twin = _dense(keras)
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(layer, twin, X, declared=E4M3_GRADS)
    message = _message(failure)
    assert "backward declared: assert_quantized: 1 of 2 matmuls differ from the declared quantization" in message
    assert re.search(KERAS_SITE + r": lhs \(8, 16\) \[float8_e5m2\]", message), message
    assert "lhs (grad) is cast to float8_e5m2; declared e4m3fn" in message, message
    assert "coverage:" not in message, message  # the forward pass is as declared

    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer, X, declared=E4M3_GRADS, backward=True)
    message = _message(failure)
    assert message.startswith("assert_quantized: 1 of 2 matmuls differ from the declared quantization"), message
    assert re.search(KERAS_SITE + r": lhs \(8, 16\) \[float8_e5m2\]", message), message
    assert "lhs (grad) is cast to float8_e5m2; declared e4m3fn" in message, message


# -- 2. a wrong fp8 flavour: declared e4m3fnuz on Keras's e4m3fn -----------------------------------------

def test_keras_float8_declared_e4m3fn_should_pass(keras):
    """Keras 3.15.1: the control. The forward site's input and kernel are held bitwise as e4m3fn."""
    layer, twin = _dense(keras)
    figures = qcheck.check_layer(layer, twin, X, declared=FP8)
    (site,) = figures.coverage
    assert site.lhs_hold.strength == site.rhs_hold.strength == "bitwise", (site.lhs_hold, site.rhs_hold)
    assert figures.backward == ()  # no grads role declared
    (site,) = qcheck.assert_quantized(layer, X, declared=FP8)
    assert site.lhs_hold.strength == site.rhs_hold.strength == "bitwise"


def test_keras_float8_declared_e4m3fnuz_should_fail_naming_the_flavour(keras):
    """Keras 3.15.1: Keras has no fnuz type, so no Keras layer can carry this plant; declaring e4m3fnuz (the
    flavour of AMD's MI300) on the stock float8 Dense stands for it, and fails naming both operands."""
    layer, twin = _dense(keras)
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(layer, twin, X, declared=FNUZ)
    message = _message(failure)
    assert "coverage: assert_quantized: 1 of 1 matmuls differ from the declared quantization" in message, message
    assert re.search(KERAS_SITE + r": lhs \(8, 32\) \[float8_e4m3fn\]", message), message
    for side in ("lhs (activation)", "rhs (weight)"):
        assert f"{side} is cast to float8_e4m3fn; declared e4m3fnuz" in message, message

    with pytest.raises(AssertionError, match=r"is cast to float8_e4m3fn; declared e4m3fnuz"):
        qcheck.assert_quantized(layer, X, declared=FNUZ)


# -- 3. the Keras reader: the mode quantize() recorded, read by default --------------------------------------

def test_keras_unquantized_declared_true_is_a_one_line_error_naming_the_readers(keras):
    """Keras 3.15.1: an unquantized Dense records no quantization mode, so nothing is read: declared=True is a
    usage error, one line, naming the readers it tried (Keras's among them), not a pass."""
    _, twin = _dense(keras)
    other = keras.layers.Dense(UNITS, name=NAME)
    other.build((None, IN))
    for entry, call in (("check_layer", lambda: qcheck.check_layer(twin, other, X, declared=True)),
                        ("assert_quantized", lambda: qcheck.assert_quantized(twin, X, declared=True))):
        with pytest.raises(ValueError) as error:
            call()
        message = str(error.value)
        found = re.match(rf"{entry}: declared=True, but no reader \((qcheck_declaration(, \w+)*)\) finds a declaration "
                         r"on it of Dense; declare it by hand", message)
        assert found and "Keras" in found.group(1).split(", "), message
        assert "\n" not in message, message


def test_keras_unquantized_with_no_declared_argument_nothing_is_read(keras):
    """Keras 3.15.1: undeclared, an unquantized Dense reads nothing (the figures say so) and its float32 matmul
    fails coverage as ever."""
    _, twin = _dense(keras)
    assert qcheck.coverage(twin, X).declared_from.startswith("nothing read"), qcheck.coverage(twin, X).declared_from
    with pytest.raises(AssertionError, match=r"1 of 1 matmuls reach full precision"):
        qcheck.assert_quantized(twin, X)


def test_keras_float8_with_no_declared_argument_the_quantize_mode_is_read_should_pass(keras):
    """Keras 3.15.1: undeclared, the float8 Dense is held to what quantize('float8') recorded on it (its
    QuantizedFloat8DTypePolicy): e4m3fn forward, e5m2 output gradients, each operand bitwise, forward and
    backward, as declared=True reads it too."""
    layer, twin = _dense(keras)
    figures = qcheck.check_layer(layer, twin, X)
    assert figures.declared_from == "read from the layer: Keras quantize('float8') on 1 layer(s) (Dense)", \
        figures.declared_from
    assert str(figures.declared).startswith("activations e4m3fn, weights e4m3fn, grads e5m2"), figures.declared
    (forward,) = figures.coverage
    (backward,) = figures.backward
    assert forward.lhs_hold.bitwise and forward.rhs_hold.bitwise and backward.lhs_hold.bitwise, figures.backward
    assert qcheck.check_layer(layer, twin, X, declared=True).declared_from == figures.declared_from
    records = qcheck.assert_quantized(layer, X, backward=True)
    assert [h.strength for r in records for h in (r.lhs_hold, r.rhs_hold)] == ["bitwise"] * 4


# -- 4. int8: Keras's own rule, int8_keras --------------------------------------------------------------------

#: Small activations (absmax near 1e-5), where Keras's epsilon moves codes: its top code is 126, not 127.
SMALL = (X * 1e-5).astype(np.float32)
INT8_KERAS = {"weights": "int8_keras", "activations": "int8_keras"}
#: Keras stores an int8 kernel as codes (no float kernel is left): by hand, its hold by type is accepted so.
KERNEL = qcheck.skip_modules(NAME)


def test_keras_int8_dense_declared_int8_keras_holds_the_activations_bitwise_should_pass(keras):
    """Keras 3.15.1: the control. Keras's int8 Dense quantizes its input in the call by abs_max_quantize
    (clip(round(x · 127 / (absmax + 1e-7)), -127, 127), keras/src/quantizers/quantizers.py:98-119) and
    multiplies it by the int8 kernel codes quantize() stored. Declared int8_keras, the input's codes are held
    bitwise on small and ordinary activations; the stored kernel is held by its type (int8), accepted by name.
    Undeclared, the reader declares the same and accepts the kernel's hold itself, saying why."""
    layer, twin = _dense(keras, "int8")
    for x in (X, SMALL):
        (site,) = qcheck.assert_quantized(layer, x, declared=INT8_KERAS, accept_weaker=KERNEL)
        assert site.lhs_hold.bitwise and site.rhs_hold.strength == "type", (site.lhs_hold, site.rhs_hold)
        assert site.rhs_hold.accepted_by == f"skip_modules({NAME!r})", site.rhs_hold
        (read,) = qcheck.assert_quantized(layer, x)
        assert read.lhs_hold.bitwise and read.rhs_hold.accepted_by.startswith("the Keras reader: "), read.rhs_hold
    figures = qcheck.check_layer(layer, twin, SMALL, max_rel_norm=0.05)
    assert figures.declared_from == "read from the layer: Keras quantize('int8') on 1 layer(s) (Dense)"
    assert str(figures.declared).startswith("activations int8_keras, weights int8_keras"), figures.declared
    # By hand, the stored kernel is held by its type only, and that fails until it is accepted.
    with pytest.raises(AssertionError, match=r"rhs \(weight\) held by its type only, not bitwise as int8_keras"):
        qcheck.assert_quantized(layer, SMALL, declared=INT8_KERAS)


def test_keras_int8_dense_on_small_activations_declared_int8_fails_naming_int8_keras(keras):
    """Keras 3.15.1: the false alarm of the issue, now diagnosed. On activations of absmax near 1e-5 Keras's
    epsilon moves codes, so declared int8 (absmax / 127) the correct Keras layer fails, and the failure names the
    rule its codes follow: int8_keras."""
    layer, _ = _dense(keras, "int8")
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer, SMALL, declared={"weights": "int8", "activations": "int8"},
                                accept_weaker=KERNEL)
    message = _message(failure)
    assert re.search(r"lhs \(activation\): codes are not int8's: \d+ of 256 codes differ from the referee's", message)
    assert "they are int8_keras's codes: another rule of the same kind and width" in message, message


def test_keras_int8_dense_with_a_quantizer_missing_the_epsilon_fails_naming_int8(keras):
    """Keras 3.15.1: the other way. A Dense whose input quantizer was replaced by one that leaves out Keras's
    epsilon (absmax / 127: qcheck's int8, Keras's calling convention, an encode scale) is read as Keras int8, and
    fails on small activations naming int8 as the rule its codes follow."""
    layer, _ = _dense(keras, "int8")

    def no_epsilon(x, axis=-1):
        q = qcheck.formats.quantize(x, "int8", axis=axis)
        return q.codes, 1.0 / q.scales["slice"]

    layer.inputs_quantizer = no_epsilon
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer, SMALL)
    message = _message(failure)
    assert "lhs (activation): codes are not int8_keras's:" in message, message
    assert "they are int8's codes: another rule of the same kind and width" in message, message
    assert message.endswith("declared: read from the fn: Keras quantize('int8') on 1 layer(s) (Dense)"), message


# -- 5. what Keras's quantize() does not reach: raw einsums on add_weight kernels (keras-hub's MoE experts) ------

def _moe(keras, raw_experts: bool):
    """A Keras MoE-shaped model: a Dense router, 4 experts and a Dense output. ``raw_experts``: the experts are
    ``add_weight`` kernels multiplied by ``keras.ops.einsum`` (keras-hub's Mixtral, mixtral_decoder.py:154-171),
    a leaf layer quantize() cannot reach; else an ``EinsumDense`` (the control)."""

    class RawExperts(keras.layers.Layer):
        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(4, IN, UNITS), name="kernel")

        def call(self, x):
            return keras.ops.einsum("bd,edh->beh", x, self.kernel)  # the expert matmul

    inputs = keras.Input((IN,))
    router = keras.layers.Dense(4, name="router")(inputs)
    experts = (RawExperts(name="experts") if raw_experts else
               keras.layers.EinsumDense("bd,edh->beh", output_shape=(4, UNITS), name="experts"))(inputs)
    weighted = keras.ops.einsum("be,beh->bh", keras.ops.softmax(router), experts)  # the combine: full precision
    model = keras.Model(inputs, keras.layers.Dense(UNITS, name="out")(weighted))
    return model


def _quantized_moe(keras, raw_experts: bool):
    model = _moe(keras, raw_experts)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.quantize("int8")
    return model, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


INPUT_WARNING = "Layer InputLayer does not have a `quantize` method implemented."
COMBINE = qcheck.skip_modules("be,beh->bh")  # the combine, outside any layer: Keras scopes it by its equation


def test_keras_int8_model_all_layers_reached_passes_the_read_declaration_should_pass(keras):
    """Keras 3.15.1: the control. Router, experts (EinsumDense) and output quantized by model.quantize('int8'):
    every matmul but the combine holds the read int8_keras, activations bitwise; no warning but InputLayer's."""
    model, warned = _quantized_moe(keras, raw_experts=False)
    assert warned == [INPUT_WARNING], warned  # Keras warns for every leaf it cannot quantize, InputLayer too
    records = qcheck.assert_quantized(model, X, skip=COMBINE)
    assert records.declared_from == "read from the fn: Keras quantize('int8') on 3 layer(s) (Dense, EinsumDense)"
    held = [r for r in records if not r.scope.endswith("be,beh->bh")]
    assert [r.scope.split("/")[1] for r in held] == ["router", "experts", "out"], qcheck.format_coverage(records)
    assert all(r.lhs_hold.bitwise for r in held), qcheck.format_coverage(records)


def test_keras_int8_model_raw_einsum_experts_stay_float32_and_fail_the_read_declaration(keras):
    """Keras 3.15.1: the keras-hub experts defect in small. model.quantize('int8') reaches the Dense router and
    output only; the experts layer's NotImplementedError becomes one UserWarning (beside InputLayer's), and its
    einsum multiplies
    float32 x float32. Read by default, the declaration holds every matmul of the model, so coverage fails
    naming the experts' einsum (at the model's line, with keras as machinery) and nothing else."""
    model, warned = _quantized_moe(keras, raw_experts=True)
    assert warned == [INPUT_WARNING, "Layer RawExperts does not have a `quantize` method implemented."], warned
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(model, X, skip=COMBINE, machinery=("keras",))
    message = _message(failure)
    assert "assert_quantized: 1 of 4 matmuls" in message, message
    assert re.search(r"dot_general at \S*tests/test_keras\.py:\d+ \(.*RawExperts\.call\), "
                     r"in functional(_\d+)?/experts/", message), message
    assert "lhs (activation) reaches the matmul in full precision; declared int8_keras" in message, message
    assert "rhs (weight) reaches the matmul in full precision; declared int8_keras" in message, message
    assert message.endswith("declared: read from the fn: Keras quantize('int8') on 2 layer(s) (Dense)"), message


def test_stateless_call_with_weights_marked_gives_the_kernel_its_role_should_pass(keras):
    """Keras's documented stateless form, ``layer.stateless_call(trainable, non_trainable, x)``: the weights arrive
    as arguments. Marked with ``qcheck.weights``, the kernel reads as a weight and the fp8 declaration holds
    bitwise; unmarked (the should-fail twin), qcheck calls it an activation (Keras 3.15.1)."""
    layer, _ = _dense(keras)
    trainable = [v.value for v in layer.trainable_variables]
    frozen = [v.value for v in layer.non_trainable_variables]

    def call(trainable, frozen, x):
        return layer.stateless_call(trainable, frozen, x)[0]

    (marked,) = qcheck.coverage(call, qcheck.weights(trainable), qcheck.weights(frozen), X, declared=FP8)
    assert (marked.lhs_role, marked.rhs_role) == ("activation", "weight"), marked
    assert marked.findings == () and marked.rhs_hold.bitwise, marked
    (unmarked,) = qcheck.coverage(call, trainable, frozen, X)
    assert (unmarked.lhs_role, unmarked.rhs_role) == ("activation", "activation"), unmarked


def test_keras_reader_imports_nothing_from_keras(keras):
    """The Keras reader reads only a Keras layer, which has imported Keras: reading any other layer (here a
    function, in a fresh process where Keras is installed) leaves keras unimported."""
    import subprocess
    import sys

    code = ("import sys, qcheck; import numpy as np; "
            "qcheck.coverage(lambda x: x @ np.ones((4, 2), np.float32), np.ones((2, 4), np.float32)); "
            "sys.exit('keras imported' if 'keras' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# -- 6. edge rows: a quantizer without its zero guard ---------------------------------------------------------

def test_keras_int8_dense_passes_every_edge_row_held_bitwise_should_pass(keras):
    """Keras 3.15.1: the control. Keras's epsilon is its zero guard: on a token row of zeros (and of tiny
    values) its scale stays finite, 127 / 1e-7, and its codes are the referee's 0, held bitwise there. The stored
    kernel is held bitwise against the twin's float kernel: no acceptance."""
    layer, twin = _dense(keras, "int8")
    figures = qcheck.check_layer(layer, twin, X, declared=INT8_KERAS)
    assert {k: figures.edges[k] for k in ("zeros", "tiny", "huge")} == dict.fromkeys(
        ("zeros", "tiny", "huge"), "run, codes held bitwise"), figures.edges


def test_keras_int8_dense_without_its_zero_guard_fails_the_row_of_zeros_naming_the_site(keras):
    """Keras 3.15.1, a plant in Keras's own quantizer: the Dense's input AbsMaxQuantizer with epsilon 0 (no
    zero guard). On an ordinary x nothing shows. On a token row of zeros its scale is 127 / 0 = inf and its
    codes NaN cast to int8: XLA's CPU makes them 0, the referee's codes, and the output stays finite (0 / inf),
    so only the scale tells; check_layer fails there, naming the row kind and the site."""
    layer, twin = _dense(keras, "int8")
    layer.inputs_quantizer.epsilon = 0.0
    qcheck.assert_quantized(layer, X, declared=INT8_KERAS, accept_weaker=KERNEL)  # x itself: nothing shows
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(layer, twin, X, declared=INT8_KERAS)
    message = _message(failure)
    assert re.search(r"edges: token row of zeros: site " + NAME + r" \(dot_general\): lhs \(activation\): its "
                     r"scale is not finite at 1 of 8 scale values", message), message
    assert "tracks" not in message and "coverage" not in message, message  # on x itself the layer passes


# -- 7. int4: codes packed two to a byte, unpacked in the call ------------------------------------------------

@functools.cache
def _int4_layers(keras, block_size):
    """A Dense and an EinsumDense after ``quantize("int4")``: per channel (``block_size=-1``, qcheck's
    ``int4_keras``) or Keras's default, grouped by 128 with zero points (``Int4QuantizationConfig``'s default,
    keras/src/quantizers/quantization_config.py:113). Built once per block size: the checks only read them."""
    config = None if block_size is None else keras.quantizers.Int4QuantizationConfig(block_size=block_size)
    dense = keras.layers.Dense(UNITS, name=NAME)
    einsum = keras.layers.EinsumDense("bd,dh->bh", output_shape=(UNITS,), bias_axes="h", name=NAME)
    for layer in (dense, einsum):
        layer.build((None, IN))
        layer.quantize("int4", config=config)
    return dense, einsum


#: Keras's two matmul sites: Dense's ops.matmul and EinsumDense's ops.einsum (keras/src/backend/jax/numpy.py).
# A stock layer checked alone has no line of the user's on the stack: its site is Keras's own int4 call.
INT4_SITES = (r"dot_general at \S*keras/src/layers/core/dense\.py:\d+ \(Dense\._int4_call\.\S*\), in " + NAME,
              r"dot_general at \S*keras/src/layers/core/einsum_dense\.py:\d+ \(EinsumDense\._int4_call\.\S*\), in "
              + NAME)


def test_keras_int4_per_channel_layers_pass_the_read_declaration_should_pass(keras):
    """Keras 3.15.1: ``quantize("int4")`` per channel stores the kernel as int4 codes packed two to an int8 byte
    (pack_int4) and unpacks them in the call by shifts and masks (unpack_int4, quantizers.py:754-900), weight-only
    (dense.py:676). Read from the layer: weights int4_keras, activations full precision, the stored kernel held by
    its type (int4), accepted by the reader, saying why. Both layers read as quantized: int4 unpacked."""
    _pinned()
    for layer, kind in zip(_int4_layers(keras, -1), ("Dense", "EinsumDense")):
        records = qcheck.assert_quantized(layer, X)
        (site,) = records
        assert records.declared_from == (f"read from the fn: Keras quantize('int4', per channel, weight-only) on 1 "
                                         f"layer(s) ({kind})"), records.declared_from
        assert (str(site.rhs), site.rhs_casts) == ("int4 unpack", frozenset({"int4"})), (site.rhs, site.rhs_casts)
        assert (site.rhs_declared, site.lhs_declared) == ("int4_keras", "full precision"), site
        assert site.rhs_hold.accepted_by.startswith("the Keras reader: quantize('int4') stores the kernel as int4 "
                                                    "codes packed"), site.rhs_hold
        assert site.findings == (), site.findings


def test_keras_int4_default_grouped_layers_pass_the_read_declaration_should_pass(keras):
    """Keras 3.15.1's default ``quantize("int4")`` is grouped by 128 along the input with zero points
    (``Int4QuantizationConfig(block_size=128)``, quantization_config.py:113), dequantized as
    (codes - zero[g_idx]) · scale[g_idx] (dequantize_with_sz_map, quantizers.py:1196-1240; dense.py:910), weight-only
    (its call never quantizes the input, dense.py:884-921). Read from the layer: weights int4_keras_grouped,
    activations full precision, the stored kernel held by its types (int4 codes, int8 zero points), accepted by the
    reader, saying why. Before int4_keras_grouped the reader read nothing for it."""
    for layer, kind in zip(_int4_layers(keras, None), ("Dense", "EinsumDense")):
        assert layer.dtype_policy.block_size == 128, layer.dtype_policy.name
        records = qcheck.assert_quantized(layer, X)
        (site,) = records
        assert records.declared_from == (f"read from the fn: Keras quantize('int4', grouped by 128 with zero points, "
                                         f"weight-only) on 1 layer(s) ({kind})"), records.declared_from
        assert (str(site.rhs), site.rhs_casts) == ("int4 unpack", frozenset({"int4", "int8"})), site.rhs_casts
        assert (site.rhs_declared, site.lhs_declared) == ("int4_keras_grouped", "full precision"), site
        assert site.rhs_hold.accepted_by.startswith("the Keras reader: quantize('int4') stores the kernel"), site
        assert site.findings == (), site.findings


#: Keras 3.15.1's int4 layers declared with another rule than they use (the should-fail twins), one row each: the
#: block size quantize() was given (-1: per channel; None: Keras's default groups of 128), the rule declared, and
#: the finding at the site, which names the format whose types the kernel is. Per channel, the kernel is int4
#: codes; grouped, int8 zero points are read beside them (kernel_zero, dense.py:719-725), which per-channel int4
#: has none of.
WRONG_INT4_RULES = [
    pytest.param(-1, "int8_keras", "rhs (weight) is cast to int4; declared int8_keras, whose codes and scales are "
                 "int8; int4 is the code type of int4_keras", id="per-channel-declared-int8_keras"),
    pytest.param(None, "int4_keras", "rhs (weight) is cast to int8; declared int4_keras, whose codes and scales are "
                 "int4; int4, int8 is the code type of int4_keras_grouped", id="grouped-declared-int4_keras"),
]


@pytest.mark.parametrize("block_size, declared, finding", WRONG_INT4_RULES)
@pytest.mark.parametrize("which", [0, 1], ids=["Dense", "EinsumDense"])
def test_keras_int4_layer_declared_with_another_rule_fails_naming_the_site_should_fail(keras, which, block_size,
                                                                                       declared, finding):
    layer = _int4_layers(keras, block_size)[which]
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer, X, declared={"weights": declared, "activations": None})
    message = _message(failure)
    assert re.search(INT4_SITES[which], message), message
    assert finding in message, message


def test_keras_int4_other_block_size_reads_the_grouped_format_at_its_block_should_pass(keras):
    """Keras 3.15.1: ``block_size=64`` groups by 64: the reader reads int4_keras_grouped at block 64 (the group size
    is the layer's config, a parameter of the format), not groups of 128 nor nothing. Alone (no twin: no float
    source) its stored kernel is held by its type, accepted by the reader; check_layer holds it bitwise
    (tests/test_keras_layer.py)."""
    layer = _int4_layers(keras, 64)[0]
    records = qcheck.assert_quantized(layer, X)
    assert records.declared_from == ("read from the fn: Keras quantize('int4', grouped by 64 with zero points, "
                                     "weight-only) on 1 layer(s) (Dense)"), records.declared_from
    (site,) = records
    assert site.rhs_declared == "int4_keras_grouped at block 64", site
    assert site.rhs_hold.accepted_by.startswith("the Keras reader"), site.rhs_hold


@pytest.mark.parametrize("magnitude", [1.0, 1e-5, 100.0])
def test_keras_int4_grouped_stored_codes_scales_zero_points_are_the_referees_bitwise_should_pass(keras, magnitude):
    """Keras 3.15.1: what the default quantize("int4") stores (``layer.kernel`` unpacks it, dense.py:186-191;
    ``kernel_scale`` and ``kernel_zero``, [n_groups, units]) equals, bitwise, qcheck's int4_keras_grouped and the
    numpy referee's, on a kernel of 300 inputs (two groups of 128, a partial one of 44 that Keras zero-pads), an
    all-zero group, and a group of one sign whose zero point clips and whose codes saturate (Keras's rule)."""
    layer = keras.layers.Dense(UNITS, name=NAME)
    layer.build((None, 300))
    kernel = (np.random.default_rng(2).normal(size=(300, UNITS)) * magnitude).astype(np.float32)
    kernel[128:256, 3] = 0.0
    kernel[:128, 5] = np.abs(kernel[:128, 5]) + np.float32(3 * magnitude)
    layer.kernel.assign(kernel)
    layer.quantize("int4")
    codes, scale, zero = (np.asarray(v) for v in (layer.kernel, layer.kernel_scale, layer.kernel_zero))
    assert scale.shape == zero.shape == (3, UNITS) and zero.dtype == np.int8, (scale.shape, zero.dtype)
    ours = qcheck.formats.quantize(kernel, "int4_keras_grouped", axis=0)
    ref_codes, ref_scales = qcheck.referees.reference_quantize(kernel, "int4_keras_grouped", axis=0)
    # qcheck's block scales are [units, n_groups] (the kept axis first), Keras's [n_groups, units].
    assert np.array_equal(codes, np.asarray(ours.codes).astype(np.int8)), "qcheck's codes differ"
    assert np.array_equal(codes, ref_codes.astype(np.int8)), "the referee's codes differ"
    assert np.array_equal(scale.view(np.uint32), np.asarray(ours.scales["block"]).T.view(np.uint32))
    assert np.array_equal(scale.view(np.uint32), ref_scales["block"].T.view(np.uint32))
    assert np.array_equal(zero, np.asarray(ours.scales["zero_point"]).T)
    assert np.array_equal(zero, ref_scales["zero_point"].T)
    assert zero[1, 3] == -8 and np.all(codes[128:256, 3] == -8) and zero[0, 5] == -8 and np.all(codes[:128, 5] == 7)


# -- 8. findings pinned as facts: what Keras computes beside its matmuls --------------------------------------

def test_keras_int4_grouped_saturates_a_group_of_one_sign_far_from_zero(keras):
    """Keras 3.15.1: the default int4's zero point round(-min / scale) - 8 is clipped to [-8, 7]
    (quantizers.py:216-218) and its range is not widened to hold 0, so a group of 128 weights in [10, 11] gets zero
    point -8, codes all 7, and multiplies as about max - min (0.99), where a group straddling 0 (the control,
    shifted by -10.5) comes back within a step. A fact test: int4_keras_grouped is that rule, held as it is."""
    kernel = np.random.default_rng(0).uniform(10, 11, (128, 2)).astype(np.float32)
    eye = np.eye(128, dtype=np.float32)
    for shift, bad in ((0.0, True), (-10.5, False)):
        layer = keras.layers.Dense(2, use_bias=False, name=NAME)
        layer.build((None, 128))
        layer.kernel.assign(kernel + np.float32(shift))
        layer.quantize("int4")
        effective = np.asarray(layer(eye))  # row i: the kernel's row i as the layer multiplies it
        error = float(np.max(np.abs(effective - (kernel + np.float32(shift)))))
        assert (error > 8.0) if bad else (error <= 1.0 / 15), (shift, error)


def test_keras_float8_dense_rounds_its_float32_bias_through_bfloat16(keras):
    """Keras 3.15.1: ``_float8_call`` casts a float32 bias to bfloat16 and back before adding it "to get the
    biasAdd fusion support" (keras/src/layers/core/dense.py:1018-1026; einsum_dense.py:1257-1262 likewise): a
    bias of 0.1 is added as 0.10009766. A fact test: qcheck's checks do not see it (the bias is no matmul
    operand, and the fp8 matmul's own error is far larger than bfloat16's rounding of the bias)."""
    import ml_dtypes

    _pinned()
    layer = keras.layers.Dense(UNITS, name=NAME)
    layer.build((None, IN))
    layer.kernel.assign(np.zeros((IN, UNITS), np.float32))  # a zero product: the output is the bias as added
    layer.bias.assign(np.full(UNITS, 0.1, np.float32))
    layer.quantize("float8")
    out = np.asarray(layer(np.zeros((2, IN), np.float32)))
    as_bf16 = np.float32(np.float32(0.1).astype(ml_dtypes.bfloat16))
    assert np.all(out == as_bf16) and as_bf16 != np.float32(0.1), (out[0, :2], as_bf16)


def test_keras_quantize_and_dequantize_rounds_the_gradient_to_fp8(keras):
    """Keras 3.15.1: ``keras.quantizers.quantize_and_dequantize`` (keras/src/quantizers/quantizers.py:609-620) has
    no custom gradient, so JAX's transpose of its cast rounds the incoming gradient to the same fp8 type: an
    upstream gradient of 0.3 comes back 0.3125 (e4m3fn's nearest), where a straight-through estimator (Keras's own
    float8 Dense, ``quantized_dequantize_inputs``) passes 0.3 on. A fact test: qcheck's coverage does not see it,
    because clip's derivative mask multiplies the rounded gradient (a full-size factor, no scale), and the walk
    reads the product as full precision."""
    import jax.numpy as jnp

    def qdq(h):
        return keras.quantizers.quantize_and_dequantize(h, jnp.float32(1.0), "float8_e4m3fn", "float32")

    def ste(h):  # the control
        return h + jax.lax.stop_gradient(qdq(h) - h)

    upstream = np.float32(0.3)
    for q, want in ((qdq, np.float32(upstream.astype(jnp.float8_e4m3fn))), (ste, upstream)):
        grad = np.asarray(jax.grad(lambda h: jnp.sum(q(h) * upstream))(jnp.ones(4, jnp.float32)))
        assert np.all(grad == want), (q.__name__, grad, want)
    assert np.float32(upstream.astype(jnp.float8_e4m3fn)) == np.float32(0.3125)


def test_keras_has_no_fnuz_type_to_cast_to(keras):
    """Keras 3.15.1: its dtypes are float8_e4m3fn and float8_e5m2 only (keras/src/backend/common/dtypes.py:24,
    28-45); ``keras.ops.cast`` to e4m3fnuz raises "Invalid dtype" (variables.py:587), so no Keras layer computes in
    MI300's fnuz types, nor can one plant the wrong flavour. A fact test: there is no cast for a check to see (a
    Keras float8 layer declared e4m3fnuz fails, "is cast to float8_e4m3fn", in section 2)."""
    with pytest.raises(ValueError, match=r"Invalid dtype: float8_e4m3fnuz"):
        keras.ops.cast(np.ones(3, np.float32), "float8_e4m3fnuz")
    assert keras.ops.cast(np.ones(3, np.float32), "float8_e4m3fn").dtype == np.dtype(jax.numpy.float8_e4m3fn)


def test_keras_int4_per_channel_with_int8_inputs_holds_the_activations_bitwise_should_pass(keras):
    """Keras 3.15.1: an Int4QuantizationConfig that names an activation quantizer (Keras's AbsMaxQuantizer, int8)
    quantizes the input in the call (dense.py:866-870): read as int8_keras activations, held bitwise, beside the
    int4_keras kernel held by its type as stored."""
    config = keras.quantizers.Int4QuantizationConfig(block_size=-1,
                                                     activation_quantizer=keras.quantizers.AbsMaxQuantizer(axis=-1))
    layer = keras.layers.Dense(UNITS, name=NAME)
    layer.build((None, IN))
    layer.quantize("int4", config=config)
    records = qcheck.assert_quantized(layer, X)
    assert records.declared_from == "read from the fn: Keras quantize('int4', per channel) on 1 layer(s) (Dense)"
    (site,) = records
    assert (site.lhs_declared, site.rhs_declared) == ("int8_keras", "int4_keras"), site
    assert site.lhs_hold.bitwise and site.rhs_hold.accepted_by.startswith("the Keras reader"), site


@pytest.mark.parametrize("magnitude", [1.0, 1e-5, 100.0])
def test_keras_int4_stored_codes_and_scales_are_int4_keras_bitwise_should_pass(keras, magnitude):
    """Keras 3.15.1: what quantize("int4") per channel stores (``layer.kernel`` unpacks it, dense.py:186-191; the
    scale ``kernel_scale``) equals, bitwise, qcheck's int4_keras and the numpy referee's codes and encode scales of
    the float kernel, per output channel (axis 0 reduced), an all-zero channel and tiny and large kernels too."""
    layer = keras.layers.Dense(UNITS, name=NAME)
    layer.build((None, IN))
    kernel = (np.random.default_rng(1).normal(size=(IN, UNITS)) * magnitude).astype(np.float32)
    kernel[:, 3] = 0.0
    layer.kernel.assign(kernel)
    layer.quantize("int4", config=keras.quantizers.Int4QuantizationConfig(block_size=-1))
    codes, scale = np.asarray(layer.kernel), np.asarray(layer.kernel_scale)
    ours = qcheck.formats.quantize(kernel, "int4_keras", axis=0)
    ref_codes, ref_scales = qcheck.referees.reference_quantize(kernel, "int4_keras", axis=0)
    assert np.array_equal(codes, np.asarray(ours.codes).astype(np.int8)), "qcheck's int4_keras codes differ"
    assert np.array_equal(codes, ref_codes.astype(np.int8)), "the referee's int4_keras codes differ"
    assert np.array_equal(scale, np.asarray(ours.scales["slice"])[0]) and np.array_equal(scale, ref_scales["slice"][0])
    assert codes.min() >= -7 and codes.max() <= 7 and not codes[:, 3].any()
