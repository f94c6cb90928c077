"""EasyDeL 0.3.0's Mixtral as a pinned client of qcheck, installed as its users install it.

Runs in EasyDeL's own environment (.ci/easydel.sh, ``tox -e easydel``, the easydel stage of .ci/run):
``pip install easydel==0.3.0`` on Python 3.12, which resolves jax 0.9.2 and flax 0.12.3, where qcheck's window
starts; skipped where EasyDeL is not installed. A tiny Mixtral (one layer, 4 experts, top-2) built by EasyDeL on one
CPU device, its MoE block and attention projections quantized by its own ``model.quantize``. Checked on easydel
0.3.0, ejkernel 0.0.78, jax 0.9.2:

* qcheck locates EasyDeL's expert matmuls at its own ``_moe_module.py`` (ejkernel and jaxtyping are machinery),
  not inside ejkernel's grouped matmul;
* a known defect: ``model.quantize`` leaves the MoE experts float32 (``ParallelMoELinear`` has no ``to_quantized``,
  and ``apply_quantization`` skips it without a word): ``assert_quantized`` and ``check_layer`` fail naming the
  three ``_moe_module.py`` sites, ``check_layer`` also finding the output bitwise the float block's, where a
  quantized attention projection's is not (the control);
* EasyDeL's other defects, each a fact of its own code beside a control that passes: INT8 with the default pattern
  raises on a router of 4 experts; nvfp8 (one e4m3 scale per 16 weights, no tensor scale) flushes every weight at
  Mixtral's init scale to zero; its ``jax_native`` NVFP8 casts to ``float8_e4m3`` (with inf), unscaled, and its
  MXFP8 to ``float8_e5m2``; ``straight_through`` raises a TypeError in every mode;
* EasyDeL's INT8 (ejkernel's affine mode) is qcheck's ``int8_easydel``: its referee's codes, float16 scales and
  float16 zero points are model.quantize's projections' and ejkernel's (eager and jitted) bitwise, where a rule
  rounding down or grouping by 32 is not; its float16 zero point overflows on a group far from 0 and its float16
  scale flushes a narrow group (a fact beside a control);
* qcheck's reader of EasyDeL's ``QuantizationConfig``: a float model declares nothing quantized; a quantized one
  is recognised and not read, saying why; a stock INT8 projection (its own config) reads as int8_easydel, weight
  only, its packed words, scales and zero points held bitwise by check_layer against the float twin's kernel, and
  the walk reads the tile ejkernel's matmul unpacks inside its scans as those stored codes; one code changed fails.
* a copy of EasyDeL's MoE block whose experts are int8 (a subclass: its routing, shard_map and ejkernel grouped
  matmuls; each expert stack quantized outside the shard_map, one scale per expert per output column, with a
  straight-through gradient), declaring itself int8 on the experts and a float router: check_layer passes, the
  three expert sites at ``_moe_module.py``'s grouped_matmul lines held bitwise; the same copy with one scale
  shared by the experts (per output column, or for the whole stack) fails at those three sites, naming int8 and
  the shared scale.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import qcheck
from tests.helpers import import_extra

#: The versions every fact below was checked on.
VERSIONS = {"easydel": "0.3.0", "ejkernel": "0.0.78", "jax": "0.9.2"}
#: transformers modules easydel 0.3.0's model configurations read a torch-only class of, outside a ``try``, at
#: import (glm4v_moe_configuration.py:31, phimoe's, qwen3_next's, qwen3_5_moe's: ``getattr(module, ...)`` raises
#: ImportError without torch, and ``import easydel.modules`` with it). easydel does not require torch; an empty
#: module stands in for each, so each patch finds nothing to patch.
TORCH_ONLY = ("transformers.models.glm4v_moe.modeling_glm4v_moe", "transformers.models.phimoe.modeling_phimoe",
              "transformers.models.qwen3_next.modeling_qwen3_next",
              "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
X_SHAPE = (2, 8, 32)  # (batch, sequence, hidden)
#: The projections quantized: attention's and the experts'. The router stays float (see the INT8 fact below).
PATTERN = r"(q_proj|k_proj|v_proj|o_proj|w1|w2|w3)$"
MOE_FILE = "easydel/layers/moe/_moe_module.py"


def _pinned() -> None:
    installed = {d: importlib.metadata.version(d) for d in VERSIONS}
    if installed != VERSIONS:
        pytest.fail(f"{installed} is installed; these facts were checked on {VERSIONS}: recheck them, then update "
                    f"this test and the EasyDeL row of README.md")


@pytest.fixture(scope="module", autouse=True)
def _rank_promotion():
    """ejkernel's packing left-shifts codes of shape (n, g, 4) by a (4,) array, a rank promotion that qcheck's own
    runs raise on (conftest.py): EasyDeL's code runs as its users run it, with JAX's default."""
    import jax

    with jax.numpy_rank_promotion("allow"):
        yield


@pytest.fixture(scope="module")
def ed():
    """The modules the tests use, once: skipped, naming how to install EasyDeL, where it is absent."""
    import_extra("easydel")
    for name in TORCH_ONLY:
        if name not in sys.modules:
            package, _, module = name.rpartition(".")
            sys.modules[name] = types.ModuleType(name)
            setattr(importlib.import_module(package), module, sys.modules[name])
    import jax
    import jax.numpy as jnp
    from easydel.layers import quantization
    from easydel.modules.mixtral import MixtralConfig, MixtralForCausalLM
    from flax import nnx

    return types.SimpleNamespace(jax=jax, jnp=jnp, nnx=nnx, q=quantization, MixtralConfig=MixtralConfig,
                                 MixtralForCausalLM=MixtralForCausalLM)


def _model(ed, quantization=None, seed: int = 0):
    config = ed.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                              num_experts_per_tok=2, max_position_embeddings=32, sliding_window=None)
    model = ed.MixtralForCausalLM(config, dtype=ed.jnp.float32, param_dtype=ed.jnp.float32, rngs=ed.nnx.Rngs(seed))
    return model if quantization is None else model.quantize(quantization, verbose=False)


def _int8(ed, **kwargs):
    return ed.q.QuantizationConfig(dtype=ed.q.QuantizationType.INT8, **kwargs)


@pytest.fixture(scope="module")
def models(ed):
    """The float model and its int8 copy (same seed: the same weights), each built once; no test changes them."""
    return {"float": _model(ed), "int8": _model(ed, _int8(ed, pattern=PATTERN, group_size=16))}


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).normal(size=X_SHAPE).astype(np.float32)


def _layer(model):
    return model.model.layers[0]


# -- where qcheck locates EasyDeL's matmuls ---------------------------------------------------------

def test_the_experts_are_located_at_easydels_moe_module_should_pass(models, x):
    records = qcheck.coverage(_layer(models["float"]).block_sparse_moe, x)
    experts = [r for r in records if r.primitive == "ragged_dot_general"]
    assert len(experts) == 3, [r.location for r in records]  # w1, w3, w2
    assert all(re.search(rf"{re.escape(MOE_FILE)}:\d+$", r.location.replace("\\", "/")) for r in experts), \
        [r.location for r in experts]
    assert not any("ejkernel" in r.location or "jaxtyping" in r.location for r in records)


# -- the known defect: model.quantize leaves the experts float -----------------------------------------

def test_quantize_leaves_the_experts_float_and_assert_quantized_names_them_should_fail(models, x):
    _pinned()
    moe = _layer(models["int8"]).block_sparse_moe
    assert type(moe.experts.w1).__name__ == "ColumnParallelMoELinear"  # not replaced: no to_quantized
    assert not hasattr(moe.experts.w1, "to_quantized")
    with pytest.raises(AssertionError) as failed:
        qcheck.assert_quantized(moe, x)
    message = str(failed.value).replace("\\", "/")
    sites = set(re.findall(rf"{re.escape(MOE_FILE)}:\d+", message))
    assert len(sites) == 3, message  # the three expert ragged_dot_generals, each named at EasyDeL's line
    experts = [r for r in qcheck.coverage(moe, x) if r.primitive == "ragged_dot_general"]
    assert [(r.lhs_dtype, r.rhs_dtype, r.lhs.kind, r.rhs.kind) for r in experts] == \
        [("float32", "float32", "full", "full")] * 3


def test_check_layer_fails_the_int8_block_at_its_experts_and_as_the_float_blocks_bits_should_fail(models, x):
    _pinned()
    with pytest.raises(AssertionError) as failed:
        qcheck.check_layer(_layer(models["int8"]).block_sparse_moe, _layer(models["float"]).block_sparse_moe, x,
                           output=0)
    message = str(failed.value).replace("\\", "/")
    assert len(set(re.findall(rf"ragged_dot_general at \S*{re.escape(MOE_FILE)}:\d+", message))) == 3, message
    assert "actual is bitwise equal to the unquantized reference — the quantized path was not taken" in message
    assert "nothing read: the EasyDeL reader: EasyDeL QuantizationConfig(dtype='int8'" in message


def test_the_int8_blocks_output_is_the_float_blocks_bitwise_beside_a_quantized_projection_should_fail(models, x):
    _pinned()
    q, f = _layer(models["int8"]), _layer(models["float"])
    assert np.array_equal(np.asarray(q.block_sparse_moe(x)[0]), np.asarray(f.block_sparse_moe(x)[0]))
    # The control: the attention's q projection was quantized (ejkernel's packed codes), and its output moved.
    assert type(q.self_attn.q_proj).__name__ == "ColumnParallelLinearQuantized"
    assert q.self_attn.q_proj.quant_kernel[...].dtype == np.uint32
    import jax.numpy as jnp

    xj = jnp.asarray(x)  # ejkernel's quantized matmul is type-checked (jaxtyping): a jax.Array, not numpy
    assert not np.array_equal(np.asarray(q.self_attn.q_proj(xj)), np.asarray(f.self_attn.q_proj(xj)))


# -- a copy of EasyDeL's MoE block whose experts ARE quantized: a shared expert scale planted in it ----------

#: How the copy's expert weights are scaled: one scale per expert per output column (qcheck's int8: absmax / 127
#: over the contraction axis, ``in``), and two plants: one scale per output column shared by all experts, and one
#: scale for the whole (experts, in, out) stack. Each with the words qcheck's finding says the codes match.
EXPERT_SCALES = {"per expert": ((1,), None),
                 "shared across experts": ((0, 1), "one scale shared across axis 0 (size 4)"),
                 "one for the whole stack": (None, "one scale for the whole tensor")}


def _ste(scale_axes):
    """int8 quantize-dequantize of an expert stack with a straight-through gradient (a QAT user's: the codes'
    rounding has no gradient, the weight's passes through), its scale reduced over ``scale_axes``."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def qdq(w):
        scale = jnp.max(jnp.abs(w), axis=scale_axes, keepdims=True) / 127
        return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8).astype(w.dtype) * scale

    qdq.defvjp(lambda w: (qdq(w), None), lambda _, g: (g,))
    return qdq


