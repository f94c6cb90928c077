"""check_layer and copy_params_into: every check paired with the bug it is for, messages asserted."""

from __future__ import annotations

import dataclasses
import functools
import linecache
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import qcheck
from qcheck import checks, formats
from qcheck.checks._compiles import counting_compilations
from qcheck.checks import LayerFigures, check_layer, copy_params_into
from qcheck.checks._layer_programs import INPUT_GRAD
from qcheck.layers.bridge import Fp8Meta
from qcheck.layers.step import apply
from tests import maxtext_like
from tests.helpers import CHECK_LAYER_X as X, MOE_FULL_PRECISION, import_extra, sparse_moe

MIXTRAL = qcheck.MODELS["mixtral"]
DOC = Path(__file__).parent.parent / "docs" / "checking-your-layer.md"


def _bits(module: nnx.Module) -> list[bytes]:
    leaves = jax.tree.leaves(nnx.state(module))
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x).tobytes()
            for x in leaves]


# -- passes on qcheck's own layers ------------------------------------------------

@pytest.mark.parametrize("recipe, max_rel_norm", [
    ("fp8", 0.22),
    ("nvfp4", qcheck.get_recipe("nvfp4").expect.max_rel_norm),  # 0.35: NVFP4's forward lies above 0.22
])
def test_check_layer_should_pass_on_qcheck_layers(recipe, max_rel_norm):
    layer, twin = sparse_moe(recipe), sparse_moe("none")
    before = _bits(layer), _bits(twin)
    with counting_compilations() as log:
        figures = check_layer(layer, twin, X, max_rel_norm=max_rel_norm, skip=MOE_FULL_PRECISION)
    # One program per layer (none if an earlier check built the same structure): the second call reuses it.
    assert sum(n for k, n in log.items() if k.startswith("jit(step)")) <= 2, log
    assert 0 < figures.rel_norm <= max_rel_norm
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, "gate", "wi_0", "wi_1", "wo"}
    assert all(0 < f <= 0.5 for f in figures.grad_rel_norms.values())
    assert [r.primitive for r in figures.coverage if r.quantized] == ["ragged_dot_general"] * 3
    # Neither module changed, RNG counts and fp8 state included.
    assert (_bits(layer), _bits(twin)) == before


