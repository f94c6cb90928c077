"""Levanter's real ``MixtralSparseMoeBlock`` (haliax underneath) as a pinned client of qcheck.

Runs in Levanter's own environment (.ci/levanter.sh, ``tox -e levanter``, the
Levanter stage of .ci/run); skipped where Levanter is not installed. The block,
tiny and on one CPU device, quantized as Levanter's ``TrainerConfig.quantization``
does it (``haliax.quantization.quantize_linear_layers``, fp8 or int8), against
its unquantized twin (the same block, same key, same weights). Checked on
marin-levanter 0.2.227.dev40316220070 with marin-haliax 0.2.227.dev40316220070:

* the router (``hnn.Linear`` with haliax's ``Fp8DotGeneralOp`` / ``Int8DotGeneralOp``)
  passes its declaration bitwise: e4m3fn codes at scale 1, AQT int8 codes (qcheck's ``int8_aqt``);
* a known defect of that version: haliax's ``MoELinear`` has no quantized path (its
  ``dot_general`` field is a TODO, haliax/nn/linear.py), so the three expert
  ``ragged_dot_general``s stay float32 x float32 under fp8 and int8 alike, and
  ``check_layer`` with the declaration fails naming that line; asserted with the
  version checked, so a new Levanter makes these tests say "recheck";
* a wrong fp8 flavour planted in user code (haliax's quantize monkeypatched to cast
  to e4m3fnuz where e4m3fn is asked) fails the declaration at the router, naming
  the flavour, where check_layer without a declaration passes it;
* ``declared=True`` reads the declaration from haliax's dot ops in the layer;
* the block checked as an Equinox module (``check_layer(block, twin, x, call=...)``): each parameter's
  gradient compared by its path (``gate/weight``, ``experts/w1/weight``), on tokens whose routing the
  quantization cannot change; a kernel gradient dropped in haliax's fp8 VJP (planted) fails naming
  ``gate/weight``, and on a token the fp8 router reroutes, the router's gradient moves past the bound;
* the unquantized block held to the float64 referee, style ``"mixtral"`` (``assert_moe_matches_referee``
  with ``call=``): it passes, Levanter's routing being Mixtral's; the block routing top-3 and the
  referee's gate and up mapped the other way round fail it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import os
import re

import numpy as np
import pytest

import qcheck
from qcheck.checks._layer import DEFAULT_MAX_GRAD_REL_NORM, INPUT_GRAD
from tests.helpers import import_extra

#: The versions the known defect and the figures were checked on.
LEVANTER_VERSION = "0.2.227.dev40316220070"
HALIAX_VERSION = "0.2.227.dev40316220070"
#: haliax's int8 (``Int8DotGeneralOp``) is AQT v2 ``config_v3()``: 8 bits on both forward operands,
#: ``IntSymmetric(preserve_max_val=False)`` with ``AbsMaxCalibration`` over the contraction axes, so a scale
#: absmax / 127.5 per index of every other axis: qcheck's ``int8_aqt`` at its own granularity.
INT8 = {"activations": "int8_aqt", "weights": "int8_aqt"}
DECLARED = {"fp8": "fp8", "int8": INT8}
QUANTIZATIONS = tuple(DECLARED)
#: The named scope of the combine (``out_repeat_unflat.dot(combine_weights, axis=TopExperts)``), a plain
#: full-precision ``hax.dot`` of the expert outputs and the routing weights: meant to stay so.
COMBINE_SCOPE = "contract top_experts -> token, embed"
#: The named scope haliax's ``named_call`` gives the experts' ``MoELinear`` calls.
EXPERTS_SCOPE = "MoELinear"
X_SHAPE = (2, 8, 32)  # (batch, position, embed)

pytestmark = [
    # aqtp 0.9.0 passes arrays to jnp.promote_types (docs/libraries.md): haliax's int8 op calls AQT.
    pytest.mark.filterwarnings("ignore:Implicit conversion of an array to a dtype:DeprecationWarning"),
    # haliax.partitioning imports jax.interpreters.pxla.thread_resources, which jax 0.11 deprecates.
    pytest.mark.filterwarnings("ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def lev():
    """The modules the tests use, once: skipped, naming how to install Levanter, where it is absent."""
    import_extra("levanter")
    import haliax as hax
    import jax
    from haliax import quantization
    from levanter.models import mixtral

    return type("Levanter", (), {"hax": hax, "jax": jax, "quantization": quantization, "mixtral": mixtral})


@pytest.fixture(scope="module")
def config(lev):
    return lev.mixtral.MixtralConfig(max_seq_len=8, hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=4,
                                     num_kv_heads=2, n_routed_experts=4, num_experts_per_tok=2)


@pytest.fixture(autouse=True)
def _mesh(request):
    """The block runs its routing in ``shard_map``: every test runs under a 1 x 1 mesh."""
    if "lev" not in request.fixturenames:
        yield
        return
    lev = request.getfixturevalue("lev")
    mesh = lev.jax.sharding.Mesh(np.asarray(lev.jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with lev.hax.partitioning.set_mesh(mesh):
        yield


def _build(lev, config, quantization: str | None, seed: int = 0):
    block = lev.mixtral.MixtralSparseMoeBlock.init(config, key=lev.jax.random.key(seed))
    if quantization is None:
        return block
    cfg = lev.quantization.QuantizationConfig(**{quantization: True})
    return lev.quantization.quantize_linear_layers(block, cfg)


@pytest.fixture(scope="module")
def blocks(lev, config):
    """Each block built once (same key: the same weights); no check changes one."""
    built = {}

    def get(quantization: str | None):
        if quantization not in built:
            built[quantization] = _build(lev, config, quantization)
        return built[quantization]

    return get


def _apply(block, x):
    """The block as a function of an array: named axes in, the output's array out (the extras dropped)."""
    import haliax as hax

    out, _extras = block(hax.named(x, ("batch", block.config.max_Pos.name, "embed")))
    return out.array