def _int8_experts_block(ed, float_block, scales: str):
    """A copy of EasyDeL's ``MixtralSparseMoeBlock`` (a subclass: EasyDeL's routing, its shard_map and its ejkernel
    grouped matmuls, nothing patched) whose experts are int8: each expert stack quantized in the call, outside
    EasyDeL's shard_map, as a user quantizing its weights would (EasyDeL's ``model.quantize`` leaves them float),
    and multiplied inside it by ejkernel's grouped_matmul (_moe_module.py's ``_sparse_call``). Its router stays
    float. Its parameters are ``float_block``'s (its own initialisation is overwritten), so that is its twin."""
    from easydel.modules.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from jax.ad_checkpoint import checkpoint_name

    qdq = _ste(EXPERT_SCALES[scales][0])

    class Int8ExpertsMoeBlock(MixtralSparseMoeBlock):
        def __call__(self, hidden_state):  # MixtralSparseMoeBlock.__call__ with each kernel through qdq
            out, router_logits = self.moe_call(
                hidden_state=hidden_state, gate_layer=self.gate, expert_layer=self.experts,
                wi_kernel=qdq(self.experts.w1.kernel[...]), wu_kernel=qdq(self.experts.w3.kernel[...]),
                wd_kernel=qdq(self.experts.w2.kernel[...]), act_fn=self.experts.act_fn)
            return checkpoint_name(out, "moe_expert_output"), checkpoint_name(router_logits, "moe_router_logits")

        def qcheck_declaration(self):
            return qcheck.libraries.Declaration(
                {"weights": qcheck.libraries.RoleFormat("int8"), "activations": None},
                "Int8ExpertsMoeBlock.qcheck_declaration(): int8 experts, a float router",
                scopes={"gate": {"weights": None, "activations": None}})

    block = Int8ExpertsMoeBlock(float_block.config, dtype=ed.jnp.float32, param_dtype=ed.jnp.float32,
                                rngs=ed.nnx.Rngs(1))
    ed.nnx.update(block, ed.nnx.state(float_block))
    return block