def test_layer_figures_are_frozen():
    figures = LayerFigures(0.1, {"w": 0.2, INPUT_GRAD: 0.3}, ())
    assert figures.worst_grad == (INPUT_GRAD, 0.3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        figures.rel_norm = 0.0


# -- the silent fallback that assert_tracks lets through ---------------------------

_e4m3 = jax.custom_vjp(lambda x: formats.qdq(x, "e4m3fn_current"))
_e4m3.defvjp(lambda x: (_e4m3(x), None), lambda _, g: (g,))


class _QuantizedRouterMoE(qcheck.MoE):
    """Mixtral's routing with the router's matmul quantized, as MaxText's quantized DenseGeneral does."""

    def route(self, x):
        logits = jnp.einsum("BSM,ME->BSE", _e4m3(x.astype(jnp.float32)), _e4m3(self.gate[...]))
        top, idx = jax.lax.top_k(logits, self.config.top_k)
        return jax.nn.softmax(top, axis=-1), idx


@functools.cache
def _silent_fallback() -> qcheck.MoE:
    """An fp8 layer whose router is quantized but whose sparse expert matmuls skip their quantizer."""
    layer = _QuantizedRouterMoE(MIXTRAL, qcheck.get_recipe("fp8"), path="sparse", rngs=nnx.Rngs(0), seed=0)
    for site in layer.sites.values():
        site.ragged_dot = jax.lax.ragged_dot
    return layer


def test_assert_tracks_alone_passes_the_silent_fallback():
    out, _ = apply(_silent_fallback(), X)
    ref, _ = apply(sparse_moe("none"), X)
    assert 0 < checks.assert_tracks(out, ref, max_rel_norm=0.22) <= 0.22


def test_check_layer_should_fail_on_the_silent_fallback_naming_each_call_and_its_line():
    with pytest.raises(AssertionError) as info:
        check_layer(_silent_fallback(), sparse_moe("none"), X, skip=MOE_FULL_PRECISION)
    message = str(info.value)
    # The layer's recipe, read from it by default, declares e4m3fn: each fallen-back site differs from it.
    assert message.startswith("check_layer: 1 check(s) failed:\n"
                              "  coverage: assert_quantized: 3 of 5 matmuls differ from the declared quantization")
    assert message.endswith("\ndeclared: read from the layer: the layer's recipe 'fp8'")
    lines = re.findall(r"ragged_dot_general at (qcheck/layers/moe.py:\d+) \(MoE._sparse\): .*\n\s+lhs \(activation\) "
                       r"reaches the matmul in full precision; declared e4m3fn", message)
    assert len(lines) == 3
    for where in lines:
        path, number = where.rsplit(":", 1)
        assert ".ragged_dot(" in linecache.getline(path, int(number))


# -- the other checks, each on its bug ----------------------------------------------

class _NoisyMoE(qcheck.MoE):
    """Adds fresh noise on every call: a second call on the same input gives other bits."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.noise = nnx.Rngs(noise=1)

    def __call__(self, x):
        y = super().__call__(x)
        return y + 1e-3 * jax.random.normal(self.noise.noise(), y.shape, y.dtype)


def test_check_layer_should_fail_on_a_non_deterministic_layer():
    layer = _NoisyMoE(MIXTRAL, qcheck.get_recipe("fp8"), path="sparse", rngs=nnx.Rngs(0), seed=0)
    before = _bits(layer)
    with pytest.raises(AssertionError, match=re.escape("check_layer: 1 check(s) failed:\n  determinism: a second "
                                                       f"call on the same input changed {X.size} of {X.size} output "
                                                       "values (float32; worst by ")):
        check_layer(layer, sparse_moe("none"), X, skip=MOE_FULL_PRECISION)
    assert _bits(layer) == before  # the RNG count the second call advanced was a copy's


class _AbstractRngsMoE(qcheck.MoE):
    """Keeps an abstract Rngs in its state (``jax.ShapeDtypeStruct`` leaves, no value), as EasyDeL 0.3.0's
    quantized linears keep the Rngs of the ``nnx.eval_shape`` that built them; ``reads``: its call reads one."""

    def __init__(self, *args, reads: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept = nnx.eval_shape(lambda: nnx.Rngs(0))
        self.reads = reads

    def __call__(self, x):
        y = super().__call__(x)
        return y + 0 * self.kept.default.count[...].astype(y.dtype) if self.reads else y


def test_check_layer_should_pass_a_layer_holding_an_abstract_leaf_it_never_reads():
    layer = _AbstractRngsMoE(MIXTRAL, qcheck.get_recipe("fp8"), path="sparse", rngs=nnx.Rngs(0), seed=0)
    assert any(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(nnx.state(layer)))
    figures = check_layer(layer, sparse_moe("none"), X, skip=MOE_FULL_PRECISION)
    assert [r.primitive for r in figures.coverage if r.quantized] == ["ragged_dot_general"] * 3


def test_check_layer_should_fail_naming_an_abstract_leaf_the_layer_reads():
    layer = _AbstractRngsMoE(MIXTRAL, qcheck.get_recipe("fp8"), path="sparse", rngs=nnx.Rngs(0), seed=0, reads=True)
    with pytest.raises(ValueError, match=r"^check_layer: layer's state kept/default/count\S* is abstract \(a "
                                         r"jax\.ShapeDtypeStruct\(\) uint32, no value\) and the layer's call reads it$"):
        check_layer(layer, sparse_moe("none"), X, skip=MOE_FULL_PRECISION)


# -- the MaxText-like block: gradients are what a forward check misses ----------------

def _maxtext(quant: str | None, seed: int = 0) -> maxtext_like.MoeBlock:
    return maxtext_like.MoeBlock(maxtext_like.Config(), quant=quant, rngs=nnx.Rngs(seed))


class _NoStraightThrough(maxtext_like.MoeBlock):
    """Quantized einsums whose gradient goes through the casts' own transposes."""

    def get_einsum(self, name):
        q = functools.partial(formats.qdq, fmt="e4m3fn_current")
        return lambda eqn, a, b: jnp.einsum(eqn, q(a), q(b))


_COMBINE = qcheck.skip_functions("MoeBlock._combine")


@functools.cache
def _maxtext_pair() -> tuple[maxtext_like.MoeBlock, maxtext_like.MoeBlock]:
    layer = _maxtext("fp8")
    return layer, copy_params_into(layer, _maxtext(None, seed=1))


def test_skip_grads_should_pass_leaving_out_the_router_kernel():
    layer, twin = _maxtext_pair()
    figures = check_layer(layer, twin, X, max_grad_rel_norm=0.25, skip=_COMBINE, skip_grads=["gate/kernel"])
    assert "gate/kernel" not in figures.grad_rel_norms and max(figures.grad_rel_norms.values()) <= 0.25


def test_skip_grads_should_fail_without_it():
    layer, twin = _maxtext_pair()
    with pytest.raises(AssertionError, match=r"check_layer: 1 check\(s\) failed:\n  gradients: gate/kernel "
                                             r"\(float32\) has relative norm 0\.\d+ against the reference's, "
                                             r"above the bound 0.25\ndeclared: nothing read"):
        check_layer(layer, twin, X, max_grad_rel_norm=0.25, skip=_COMBINE)


def test_check_layer_should_fail_on_a_quantized_einsum_without_straight_through_gradients():
    layer = _NoStraightThrough(maxtext_like.Config(), quant="fp8", rngs=nnx.Rngs(0))
    _, twin = _maxtext_pair()
    with pytest.raises(AssertionError) as info:
        check_layer(layer, twin, X, skip=_COMBINE)
    failed = re.findall(r"\n  (\w+): (\S+)", str(info.value))
    # The forward is the same as the working block's: only the gradients see the bug, every one of them; on a
    # token row beyond e4m3's range the casts' transposes (no saturation) turn the gradients NaN, and on the whole
    # tensor of tiny values the derivative of its capped current scale does (its site named).
    # And why: the gradients cast to e4m3 at the forward pass's scales flush.
    assert failed == [("gradients", p) for p in (INPUT_GRAD.split()[0], "gate/kernel", "wi_0", "wi_1", "wo")] + [
        ("edges", "token"), ("edges", "whole"), ("edges", "whole")]
    assert re.search(r"\n    flushed: .* became 0 codes of float8_e4m3fn at scale .*: the gradients are not "
                     r"scaled into float8_e4m3fn's range before this cast", str(info.value))
    assert re.search(r"edges: token row with one value far beyond the format's range \(1e5\): not finite: "
                     r"gradient of wi_0 \(\d+ of 8192\)", str(info.value))


# -- gradients at size, and gradients the layer's own casts flush ------------------------------------------

# 16384 tokens of the stock layer: the step's output gradients, were they a mean's (2 out / N), would come to
# about 4e-6, below e5m2's smallest subnormal, and a fresh fp8 layer's gradients would flush to zero (they did
# at 8deeb9f: relative norms 0.98).
MANY_TOKENS = np.random.default_rng(0).normal(size=(2, 8192, 32)).astype(np.float32)


def test_check_layer_should_pass_the_stock_fp8_layer_on_many_tokens_its_gradients_not_flushed():
    layer = qcheck.build_moe("mixtral", "fp8")
    twin = copy_params_into(layer, qcheck.build_moe("mixtral", "none"))
    figures = check_layer(layer, twin, MANY_TOKENS, skip=MOE_FULL_PRECISION)
    assert max(figures.grad_rel_norms.values()) <= 0.5


def _small_output(module, x):
    # A layer whose output is a thousandth of the stock one's: the step's output gradients (2^-10 out) come to
    # about 1e-9, below e5m2's smallest subnormal at a fresh delayed scale of 1.
    return module(x) * 1e-3


def test_check_layer_should_fail_naming_the_flush_where_a_fresh_fp8_scale_flushes_the_gradients():
    layer = qcheck.build_moe("mixtral", "fp8")
    twin = copy_params_into(layer, qcheck.build_moe("mixtral", "none"))
    with pytest.raises(AssertionError, match=r"\n  gradients: \S+ .*\n    flushed: (\d+) of \1 nonzero gradient values \(100\.0%\) at "
                                             r"MoE/sites/wo/\S+ became 0 codes of float8_e5m2 at scale 1 \(.*: a fresh "
                                             r"delayed scale of 1 does this; warm the scale with a training step"):
        check_layer(layer, twin, X, call=_small_output, skip=MOE_FULL_PRECISION)


def _small_output_and_a_nan_in_wo(module, x):
    # _small_output's flush, and one NaN in wo's gradient in both layers (sqrt's derivative at 0, times 0): wo
    # sorts last, so its non-finite lines come after the gradients that fail by norm.
    w = module.wo[...].reshape(-1)[0]
    return _small_output(module, x) + 0 * jnp.sqrt(w - w)


def test_check_layer_should_put_the_flush_under_a_gradient_it_explains_not_under_a_non_finite_one_after_it():
    layer = qcheck.build_moe("mixtral", "fp8")
    twin = copy_params_into(layer, qcheck.build_moe("mixtral", "none"))
    with pytest.raises(AssertionError) as info:
        check_layer(layer, twin, X, call=_small_output_and_a_nan_in_wo, skip=MOE_FULL_PRECISION)
    lines = str(info.value).splitlines()
    assert "  gradients: wo (float32) has 1 non-finite values out of 16384 in the reference" in lines, lines
    at = next(i for i, line in enumerate(lines) if line.startswith("    flushed: "))
    assert re.fullmatch(r"  gradients: \S+ \(float32\) has relative norm \d\.\d+ against the reference's, above "
                        r"the bound 0\.5", lines[at - 1]), lines


def test_check_layer_should_pass_the_same_layer_once_a_training_step_warmed_its_scales():
    warm = qcheck.train(qcheck.build_moe("mixtral", "fp8"), X)
    twin = copy_params_into(warm, qcheck.build_moe("mixtral", "none"))
    figures = check_layer(warm, twin, X, call=_small_output, skip=MOE_FULL_PRECISION)
    assert max(figures.grad_rel_norms.values()) <= 0.5


# -- plain functions -------------------------------------------------------------------

W = np.random.default_rng(1).normal(size=(32, 16)).astype(np.float32)


def _fp8_matmul(x):
    return _e4m3(x) @ _e4m3(jnp.asarray(W))


def _matmul(x):
    return x @ jnp.asarray(W)


def test_check_layer_on_plain_functions_should_pass_comparing_the_input_gradient():
    figures = check_layer(_fp8_matmul, _matmul, X[0])
    assert set(figures.grad_rel_norms) == {INPUT_GRAD} and len(figures.coverage) == 1


def test_check_layer_on_plain_functions_should_fail_on_an_unquantized_matmul():
    with pytest.raises(AssertionError, match=r"check_layer: 2 check\(s\) failed:\n  coverage: assert_quantized: "
                                             r"1 of 1 matmuls reach full precision:\n.*\n  tracks: assert_tracks: "
                                             r"actual is bitwise equal to the unquantized reference"):
        check_layer(_matmul, _matmul, X[0])


@dataclasses.dataclass
class _Unhashable:
    """A callable object that cannot be a static argument of jax.jit (a dataclass with eq and no hash)."""

    w: np.ndarray

    def __call__(self, x):
        return _e4m3(x) @ _e4m3(jnp.asarray(self.w))


def test_check_layer_should_pass_on_an_unhashable_callable():
    assert check_layer(_Unhashable(W), _matmul, X[0]).rel_norm > 0


def test_check_layer_should_fail_on_a_parameter_the_twin_lacks():
    layer = _WithBias(maxtext_like.Config(), quant="fp8", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"check_layer: reference has another structure than layer: parameters "
                                         r"in layer only: bias \(build the twin"):
        check_layer(layer, _maxtext_pair()[1], X, skip=_COMBINE)


def _asserts(x):
    assert x.shape[0] % 8 == 3  # a library's own shape assertion (AQT's), not a failed check
    return x


@pytest.mark.parametrize("call, error", [
    (lambda: check_layer(_fp8_matmul, _matmul, X[0].tolist()), r"check_layer: x must be a floating-point numpy "
                                                                r"or JAX array, got list"),
    (lambda: check_layer(_fp8_matmul, _matmul, X[0].astype(np.int32)), r"check_layer: x must be .*got ndarray of "
                                                                        r"int32"),
    (lambda: check_layer(_fp8_matmul, lambda x: _matmul(x)[:4], X[0]), r"check_layer: layer output has shape "
                                                                        r"\(32, 16\) but reference output has shape "
                                                                        r"\(4, 16\)"),
    (lambda: check_layer(_fp8_matmul, lambda x: (x, x), X[0]), r"check_layer: layer output has another structure "
                                                                r"than reference output: leaves the output against "
                                                                r"\[0\], \[1\]"),
    (lambda: check_layer(_fp8_matmul, _matmul, X[0], output=1), r"check_layer: layer's output=1 does not index the "
                                                                 r"output"),
    (lambda: check_layer(_fp8_matmul, lambda x: (_matmul(x), None), X[0], output=lambda o: o),
     r"check_layer: layer output has another structure"),
    (lambda: check_layer(lambda x: (_fp8_matmul(x), None), lambda x: (_matmul(x), None), X[0], output=1),
     r"check_layer: layer's output=1 selects no floating-point array of the output \(\[0\] float32\[32, 16\], "
     r"\[1\] None\)"),
    (lambda: check_layer(_fp8_matmul, "none", X[0]), r"check_layer: reference must be an flax.nnx.Module, a "
                                                      r"\(linen.Module, variables\) pair, an equinox.Module, a Keras "
                                                      r"layer or a function of x, got str"),
    (lambda: check_layer(_fp8_matmul, _matmul, X[0], max_grad_rel_norm=0), r"check_layer: max_grad_rel_norm must "
                                                                             r"be a positive number, got 0"),
    (lambda: check_layer(*_maxtext_pair(), X, skip_grads=["router"]), r"check_layer: skip_grads names \['router'\], "
                                                                       r"which are not parameters; parameter paths: "
                                                                       r"gate/kernel, wi_0, wi_1, wo"),
    (lambda: check_layer(_fp8_matmul, _matmul, X[0], skip_grads="wo"), r"check_layer: skip_grads must be a "
                                                                         r"collection of parameter paths"),
    (lambda: check_layer(lambda x: x @ jnp.ones((3, 3)), _matmul, X[0]), r"^check_layer: layer could not be traced "
                                                                          r"and run on cpu: TypeError: dot_general "
                                                                          r"requires contracting dimensions"),
    (lambda: check_layer(_fp8_matmul, _matmul, X[0], output=1.5), r"check_layer: output must be None"),
    (lambda: check_layer(_asserts, _matmul, X[0]), r"^check_layer: layer could not be traced and run on cpu: "
                                                   r"AssertionError: assert \(32 % 8\) == 3$"),
    (lambda: check_layer(_fp8_matmul, _matmul, X[0], skip="gate"), r"check_layer: skip must be a callable"),
])
def test_check_layer_bad_input_names_the_argument(call, error):
    with pytest.raises(ValueError, match=error):
        call()


# -- the twin helper ---------------------------------------------------------------------

def _params(module: nnx.Module) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_copy_params_into_should_pass_copying_params_and_nothing_else():
    layer = qcheck.build_moe("mixtral", "nvfp4", path="sparse")  # RNG streams at its sites, seed 0
    twin = qcheck.build_moe("mixtral", "int8", path="sparse", seed=1)  # its own streams, seed 1
    rng_before = [np.asarray(jax.random.key_data(k)) for k in jax.tree.leaves(nnx.state(twin, nnx.RngKey))]
    assert not all(_same_bits(a, _params(twin)[p]) for p, a in _params(layer).items())  # the control
    assert copy_params_into(layer, twin) is twin
    assert all(_same_bits(a, _params(twin)[p]) for p, a in _params(layer).items())
    rng_after = [np.asarray(jax.random.key_data(k)) for k in jax.tree.leaves(nnx.state(twin, nnx.RngKey))]
    assert len(rng_after) == 3 and all(_same_bits(a, b) for a, b in zip(rng_before, rng_after))


def test_copy_params_into_leaves_fp8_state_behind():
    twin = copy_params_into(sparse_moe("fp8"), qcheck.build_moe("mixtral", "none", path="sparse", seed=1))
    assert len(jax.tree.leaves(nnx.state(sparse_moe("fp8"), Fp8Meta))) == 18
    assert jax.tree.leaves(nnx.state(twin, Fp8Meta)) == []


class _WithBias(maxtext_like.MoeBlock):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bias = nnx.Param(jnp.zeros((32,)))


@pytest.mark.parametrize("layer, reference, error", [
    (lambda: qcheck.build_moe("gemma", "none"), lambda: qcheck.build_moe("mixtral", "none"),
     r"copy_params_into: parameter gate is float32\[32, 16\] in layer but float32\[32, 8\] in reference "
     r"\(layer Params: gate, per_expert_scale, wi_0, wi_1, wo; reference Params: gate, wi_0, wi_1, wo\)"),
    (lambda: _maxtext("fp8"), lambda: qcheck.build_moe("mixtral", "none"),
     r"copy_params_into: reference parameter gate has no counterpart in layer \(layer Params: gate/kernel, "),
    (lambda: _WithBias(maxtext_like.Config(), quant="fp8", rngs=nnx.Rngs(0)), lambda: _maxtext(None),
     r"copy_params_into: layer parameter bias has no counterpart in reference"),
    (lambda: _maxtext("fp8"), lambda: _matmul,
     r"copy_params_into: reference must be an flax.nnx.Module or an equinox.Module, got function"),
])
def test_copy_params_into_should_fail_naming_the_first_leaf(layer, reference, error):
    with pytest.raises(ValueError, match=error):
        copy_params_into(layer(), reference())


# -- the guide ------------------------------------------------------------------------------

def test_the_docs_example_runs(capsys):
    (code,) = re.findall(r"<!-- check-layer: example -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(code.splitlines()) <= 25
    exec(compile(code, str(DOC), "exec"), {"__name__": "checking_your_layer"})
    out = capsys.readouterr().out
    assert re.match(r"forward 0\.\d+, worst gradient \('gate/kernel', ", out)
    assert len([line for line in out.splitlines() if line.startswith("dot_general")]) == 5


# -- layers as libraries build them ---------------------------------------------------------

@dataclasses.dataclass  # not frozen: unhashable, as MaxText's quantization configs are
class _QuantConfig:
    formats: list[str]


class _RealWorldBlock(nnx.Module):
    """What real modules hold: an unhashable config, a Linen module behind ToNNX, an RNG count advanced per call,
    a submodule created on the first call, and a tuple output with an aux loss and a None."""

    def __init__(self, quant: _QuantConfig | None, rngs: nnx.Rngs):
        self.quant = quant
        self.rngs = rngs
        dense = linen.Dense(16, use_bias=False, dot_general_cls=linen.Fp8DirectDotGeneralOp if quant else None)
        self.proj = nnx.bridge.ToNNX(dense, rngs=rngs).lazy_init(jnp.zeros((1, 32)))
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (16, 32)) * 0.2)

    def __call__(self, x):
        self.rngs.dropout()  # a draw that does not change the output: the count moves
        if not hasattr(self, "out"):
            self.out = _LazyOut(self.quant is not None, self.kernel[...].shape)
        y = self.out(self.proj(x), self.kernel[...])
        return y, jnp.mean(y ** 2), None


