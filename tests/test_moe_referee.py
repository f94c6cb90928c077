"""assert_moe_matches_referee and the float64 MoE referee: should-pass/should-fail pairs, near-ties, bad mappings.

The layers under check are qcheck's own and small JAX layers written here the
way other codebases write theirs (HF-style per-expert Linear weights stored
[out, in]; DeepSeek-style with shared experts), each failing with the bug it
stands for. The referee's own rules (ties, capacity) are held to examples
worked by hand from their definitions.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck import referees
from qcheck.layers.moe import MODELS, PATHS, MoE
from qcheck.suite import cases, invariants
from tests.helpers import import_extra, requires_extra

ROLES = {"gate": "router", "wi_0": "gate", "wi_1": "up", "wo": "down"}
GEMMA_ROLES = {**ROLES, "per_expert_scale": "expert_scale"}


def qcheck_layer(model: str, cls: type[MoE] = MoE, *, dropping: bool = False) -> MoE:
    return cls(MODELS[model], qcheck.get_recipe("none"), capacity_factor=1.0 if dropping else -1.0,
               rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)


def check(layer, model: str, **kwargs):
    roles = GEMMA_ROLES if MODELS[model].router == "gemma" else ROLES
    return qcheck.assert_moe_matches_referee(layer, cases.layer_input(model), roles, style=MODELS[model].router,
                                             top_k=MODELS[model].top_k, **kwargs)


# -- qcheck's own layers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_qcheck_layer_should_pass(model):
    figures = check(qcheck_layer(model), model)
    assert figures <= 1e-5 and figures["tokens"] == cases.BATCH * cases.SEQ and figures["near_ties"] == 0


def test_gemma_is_held_to_gelus_tanh_form_and_fails_the_exact_one():
    # qcheck's gemma uses jax.nn.gelu(approximate=True); the exact erf form is 1e-3 away, far outside rtol.
    assert check(qcheck_layer("gemma"), "gemma", activation="gelu_tanh") <= 1e-5
    with pytest.raises(AssertionError, match=r"^assert_moe_matches_referee: token \(\d+, \d+\) differs .*no mix of "
                                             r"the referee's expert outputs"):
        check(qcheck_layer("gemma"), "gemma", activation="gelu")


@pytest.mark.parametrize("model, path", [(m, p) for m in MODELS for p in PATHS])
def test_every_dropping_layer_matches_the_referee(model, path):
    # The case table drops tokens on Mixtral's dense layer only; dense == sparse runs all four, and so does this.
    case = cases.Case("none", cases.Variant(model, path, True))
    figures = invariants.assert_layer_matches_referee(
        cases.layer(case), np.asarray(cases.layer_input(model)), rtol=cases.REFEREE_RTOL, atol=cases.REFEREE_ATOL,
        output=cases.layer_output(case), label=case.id)
    assert figures["dropped"] > 0  # the capacity binds: tokens are dropped on this seed


class LastTokensFirst(MoE):
    """Token dropping that serves each row's tokens from the last: the first ones are dropped."""

    def assignment_slots(self, idx):
        return super().assignment_slots(idx[:, ::-1])[:, ::-1]


def test_dropping_in_token_order_should_pass_and_from_the_last_token_should_fail():
    assert check(qcheck_layer("mixtral", dropping=True), "mixtral", capacity_factor=1.0) <= 1e-5
    capacity = referees.reference_capacity(cases.SEQ, 2, 8, 1.0)
    assert check(qcheck_layer("mixtral", dropping=True), "mixtral", capacity=capacity) <= 1e-5
    with pytest.raises(AssertionError, match=r"token \(\d+, \d+\) differs .*routes it to experts \[\d, \d\] with .*"
                                             r"the layer's output there is the referee's experts \[\d?\] mixed .*"
                                             r"other experts: the choice differs"):
        check(qcheck_layer("mixtral", LastTokensFirst, dropping=True), "mixtral", capacity_factor=1.0)
    with pytest.raises(AssertionError, match=r"other experts: the choice differs"):  # the referee told no capacity
        check(qcheck_layer("mixtral", dropping=True), "mixtral")