def _grouped_matmul_lines() -> list[int]:
    """The lines of _moe_module.py where ``_sparse_call`` calls ejkernel's grouped_matmul (w1, w3, w2)."""
    import inspect

    from easydel.layers.moe._moe_module import BaseMoeModule

    lines, start = inspect.getsourcelines(BaseMoeModule._sparse_moe_call)
    return [start + i for i, line in enumerate(lines) if " = grouped_matmul(" in line]


def test_a_copy_of_the_moe_block_with_per_expert_int8_scales_holds_its_experts_bitwise_should_pass(ed, models, x):
    """The control: every expert site, at the line of _moe_module.py that calls ejkernel's grouped_matmul inside
    EasyDeL's shard_map, holds the int8 codes made outside it bitwise; the router is held as declared, float."""
    _pinned()
    f = _layer(models["float"]).block_sparse_moe
    figures = qcheck.check_layer(_int8_experts_block(ed, f, "per expert"), f, x, output=0)
    assert figures.declared_from == "read from the layer: Int8ExpertsMoeBlock.qcheck_declaration(): int8 experts, " \
                                    "a float router", figures.declared_from
    experts = [s for s in figures.coverage if s.primitive == "ragged_dot_general"]
    lines = _grouped_matmul_lines()
    assert len(lines) == 3 and [s.location.replace("\\", "/").split("site-packages/")[-1] for s in experts] == \
        [f"{MOE_FILE}:{n}" for n in lines], [s.location for s in experts]
    assert [(s.rhs_declared, str(s.rhs), s.rhs_hold.strength) for s in experts] == [("int8", "int8", "bitwise")] * 3
    (gate,) = [s for s in figures.coverage if s.scope.startswith("gate/")]
    assert (gate.rhs_declared, gate.rhs_hold.strength) == ("full precision", "type"), gate
    assert figures.edges["zeros"] == "run, codes held bitwise", figures.edges
    assert 0 < figures.rel_norm < 0.05, figures.rel_norm  # the quantized path was taken, and stays close