def as_layer(block):
    """The block as check_layer's layer: a function of x that is a pytree holding the block (so
    ``declared=True`` can read haliax's dot ops in it)."""
    import jax

    return jax.tree_util.Partial(_apply, block)


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).normal(size=X_SHAPE).astype(np.float32)


def _pinned() -> None:
    installed = {d: importlib.metadata.version(d) for d in ("marin-levanter", "marin-haliax")}
    if installed != {"marin-levanter": LEVANTER_VERSION, "marin-haliax": HALIAX_VERSION}:
        pytest.fail(f"{installed} is installed; this known defect was checked on marin-levanter {LEVANTER_VERSION}, "
                    f"marin-haliax {HALIAX_VERSION}: recheck it, then update this test and the Levanter row of "
                    f"docs/libraries.md")


def _source_line(fn, needle: str) -> str:
    """``haliax/...py:LINE`` of the one line of ``fn``'s source holding ``needle``, read from the installed source."""
    fn = inspect.unwrap(fn)  # haliax's named_call wraps the method
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if needle in line]
    path = inspect.getsourcefile(fn).replace(os.sep, "/")
    return f"{path[path.rindex('/haliax/') + 1:]}:{start + offset}"


def _ragged_dot_line() -> str:
    """``haliax/nn/linear.py:LINE`` of ``MoELinear.__call__``'s float ``jax.lax.ragged_dot_general`` call."""
    from haliax.nn.linear import MoELinear

    return _source_line(MoELinear.__call__, "= jax.lax.ragged_dot_general(")


def _location(record) -> str:
    return record.location.replace(os.sep, "/")


def _router(records):
    (router,) = [r for r in records if r.primitive == "dot_general" and COMBINE_SCOPE not in r.scope]
    return router


def _params(block) -> dict[str, np.ndarray]:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(block)[0]  # the weights, not the dot ops' fp8 state or flags
    return {jax.tree_util.keystr(p).split("[")[0]: np.asarray(v) for p, v in flat
            if isinstance(v, jax.Array) and "dot_general" not in jax.tree_util.keystr(p)}