class _LazyOut(nnx.Module):
    def __init__(self, quantized: bool, shape: tuple[int, ...]):
        self.quantized = quantized

    def __call__(self, h, kernel):
        if self.quantized:
            return maxtext_like.quantized_einsum("fp8")("bh,hm->bm", h, kernel)
        return h @ kernel


def _real_world_pair():
    layer = _RealWorldBlock(_QuantConfig(["e4m3fn"]), nnx.Rngs(0))
    return layer, copy_params_into(layer, _RealWorldBlock(None, nnx.Rngs(1)))


def test_check_layer_should_pass_on_a_module_as_libraries_build_it():
    layer, twin = _real_world_pair()
    with pytest.raises(TypeError):
        hash(nnx.graphdef(layer))  # what a static argument of jax.jit would need
    before = _bits(layer), _bits(twin)
    figures = check_layer(layer, twin, X[0], output=0)
    assert set(figures.rel_norms) == {"[0]"} and 0 < figures.rel_norm <= 0.22
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, "kernel", "proj/kernel"}
    assert [r.scope.split("/")[0] for r in figures.coverage] == ["proj", "out"]
    assert (_bits(layer), _bits(twin)) == before and not hasattr(layer, "out")  # the warm-up ran on a copy
    # Every floating leaf by default: the aux loss gets its own figure.
    assert set(check_layer(layer, twin, X[0]).rel_norms) == {"[0]", "[1]"}