@pytest.mark.parametrize("scales", ("shared across experts", "one for the whole stack"))
def test_a_shared_expert_scale_planted_in_a_copy_of_the_moe_block_should_fail_naming_its_sites(ed, models, x, scales):
    """The plant: the same copy with one scale shared by the experts. check_layer fails the declaration at each
    grouped_matmul line of _moe_module.py, naming int8 and how the codes were scaled; nothing else fails."""
    _pinned()
    f = _layer(models["float"]).block_sparse_moe
    with pytest.raises(AssertionError) as failed:
        qcheck.check_layer(_int8_experts_block(ed, f, scales), f, x, output=0)
    message = str(failed.value).replace("\\", "/")
    assert message.startswith("check_layer: 1 check(s) failed:\n  coverage: assert_quantized: 3 of 5 matmuls "
                              "differ from the declared quantization (weights int8, activations full precision, "
                              "module gate: weights full precision"), message
    for line in _grouped_matmul_lines():
        site = rf"ragged_dot_general at \S*{re.escape(MOE_FILE)}:{line} \(BaseMoeModule\._sparse_moe_call\.<locals>\." \
               rf"_sparse_call\): lhs \(\d+, \d+\) \[full precision\], rhs \(4, \d+, \d+\) \[int8\]\n" \
               rf"      rhs \(weight\): codes are not int8's: \d+ of 8192 codes differ from the referee's; .*; " \
               rf"they match {re.escape(EXPERT_SCALES[scales][1])}\n"
        assert re.search(site, message), (site, message)


# -- qcheck's reader of EasyDeL's QuantizationConfig --------------------------------------------------

def test_a_float_model_reads_as_declaring_nothing_quantized_should_pass(models, x):
    figures = qcheck.coverage(_layer(models["float"]).block_sparse_moe, x)
    assert figures.declared_from == "read from the fn: EasyDeL config.quantization_config=None, which declares " \
                                    "no quantized format"


