"""Interception recipes: the `none` layer's walkable call sites, InterceptRecipe, and qwix_int8 built through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck import checks
from qcheck.layers import step
from qcheck.recipes._plain import UnquantizedSite
from qcheck.layers.decoder import build_decoder
from qcheck.layers.moe import MODELS, MoE
from qcheck.recipes import InterceptRecipe
from qcheck.suite import cases
from tests.helpers import QWIX_WARNS, import_extra, requires_extra

X = cases.layer_input("mixtral")


def _none_output(path: str = "dense") -> np.ndarray:
    return cases.layer_output(cases.Case("none", cases.Variant("mixtral", path, False)))


def test_none_layer_sites_are_plain_nnx_modules_qwix_can_walk():
    layer = qcheck.build_moe("mixtral", "none", capacity_factor=1.0)
    assert {n: type(s) for n, s in layer.sites.items()} == dict.fromkeys(
        ("dispatch", "wi_0", "wi_1", "wo", "combine"), UnquantizedSite)
    assert not [p for p, m in nnx.iter_modules(layer) if isinstance(m, nnx.bridge.ToNNX)]


def _decoder_params(recipe: str) -> dict:
    d = build_decoder("mixtral", recipe, layers=2)
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(d, nnx.Param))}


def test_none_decoder_draws_the_weights_of_every_recipe_should_pass():
    none, int8 = _decoder_params("none"), _decoder_params("int8")
    assert none.keys() == int8.keys() and all(np.array_equal(none[k], int8[k]) for k in none)


def test_none_decoder_draws_the_weights_of_every_recipe_should_fail(monkeypatch):
    # The bug the fork exists for: a plain site that leaves the caller's streams alone moves every later draw.
    monkeypatch.setattr(UnquantizedSite, "__init__", lambda self, name, *, rngs=None: None)
    none, int8 = _decoder_params("none"), _decoder_params("int8")
    assert [k for k in none if not np.array_equal(none[k], int8[k])]


class _Doubled(nnx.Module):
    def __init__(self, site):
        self.site = site

    def __call__(self, eqn, lhs, rhs):
        return 2 * self.site(eqn, lhs, rhs)


def _double_wo(layer, sample_input):
    assert sample_input.shape == (1, 8, MODELS["mixtral"].emb)
    layer.sites["wo"] = _Doubled(layer.sites["wo"])
    return layer


def test_build_moe_builds_an_intercept_recipe_from_the_none_layer():
    layer = qcheck.build_moe("mixtral", InterceptRecipe("doubled_wo", _double_wo))
    assert layer.recipe_name == "doubled_wo" and isinstance(layer, MoE)
    # The combine is linear in wo's output and doubling is exact: the none layer's output, doubled, bitwise.
    np.testing.assert_array_equal(np.asarray(step.apply(layer, X)[0]), 2 * _none_output())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(transform=None), TypeError, r"transform must be a callable \(layer, sample_input\) -> layer, got None"),
    (dict(transform=lambda layer, x: None), TypeError, r"InterceptRecipe 'bad': transform returned NoneType"),
])
def test_intercept_recipe_bad_transform_is_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        qcheck.build_moe("mixtral", InterceptRecipe("bad", **kwargs))


def test_intercept_recipe_has_no_site_module_to_build_a_layer_around():
    with pytest.raises(TypeError, match=r"InterceptRecipe 'doubled_wo' has no site module: .*qcheck.build_moe"):
        MoE(MODELS["mixtral"], InterceptRecipe("doubled_wo", _double_wo), rngs=nnx.Rngs(0))


def test_unrolled_decoder_builds_an_intercept_recipe_layer_by_layer():
    d = build_decoder("mixtral", InterceptRecipe("doubled_wo", _double_wo), layers=2)
    assert [type(layer.sites["wo"]) for layer in d.layers] == [_Doubled, _Doubled]
    mine = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(d, nnx.Param))}
    none = _decoder_params("none")
    assert mine.keys() == none.keys() and all(np.array_equal(mine[k], none[k]) for k in none)


def test_scanned_decoder_refuses_an_intercept_recipe():
    with pytest.raises(ValueError, match=r"recipe 'doubled_wo' is an InterceptRecipe: .*use scan=False"):
        build_decoder("mixtral", InterceptRecipe("doubled_wo", _double_wo), layers=2, scan=True)


# -- qwix ------------------------------------------------------------------------


def _qwix():
    return import_extra("qwix")


def _int8_rule(**kw):
    return _qwix().QtRule(module_path=".*", **kw)


def qwix_test(fn):
    """A test of qwix_int8 or QwixRecipe: skipped, naming the extra, without qwix; qwix's deprecations allowed."""
    for mark in (requires_extra("qwix"), *QWIX_WARNS):
        fn = mark(fn)
    return fn