# -- the twin -------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_twin_holds_the_layers_weights(blocks, quantization):
    mine, theirs = _params(blocks(quantization)), _params(blocks(None))
    assert sorted(mine) == [".experts.w1.weight", ".experts.w2.weight", ".experts.w3.weight", ".gate.weight"]
    assert sorted(mine) == sorted(theirs) and len(mine) == 4, sorted(mine)
    assert all(np.array_equal(mine[k], theirs[k]) for k in mine)


def test_twin_with_another_key_has_other_weights(lev, config, blocks):
    # Should-fail of the one above: the weights really come from the key.
    other = _params(_build(lev, config, None, seed=1))
    assert not any(np.array_equal(a, other[k]) for k, a in _params(blocks(None)).items())


# -- the router passes its declaration; the experts are the known defect -----------------------------

@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_router_passes_its_declaration_should_pass(blocks, x, quantization):
    records = qcheck.coverage(as_layer(blocks(quantization)), x, declared=DECLARED[quantization])
    router = _router(records)
    assert router.quantized and (router.lhs_role, router.rhs_role) == ("activation", "weight")
    assert router.findings == (), qcheck.format_coverage(records)
    # The same line in the layer and the twin: the Linear's, never inside haliax's dot ops or Equinox's jit.
    assert _location(router) == _location(_router(qcheck.coverage(as_layer(blocks(None)), x)))
    assert not any(re.search(r"/(equinox/|haliax/quantization\.py|haliax/_src/fp8\.py)", _location(r))
                   for r in records), qcheck.format_coverage(records)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_twin_router_fails_the_declaration(blocks, x, quantization):
    # Control: the unquantized twin's router does not satisfy the declaration the layer's passes.
    router = _router(qcheck.coverage(as_layer(blocks(None)), x, declared=DECLARED[quantization]))
    assert any("reaches the matmul in full precision" in f for f in router.findings), router.findings


def test_int8_router_fails_a_declaration_of_other_int8_codes(blocks, x):
    # Control: the int8 router's pass is bitwise. Declared qcheck's int8 (absmax / 127, AQT's
    # preserve_max_val=True), haliax's codes (absmax / 127.5) differ.
    router = _router(qcheck.coverage(as_layer(blocks("int8")), x, declared={"activations": "int8", "weights": "int8"}))
    assert any(re.match(r"(lhs|rhs) \(\w+\): codes are not int8's: \d+ of \d+ codes differ", f)
               for f in router.findings), router.findings


def test_location_is_equinox_jit_without_it_among_machinery(blocks, x):
    # Control of the location check above: hax.dot is an Equinox filter_jit, and the traceback JAX keeps inside
    # a jit ends at Equinox's wrapper; were Equinox not machinery, the combine would be located there.
    from qcheck import libraries

    with libraries.registered(qcheck.Library("Equinox"), replace=True):  # Equinox's record, with no machinery
        records = qcheck.coverage(as_layer(blocks(None)), x)
    (combine,) = [r for r in records if COMBINE_SCOPE in r.scope]
    assert "/equinox/" in _location(combine), _location(combine)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_haliax_moe_linear_has_no_quantized_path(blocks, x, quantization):
    """marin-haliax 0.2.227.dev40316220070 (marin-levanter 0.2.227.dev40316220070): ``MoELinear`` has no quantized path.

    ``quantize_linear_layers`` (what Levanter's ``TrainerConfig.quantization``
    applies) sets an fp8 or int8 dot op on every ``hnn.Linear``; ``MoELinear``
    has no ``dot_general`` (a TODO in haliax/nn/linear.py) and calls
    ``jax.lax.ragged_dot_general`` on the float32 activations and expert weights,
    so Mixtral's (and Qwen3-MoE's) three expert matmuls stay full precision and
    only the router is quantized.
    """
    _pinned()
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(as_layer(blocks(quantization)), as_layer(blocks(None)), x,
                           skip=qcheck.skip_modules(COMBINE_SCOPE), declared=DECLARED[quantization])
    message = str(failure.value).replace(os.sep, "/")
    assert message.startswith("check_layer: 1 check(s) failed:\n  coverage: "), message
    assert "3 of 5 matmuls differ from the declared quantization" in message, message
    assert message.count("ragged_dot_general at ") == message.count(_ragged_dot_line()) == 3, message
    assert message.count("reaches the matmul in full precision") == 6, message  # both operands of each


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_rest_of_the_block_passes_with_the_experts_spared_should_pass(blocks, x, quantization):
    # The pass beside the defect: with the experts spared, the router passes its declaration, the output
    # tracks the twin within the fp8-class bound, gradients are close, the bits repeat.
    figures = qcheck.check_layer(as_layer(blocks(quantization)), as_layer(blocks(None)), x,
                                 skip=[qcheck.skip_modules(COMBINE_SCOPE), qcheck.skip_modules(EXPERTS_SCOPE)],
                                 declared=DECLARED[quantization])
    assert 0 < figures.rel_norm <= 0.22
    print(f"{quantization}: forward {figures.rel_norm:.4f}, worst gradient {figures.worst_grad}")