def test_check_layer_should_fail_on_a_module_as_libraries_build_it_whose_lazy_part_falls_back():
    layer, twin = _real_world_pair()
    layer.quant = None  # read when the lazy submodule is created: it comes out unquantized
    with pytest.raises(AssertionError, match=r"coverage: assert_quantized: 1 of 2 matmuls reach full precision:\n"
                                             r"    dot_general at tests/test_layer_check.py:\d+ \(_LazyOut.__call__\)"
                                             r".* lhs and rhs unquantized, in out"):
        check_layer(layer, twin, X[0], output=0)


class _LinenBlock(linen.Module):
    quantized: bool

    @linen.compact
    def __call__(self, x):
        dot = linen.Fp8DirectDotGeneralOp if self.quantized else None
        h = linen.Dense(32, use_bias=False, dot_general_cls=dot)(x)
        return linen.Dense(16, use_bias=False, dot_general_cls=dot)(jax.nn.relu(h))


def test_check_layer_should_pass_on_a_linen_module_with_its_variables():
    layer = _LinenBlock(True)
    variables = layer.init(jax.random.key(0), X[0])
    twin = (_LinenBlock(False), {"params": variables["params"]})
    figures = check_layer((layer, variables), twin, X[0])
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, "Dense_0/kernel", "Dense_1/kernel"}
    assert all(r.quantized for r in figures.coverage)