def test_a_quantized_model_is_recognised_and_not_read_saying_why_should_fail(models, x):
    figures = qcheck.coverage(_layer(models["int8"]).block_sparse_moe, x)
    assert figures.declaration is None
    assert figures.declared_from == (
        "nothing read: the EasyDeL reader: EasyDeL QuantizationConfig(dtype='int8', group_size=16, bits=None) is "
        "int8_easydel on its quantized projections, each read on its own (check_layer on one, beside its float twin, "
        "holds its packed codes), but model.quantize leaves the experts float: no one declaration holds the model "
        "or a block (fn MixtralSparseMoeBlock); pass declared= to hold its sites")
    with pytest.raises(ValueError, match=r"declared=True, but the EasyDeL reader: EasyDeL QuantizationConfig"):
        qcheck.coverage(_layer(models["int8"]).block_sparse_moe, x, declared=True)


# -- EasyDeL's INT8 as qcheck's int8_easydel, held bitwise to EasyDeL's own quantizer -------------------------

def _unpacked(words) -> np.ndarray:
    """ejkernel's packed affine 8-bit codes: four to a uint32, least significant byte first (bitpack.py); codes
    already unpacked (qcheck's) as they are."""
    w = np.asarray(words)
    if w.dtype == np.uint8:
        return w
    return np.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=-1).reshape(*w.shape[:-1], -1).astype(np.uint8)


def _bits_differ(what: str, got, want) -> str | None:
    got, want = np.asarray(got), np.asarray(want)
    if (got.dtype, got.shape) != (want.dtype, want.shape):
        return f"{what}: {got.dtype}{list(got.shape)} vs EasyDeL's {want.dtype}{list(want.shape)}"
    off = got.view(f"u{got.dtype.itemsize}") != want.view(f"u{want.dtype.itemsize}")
    if off.any():
        i = tuple(int(j) for j in np.argwhere(off)[0])
        return f"{what}: {int(off.sum())} of {off.size} differ, first at {i}: {got[i]!r} vs EasyDeL's {want[i]!r}"
    return None


def assert_easydels_int8(kernel: np.ndarray, stored, block: int, quantize=None) -> str:
    """EasyDeL's stored (packed codes, scales, zero points) of the float ``kernel`` (in, out) are the
    ``int8_easydel`` referee's along the output axis, bitwise, in one of the record's forms (returned)."""
    quantize = quantize or (lambda x, form: qcheck.referees.reference_quantize(
        x, "int8_easydel", axis=1, block=block, ftz=True, xla_reciprocal=form))
    words, scales, zeros = (np.asarray(a) for a in stored)
    failures = []
    for form in qcheck.formats.get_format("int8_easydel").forms:
        codes, ref = quantize(kernel, form)
        why = (_bits_differ("codes", codes, _unpacked(words)) or _bits_differ("scales", ref["block"], scales)
               or _bits_differ("zero points", ref["zero_point"], zeros))
        if why is None:
            return form
        failures.append(f"[{form}] {why}")
    raise AssertionError("; ".join(failures))


def _stored(projection):
    return projection.quant_kernel[...], projection.quant_scales[...], projection.quant_biases[...]


