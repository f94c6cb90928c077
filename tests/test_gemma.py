"""gemma 4.0.1's quantization-aware training wrapper as a pinned client of qcheck.

``gm.nn.QuantizationAwareWrapper(model=..., method=peft.QuantizationMethod.INT8)``
swaps, through a Flax module interceptor, every ``nn.Dense``, ``nn.Einsum`` and
Gemma 1-3 ``Einsum`` of the model it wraps for a module that multiplies by
``peft.simulate_quantize(kernel, INT8)`` inside a straight-through estimator:
weight-only int8, scales 127 · (1/absmax) with absmax over every axis of the
kernel but the last, codes ``jnp.round`` clipped to [-128, 127], divided back by
the scales (gemma/peft/_quantization.py). Activations stay float. That is qcheck's
``int8`` with one scale per index of the kernel's last axis:
``{"weights": {"format": "int8", "per": (-1,)}, "activations": None}``, which is
also what ``declared=True`` reads from the wrapper's ``method``.

Runs in gemma's own environment (.ci/gemma.sh, ``tox -e gemma``, the gemma stage of
.ci/run); skipped where gemma is not installed. The known defects of gemma 4.0.1
(docs/libraries.md) are asserted with the version checked, so a new gemma makes
these tests say "recheck" rather than pass or fail silently:

* Gemma 4's MoE block under the wrapper quantizes nothing: Gemma 4 has its own
  ``Einsum`` (gemma4/_layers.py), which the interceptor does not match, and
  ``MoERagged`` multiplies its experts by a plain ``jax.lax.ragged_dot``;
* with ``transpose_gating_einsum=True`` (every Gemma 3 config) the gating kernel's
  last axis is the contraction: QAT trains one scale per input feature, while
  gemma's serving path (``peft.quantize`` and ``IntWrapper``) keeps one per output.

The layers are tiny (16 wide, hidden 32, 4 experts, top 2) and each is built once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcheck
from qcheck._coverage._readers import read_declaration
from tests.helpers import import_extra

#: The gemma version these checks and their known defects were checked on.
GEMMA_VERSION = "4.0.1"
EMB, HIDDEN, EXPERTS, TOP_K = 16, 32, 4, 2
X_SHAPE = (2, 8, EMB)
#: What the INT8 wrapper computes: weight-only int8, one scale per index of the kernel's last axis.
WEIGHT_ONLY_INT8 = {"weights": {"format": "int8", "per": (-1,)}, "activations": None}
#: gemma's serving granularity (``peft.quantize``: one scale per output feature), which is int8's own rule:
#: one scale per index of every kernel axis but the contraction.
SERVED_INT8 = {"weights": "int8", "activations": None}
READ = "gemma QuantizationAwareWrapper(method=INT8)"


@pytest.fixture(scope="module", autouse=True)
def _gemma():
    import_extra("gemma", "gemma.gm")
    # gemma's modules broadcast by rank (Gemma 4's router scale (F,) against (B, T, F)); the suite raises on it.
    with jax.numpy_rank_promotion("allow"):
        yield


def _pinned() -> None:
    installed = importlib.metadata.version("gemma")
    if installed != GEMMA_VERSION:
        pytest.fail(f"gemma {installed} is installed; this known defect was checked on gemma {GEMMA_VERSION}: "
                    f"recheck it on {installed}, then update this test and the gemma rows of docs/libraries.md")


def _line(fn, needle: str) -> str:
    """``file:line`` (from the package root) of the one line of ``fn``'s source that holds ``needle``."""
    fn = inspect.unwrap(fn)  # Flax wraps nn.compact methods
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if needle in line]
    path = inspect.getsourcefile(fn).replace(os.sep, "/")
    return f"{path[path.rindex('gemma/gm/'):]}:{start + offset}"


def _message(failure: pytest.ExceptionInfo) -> str:
    return str(failure.value).replace(os.sep, "/")


@functools.cache
def inputs() -> np.ndarray:
    return np.random.default_rng(0).normal(size=X_SHAPE).astype(np.float32)


def _wrap(model, method: str = "INT8"):
    from gemma import gm, peft

    return gm.nn.QuantizationAwareWrapper(model=model, method=getattr(peft.QuantizationMethod, method))