# -- near-ties in the router ---------------------------------------------------------------------------------


def near_tie_layer(*, dropping: bool = False) -> tuple[MoE, int]:
    """Mixtral with router columns a < b equal but one ulp in the row ``m`` (float64 tells them apart, the float32
    logits mostly not: there the layer's top_k keeps the lower index a); returns the layer and ``m``."""
    layer = qcheck_layer("mixtral", dropping=dropping)
    gate = np.array(layer.gate[...])
    a, b, m = 1, 5, 0
    gate[:, b] = gate[:, a]
    gate[m, b] = np.nextafter(gate[m, a], np.float32(np.inf))
    layer.gate[...] = jnp.asarray(gate)
    return layer, m


@pytest.mark.parametrize("dropping", [False, True], ids=["no-drop", "drop"])
def test_near_ties_are_left_out_and_counted_should_pass(dropping):
    layer, _ = near_tie_layer(dropping=dropping)
    figures = check(layer, "mixtral", capacity_factor=1.0 if dropping else None)
    assert figures["near_ties"] > 0 and figures["tokens"] + figures["near_ties"] == cases.BATCH * cases.SEQ
    assert figures <= 1e-5


def test_near_ties_compared_anyway_should_fail():
    # The control: without the margin, the same layer fails at a near-tie, the expert choice named as differing.
    layer, _ = near_tie_layer()
    with pytest.raises(AssertionError, match=r"other experts: the choice differs"):
        check(layer, "mixtral", tie_rtol=0)


def test_referee_ties_go_to_the_lowest_index_as_jax_lax_top_k():
    x = np.ones((1, 2))
    router = np.array([[1.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]])  # experts 1, 2, 3 tie above expert 0
    w = np.zeros((4, 2, 3))
    ref = referees.reference_moe(x, router, w, w, np.zeros((4, 3, 2)), top_k=2, style="mixtral")
    assert ref.experts.tolist() == [[1, 2]] and ref.runner_up.tolist() == [3] and ref.margin.tolist() == [0.0]
    assert ref.experts.tolist() == np.asarray(jax.lax.top_k(jnp.asarray(x @ router), 2)[1]).tolist()


def test_referee_drops_in_token_order_then_rank_order():
    # One row, three tokens, two experts, top-2: every token wants both; capacity 2 keeps the first two tokens.
    x = np.array([[[1.0], [2.0], [3.0]]])
    router = np.array([[1.0, 0.5]])
    w = np.ones((2, 1, 1))
    ref = referees.reference_moe(x, router, w, w, w, top_k=2, style="mixtral", capacity=2)
    assert ref.kept.tolist() == [[[True, True], [True, True], [False, False]]]
    assert ref.output[0, 2].tolist() == [0.0]
    assert referees.reference_capacity(seq=32, top_k=2, num_experts=8, capacity_factor=1.0) == 8
    assert referees.reference_capacity(seq=3, top_k=1, num_experts=8, capacity_factor=1.0) == 1


# -- layers written elsewhere: HF-style per-expert weights stored [out, in], DeepSeek with shared experts --------

E, M, H, K = 4, 16, 8, 2