# -- the block as an Equinox module: each parameter's gradient, by path ---------------------------------------

#: The block's parameters as check_layer names them: field paths, a NamedArray by its field (not ``.array``);
#: the fp8 dot op's scales and amax histories are state (haliax overwrites them), not parameters.
PARAMS = {"gate/weight", "experts/w1/weight", "experts/w2/weight", "experts/w3/weight"}


def _top_k(logits: np.ndarray, k: int) -> list[frozenset[int]]:
    return [frozenset(np.argsort(-row)[:k].tolist()) for row in logits]


@pytest.fixture(scope="module")
def routed_x(blocks, config):
    """Tokens whose experts no rounding of the router's operands to e4m3fn (at haliax's initial scale 1) or to
    AQT's int8 can change, so the gradients are compared through one routing.

    A token's top-k set stands while the gap between its k-th and (k+1)-th logits exceeds twice the largest
    error either rounding can put on one logit, bounded from the operands (numpy, float64): e4m3fn's relative
    rounding 2**-4 per operand and absolute 2**-10 below its normal range; int8's absmax / 255 per element,
    the scale taken per token and per expert row, as AQT's ``config_v3`` takes it over the contraction axis.
    """
    k, w = config.num_experts_per_tok, np.asarray(blocks(None).gate.weight.array, np.float64)
    pool = np.random.default_rng(1).normal(size=(64 * 16, X_SHAPE[-1]))
    ax, aw, eps = np.abs(pool), np.abs(w), 2.0 ** -4
    fp8 = ((2 * eps + eps ** 2) * ax @ aw.T + 2.0 ** -10 * (1 + eps) * (ax.sum(1, keepdims=True) + aw.sum(1))
           + 2.0 ** -20 * X_SHAPE[-1])
    ex, ew = ax.max(1, keepdims=True) / 255, aw.max(1) / 255
    int8 = ex * aw.sum(1) + ew * ax.sum(1, keepdims=True) + X_SHAPE[-1] * ex * ew
    logits = -np.sort(-(pool @ w.T), axis=1)
    clear = pool[logits[:, k - 1] - logits[:, k] > 2 * (fp8 + int8).max(1)]
    assert len(clear) >= 16, len(clear)
    return clear[:16].reshape(X_SHAPE).astype(np.float32)


def _named_call(block, x):
    """How check_layer calls the block: named axes in, its (NamedArray, extras) out."""
    import haliax as hax

    return block(hax.named(x, ("batch", block.config.max_Pos.name, "embed")))


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_block_as_a_module_compares_each_parameters_gradient_should_pass(lev, config, blocks, routed_x,
                                                                         quantization):
    layer = blocks(quantization)
    twin = qcheck.copy_params_into(layer, _build(lev, config, None, seed=1))  # the layer's weights, copied
    figures = qcheck.check_layer(layer, twin, routed_x, call=_named_call, output=0, skip=SPARE[1](),
                                 declared=DECLARED[quantization])
    assert set(figures.rel_norms) == {"[0]"}  # the block's output, a NamedArray, compared as its array
    assert set(figures.grad_rel_norms) == {INPUT_GRAD, *PARAMS}, sorted(figures.grad_rel_norms)
    assert all(0 < f <= DEFAULT_MAX_GRAD_REL_NORM for f in figures.grad_rel_norms.values())
    # The known defect stays as pinned above: the experts' matmuls are spared, full precision, and their
    # weights' gradients differ from the twin's through the quantized router alone.
    spared = figures.spared[f"skip_modules({EXPERTS_SCOPE!r})"]
    assert [r.primitive for r in spared] == ["ragged_dot_general"] * 3 and not any(r.quantized for r in spared)
    print(f"{quantization}: forward {figures.rel_norm:.4f}, "
          + ", ".join(f"{p} {f:.4f}" for p, f in sorted(figures.grad_rel_norms.items())))