@pytest.fixture(scope="module")
def cells():
    """Each cell built once: ``(wrapped, model, variables)``, the wrapper sharing the model's parameters."""
    built = {}

    def build(name: str):
        from gemma.gm.nn import _modules
        from gemma.gm.nn.gemma4 import _modules as gemma4_modules
        from gemma.gm.nn.gemma4 import _moe

        if name not in built:
            model = {
                "gemma3_ffw": lambda: _modules.FeedForward(features=EMB, hidden_dim=HIDDEN,
                                                           transpose_gating_einsum=True),
                "gemma2_ffw": lambda: _modules.FeedForward(features=EMB, hidden_dim=HIDDEN,
                                                           transpose_gating_einsum=False),
                "gemma4_moe": lambda: _moe.MoERagged(features=EMB, hidden_dim=HIDDEN, num_experts=EXPERTS,
                                                     num_experts_per_datapoint=TOP_K),
                "gemma4_ffw": lambda: gemma4_modules.FeedForward(features=EMB, hidden_dim=HIDDEN),
            }[name]()
            variables = model.init(jax.random.key(0), inputs())
            built[name] = _wrap(model), model, variables
        return built[name]

    return build


def _pair(cell, which: str):
    wrapped, model, variables = cell
    return (wrapped if which == "wrapped" else model), variables


# -- Gemma 1-3's FeedForward: the wrapper computes what it declares -------------------------------

@pytest.mark.parametrize("name", ["gemma3_ffw", "gemma2_ffw"])
def test_gemma_feed_forward_under_int8_wrapper_passes_weight_only_int8_should_pass(cells, name):
    cell = cells(name)
    figures = qcheck.check_layer(_pair(cell, "wrapped"), _pair(cell, "model"), inputs(), declared=WEIGHT_ONLY_INT8)
    assert 0 < figures.rel_norm <= 0.22
    # Both einsums (gating, linear): weights on the int8 grid (codes bitwise), activations float.
    assert len(figures.coverage) == 2
    assert all(r.rhs_role == "weight" and r.rhs.quantized and not r.lhs.quantized for r in figures.coverage)
    assert all(r.rhs_declared == "int8 per axes (-1,)" and not r.findings for r in figures.coverage)


@pytest.mark.parametrize("name", ["gemma3_ffw", "gemma2_ffw"])
def test_gemma_feed_forward_unwrapped_twin_fails_weight_only_int8(cells, name):
    # Control of the pass above: the same module and parameters without the wrapper.
    twin = _pair(cells(name), "model")
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(lambda x: twin[0].apply(twin[1], x), inputs(), declared=WEIGHT_ONLY_INT8)
    message = _message(failure)
    from gemma.gm.nn import _layers

    assert message.count(_line(_layers.Einsum.__call__, "return jnp.einsum(")) == 2, message
    assert message.count("rhs (weight) reaches the matmul in full precision; declared int8 per axes (-1,)") == 2


def test_gemma_feed_forward_wrapper_fails_another_granularity(cells):
    # Control that the codes are read bitwise: one scale per index of the kernel's first axis is not gemma's.
    wrapped, _, variables = cells("gemma3_ffw")
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(lambda x: wrapped.apply(variables, x), inputs(),
                                declared={"weights": {"format": "int8", "per": (0,)}, "activations": None})
    assert "2 of 2 matmuls differ from the declared quantization" in str(failure.value)
    assert str(failure.value).count("codes are not int8 per axes (0,)'s") == 2, str(failure.value)


# -- declared=True: the declaration read from the wrapper --------------------------------------

def test_check_layer_reads_gemma_wrappers_declaration(cells):
    cell = cells("gemma3_ffw")
    figures = qcheck.check_layer(_pair(cell, "wrapped"), _pair(cell, "model"), inputs(), declared=True)
    assert figures.declared.source == READ
    assert {k: (None if v is None else str(v)) for k, v in figures.declared.roles.items()} == {
        "weights": "int8 per axes (-1,)", "activations": None}


def test_gemma_reader_reads_nothing_from_an_unwrapped_model_or_another_method(cells):
    # Controls of the reader: only the wrapper declares, and only the methods it knows.
    _, model, variables = cells("gemma3_ffw")
    assert read_declaration((model, variables)) is None
    assert read_declaration((_wrap(model, "INT4"), variables)) is None
    none = read_declaration((_wrap(model, "NONE"), variables))
    assert none is not None and none.roles == {"weights": None, "activations": None}


# -- known defect: Gemma 4's MoE block under the wrapper quantizes nothing -------------------------