def _linear(rng, out_features, in_features):
    return (rng.normal(size=(out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)


def hf_weights(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"router": _linear(rng, E, M),
            "experts": [{"w1": _linear(rng, H, M), "w3": _linear(rng, H, M), "w2": _linear(rng, M, H)}
                        for _ in range(E)]}


HF_ROLES = {"router": "router.T", **{f"experts/{e}/{n}": f"{r}[{e}].T" for e in range(E)
                                     for n, r in (("w1", "gate"), ("w3", "up"), ("w2", "down"))}}


def hf_mixtral(weights: dict, renormalise: bool = True):
    """HF's MixtralSparseMoeBlock in JAX: softmax over all experts, top-k, renormalised; Linear weights [out, in]."""

    def block(x):
        probs = jax.nn.softmax(x @ weights["router"].T, axis=-1)
        w, idx = jax.lax.top_k(probs, K)
        if renormalise:
            w = w / w.sum(-1, keepdims=True)
        y = jnp.zeros_like(x)
        for e, p in enumerate(weights["experts"]):
            ffn = (jax.nn.silu(x @ p["w1"].T) * (x @ p["w3"].T)) @ p["w2"].T
            y = y + jnp.sum(jnp.where(idx == e, w, 0.0), -1, keepdims=True) * ffn
        return y

    return block


X_SMALL = np.random.default_rng(1).normal(size=(3, 10, M)).astype(np.float32)


def test_hf_style_layer_should_pass_and_without_renormalising_should_fail():
    weights = hf_weights()
    assert qcheck.assert_moe_matches_referee(hf_mixtral(weights), X_SMALL, HF_ROLES, style="mixtral", top_k=K,
                                             weights=weights) <= 1e-5
    with pytest.raises(AssertionError, match=r"^assert_moe_matches_referee: token \(0, 0\) differs .*worst at "
                                             r"output\[0, 0, \d+\].*: the same experts, other weights$"):
        qcheck.assert_moe_matches_referee(hf_mixtral(weights, renormalise=False), X_SMALL, HF_ROLES, style="mixtral",
                                          top_k=K, weights=weights)


def deepseek_weights(seed: int = 2) -> dict:
    rng = np.random.default_rng(seed)
    stacked = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[-2])).astype(np.float32)  # noqa: E731
    return {"gate": stacked(M, E), "wi_0": stacked(E, M, H), "wi_1": stacked(E, M, H), "wo": stacked(E, H, M),
            "shared": {"wi_0": stacked(2, M, H), "wi_1": stacked(2, M, H), "wo": stacked(2, H, M)}}


DEEPSEEK_ROLES = {"gate": "router", "wi_0": "gate", "wi_1": "up", "wo": "down", "shared/wi_0": "shared_gate",
                  "shared/wi_1": "shared_up", "shared/wo": "shared_down"}


def deepseek_moe(w: dict, *, shared: bool = True, scaling: float = 2.5):
    """DeepSeekMoE in JAX: softmax over all experts, top-k as they are, scaled; plus two shared experts.

    Returns ``(y, aux)`` as MoE layers often do (``output=0`` selects y)."""

    def ffn(x, g, u, d):
        return (jax.nn.silu(x @ g) * (x @ u)) @ d

    def layer(x):
        probs = jax.nn.softmax(x @ w["gate"], axis=-1)
        top, idx = jax.lax.top_k(probs, K)
        y = sum(jnp.sum(jnp.where(idx == e, top * scaling, 0.0), -1, keepdims=True)
                * ffn(x, w["wi_0"][e], w["wi_1"][e], w["wo"][e]) for e in range(E))
        if shared:
            y = y + sum(ffn(x, *(w["shared"][n][i] for n in ("wi_0", "wi_1", "wo"))) for i in range(2))
        return y, jnp.mean(probs)

    return layer


def test_deepseek_layer_with_shared_experts_should_pass_and_without_them_should_fail():
    w = deepseek_weights()
    kwargs = dict(style="deepseek", top_k=K, routed_scaling_factor=2.5, weights=w, output=0)
    assert qcheck.assert_moe_matches_referee(deepseek_moe(w), X_SMALL, DEEPSEEK_ROLES, **kwargs) <= 1e-5
    with pytest.raises(AssertionError, match=r"token \(0, 0\) differs .*no mix of the referee's expert outputs"):
        qcheck.assert_moe_matches_referee(deepseek_moe(w, shared=False), X_SMALL, DEEPSEEK_ROLES, **kwargs)
    with pytest.raises(AssertionError, match=r"the same experts, other weights"):  # renormalised: not DeepSeek's
        qcheck.assert_moe_matches_referee(deepseek_moe(w), X_SMALL, DEEPSEEK_ROLES, norm_topk_prob=True, **kwargs)


# -- bad mappings and arguments: one ValueError naming what is wrong --------------------------------------------