@qwix_test
@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_qwix_int8_layer_tracks_the_none_layer_should_pass(path):
    from qcheck.adapters import qwix_int8

    layer = qcheck.build_moe("mixtral", qwix_int8(), path=path)
    rel = checks.assert_tracks(np.asarray(step.apply(layer, X)[0]), _none_output(path), max_rel_norm=0.05)
    assert 0 < rel < 0.05


@qwix_test
@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_qwix_int8_skipping_qwixs_initializing_call_changes_no_state_and_no_bit(path):
    """Why QwixRecipe skips qwix's first call of each site: for its rules that call creates nothing."""
    from qcheck.adapters import qwix_int8

    ran = qwix_int8()
    ran.skip_init = False
    built = {skip: qcheck.build_moe("mixtral", recipe, path=path, seed=cases.SEED)
             for skip, recipe in ((True, qwix_int8()), (False, ran))}
    states = {skip: nnx.to_flat_state(nnx.state(layer)) for skip, layer in built.items()}
    assert [p for p, _ in states[True]] == [p for p, _ in states[False]]
    for (path_, a), (_, b) in zip(states[True], states[False]):
        assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), path_
    out = {skip: np.asarray(step.apply(layer, X)[0]) for skip, layer in built.items()}
    assert np.array_equal(out[True].view(np.uint32), out[False].view(np.uint32))


@qwix_test
def test_qwix_sees_a_qcheck_sites_weight_as_an_activation():
    """Why QwixRecipe refuses rules that treat weights differently: qwix 0.1.8 walks the none layer, but a
    weight-only rule quantizes nothing there (the weights reach the sites as arguments)."""
    qwix = _qwix()
    # Only the call sites: the router's einsum runs in the layer itself, on the layer's own `gate` param,
    # which qwix does take for a weight (hence QwixRecipe quantizes each site, not the whole layer).
    provider = qwix.QtProvider([qwix.QtRule(module_path=r"sites/.*", weight_qtype=jnp.int8)])
    layer = qwix.quantize_model(qcheck.build_moe("mixtral", "none"), provider, X)
    with pytest.raises(AssertionError, match=r"assert_tracks: actual is bitwise equal to the unquantized reference"
                                             r" .*silent fallback"):
        checks.assert_tracks(np.asarray(step.apply(layer, X)[0]), _none_output())


@qwix_test
@pytest.mark.parametrize("rule, match", [
    (dict(weight_qtype=jnp.int8), r"weight_qtype=.*act_qtype=None: qwix's QT provider skips"),
    (dict(weight_qtype=jnp.int8, act_qtype=jnp.float8_e4m3fn), r"weight_qtype int8 differs from act_qtype "
                                                               r"float8_e4m3fn\).*flax_util.find_param"),
    (dict(weight_qtype=jnp.int8, act_qtype=jnp.int8, act_calibration_method="minmax"),
     r"weight_calibration_method 'absmax' differs from act_calibration_method 'minmax'"),
])
def test_qwix_recipe_refuses_rules_that_tell_weights_from_activations(rule, match):
    from qcheck.adapters import QwixRecipe

    with pytest.raises(ValueError, match=r"QwixRecipe 'q': rules\[0\] treats weights and activations differently \("
                                         + match):
        QwixRecipe("q", [_int8_rule(**rule)])


@qwix_test
def test_qwix_recipe_bad_rules_are_named():
    from qcheck.adapters import QwixRecipe

    _qwix()
    with pytest.raises(ValueError, match=r"QwixRecipe 'q': rules must hold at least one qwix.QtRule"):
        QwixRecipe("q", [])
    with pytest.raises(TypeError, match=r"QwixRecipe 'q': rules\[0\] must be a qwix.QtRule, got dict"):
        QwixRecipe("q", [dict(weight_qtype=jnp.int8)])