def test_block_with_its_own_weights_is_no_twin_should_fail(lev, config, blocks, routed_x):
    # Control of the copy above: built with another key, the twin's weights are not the layer's.
    with pytest.raises(ValueError, match=r"^check_layer: reference's weights differ from layer's: experts/w1/weight "
                                         r"\(float32\[4, 32, 64\]\) differs in \d+ of 8192 values"):
        qcheck.check_layer(blocks("fp8"), _build(lev, config, None, seed=1), routed_x, call=_apply, skip=SPARE[1]())


def _kernel_gradient_dropped(fp8):
    """haliax's fp8 matmul with the bug: its custom VJP sends back zeros for the kernel (the Linear's weight)."""
    import jax
    import jax.numpy as jnp

    def bwd(*args):
        grads = fp8.quantized_dot_bwd(*args)
        return (*grads[:3], jnp.zeros_like(grads[3]), *grads[4:])

    planted = jax.custom_vjp(fp8.quantized_dot.fun, nondiff_argnums=(8, 9, 10))
    planted.defvjp(fp8.quantized_dot_fwd, bwd)
    return planted


def test_planted_lost_router_gradient_fails_naming_its_path_should_fail(lev, config, blocks, routed_x, monkeypatch):
    from haliax._src import fp8

    lev.jax.clear_caches()  # hax.dot's traces, and check_layer's program of a block like this one
    monkeypatch.setattr(fp8, "quantized_dot", _kernel_gradient_dropped(fp8))
    try:
        # haliax casts the output gradients to e5m2 at scale 1 before any history: the flush line may follow.
        with pytest.raises(AssertionError, match=r"^check_layer: 1 check\(s\) failed:\n  gradients: gate/weight "
                                                 r"\(float32\) has relative norm 1\.0000 against the reference's, "
                                                 r"above the bound 0\.5\n(    flushed: [^\n]*\n)*declared: read from the layer: haliax "
                                                 r"Fp8DotGeneralOp"):
            qcheck.check_layer(_build(lev, config, "fp8"), blocks(None), routed_x, call=_apply, skip=SPARE[1]())
    finally:
        monkeypatch.undo()
        lev.jax.clear_caches()


def test_fp8_router_that_reroutes_a_token_moves_its_own_gradient_furthest(blocks, x, config):
    """Why the checks above take clearly routed tokens: on ``x``, e4m3fn rounding of the router's operands
    (scale 1: haliax's delayed scaling before any amax history) gives a token other experts (ml_dtypes); the
    router's gradient, a difference of expert outputs, follows the other routing past the bound, while the
    output, the input's gradient and the experts' stay within theirs."""
    import ml_dtypes

    def e4m3(a):
        return np.asarray(a, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)

    w = np.asarray(blocks(None).gate.weight.array)
    tokens = x.reshape(-1, X_SHAPE[-1])
    k = config.num_experts_per_tok
    rerouted = [a != b for a, b in zip(_top_k(tokens.astype(np.float64) @ w.T.astype(np.float64), k),
                                       _top_k(e4m3(tokens) @ e4m3(w).T, k))]
    assert any(rerouted), "no token rerouted: this input no longer shows the effect"
    with pytest.raises(AssertionError, match=r"^check_layer: 1 check\(s\) failed:\n  gradients: gate/weight "
                                             r"\(float32\) has relative norm \d\.\d+ against the reference's, "
                                             r"above the bound 0\.5\n(    flushed: [^\n]*\n)*declared: given: "):
        qcheck.check_layer(blocks("fp8"), blocks(None), x, call=_apply, skip=SPARE[1](), declared="fp8")