def test_easydels_int8_projection_is_int8_easydel_bitwise_should_pass(models):
    """model.quantize's q_proj: ejkernel's affine codes (four to a uint32), float16 scales and float16 zero
    points, one per 16 outputs of each input row, are the referee's of the float model's kernel (same seed)."""
    _pinned()
    q, f = _layer(models["int8"]).self_attn, _layer(models["float"]).self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        kernel = np.asarray(getattr(f, name).kernel[...])
        words, scales, zeros = _stored(getattr(q, name))
        assert (words.dtype, scales.dtype, zeros.dtype) == (np.uint32, np.float16, np.float16)
        assert scales.shape == (kernel.shape[0], kernel.shape[1] // 16)  # grouped along the output axis
        assert_easydels_int8(kernel, (words, scales, zeros), 16)


def test_a_projection_declared_int8_easydel_by_hand_reads_its_unpacked_codes_held_by_type_only_should_fail(models, x):
    """Where qcheck stands on ejkernel's packed words: its XLA matmul pads them to a tile and unpacks each tile
    inside nested scans (shifts by 0, 8, 16, 24 and a mask of 255), and the walk reads the tile reaching the matmul
    at EasyDeL's _linear_quantized.py as uint8 codes unpacked from stored words. assert_quantized has no float twin
    to hold them against (check_layer does, below): declared by hand, they are held by type only, and said so."""
    _pinned()
    declared = {"weights": {"format": "int8_easydel", "block": 16}, "activations": None}
    with pytest.raises(AssertionError) as failed:
        qcheck.assert_quantized(_layer(models["int8"]).self_attn.q_proj, ed_array(x), declared=declared)
    message = str(failed.value).replace("\\", "/")
    assert re.search(r"easydel/layers/linears/_linear_quantized\.py:\d+ .*rhs \(64, 128\) \[uint8 unpack\]",
                     message), message
    assert "rhs (weight) held by its type only, not bitwise as int8_easydel at block 16" in message, message


#: check_layer's twin is the float model's projection: its kernel is the quantized one's packed words, scales and
#: zero points, none of which has a gradient.
PROJECTION_GRADS = ("quant_scales", "quant_biases", "kernel")


@pytest.mark.parametrize("name", ("q_proj", "o_proj"))
def test_a_stock_int8_projection_passes_its_read_declaration_its_codes_held_bitwise_should_pass(models, x, name):
    """The reader reads a quantized projection's own QuantizationConfig (int8_easydel at its group size, weight
    only) and its stored words, scales and zero points; check_layer holds them bitwise against the float twin's
    kernel, and the weight reaching ejkernel's matmul is those stored codes (held bitwise, not by type). Its state
    keeps the abstract Rngs of the ``nnx.eval_shape`` that built it, which its call never reads."""
    _pinned()
    import jax
    from flax import nnx

    q, f = getattr(_layer(models["int8"]).self_attn, name), getattr(_layer(models["float"]).self_attn, name)
    abstract = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(q))[0]
                if isinstance(v, jax.ShapeDtypeStruct)]
    assert abstract == ["['rngs']['default']['count'].value", "['rngs']['default']['key'].value"], abstract
    figures = qcheck.check_layer(q, f, ed_array(x), skip_grads=PROJECTION_GRADS)  # o_proj's input is 4 heads of 8
    assert "QuantizationConfig(dtype='int8', group_size=16" in figures.declared_from, figures.declared_from
    assert str(figures.declared.roles["weights"]) == "int8_easydel at block 16"
    (site,) = figures.coverage
    assert site.location.replace("\\", "/").split("site-packages/")[-1].startswith(
        "easydel/layers/linears/_linear_quantized.py:"), site.location
    assert (str(site.rhs), site.rhs_hold.strength) == ("uint8 unpack", "bitwise"), site
    assert site.rhs_hold.reason == "stored codes held bitwise against the reference's kernel", site.rhs_hold


def test_a_stock_int8_projection_with_one_stored_code_changed_fails_naming_it_should_fail(models, x):
    """The same projection with one code of its packed words moved by one step (a copy): check_layer fails,
    naming the stored words and the twin's kernel they no longer are int8_easydel of."""
    _pinned()
    from flax import nnx

    q = nnx.clone(_layer(models["int8"]).self_attn.q_proj)
    words = np.array(q.quant_kernel[...])
    words[0, 0] ^= np.uint32(1)  # the lowest byte: the first code of the first group
    q.quant_kernel[...] = words
    with pytest.raises(AssertionError) as failed:
        qcheck.check_layer(q, _layer(models["float"]).self_attn.q_proj, ed_array(x), skip_grads=PROJECTION_GRADS)
    message = str(failed.value)
    assert "stored quant_kernel against the reference's kernel: codes are not int8_easydel at block 16's" in message, \
        message


def ed_array(x):
    import jax.numpy as jnp

    return jnp.asarray(x)  # ejkernel's quantized matmul is type-checked (jaxtyping): a jax.Array, not numpy


#: Values over many binades, a group of one sign and an all-equal group: where the forms and rules part.
def _wide(shape=(256, 512)) -> np.ndarray:
    rng = np.random.default_rng(1)
    x = rng.normal(size=shape) * np.exp2(rng.integers(-8, 8, size=shape))
    x[0, :64] = np.abs(x[0, :64]) + 3.0
    x[1, :64] = 0.25
    return x.astype(np.float32)