def test_gemma4_wrapper_leaves_the_model_bitwise_unchanged_where_gemma3_changes(cells):
    """gemma 4.0.1: the wrapper computes the unwrapped Gemma 4 module's bits; Gemma 3's it changes (control)."""
    _pinned()
    for name, same in (("gemma4_moe", True), ("gemma4_ffw", True), ("gemma3_ffw", False)):
        wrapped, model, variables = cells(name)
        a, b = (np.asarray(m.apply(variables, inputs())) for m in (wrapped, model))
        assert np.array_equal(a, b) is same, name


@pytest.mark.parametrize("name", ["gemma4_moe", "gemma4_ffw"])
def test_gemma4_moe_block_under_int8_wrapper_quantizes_nothing(cells, name):
    """gemma 4.0.1: ``QuantizationAwareWrapper(method=INT8)`` leaves Gemma 4's MoE block in full precision.

    Its interceptor (gm/nn/_quantization.py, ``_replace_by_simulated_quantization``)
    matches ``nn.Dense``, ``nn.Einsum`` and Gemma 1-3's ``Einsum``; Gemma 4 has its
    own ``Einsum`` (gemma4/_layers.py), and ``MoERagged`` multiplies its experts by
    a plain ``jax.lax.ragged_dot``. Both branches of the block, the routed experts
    (``MoERagged``: the router einsum and two ragged_dots) and the shared dense
    ``FeedForward`` (two einsums), run float32 × float32 while the declaration read
    from the wrapper says int8 weights; the output is bitwise the unwrapped model's.
    """
    _pinned()
    from gemma.gm.nn.gemma4 import _layers, _moe

    cell = cells(name)
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(_pair(cell, "wrapped"), _pair(cell, "model"), inputs(), declared=True)
    message = _message(failure)
    assert message.startswith("check_layer: ") and f"({READ})" in message
    einsum = _line(_layers.Einsum.__call__, "return jnp.einsum(")
    if name == "gemma4_moe":
        assert "3 of 4 matmuls differ from the declared quantization" in message, message
        assert message.count(einsum) == 1, message  # the router
        ragged = [_line(_moe.MoERagged._run_ffw_and_routing, "gate_out = jax.lax.ragged_dot("),
                  _line(_moe.MoERagged._run_ffw_and_routing, "expert_outputs = jax.lax.ragged_dot(")]
        assert [message.count(f"{line} (MoERagged._run_ffw_and_routing)") for line in ragged] == [1, 1], message
    else:
        assert "2 of 2 matmuls differ from the declared quantization" in message, message
        assert message.count(einsum) == 2, message
    unquantized = "rhs (weight) reaches the matmul in full precision; declared int8 per axes (-1,)"
    assert message.count(unquantized) == (3 if name == "gemma4_moe" else 2), message
    # Nothing is quantized: the output is the twin's, bit for bit.
    assert re.search(r"\n  tracks: assert_tracks: actual is bitwise equal to the unquantized reference", message)


# -- known defect: Gemma 3's transposed gating trains another quantizer than the one served -------

def _served(params: dict, num_heads: int = 4, head_dim: int = 8) -> dict:
    """gemma's serving quantization (``peft.quantize``, INT8) of one FeedForward's parameters.

    ``peft.quantize`` finds the model width from ``layer_0/attn/q_einsum/w`` (shape
    ``(num_heads, features, head_dim)`` in a Gemma checkpoint) and reads each kernel's
    role from its shape; the MLP sits in ``layer_0/mlp`` as in a checkpoint.
    """
    from gemma import peft

    tree = {"layer_0": {"attn": {"q_einsum": {"w": jnp.zeros((num_heads, EMB, head_dim))}}, "mlp": params}}
    return peft.quantize(tree, method=peft.QuantizationMethod.INT8)["layer_0"]["mlp"]


def _dequantized(kernel, scale) -> np.ndarray:
    """The served weights as gemma's ``_IntEinsum`` computes them: the codes divided by the scale, in JAX."""
    return np.asarray(kernel.astype(jnp.float32) / scale)