def test_check_layer_should_fail_on_a_linen_module_that_is_not_quantized():
    variables = _LinenBlock(False).init(jax.random.key(0), X[0])
    with pytest.raises(AssertionError, match=r"tracks: assert_tracks: .*bitwise equal"):
        check_layer((_LinenBlock(False), variables), (_LinenBlock(False), variables), X[0])


# -- Linen modules holding stored codes: integer parameters frozen ---------------------------------------

class _LinenStoredDense(linen.Module):
    """A hand-written serving layer: its kernel stored as int8 codes with a scale per output, dequantized in the
    call (``scaled=False``: the plant that forgets the scale)."""

    scaled: bool = True

    @linen.compact
    def __call__(self, x):
        codes = self.param("kernel", linen.initializers.zeros, (x.shape[-1], 16), jnp.int8)
        scale = self.param("scale", linen.initializers.ones, (1, 16), jnp.float32)
        return x @ (codes.astype(jnp.float32) * (scale if self.scaled else 1.0))


class _LinenFloat(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(16, use_bias=False, name="proj")(x)


class _LinenStored(linen.Module):
    scaled: bool = True

    @linen.compact
    def __call__(self, x):
        return _LinenStoredDense(self.scaled, name="proj")(x)


_WEIGHT_ONLY = {"weights": "int8", "activations": None}


def _linen_stored_pair(scaled=True):
    twin = _LinenFloat()
    variables = twin.init(jax.random.key(0), X[0])
    w = np.asarray(variables["params"]["proj"]["kernel"])
    scale = np.max(np.abs(w), axis=0, keepdims=True) / np.float32(127)
    codes = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    stored = {"params": {"proj": {"kernel": jnp.asarray(codes), "scale": jnp.asarray(scale)}}}
    return (_LinenStored(scaled), stored), (twin, variables)


def test_check_layer_should_pass_on_a_linen_module_holding_int8_codes_frozen_never_given_to_grad():
    """A Linen module whose parameters hold int8 codes gave a raw TypeError (grad of an int8 input). Its integer
    parameters and the scales beside them are state: no gradient, named in figures.frozen, not compared; the
    weight-only declaration holds its codes by type, accepted by name."""
    layer, twin = _linen_stored_pair()
    figures = check_layer(layer, twin, X[0], declared=_WEIGHT_ONLY, accept_weaker=True)
    assert set(figures.grad_rel_norms) == {INPUT_GRAD}
    assert dict(figures.frozen) == {"proj/kernel": "frozen in the layer (int8[32, 16], state: no gradient); a "
                                                   "parameter of the reference (float32[32, 16])"}
    assert [r.rhs_hold.strength for r in figures.coverage] == ["type"] and 0 < figures.rel_norm < 0.05


def test_check_layer_should_fail_on_a_linen_module_holding_codes_that_forgets_their_scale():
    """The plant: the same stored codes multiplied without their scale. The frozen kernel is still named, and the
    output no longer tracks the float twin's."""
    layer, twin = _linen_stored_pair(scaled=False)
    with pytest.raises(AssertionError, match=r"(?s)tracks: assert_tracks: .*not compared: the gradient of "
                                             r"proj/kernel, frozen in the layer \(int8\[32, 16\]"):
        check_layer(layer, twin, X[0], declared=_WEIGHT_ONLY, accept_weaker=True)


def test_check_layer_should_pass_on_a_qwix_ptq_linen_model_its_stored_weights_frozen():
    """qwix 0.1.8's Linen serving path: quantize_model(linen_module, PtqProvider(rules)) keeps each kernel as
    WithAux(QArray(qvalue int8, scale)) under params. Its codes and scale are frozen and named under the float
    twin's kernel path, never given to grad. (qcheck's qwix reader reads NNX models only: declared by hand.)"""
    qwix = import_extra("qwix")
    twin = _LinenFloat()
    variables = twin.init(jax.random.key(0), X[0])
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8)]
    ptq = qwix.quantize_model(_LinenFloat(), qwix.PtqProvider(rules))
    figures = check_layer((ptq, ptq.init(jax.random.key(0), X[0])), (twin, variables), X[0],
                          declared=_WEIGHT_ONLY, accept_weaker=True)
    assert set(figures.grad_rel_norms) == {INPUT_GRAD}
    assert figures.frozen["proj/kernel"].startswith(
        "frozen in the layer (proj/kernel/array/qvalue int8[32, 16], proj/kernel/array/scale float32[1, 16], "
        "state: no gradient)"), figures.frozen


