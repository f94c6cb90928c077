"""The tiny MoE layers: shapes, routing, call sites and the errors at their boundary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck.layers import step
from qcheck.suite import cases
from qcheck.layers.bridge import Fp8Meta
from qcheck.suite.cases import Case, Variant


def fresh(recipe="none", model="mixtral", path="dense", dropping=False):
    return cases.layer(Case(recipe, Variant(model, path, dropping)))


@pytest.mark.parametrize("model", list(qcheck.MODELS))
def test_config_and_output_shape(model):
    layer = fresh(model=model)
    c = layer.config
    assert (c.emb, c.mlp, c.num_experts, c.top_k) == (
        qcheck.MODELS[model].emb, qcheck.MODELS[model].mlp,
        qcheck.MODELS[model].num_experts, qcheck.MODELS[model].top_k)
    assert layer.wi_0.shape == (c.num_experts, c.emb, c.mlp)
    assert layer.wo.shape == (c.num_experts, c.mlp, c.emb)
    assert cases.layer_output(Case("none", Variant(model, "dense", False))).shape == (
        cases.BATCH, cases.SEQ, c.emb)


def test_gemma_has_more_experts_and_a_larger_k_than_mixtral():
    g, m = qcheck.MODELS["gemma"], qcheck.MODELS["mixtral"]
    assert g.num_experts > m.num_experts and g.top_k > m.top_k


def test_same_seed_same_weights_whatever_the_recipe_or_path():
    ref = nnx.state(fresh(), nnx.Param)
    for recipe in qcheck.recipe_names():
        for variant in cases.VARIANTS:
            if variant.model != "mixtral":
                continue
            other = nnx.state(cases.layer(Case(recipe, variant)), nnx.Param)
            for (path, a), (_, b) in zip(nnx.to_flat_state(ref), nnx.to_flat_state(other), strict=True):
                assert np.array_equal(a.get_value(), b.get_value()), (recipe, variant, path)


def test_different_seeds_give_different_weights():
    a = qcheck.build_moe("mixtral", "none", seed=0).wi_0[...]
    b = qcheck.build_moe("mixtral", "none", seed=1).wi_0[...]
    assert not np.array_equal(a, b)


def test_mixtral_router_softmaxes_the_top_k_logits():
    layer = fresh()
    x = cases.layer_input("mixtral")
    w, idx = layer.route(x)
    logits = jnp.einsum("BSM,ME->BSE", x, layer.gate[...])
    top = jnp.take_along_axis(logits, idx, axis=-1)
    np.testing.assert_allclose(w, jax.nn.softmax(top, axis=-1), rtol=1e-6)
    assert np.all(np.diff(np.asarray(top), axis=-1) <= 0)  # idx are the top-k, best first


def test_gemma_router_renormalizes_full_softmax_and_applies_expert_scale():
    layer = qcheck.build_moe("gemma", "none")
    layer.per_expert_scale[...] = jnp.arange(1.0, 17.0)
    x = cases.layer_input("gemma")
    w, idx = layer.route(x)
    probs = jax.nn.softmax(jnp.einsum("BSM,ME->BSE", x, layer.gate[...]), axis=-1)
    sel = jnp.take_along_axis(probs, idx, axis=-1)
    expected = sel / sel.sum(-1, keepdims=True) * (idx + 1.0)
    np.testing.assert_allclose(w, expected, rtol=1e-6)


def test_dropping_variant_really_drops_tokens():
    for model in qcheck.MODELS:
        layer = fresh(model=model, dropping=True)
        _, idx = layer.route(cases.layer_input(model))
        slots = layer.assignment_slots(idx)
        assert np.any(slots >= layer.capacity(cases.SEQ)), f"{model}: nothing dropped"
        assert np.any(slots < layer.capacity(cases.SEQ))


@pytest.mark.parametrize(
    "path, dropping, names",
    [
        ("dense", False, ("wi_0", "wi_1", "wo")),
        ("dense", True, ("dispatch", "wi_0", "wi_1", "wo", "combine")),
        ("sparse", False, ("wi_0", "wi_1", "wo")),
    ],
)
def test_call_sites_have_stable_names(path, dropping, names):
    layer = fresh("fp8", path=path, dropping=dropping)
    assert layer.site_names() == names
    assert set(layer.site_specs(cases.BATCH, cases.SEQ)) == set(names)
    for name in names:
        assert layer.get_einsum(name).site_name == name


def test_get_einsum_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"'einsum' is not registered.*wi_0, wi_1, wo$"):
        fresh("fp8").get_einsum("einsum")
    with pytest.raises(ValueError, match="dispatch, wi_0, wi_1, wo, combine"):
        fresh("int8", dropping=True).get_einsum("gate")


def _site_state_ids(layer):
    return {
        name: {id(v.get_raw_value()) for _, v in nnx.to_flat_state(nnx.state(site))}
        for name, site in layer.sites.items()
    }


def test_no_two_call_sites_share_quantization_state():
    layer = fresh("fp8", dropping=True)
    sites = list(layer.sites.values())
    assert len({id(s) for s in sites}) == len(sites)
    ids = _site_state_ids(layer)
    for a in ids:
        for b in ids:
            assert a == b or not ids[a] & ids[b], f"sites {a} and {b} share state"
    meta = nnx.state(layer, Fp8Meta)
    assert len(list(nnx.to_flat_state(meta))) == 6 * len(sites)


def test_int8_site_is_built_once_and_reused_across_calls():
    layer = qcheck.build_moe("mixtral", "int8")
    before = {n: id(s) for n, s in layer.sites.items()}
    x = cases.layer_input("mixtral")
    call = nnx.jit(lambda m, x: m(x))
    call(layer, x)
    call(layer, x)
    assert {n: id(s) for n, s in layer.sites.items()} == before
    assert not list(nnx.to_flat_state(nnx.state(layer, Fp8Meta)))


def test_fp8_state_is_materialized_at_build_not_in_call():
    layer = qcheck.build_moe("mixtral", "nanoo_fp8")
    meta = {p: v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(layer, Fp8Meta))}
    assert meta[("sites", "wo", "input_scale")] == (1,)
    assert meta[("sites", "wo", "kernel_amax_history")] == (1024,)
    graph_before = nnx.graphdef(layer)
    step.apply(layer, cases.layer_input("mixtral"))
    assert nnx.graphdef(layer) == graph_before


def test_layer_runs_under_plain_jit_and_nnx_jit():
    layer = qcheck.build_moe("gemma", "fp8", path="dense", capacity_factor=1.0)
    x = cases.layer_input("gemma")
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": "llama"}, "unknown model 'llama'; valid models: mixtral, gemma"),
        ({"path": "ragged"}, "unknown path 'ragged'; valid paths: dense, sparse"),
        ({"recipe": "fp4"}, "unknown recipe 'fp4'; registered recipes: none, int8, fp8, nanoo_fp8"),
    ],
)
def test_unknown_names_list_the_valid_ones(kwargs, message):
    args = {"model": "mixtral", "recipe": "none", **kwargs}
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        qcheck.build_moe(args.pop("model"), args.pop("recipe"), **args)


def test_input_with_wrong_embedding_width_names_both_numbers():
    with pytest.raises(ValueError, match="last axis 48, but the layer's embedding width is 32"):
        fresh()(jnp.ones((1, 4, 48)))
    with pytest.raises(ValueError, match=r"shape \[batch, seq, emb=32\], got shape \(4, 32\)"):
        fresh()(jnp.ones((4, 32)))


def test_a_bad_mesh_is_refused_naming_what_is_wrong():
    import jax
    from jax.sharding import Mesh

    devices = np.array(jax.devices("cpu")[:8])
    with pytest.raises(ValueError, match=r"mesh must have axes \('data', 'expert'\), got \('x', 'y'\)"):
        qcheck.build_moe("mixtral", "none", mesh=Mesh(devices.reshape(2, 4), ("x", "y")))
    with pytest.raises(ValueError, match="mesh axis 'expert' has 3 devices, which does not divide mixtral's 8 experts"):
        qcheck.build_moe("mixtral", "none", mesh=Mesh(devices[:6].reshape(2, 3), ("data", "expert")))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh or None, got tuple"):
        qcheck.build_moe("mixtral", "none", mesh=(2, 4))


def test_a_sharded_layer_keeps_its_expert_weights_split():
    layer = qcheck.build_moe("gemma", "int8", mesh=cases.mesh())
    assert layer.wi_0[...].sharding.spec[0] == "expert" and len(layer.wi_0[...].sharding.device_set) == 8