def test_a_path_the_layer_lacks_lists_its_parameter_paths():
    with pytest.raises(ValueError, match=r"^assert_moe_matches_referee: params names 'wi_2', not parameters of the "
                                         r"layer; its parameter paths: gate, wi_0, wi_1, wo$"):
        qcheck.assert_moe_matches_referee(qcheck_layer("mixtral"), cases.layer_input("mixtral"),
                                          {**ROLES, "wi_2": "up"}, style="mixtral", top_k=2)


@pytest.mark.parametrize("params, style, message", [
    ({**ROLES, "wo": "dwn"}, "mixtral", r"unknown role 'dwn'; valid roles: router, expert_scale, gate, up, down, "),
    ({k: v for k, v in ROLES.items() if k != "wi_1"}, "mixtral", r"params maps no parameter to role\(s\) up "
                                                                  r"\(style 'mixtral'\); the layer's parameter paths"),
    (ROLES, "gemma", r"params maps no parameter to role\(s\) expert_scale \(style 'gemma'\)"),
    ({**ROLES, "gate": "router.T"}, "mixtral", r"params: router \(gate\) has shape \[8, 32\], the referee takes "
                                               r"\[32, 8\] \(emb 32, experts 8, hidden 64\); it fits transposed"),
    ({**ROLES, "wi_1": "gate"}, "mixtral", r"params: role 'gate' given twice"),
    (ROLES, "switch", r"unknown style 'switch'; valid styles: mixtral, gemma, deepseek"),
], ids=["unknown-role", "missing-role", "gemma-without-scale", "transposed", "twice", "unknown-style"])
def test_a_bad_mapping_is_one_value_error_naming_it(params, style, message):
    layer = qcheck_layer("mixtral")
    with pytest.raises(ValueError, match=r"^assert_moe_matches_referee: " + message):
        qcheck.assert_moe_matches_referee(layer, cases.layer_input("mixtral"), params, style=style, top_k=2)


def test_weights_belong_to_a_function_and_a_function_needs_them():
    with pytest.raises(ValueError, match=r"weights is for a layer given as a function of x"):
        qcheck.assert_moe_matches_referee(qcheck_layer("mixtral"), cases.layer_input("mixtral"), ROLES,
                                          style="mixtral", top_k=2, weights={})
    with pytest.raises(ValueError, match=r"a layer given as a function of x takes its parameters from weights="):
        qcheck.assert_moe_matches_referee(hf_mixtral(hf_weights()), X_SMALL, HF_ROLES, style="mixtral", top_k=K)


def test_the_documented_example_runs(capsys):
    doc = (Path(__file__).parent.parent / "docs" / "checking-your-layer.md").read_text()
    (code,) = re.findall(r"<!-- moe-referee: example -->\n```python\n(.*?)```", doc, re.S)
    exec(compile(code, "checking-your-layer.md", "exec"), {})
    assert "of a token's norm at worst; 0 near-ties left out" in capsys.readouterr().out


def test_a_nan_names_its_token():
    weights = hf_weights()
    block = hf_mixtral(weights)
    with pytest.raises(AssertionError, match=r"^assert_moe_matches_referee: token \(1, 2\) differs .*1 of 30 tokens "
                                             r"differ.*the layer's output there has 1 non-finite values$"):
        qcheck.assert_moe_matches_referee(lambda x: block(x).at[1, 2, 3].set(jnp.nan), X_SMALL, HF_ROLES,
                                          style="mixtral", top_k=K, weights=weights)


# -- modules called through call=: an Equinox block, parameters by field path -----------------------------------


