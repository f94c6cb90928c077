"""keras-hub's MoE backbones after ``model.quantize("int8")``: the experts Keras's quantize() does not reach.

Runs in Keras's environment with keras-hub 0.32.0 installed beside it (.ci/keras.sh, ``tox -e keras``, the keras
stage of .ci/run); skipped, naming how to install it, where keras_hub does not import. keras-hub requires
tensorflow-text (a TensorFlow of about 3 GB), which its model code never imports: it is installed with
``pip install --no-deps keras-hub==0.32.0`` and then ``regex tokenizers kagglehub sentencepiece``. Measured on
keras-hub 0.32.0, Keras 3.15.1, jax 0.12.0.1, Python 3.12, on the CPU.

keras-hub's MoE experts are raw ``keras.ops.einsum`` calls on ``add_weight`` kernels inside one layer
(``MixtralMoeExperts.call``, keras_hub/src/models/mixtral/mixtral_decoder.py:154, 163, 171; likewise Qwen-MoE's
qwen_moe_decoder.py:207, 212, Qwen3-MoE's qwen3_moe_decoder.py:241, 246, gpt-oss's gpt_oss_decoder.py:85, 98).
That layer has no ``quantize`` method, so ``model.quantize("int8")`` warns once and leaves the experts' einsums
multiplying float32 by float32, while every Dense and EinsumDense of the model is int8: the silent fallback, in
the layers that hold most of an MoE model's weights. Read from the model, the declaration (Keras quantize('int8'):
int8_keras) fails naming each expert einsum; the model's Dense and EinsumDense sites are held (the control).

One tiny randomly initialised backbone per model (2 layers, hidden 16, 4 experts, top 2), built once per module.
The attention's own score and mix einsums (activations only, called in the attention layer itself, no layer
quantize() reaches or claims) are spared by name.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import warnings

import jax
import numpy as np
import pytest

import qcheck

#: The version the experts' lines and the traced structure were checked on.
KERAS_HUB_VERSION = "0.32.0"
KERAS_VERSION = "3.15.1"
HOW = ("install it beside Keras without tensorflow-text: pip install --no-deps keras-hub==0.32.0; pip install regex "
       "tokenizers kagglehub sentencepiece; then .ci/keras.sh run VENV/bin/python pytest tests/test_keras_hub.py")
pytestmark = pytest.mark.filterwarnings(
    r"ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")

TINY = dict(vocabulary_size=32, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
            num_experts=4, top_k=2)
#: Each backbone, tiny, and its experts' einsums: (file, lines) in keras-hub 0.32.0.
MODELS = {
    "mixtral": ("MixtralBackbone", dict(intermediate_dim=32), "mixtral/mixtral_decoder.py", (154, 163, 171)),
    "qwen_moe": ("QwenMoeBackbone", dict(intermediate_dim=32, moe_intermediate_dim=8,
                                         shared_expert_intermediate_dim=16), "qwen_moe/qwen_moe_decoder.py",
                 (207, 212)),
    "qwen3_moe": ("Qwen3MoeBackbone", dict(intermediate_dim=32, moe_intermediate_dim=8, head_dim=8),
                  "qwen3_moe/qwen3_moe_decoder.py", (241, 246)),
    "gpt_oss": ("GptOssBackbone", dict(intermediate_dim=32, head_dim=8), "gpt_oss/gpt_oss_decoder.py", (85, 98)),
}
TOKENS = {"token_ids": np.array([[1, 2, 3, 4, 5, 6]], np.int32), "padding_mask": np.ones((1, 6), np.int32)}


def _attention_core(record) -> bool:
    # An einsum called in the attention layer itself (scores, mix), not in one of its EinsumDense sublayers.
    parts = record.scope.split("/")
    return len(parts) >= 2 and parts[-2] == "self_attention" and "->" in parts[-1]


ATTENTION = qcheck.skip_where(_attention_core, "the attention's scores and mix (activations only)")


@pytest.fixture(scope="module")
def keras_hub():
    if importlib.util.find_spec("keras_hub") is None:
        pytest.skip(f"keras_hub is not installed (Keras's environment holds it): {HOW}")
    if os.environ.get("KERAS_BACKEND") != "jax":
        pytest.skip(f"keras-hub's tests run with KERAS_BACKEND=jax (Keras's own environment): {HOW}")
    try:
        import keras_hub
    except ImportError as error:
        pytest.skip(f"keras_hub does not import ({error}): {HOW}")
    installed = {name: importlib.metadata.version(name) for name in ("keras-hub", "keras")}
    if installed != {"keras-hub": KERAS_HUB_VERSION, "keras": KERAS_VERSION}:
        pytest.fail(f"keras-hub {installed['keras-hub']} and keras {installed['keras']} are installed; this was "
                    f"checked on keras-hub {KERAS_HUB_VERSION} and keras {KERAS_VERSION} (the experts' lines "
                    f"above): recheck them, then update this test")
    with jax.numpy_rank_promotion("allow"):  # Keras adds biases by rank broadcasting
        yield keras_hub


@pytest.fixture(scope="module", params=list(MODELS))
def quantized(request, keras_hub):
    """``(name, model, warnings)``: the tiny backbone after ``model.quantize("int8")``, and what Keras warned."""
    import keras

    keras.utils.set_random_seed(0)
    cls, dims, _, _ = MODELS[request.param]
    model = getattr(keras_hub.models, cls)(**TINY, **dims)
    model(TOKENS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.quantize("int8")
    return request.param, model, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _expert_sites(name, records):
    _, _, path, lines = MODELS[name]
    where = re.compile(rf"keras_hub/src/models/{re.escape(path)}:({'|'.join(map(str, lines))})$")
    return [r for r in records if where.search(r.location.replace(os.sep, "/"))]


def test_keras_hub_moe_experts_stay_float32_after_quantize_int8_and_fail_the_read_declaration(quantized):
    """keras-hub 0.32.0, Keras 3.15.1: the defect. Keras warns that the experts layer has no quantize method,
    and nothing else says the experts stay float32; qcheck's coverage names each expert einsum (at keras-hub's
    line) full precision, and the declaration read from the model fails naming them, once per decoder layer."""
    name, model, warned = quantized
    assert any(re.fullmatch(r"Layer \w*Experts does not have a `quantize` method implemented\.", w)
               for w in warned), warned
    records = qcheck.coverage(model, TOKENS, machinery=("keras",))
    experts = _expert_sites(name, records)
    assert len(experts) == TINY["num_layers"] * len(MODELS[name][3]), qcheck.format_coverage(records)
    assert all(not r.lhs.quantized and not r.rhs.quantized for r in experts), qcheck.format_coverage(experts)
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(model, TOKENS, skip=ATTENTION, machinery=("keras",))
    message = str(failure.value).replace(os.sep, "/")
    _, _, path, lines = MODELS[name]
    for line in lines:
        assert re.search(rf"keras_hub/src/models/{re.escape(path)}:{line} ", message), (line, message)
    assert re.search(rf"assert_quantized: {len(experts)} of \d+ matmuls differ", message), message
    assert "reaches the matmul in full precision; declared int8_keras" in message, message
    assert "declared: read from the fn: Keras quantize('int8') on" in message, message


def test_keras_hub_moe_dense_and_einsum_dense_sites_hold_the_read_declaration_should_pass(quantized):
    """keras-hub 0.32.0, Keras 3.15.1: the control. Every site of the model but the experts and the attention's
    own einsums is a Dense or EinsumDense quantize() reached: int8 codes, no finding, the input's codes held
    bitwise."""
    name, model, _ = quantized
    records = qcheck.coverage(model, TOKENS, machinery=("keras",), declared=True)
    experts = {id(r) for r in _expert_sites(name, records)}
    held = [r for r in records if id(r) not in experts and not _attention_core(r)]
    assert len(held) >= 4 * TINY["num_layers"], qcheck.format_coverage(records)  # q, k, v, out at least
    assert all(r.findings == () and r.lhs.quantized and r.rhs.dtype == "int8" for r in held), \
        qcheck.format_coverage(held)
    assert all(r.lhs_hold.bitwise for r in held), qcheck.format_coverage(held)