# -- call=: a module that is not called as module(x) -----------------------------------------------

def _first(module, x):
    return module(x)[0]


def test_call_on_an_nnx_module_should_pass_with_its_parameter_paths():
    layer, twin = _real_world_pair()
    before = _bits(layer), _bits(twin)
    figures = check_layer(layer, twin, X[0], call=_first)
    assert set(figures.rel_norms) == {""} and 0 < figures.rel_norm <= 0.22  # the one array call returns
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, "kernel", "proj/kernel"}
    # Coverage calls it through call too, under the module's class name (as Linen's scopes read).
    assert [r.scope.split("/")[:2] for r in figures.coverage] == [["_RealWorldBlock", "proj"],
                                                                   ["_RealWorldBlock", "out"]]
    assert (_bits(layer), _bits(twin)) == before and not hasattr(layer, "out")  # the warm-up ran on a copy


def test_call_on_an_nnx_module_should_fail_where_its_lazy_part_falls_back():
    # The warm-up calls the module through call as well: the submodule its first call creates is checked.
    layer, twin = _real_world_pair()
    layer.quant = None
    with pytest.raises(AssertionError, match=r"coverage: assert_quantized: 1 of 2 matmuls reach full precision:\n"
                                             r".*lhs and rhs unquantized, in _RealWorldBlock/out"):
        check_layer(layer, twin, X[0], call=_first)