@pytest.mark.parametrize("run", ("eager", "jit"))
def test_ejkernels_affine_int8_is_int8_easydel_eager_and_jitted_should_pass(ed, run):
    """ejkernel's prepack_quantized_weights as EasyDeL calls it (transpose=False: groups along the output axis),
    eager and under jit, and qcheck's own int8_easydel quantizer: the referee's codes, scales and zero points."""
    _pinned()
    from ejkernel.quantization import prepack_quantized_weights

    x = _wide()
    f = lambda w: prepack_quantized_weights(w, group_size=64, bits=8, mode="affine", transpose=False)  # noqa: E731
    stored = (ed.jax.jit(f) if run == "jit" else f)(ed.jnp.asarray(x))
    assert_easydels_int8(x, stored, 64)
    # qcheck's own quantizer, as compiled here: the referee's in one of its forms (XLA may fuse it unlike
    # ejkernel's: measured, one code of these 131072 parts from the jitted ejkernel's).
    mine = qcheck.formats.quantize(ed.jnp.asarray(x), "int8_easydel", axis=1)
    assert_easydels_int8(x, (mine.codes, mine.scales["block"], mine.scales["zero_point"]), 64)


def _floored(x, form):
    """A planted variant: int8_easydel's rule rounding down (x / scale + zero point floored), not to nearest."""
    g = x.reshape(x.shape[0], -1, 64)
    lo = g.min(-1, keepdims=True)
    scale = ((g.max(-1, keepdims=True) - lo) / np.float32(255)).astype(np.float32)
    scale = np.where(scale == 0, np.float32(1), scale)
    zero = (-lo / scale).astype(np.float32)
    codes = np.clip(np.floor((g / scale).astype(np.float32) + zero), 0, 255).reshape(x.shape).astype(np.uint8)
    return codes, {"block": scale[..., 0].astype(np.float16), "zero_point": zero[..., 0].astype(np.float16)}


@pytest.mark.parametrize("variant", ("rounded down", "groups of 32"))
def test_a_planted_variant_of_int8_easydel_is_not_ejkernels_should_fail(ed, variant):
    _pinned()
    from ejkernel.quantization import prepack_quantized_weights

    x = _wide()
    stored = prepack_quantized_weights(ed.jnp.asarray(x), group_size=64, bits=8, mode="affine", transpose=False)
    if variant == "groups of 32":
        with pytest.raises(AssertionError, match=r"codes: \d+ of 131072 differ"):
            assert_easydels_int8(x, stored, 32)
        return
    with pytest.raises(AssertionError, match=r"codes: \d+ of 131072 differ"):
        assert_easydels_int8(x, stored, 64, quantize=_floored)


def _affine_round_trip(ed, x: np.ndarray) -> np.ndarray:
    from ejkernel.quantization import dequantize, prepack_quantized_weights

    kw = {"group_size": 16, "bits": 8, "mode": "affine"}
    w, s, z = prepack_quantized_weights(ed.jnp.asarray(x), transpose=False, **kw)
    return np.asarray(dequantize(w, s, z, **kw), np.float32), np.asarray(s), np.asarray(z)


def test_int8s_float16_zero_point_overflows_on_a_group_far_from_zero_and_its_scale_flushes_on_a_narrow_one(ed):
    _pinned()
    # A group whose min is more than 257 spans from 0: -min / scale is beyond float16's 65504, stored inf, and the
    # group decodes to inf/NaN from finite weights. A group spanning less than 255 · 2^-24: its float16 scale is 0,
    # and every weight decodes to 0 (int8_easydel's referee computes both: its record's edge rows).
    far = np.tile(np.linspace(1.0, 1.001, 16, dtype=np.float32), (2, 1))
    out, _, zero = _affine_round_trip(ed, far)
    assert np.all(np.isinf(zero)) and not np.any(np.isfinite(out))
    narrow = np.tile(np.linspace(-1e-6, 1e-6, 16, dtype=np.float32), (2, 1))
    out, scale, _ = _affine_round_trip(ed, narrow)
    assert np.all(scale == 0) and not np.any(out)