# -- a wrong fp8 flavour planted in user code ---------------------------------------------------------

def _fnuz_quantize(real):
    import jax.numpy as jnp

    def quantize(x, q_dtype, scale, compute_dtype):
        if q_dtype != jnp.float8_e4m3fn:
            return real(x, q_dtype, scale, compute_dtype)
        scaled = x / jnp.broadcast_to(scale.astype(compute_dtype), x.shape)
        return jnp.clip(scaled, -448.0, 448.0).astype(jnp.float8_e4m3fnuz)  # the bug: the other flavour

    return quantize


def _unsaturated_quantize(real):
    import jax.numpy as jnp

    def quantize(x, q_dtype, scale, compute_dtype):
        if q_dtype != jnp.float8_e4m3fn:
            return real(x, q_dtype, scale, compute_dtype)
        return (x / jnp.broadcast_to(scale.astype(compute_dtype), x.shape)).astype(q_dtype)  # the bug: no clip

    return quantize


@pytest.fixture
def plant(lev, monkeypatch):
    """Replace haliax's fp8 quantize from outside (site-packages untouched) with ``make(real_quantize)``.

    ``hax.dot`` is an Equinox filter_jit whose traces JAX caches: the caches are
    cleared before (so the plant is traced) and after (so no later test sees it).
    """
    from haliax._src import fp8

    def planted(make):
        lev.jax.clear_caches()
        monkeypatch.setattr(fp8, "quantize", make(fp8.quantize))

    yield planted
    monkeypatch.undo()
    lev.jax.clear_caches()


@pytest.fixture
def planted_fnuz(plant):
    """haliax's fp8 quantize casting to e4m3fnuz where e4m3fn is asked."""
    plant(_fnuz_quantize)


SPARE = ("combine and experts", lambda: [qcheck.skip_modules(COMBINE_SCOPE), qcheck.skip_modules(EXPERTS_SCOPE)])


@pytest.mark.parametrize("declared", ["fp8", True], ids=["given", "read"])
def test_planted_fnuz_router_fails_the_declaration_should_fail(lev, config, x, planted_fnuz, declared):
    layer = _build(lev, config, "fp8")  # a fresh block, traced with the plant in place
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(as_layer(layer), as_layer(_build(lev, config, None)), x, skip=SPARE[1](),
                           declared=declared)
    message = str(failure.value)
    assert "\n  coverage: assert_quantized: 1 of 5 matmuls differ from the declared quantization" in message, message
    # And on the edge rows: clipped at e4m3fn's 448, the e4m3fnuz cast (largest 240) turns NaN.
    assert "edges: token row with one value far beyond the format's range (1e5): not finite" in message, message
    assert re.search(r"lhs \(activation\) is cast to float8_e4m3fnuz; declared e4m3fn", message), message
    assert re.search(r"rhs \(weight\) is cast to float8_e4m3fnuz; declared e4m3fn", message), message


def test_planted_fnuz_fails_check_layer_with_no_declared_argument(lev, config, x, planted_fnuz):
    # The declaration is read from haliax's ops by default: the plant fails unasked, naming the router.
    layer, twin = as_layer(_build(lev, config, "fp8")), as_layer(_build(lev, config, None))
    with pytest.raises(AssertionError) as info:
        qcheck.check_layer(layer, twin, x, skip=SPARE[1]())
    assert "is cast to float8_e4m3fnuz; declared e4m3fn" in str(info.value), str(info.value)
    assert str(info.value).endswith("declared: read from the layer: haliax Fp8DotGeneralOp on 1 Linear layer(s): "
                                    "activations e4m3fn, weights e4m3fn, grads e5m2")
    # With no declaration held (declared=False), the router is "quantized somehow" and only the edge row shows
    # the plant: clipped at e4m3fn's 448, the e4m3fnuz cast (largest 240) turns NaN.
    with pytest.raises(AssertionError) as info:
        qcheck.check_layer(layer, twin, x, skip=SPARE[1](), declared=False)
    failed = re.findall(r"\n  ([\w ]+?): ", str(info.value))
    assert set(failed) == {"edges"}, str(info.value)
    assert "token row with one value far beyond the format's range (1e5): not finite: the output" in str(info.value)