def test_call_on_a_linen_module_is_its_apply_method():
    layer = _LinenBlock(True)
    variables = layer.init(jax.random.key(0), X[0])
    figures = check_layer((layer, variables), (_LinenBlock(False), {"params": variables["params"]}), X[0],
                          call=lambda m, x: m(x[:8]))
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, "Dense_0/kernel", "Dense_1/kernel"}
    assert [r.lhs_shape[0] for r in figures.coverage] == [8, 8]  # the rows call picked


@pytest.mark.parametrize("call, error", [
    (lambda: check_layer(_fp8_matmul, _matmul, X[0], call=_first), r"check_layer: call is how a module is called "
                                                                    r"on x, and neither layer nor reference is a "
                                                                    r"module"),
    (lambda: check_layer(*_real_world_pair(), X[0], call="__call__"), r"check_layer: call must be a function "
                                                                       r"\(module, x\) -> output, got str"),
])
def test_call_bad_input_names_the_argument(call, error):
    with pytest.raises(ValueError, match=error):
        call()


# -- what a check compiles --------------------------------------------------------

class _ConstrainedState(nnx.Module):
    """A matmul whose call leaves its state under a sharding constraint, as MaxText's blocks leave theirs."""

    def __init__(self, quantized: bool):
        self.w = nnx.Param(jnp.asarray(W))
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.float32))
        self.quantized = quantized

    def __call__(self, x):
        one = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("one",))
        replicated = jax.sharding.NamedSharding(one, jax.sharding.PartitionSpec())
        self.calls.set_value(jax.lax.with_sharding_constraint(self.calls[...] + 1, replicated))
        w = self.w[...]
        return _e4m3(x) @ _e4m3(w) if self.quantized else x @ w