def test_int8_decodes_a_group_around_zero_finite_and_close_should_pass(ed):
    x = np.tile(np.linspace(-1.0, 1.001, 16, dtype=np.float32), (2, 1))
    out, _, _ = _affine_round_trip(ed, x)
    assert np.all(np.isfinite(out)) and np.max(np.abs(out - x)) < 2.0 / 255


# -- EasyDeL's other defects, each a fact beside its control -------------------------------------------

def test_int8_with_the_default_pattern_raises_on_a_router_of_4_experts(ed):
    _pinned()
    # The default pattern reaches the router (4 outputs): no affine group size in {16, ..., 1024} divides 4.
    with pytest.raises(ValueError, match=r"No supported ejkernel group_size divides the local grouping axis.*"
                                         r"group_dim=4"):
        _model(ed, _int8(ed))


def test_int8_passing_the_router_by_quantizes_should_pass(models):
    assert type(_layer(models["int8"]).block_sparse_moe.gate).__name__ == "ColumnParallelLinear"


def _simulated(ed, w, dtype):
    return np.asarray(ed.q.quantize(ed.jnp.asarray(w), config=ed.q.QuantizationConfig(dtype=dtype, simulate=True)))


def test_nvfp8_flushes_weights_at_mixtrals_init_scale_to_zero(ed):
    _pinned()
    # Mixtral's experts are initialised with std 0.01 (nn.initializers.normal()); nvfp8 has one e4m3 scale per 16
    # weights and no tensor scale, so a group whose absmax is below about 0.44 is all zeros.
    w = np.random.default_rng(0).normal(0, 0.01, size=(64, 64)).astype(np.float32)
    assert np.count_nonzero(_simulated(ed, w, "nvfp8")) == 0
    flushed, kept = (_simulated(ed, np.full((16, 2), v, np.float32), "nvfp8") for v in (0.43, 0.44))
    assert np.count_nonzero(flushed) == 0 and np.count_nonzero(kept) == kept.size


def test_nvfp8_keeps_weights_of_unit_scale_should_pass(ed):
    w = np.random.default_rng(0).normal(0, 1.0, size=(64, 64)).astype(np.float32)
    assert np.count_nonzero(_simulated(ed, w, "nvfp8")) == w.size


def _native(ed, dtype, values):
    config = ed.q.QuantizationConfig(dtype=dtype, jax_native=True)
    return ed.q.quantize(ed.jnp.asarray(values, ed.jnp.float32), config=config)


def test_jax_native_nvfp8_casts_to_e4m3_with_inf_unscaled_and_mxfp8_to_e5m2(ed):
    _pinned()
    nvfp8 = _native(ed, "nvfp8", [300.0, 1.0])
    assert nvfp8.dtype == ml_dtypes.float8_e4m3  # IEEE-like, max 240, with inf: not e4m3fn
    assert np.isinf(np.asarray(nvfp8, np.float32)[0])
    assert _native(ed, "mxfp8", [300.0, 1.0]).dtype == ml_dtypes.float8_e5m2  # "MXFP8 (E4M3 codes)"


def test_e4m3fn_the_nvfp8_element_type_saturates_300_should_pass():
    # The control: the type NVIDIA's fp8 (E4M3) is, e4m3fn (max 448), holds 300 finite; within range, both agree.
    assert np.asarray(np.float32(300.0).astype(ml_dtypes.float8_e4m3fn), np.float32) == 288.0
    assert np.asarray(np.float32(1.0).astype(ml_dtypes.float8_e4m3), np.float32) == 1.0


#: Every mode ``straight_through`` offers (nvfp4 it refuses: "Unsupported quantization type").
MODES = ("int8", "affine", "nf4", "mxfp4", "mxfp8", "nvfp8")


@pytest.mark.parametrize("mode", MODES)
def test_straight_through_raises_a_type_error(ed, mode):
    _pinned()
    w = ed.jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32))
    with pytest.raises(TypeError, match=r"_straight_through_ejkernel could not be resolved to positional-only"):
        ed.q.straight_through(w, config=ed.q.QuantizationConfig(dtype=mode))


@pytest.mark.parametrize("mode", MODES)
def test_quantize_simulated_in_the_same_mode_runs_should_pass(ed, mode):
    w = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    out = _simulated(ed, w, mode)
    assert out.shape == w.shape and np.all(np.isfinite(out)) and not np.array_equal(out, w)