def test_fp8_router_saturates_as_declared_should_pass(blocks, x):
    # Inputs beyond e4m3fn's 448: haliax clips, as the referee does.
    router = _router(qcheck.coverage(as_layer(blocks("fp8")), x * 1000, declared="fp8"))
    assert router.findings == (), router.findings


def test_planted_unsaturated_cast_fails_bitwise_should_fail(lev, config, x, plant):
    # Control of the pass above, and proof that the fp8 router is held bitwise (its type is right): a cast
    # without the clip gives NaN where the referee saturates.
    plant(_unsaturated_quantize)
    router = _router(qcheck.coverage(as_layer(_build(lev, config, "fp8")), x * 1000, declared="fp8"))
    assert any(re.match(r"lhs \(activation\): codes are not e4m3fn's: \d+ of 512 codes differ", f)
               for f in router.findings), router.findings


# -- declared=True: the declaration read from haliax's dot ops --------------------------------------

@pytest.mark.parametrize("quantization, roles", [
    ("fp8", {"activations": "e4m3fn", "weights": "e4m3fn", "grads": "e5m2"}),
    ("int8", INT8),
])
def test_declaration_is_read_from_haliax_dot_ops(blocks, x, quantization, roles):
    figures = qcheck.check_layer(as_layer(blocks(quantization)), as_layer(blocks(None)), x, skip=SPARE[1](),
                                 declared=True)
    decl = figures.declared
    assert {k: str(v) for k, v in decl.roles.items()} == roles
    op = {"fp8": "Fp8DotGeneralOp", "int8": "Int8DotGeneralOp"}[quantization]
    assert decl.source.startswith(f"haliax {op} on 1 Linear layer(s)"), decl.source
    assert _router(figures.coverage).findings == ()


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_read_declaration_fails_the_experts(blocks, x, quantization):
    # The defect seen through the declaration read from the layer, not given.
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(as_layer(blocks(quantization)), as_layer(blocks(None)), x,
                           skip=qcheck.skip_modules(COMBINE_SCOPE), declared=True)
    # Each expert matmul, forward; with fp8's grads role (e5m2), each one's gradient matmul on the backward pass too.
    expected = 6 if quantization == "fp8" else 3
    assert str(failure.value).replace(os.sep, "/").count(_ragged_dot_line()) == expected, str(failure.value)


def test_nothing_is_read_from_a_plain_function_or_the_unquantized_block(blocks):
    # Controls of the reader: a function closing over the block holds nothing to read (declared=True then
    # holds each role to one format), nor does the block without quantize_linear_layers.
    from qcheck._coverage._readers import read_declaration

    fp8 = blocks("fp8")
    assert read_declaration(as_layer(fp8)) is not None
    assert read_declaration(fp8) is not None  # the Equinox module itself
    assert read_declaration(lambda x: _apply(fp8, x)) is None
    assert read_declaration(as_layer(blocks(None))) is None


# -- docs/libraries.md ----------------------------------------------------------------------------

def test_docs_row_names_the_lines_haliax_has(lev):
    from pathlib import Path

    from haliax.nn.linear import MoELinear

    doc = (Path(__file__).parent.parent / "docs" / "libraries.md").read_text()
    (row,) = [line for line in doc.splitlines() if "`test_haliax_moe_linear_has_no_quantized_path`" in line]
    todo = _source_line(MoELinear, "TODO: support quantization for ragged_dot")
    for line in (todo, _ragged_dot_line()):  # linear.py:LINE, as haliax's source has it
        assert line.rsplit("/", 1)[1] in row, (line, row)
    assert f"marin-levanter {LEVANTER_VERSION}, marin-haliax {HALIAX_VERSION}" in row


# -- the unquantized block against the float64 referee: Mixtral's definition -------------------------------