def test_gemma3_transposed_gating_qat_scales_per_input_feature_not_as_served(cells):
    """gemma 4.0.1, ``transpose_gating_einsum=True`` (every Gemma 3 config): QAT's gating scales follow the contraction.

    The gating kernel is ``(2, hidden, features)`` with ``features`` contracted;
    ``simulate_quantize`` keeps one scale per index of the last axis, one per
    input feature, while ``peft.quantize`` (the served int8 checkpoint) keeps one per
    output, ``(2, hidden, 1)``. Declared at the served granularity, qcheck fails the
    gating site and passes the linear one, whose last axis is the output in both.
    """
    _pinned()
    from gemma.gm.nn import _modules, _quantization

    wrapped, _, variables = cells("gemma3_ffw")
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(lambda x: wrapped.apply(variables, x), inputs(), declared=SERVED_INT8)
    message = _message(failure)
    assert "1 of 2 matmuls differ from the declared quantization" in message, message
    assert f"rhs (2, {HIDDEN}, {EMB})" in message and f"rhs ({HIDDEN}, {EMB})" not in message, message
    assert re.search(r"rhs \(weight\): codes are not int8's: \d+ of \d+ codes differ from the referee's; .*they "
                     r"match scales reduced over axes \(0, 1\) instead: one scale per index of axes \(2,\)", message)
    assert _line(_quantization._SimulateQuantizedEinsum.__call__, "y = jnp.einsum(") in message
    # The failing site is the gating einsum: FeedForward's gating call is on its stack, the linear one's is not.
    records = qcheck.coverage(lambda x: wrapped.apply(variables, x), inputs(), declared=SERVED_INT8)
    gating, linear = (_line(_modules.FeedForward.__call__, s) for s in ("gate = gating(eq, x)", "= linear("))
    (bad,) = [r for r in records if r.findings]
    stack = [loc.replace(os.sep, "/") for loc, _ in bad.stack]
    assert any(loc.endswith(gating) for loc in stack) and not any(loc.endswith(linear) for loc in stack), stack

    # gemma's own serving path holds other weights than the ones QAT trained against, and computes otherwise.
    from gemma import gm, peft

    params = variables["params"]
    served = _served(params)
    kernel, scale = served["_IntEinsum_gating_einsum"]["kernel"], served["_IntEinsum_gating_einsum"]["scale"]
    assert scale.shape == (2, HIDDEN, 1)
    trained = peft.simulate_quantize(params["gating_einsum"], peft.QuantizationMethod.INT8)
    differ = int(np.count_nonzero(_dequantized(kernel, scale) != np.asarray(trained)))
    assert differ > kernel.size // 2, (differ, kernel.size)
    serve = gm.nn.IntWrapper(model=_modules.FeedForward(features=EMB, hidden_dim=HIDDEN, transpose_gating_einsum=True),
                             dtype=jnp.int8)
    out = np.asarray(serve.apply({"params": served}, inputs()))
    assert not np.array_equal(out, np.asarray(wrapped.apply(variables, inputs())))


def test_gemma3_linear_kernel_qat_and_serving_agree_should_pass(cells):
    # Control of the defect above, on the same layer: the linear kernel's last axis is its output, so QAT's and
    # the served weights are the same, bit for bit (the site passes the served rule there: the test above).
    from gemma import peft

    _, _, variables = cells("gemma3_ffw")
    params = variables["params"]
    served = _served(params)["_IntEinsum_linear"]
    trained = peft.simulate_quantize(params["linear"], peft.QuantizationMethod.INT8)
    assert np.array_equal(_dequantized(served["kernel"], served["scale"]), np.asarray(trained))


# -- docs/libraries.md ----------------------------------------------------------------------------

DOC = (Path(__file__).parent.parent / "docs" / "libraries.md").read_text()


def test_libraries_doc_gemma_block_runs_and_says_what_it_prints(capsys):
    (block,) = re.findall(r"<!-- gemma: declared -->\n```python\n(.*?)```", DOC, re.S)
    namespace = {"__name__": "doc_gemma"}
    exec(compile(block, "docs/libraries.md[gemma]", "exec"), namespace)
    shown = capsys.readouterr().out
    assert namespace["figures"].declared.source == READ
    # The prose quotes what the block prints: the declaration read, and the served rule's diagnosis.
    prose = " ".join(DOC.split())
    ((read, diagnosis),) = re.findall(r"The check passes, reading `([^`]+)`.*?instead, the gating einsum fails "
                                      r"\(`([^`]+)`\)", prose)
    assert read in " ".join(shown.split()) and diagnosis in shown, shown
    assert "1 of 2 matmuls differ from the declared quantization" in shown, shown


def test_libraries_doc_names_gemmas_ragged_dot_lines():
    from gemma.gm.nn.gemma4 import _moe

    lines = [_line(_moe.MoERagged._run_ffw_and_routing, s).rsplit(":", 1)[1]
             for s in ("gate_out = jax.lax.ragged_dot(", "expert_outputs = jax.lax.ragged_dot(")]
    assert f"gemma4/_moe.py:{lines[0]}, {lines[1]})" in DOC