def test_check_layer_compiles_each_step_once_though_its_state_comes_back_sharded():
    # The determinism check's second call starts from a state whose sharding the first call set (a
    # NamedSharding, where the module held a plain array): plain jax.jit would compile the layer's step
    # again for it, the cost of a second layer. One program per layer, the twin's included.
    with counting_compilations() as log:
        figures = check_layer(_ConstrainedState(True), _ConstrainedState(False), X[0])
    assert figures.rel_norm > 0
    assert sum(n for k, n in log.items() if k.startswith("jit(step)")) == 2, log


def test_check_layer_under_a_declaration_compiles_no_program_of_its_own():
    # The declared check reads each quantizer's input and codes, on x and on every edge row: the walk that
    # records them is compiled into the layer's own step, so the check compiles what a user's own two steps
    # do. x's shape is this test's alone, so no other test has compiled these programs in this process.
    layer = qcheck.build_moe("mixtral", "fp8")
    twin = copy_params_into(layer, qcheck.build_moe("mixtral", "none"))
    x = np.random.default_rng(1).normal(size=(1, 24, 32)).astype(np.float32)
    with counting_compilations() as log:
        figures = check_layer(layer, twin, x, skip=MOE_FULL_PRECISION)
    assert figures.declared is not None and "run, codes held bitwise" in figures.edges.values()
    assert sum(log.values()) == 2 and all(k.startswith("jit(step)") for k in log), log