def _site_vjp(recipe: str, path: str, lhs, rhs):
    site = cases.layer(cases.Case(recipe, cases.Variant("mixtral", path, False))).get_einsum("wi_0")
    graphdef, state = nnx.split(site)
    sizes = jnp.asarray([16] * 8, jnp.int32)

    def run(a, b):
        s = nnx.merge(graphdef, state)
        return s("BSM,EMH->BSEH", a, b) if path == "dense" else s.ragged_dot(a, b, sizes)

    y, vjp = jax.vjp(jax.jit(run), lhs, rhs)
    g = 0.37 + jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) * 1e-3
    return np.asarray(y), [np.asarray(t) for t in vjp(g)]


@qwix_test
@pytest.mark.parametrize("path, lhs_shape, same", [("dense", (2, 32, 32), True), ("sparse", (128, 32), False)])
def test_qwix_int8_site_gradients_against_the_unquantized_sites(path, lhs_shape, same):
    """Why `backward` holds qwix_int8 (qwix 0.1.8, no bwd_qtype) to g against the original operands
    (grad_operands="original") on the dense path only: there the gradients are the unquantized site's, bitwise
    (qwix keeps the original operands for the backward pass), not the product with the quantized operands;
    its ragged_dot's differ from the unquantized ones."""
    _qwix()
    lhs, rhs = checks.probe_operands(0, lhs_shape, (8, 32, 64))
    (yq, gq), (yn, gn) = _site_vjp("qwix_int8", path, lhs, rhs), _site_vjp("none", path, lhs, rhs)
    assert not np.array_equal(yq, yn)
    assert [np.array_equal(a, b) for a, b in zip(gq, gn)] == [same, same]


# -- KnownDefect(models=...): a defect one model's shapes show -----------------------------------


def _defect(**kw):
    from qcheck.recipes import KnownDefect

    return KnownDefect(**(dict(library="lib", invariant="sharded", paths=("sparse",), reason="r", match="m") | kw))


def test_known_defect_for_one_model_covers_only_that_model():
    from qcheck.suite._declared_cells import declared

    from qcheck.recipes import Expect

    class Declares:
        expect = Expect(known_defects=(_defect(models=("mixtral",)),))

    sparse = {m: cases.Variant(m, "sparse", False) for m in MODELS}
    assert declared(Declares(), sparse["mixtral"], "sharded") is Declares.expect.known_defects[0]
    assert declared(Declares(), sparse["gemma"], "sharded") is None
    Declares.expect = Expect(known_defects=(_defect(),))  # no models: every model
    assert declared(Declares(), sparse["gemma"], "sharded") is Declares.expect.known_defects[0]


@pytest.mark.parametrize("models", ["mixtral", ("mixtral", "")])
def test_known_defect_bad_models_are_named(models):
    with pytest.raises(TypeError, match=r"models must be a tuple of model names \(empty: every model\), got"):
        _defect(models=models)


@qwix_test
def test_qwix_rule_with_bwd_qtype_has_no_backward_reference_and_fails_the_straight_through_one():
    """A rule that quantizes gradients (bwd_qtype=int8, qwix 0.1.8) leaves backward_paths empty: qcheck has no
    referee for qwix's gradient quantization; held to the straight-through reference anyway, it fails."""
    import dataclasses

    from qcheck.adapters import QwixRecipe
    from qcheck.suite import invariants

    rule = _int8_rule(weight_qtype=jnp.int8, act_qtype=jnp.int8, bwd_qtype=jnp.int8)
    recipe = QwixRecipe("qwix_int8_bwd", [rule], lhs="int8_qwix", rhs="int8_qwix",
                        reference=dataclasses.replace(QwixRecipe.reference, matmul="integer"))
    assert recipe.expect.backward_paths == () and recipe.reference.grad_operands == "original"
    with pytest.raises(AssertionError, match=r"qwix_int8_bwd: assert_sites_backward_exact: site '\w+' "
                                             r"dgrad \(g unquantized \(straight through to the original operands\)\)"
                                             r": differs from the reference"):
        invariants.assert_sites_backward_exact(qcheck.build_moe("mixtral", recipe, path="dense"), recipe,
                                               label="qwix_int8_bwd")