def equinox_block(*, renormalise: bool = True):
    """Mixtral as an Equinox block: the router [out, in], the experts stacked [experts, in, out]; called on a
    mapping with a keyword, as library blocks are (not a function of x), returning ``(y, aux)``."""
    eqx = import_extra("equinox")
    rng = np.random.default_rng(3)
    stacked = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[-2])).astype(np.float32)  # noqa: E731

    class Block(eqx.Module):
        router: jax.Array
        experts: dict
        renormalise: bool = eqx.field(static=True)

        def __call__(self, inputs, *, key=None):
            x = inputs["tokens"]
            probs = jax.nn.softmax(x @ self.router.T, axis=-1)
            w, idx = jax.lax.top_k(probs, K)
            if self.renormalise:
                w = w / w.sum(-1, keepdims=True)
            h = jax.nn.silu(jnp.einsum("...m,emh->...eh", x, self.experts["w1"]))
            h = h * jnp.einsum("...m,emh->...eh", x, self.experts["w3"])
            out = jnp.einsum("...eh,ehm->...em", h, self.experts["w2"])
            combine = jnp.sum(jax.nn.one_hot(idx, E) * w[..., None], axis=-2)  # [..., experts]
            return jnp.einsum("...em,...e->...m", out, combine), jnp.mean(probs)

    return Block(jnp.asarray(stacked(E, M)), {n: jnp.asarray(stacked(E, *s)) for n, s in
                                              (("w1", (M, H)), ("w3", (M, H)), ("w2", (H, M)))}, renormalise)


EQX_ROLES = {"router": "router.T", "experts/w1": "gate", "experts/w3": "up", "experts/w2": "down"}


def call_on_tokens(block, x):
    return block({"tokens": x}, key=None)


@requires_extra("equinox")
def test_equinox_block_through_call_should_pass_and_without_renormalising_should_fail():
    kwargs = dict(style="mixtral", top_k=K, call=call_on_tokens, output=0)
    figures = qcheck.assert_moe_matches_referee(equinox_block(), X_SMALL, EQX_ROLES, **kwargs)
    assert figures <= 1e-5 and figures["tokens"] + figures["near_ties"] == 30
    with pytest.raises(AssertionError, match=r"^assert_moe_matches_referee: token \(0, 0\) differs .*: the same "
                                             r"experts, other weights$"):
        qcheck.assert_moe_matches_referee(equinox_block(renormalise=False), X_SMALL, EQX_ROLES, **kwargs)


@requires_extra("equinox")
def test_equinox_block_parameters_are_its_field_paths_and_its_own():
    # Its inexact arrays by field path (the static flag is none); weights= belongs to a function of x.
    with pytest.raises(ValueError, match=r"^assert_moe_matches_referee: params names 'w1', not parameters of the "
                                         r"layer; its parameter paths: router, experts/w1, experts/w2, experts/w3$"):
        qcheck.assert_moe_matches_referee(equinox_block(), X_SMALL, {**EQX_ROLES, "w1": "gate"}, style="mixtral",
                                          top_k=K, call=call_on_tokens, output=0)
    with pytest.raises(ValueError, match=r"weights is for a layer given as a function of x"):
        qcheck.assert_moe_matches_referee(equinox_block(), X_SMALL, EQX_ROLES, style="mixtral", top_k=K,
                                          call=call_on_tokens, output=0, weights={})


def test_call_belongs_to_a_module_and_is_a_function():
    weights = hf_weights()
    with pytest.raises(ValueError, match=r"^assert_moe_matches_referee: call is how a module is called on x; a layer "
                                         r"given as a function of x is called as it is$"):
        qcheck.assert_moe_matches_referee(hf_mixtral(weights), X_SMALL, HF_ROLES, style="mixtral", top_k=K,
                                          weights=weights, call=lambda m, x: m(x))
    with pytest.raises(ValueError, match=r"^assert_moe_matches_referee: call must be a function \(module, x\) -> "
                                         r"output, got str$"):
        qcheck.assert_moe_matches_referee(qcheck_layer("mixtral"), cases.layer_input("mixtral"), ROLES,
                                          style="mixtral", top_k=2, call="__call__")


def test_nnx_module_through_call_should_pass_and_through_a_wrong_call_should_fail():
    # call= on an NNX module, as check_layer takes it: the module's own output passes; a call that feeds it
    # the input reversed along the features gives a layer no referee routing explains.
    layer = qcheck_layer("mixtral")
    assert check(layer, "mixtral", call=lambda m, x: m(x)) <= 1e-5
    with pytest.raises(AssertionError, match=r"token \(0, 0\) differs"):
        check(layer, "mixtral", call=lambda m, x: m(x[..., ::-1]))