#: The block's parameters by the referee's roles. Levanter routes as Mixtral does (levanter/models/mixtral.py):
#: the softmax over all experts, ``jax.lax.top_k`` of those probabilities, the chosen renormalised to sum to 1,
#: SiLU (MixtralConfig's default activation). haliax's ``Linear`` holds the router [experts, embed] (out first);
#: ``MoELinear`` holds each projection [experts, in, out]; w1 is Mixtral's gate projection, w3 its up, w2 its down.
REFEREE_ROLES = {"gate/weight": "router.T", "experts/w1/weight": "gate", "experts/w3/weight": "up",
                 "experts/w2/weight": "down"}
REFEREE_X_SHAPE = (8, 8, 32)  # 64 tokens over 4 experts, top-2


@pytest.fixture(scope="module")
def referee_x():
    return np.random.default_rng(2).normal(size=REFEREE_X_SHAPE).astype(np.float32)


def test_block_matches_the_mixtral_referee_should_pass(blocks, config, referee_x):
    figures = qcheck.assert_moe_matches_referee(blocks(None), referee_x, REFEREE_ROLES, style="mixtral",
                                                top_k=config.num_experts_per_tok, call=_named_call, output=0)
    assert figures <= 1e-5 and figures["tokens"] + figures["near_ties"] == 64 and figures["tokens"] >= 60, figures
    print(f"against the referee: {figures['max_rel']:.3g} of a token's norm at worst, {figures['tokens']} tokens, "
          f"{figures['near_ties']} near-ties left out")


def _routing_top_3(block):
    """The bug: the same block (same weights) built for top-3 routing where its model is top-2."""
    import dataclasses

    return dataclasses.replace(block, config=dataclasses.replace(block.config, num_experts_per_tok=3))


@pytest.mark.parametrize("plant, roles, message", [
    (_routing_top_3, REFEREE_ROLES,
     r"routes it to experts \[\d, \d\] .*the layer's output there is the referee's experts \[\d, \d, \d\] mixed "
     r"with weights .*: other experts: the choice differs$"),
    (None, {**REFEREE_ROLES, "experts/w1/weight": "up", "experts/w3/weight": "gate"},
     r"the layer's output there is no mix of the referee's expert outputs"),
], ids=["block-routes-top-3", "gate-and-up-swapped"])
def test_block_with_a_plant_fails_the_mixtral_referee_should_fail(blocks, config, referee_x, plant, roles, message):
    # Controls of the pass above: a wrong top-k in the block itself, and w1 and w3 mapped the other way round.
    block = blocks(None) if plant is None else plant(blocks(None))
    with pytest.raises(AssertionError, match=r"^assert_moe_matches_referee: token \(0, 0\) differs from the float64 "
                                             r"referee .*" + message):
        qcheck.assert_moe_matches_referee(block, referee_x, roles, style="mixtral", top_k=config.num_experts_per_tok,
                                          call=_named_call, output=0)


# -- edge rows: a token row far beyond e4m3's range ----------------------------------------------------

def test_planted_unsaturated_cast_fails_an_edge_row_naming_the_site_should_fail(lev, config, x, plant):
    """``check_layer(layer, twin, x)`` on an ordinary normal ``x``: the token row holding one value of 1e5 (beyond
    e4m3fn's 448 at haliax's fresh scale of 1) turns haliax's fp8 cast without its clip NaN, and the check names
    the row and the router's site (marin-haliax 0.2.227.dev40316220070). The stock block, which clips, passes
    every edge row, its codes held bitwise there (the control)."""
    twin = as_layer(_build(lev, config, None))
    figures = qcheck.check_layer(as_layer(_build(lev, config, "fp8")), twin, x, skip=SPARE[1]())
    assert dict(figures.edges) == dict.fromkeys(("zeros", "tiny", "huge", "saturation", "tiny_tensor"),
                                             "run, codes held bitwise")
    plant(_unsaturated_quantize)
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(as_layer(_build(lev, config, "fp8")), twin, x, skip=SPARE[1]())
    message = str(failure.value)
    row = "edges: token row with one value far beyond the format's range (1e5)"
    assert f"{row}: not finite: the output" in message, message
    assert re.search(re.escape(row) + r": site .*\(dot_general\): lhs \(activation\): codes are not e4m3fn's: 1 of "
                     r"\d+ codes differ from the referee's; first at .*: nan where the referee gives 448", message), (
        message)
