"""Declared quantization: each matmul held, site by site, to the quantization its layer declares.

Should-pass / should-fail pairs on small functions (each plants one bug of the
shapes real layers had: the other fp8 flavour on one site, no saturation, one
weight scale shared across experts, int4 codes where int8 is declared, a
straight-through estimator read as full precision), the declaration's usage
errors, and qcheck's own recipes' layers, which must pass their own recipe's
declaration (no false alarm) except where a library's known defect says why not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qcheck
from qcheck import formats
from qcheck.libraries import as_declaration
from qcheck.recipes import get_recipe, recipe_names

E4M3FN = jnp.float8_e4m3fn
E4M3FNUZ = jnp.float8_e4m3fnuz
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(16, 32)).astype(np.float32))
W = jnp.asarray(RNG.normal(size=(32, 24)).astype(np.float32))
# Experts' weights whose scales differ per expert: a scale shared across them changes most codes.
WE = jnp.asarray((RNG.normal(size=(4, 32, 24)) * np.array([1, 3, 10, 30])[:, None, None]).astype(np.float32))
GROUPS = jnp.asarray([4, 4, 4, 4], jnp.int32)
FP8_BOTH = {"activations": "e4m3fn", "weights": "e4m3fn"}
# AQT's codes as a format of qcheck's own: the aqt_int8 recipe needs the aqt extra, and [test] alone runs these.
INT8_AQT_BOTH = {"activations": "int8_aqt", "weights": "int8_aqt"}


def _fp8(v, dtype=E4M3FN):
    top = float(ml_dtypes.finfo(dtype).max)
    return jnp.clip(v, -top, top).astype(dtype).astype(jnp.float32)


def _int8(v, axis, levels=127):
    scale = jnp.max(jnp.abs(v), axis=axis, keepdims=True) / levels
    return jnp.clip(jnp.round(v / scale), -levels, levels).astype(jnp.int8), scale


def _findings(fn, *args, declared):
    return [f for r in qcheck.coverage(fn, *args, declared=declared) for f in r.findings]


def _assert_fails(fn, *args, declared, match):
    with pytest.raises(AssertionError, match=match):
        qcheck.assert_quantized(fn, *args, declared=declared)


# -- the fp8 flavour, bitwise --------------------------------------------------------------

def fp8_matmul(x):
    return _fp8(x) @ _fp8(W)


def fp8_wrong_flavour_on_weights(x):
    return _fp8(x) @ _fp8(W, E4M3FNUZ)


def test_fp8_site_as_declared_should_pass():
    records = qcheck.assert_quantized(fp8_matmul, X, declared=FP8_BOTH)
    (r,) = records
    assert (r.lhs_role, r.rhs_role) == ("activation", "weight")
    assert (r.lhs_declared, r.rhs_declared) == ("e4m3fn", "e4m3fn")


def test_fp8_site_other_flavour_should_fail():
    _assert_fails(fp8_wrong_flavour_on_weights, X, declared=FP8_BOTH,
           match=r"rhs \(weight\) is cast to float8_e4m3fnuz; declared e4m3fn")


def test_fp8_site_declared_fnuz_fails_on_e4m3fn_codes():
    # The control of the pair above: the same correct site under the other flavour's declaration.
    _assert_fails(fp8_matmul, X, declared={"activations": "e4m3fnuz", "weights": "e4m3fnuz"},
           match=r"lhs \(activation\) is cast to float8_e4m3fn; declared e4m3fnuz")


def test_fp8_site_without_saturation_should_fail_bitwise():
    big = X * 300.0  # beyond e4m3fn's 448: the referee saturates, a bare cast gives NaN

    def unsaturated(x):
        return x.astype(E4M3FN).astype(jnp.float32) @ _fp8(W)

    assert not _findings(fp8_matmul, big, declared=FP8_BOTH)
    _assert_fails(unsaturated, big, declared=FP8_BOTH,
           match=r"lhs \(activation\): codes are not e4m3fn's: \d+ of 512 codes differ from the referee's; first at")


def test_fp8_site_with_a_scale_is_divided_by_the_layers_scale():
    scale = jnp.float32(0.5)

    def scaled(x):
        return (_fp8(x / scale) * scale) @ _fp8(W)

    def scale_ignored(x):  # multiplies back a scale it never divided by
        return (_fp8(x) * scale) @ _fp8(W)

    assert not _findings(scaled, X, declared=FP8_BOTH)
    assert not _findings(scale_ignored, X, declared=FP8_BOTH)  # codes of x itself: still e4m3fn's
    # Control: the divided input's codes really differ from the undivided one's (the divisor is applied).
    assert not np.array_equal(_fp8(X / scale), _fp8(X))


# -- int8: granularity and levels ---------------------------------------------------------

def _ragged(weight_axes, levels=127):
    def fn(x):
        qx, sx = _int8(x, axis=1)
        qw, sw = _int8(WE, axis=weight_axes, levels=levels)
        return jax.lax.ragged_dot(qx.astype(jnp.float32) * sx, qw.astype(jnp.float32) * sw, GROUPS)
    return fn


def test_int8_per_expert_scale_should_pass():
    (r,) = qcheck.assert_quantized(_ragged(weight_axes=1), X, declared="int8")
    assert r.primitive.startswith("ragged_dot") and r.rhs_role == "weight"


def test_int8_scale_shared_across_experts_should_fail():
    _assert_fails(_ragged(weight_axes=(0, 1)), X, declared="int8",
           match=r"rhs \(weight\): codes are not int8's: .*they match one scale shared across axis 0 \(size 4\)")


def test_int4_codes_where_int8_is_declared_should_fail():
    _assert_fails(_ragged(weight_axes=1, levels=7), X, declared="int8",
           match=r"rhs \(weight\): codes are not int8's: .*they are int4_keras's codes: another rule of the same "
                 r"kind, int4 codes")


def test_six_bit_codes_where_int8_is_declared_should_fail_naming_the_levels():
    # ±31 codes (absmax / 31) are no format qcheck knows: the diagnosis counts the levels against int8's.
    _assert_fails(_ragged(weight_axes=1, levels=31), X, declared="int8",
           match=r"rhs \(weight\): codes are not int8's: .*the codes reach only ±31 \(\d+ distinct levels\): fewer "
                 r"bits than int8's ±127")


def _aqt_after_a_literal_factor(weight_axes):
    # haliax multiplies each weight by its reparametrisation's literal scale (weight * 1.0 under
    # LinearStandardParam, a 1/sqrt(fan) under muP) before AQT's int8 quantizes it.
    def fn(x):
        qx, qw = formats.quantize(x, "int8_aqt", axis=1), formats.quantize(W * 0.5, "int8_aqt", axis=weight_axes)
        return (qx.codes.astype(jnp.float32) * qx.scales["slice"]) @ (qw.codes.astype(jnp.float32) * qw.scales["slice"])
    return fn


def test_int8_after_a_literal_factor_should_pass():
    # The literal factor is the layer's arithmetic, not the quantizer's scale: the codes are int8_aqt's of W * 0.5.
    (r,) = qcheck.assert_quantized(_aqt_after_a_literal_factor(0), X, declared=INT8_AQT_BOTH)
    assert r.rhs_role == "weight" and r.rhs_declared == "int8_aqt"


def test_int8_after_a_literal_factor_shared_scale_should_fail():
    _assert_fails(_aqt_after_a_literal_factor((0, 1)), X, declared=INT8_AQT_BOTH,
           match=r"rhs \(weight\): codes are not int8_aqt's: .*they match one scale for the whole tensor")


# -- weight-only schemes and straight-through estimators ------------------------------------

def _gemma_int8(kernel, axis):
    # gemma's simulate_quantize: scales 127 · (1/absmax) over every axis but the last, round, clip, divide.
    scale = 127.0 * (1.0 / jnp.max(jnp.abs(kernel), axis=axis, keepdims=True))
    return jnp.clip(jnp.round(kernel * scale), -128, 127) / scale


def _qat(kernel_fn):
    def fn(x):
        w = W
        w = (w - jax.lax.stop_gradient(w)) + jax.lax.stop_gradient(kernel_fn(w))
        return x @ w
    return fn


WEIGHT_ONLY = {"weights": {"format": "int8", "per": (-1,)}, "activations": None}


def test_straight_through_weight_only_should_pass():
    records = qcheck.assert_quantized(_qat(lambda w: _gemma_int8(w, axis=0)), X, declared=WEIGHT_ONLY)
    assert records[0].rhs.quantized and not records[0].lhs.quantized


def test_straight_through_other_granularity_should_fail():
    _assert_fails(_qat(lambda w: _gemma_int8(w, axis=1)), X, declared=WEIGHT_ONLY,
           match=r"rhs \(weight\): codes are not int8 per axes \(-1,\)'s")


#: Weight-only int8 at the format's own rule: one scale per output channel, along the contraction.
WEIGHT_ONLY_OWN_RULE = {"weights": "int8", "activations": None}


def test_straight_through_at_the_formats_own_rule_should_pass():
    # W (32, 24) contracts its axis 0: one scale per output column (reduced over axis 0) is int8's own rule.
    (r,) = qcheck.assert_quantized(_qat(lambda w: _gemma_int8(w, axis=0)), X, declared=WEIGHT_ONLY_OWN_RULE)
    assert r.rhs.quantized and r.rhs_declared == "int8"


def test_straight_through_scale_per_contraction_index_should_fail():
    # One scale per input row (reduced over the output axis 1): the stop_gradient of the straight-through
    # estimator must keep the codes' axes, or the contraction axis is lost and only the type is checked.
    _assert_fails(_qat(lambda w: _gemma_int8(w, axis=1)), X, declared=WEIGHT_ONLY_OWN_RULE,
           match=r"rhs \(weight\): codes are not int8's: .*they match scales reduced over axes \(1,\) instead: "
                 r"one scale per index of axes \(0,\)")


def test_straight_through_add_back_form_is_read_as_quantized():
    def fn(x):
        return x @ (W + jax.lax.stop_gradient(_gemma_int8(W, axis=0) - W))

    (r,) = qcheck.coverage(fn, X)
    assert r.rhs.quantized
    (plain,) = qcheck.coverage(lambda x: x @ (W + jax.lax.stop_gradient(W * 0.5 - W)), X)
    assert not plain.rhs.quantized


def test_declared_full_precision_role_quantized_should_fail():
    _assert_fails(fp8_matmul, X, declared={"weights": "e4m3fn", "activations": None},
           match=r"lhs \(activation\) is quantized \(float8_e4m3fn\) but declared full precision")


def test_declared_format_on_full_precision_operand_should_fail():
    _assert_fails(lambda x: x @ _fp8(W), X, declared=FP8_BOTH,
           match=r"lhs \(activation\) reaches the matmul in full precision; declared e4m3fn")
    assert not _findings(lambda x: x @ _fp8(W), X, declared={"weights": "e4m3fn"})  # a role left out: unchecked


def test_roles_follow_data_flow_not_operand_position():
    (r,) = qcheck.coverage(lambda x: jnp.einsum("kn,mk->mn", _fp8(W), _fp8(x)), X, declared=FP8_BOTH)
    assert {r.lhs_role, r.rhs_role} == {"activation", "weight"} and not r.findings


# -- the declaration's control and usage errors --------------------------------------------

def test_declaration_that_the_unquantized_twin_satisfies_should_fail():
    _fails_control = pytest.raises(AssertionError, match="holds on the unquantized control as well")
    with _fails_control:
        qcheck.assert_quantized(fp8_matmul, X, declared={"grads": "e5m2"}, control=lambda x: x @ W)
    qcheck.assert_quantized(fp8_matmul, X, declared=FP8_BOTH, control=lambda x: x @ W)


@pytest.mark.parametrize("declared, match", [
    ({"weights": "e4m3"}, r"declared: unknown weights format 'e4m3'; valid weights formats: .*e4m3fn"),
    ({"kernel": "int8"}, r"declared: unknown role 'kernel'; valid roles: weights, activations, grads"),
    ({"weights": {"format": "int8", "axes": 0}}, r"must be a format name, None, or"),
    ({"weights": {"format": "int8", "per": "last"}}, r"per must be a tuple of axes"),
    ({"lhs": "int8", "weights": "int8"}, r"by role .* or by position .*, not both"),
    ("no_such_recipe", r"^declared: unknown recipe 'no_such_recipe'; registered recipes: none, .*; formats: .*"
                       r"int8_keras"),
    (3, r"declared must be a recipe or format name, a qcheck.Recipe or a mapping"),
])
def test_declaration_usage_errors_name_the_argument(declared, match):
    with pytest.raises(ValueError, match=match) as info:
        as_declaration(declared, "declared")
    assert "\n" not in str(info.value)


def test_a_format_name_declares_it_on_weights_and_activations():
    declaration = as_declaration("e4m3fn", "declared")
    assert {k: v.format for k, v in declaration.roles.items()} == {"weights": "e4m3fn", "activations": "e4m3fn"}
    assert declaration.source == "format 'e4m3fn' on weights and activations"
    qcheck.assert_quantized(fp8_matmul, X, declared="e4m3fn")  # should pass: both operands e4m3fn
    with pytest.raises(AssertionError, match=r"declared e4m3fnuz"):  # should fail: the other flavour
        qcheck.assert_quantized(fp8_matmul, X, declared="e4m3fnuz")
    assert as_declaration("int8", "declared").source == "recipe 'int8'"  # a recipe's name is the recipe first


def test_check_layer_reads_the_declaration_of_qcheck_layers():
    layer = qcheck.build_moe("mixtral", "nanoo_fp8", path="dense")
    twin = qcheck.build_moe("mixtral", "none", path="dense")
    x = jax.random.normal(jax.random.key(1), (2, 32, layer.config.emb))
    from qcheck.layers.moe import UNQUANTIZED_BY_DESIGN
    skip = qcheck.skip_functions(*UNQUANTIZED_BY_DESIGN)
    figures = qcheck.check_layer(layer, twin, x, skip=skip, declared=True)
    assert figures.declared.source == "the layer's recipe 'nanoo_fp8'"
    with pytest.raises(AssertionError, match=r"is cast to float8_e4m3fnuz; declared e4m3fn"):
        qcheck.check_layer(layer, twin, x, skip=skip, declared="fp8")


def test_check_layer_declared_usage_error_is_one_line():
    with pytest.raises(ValueError, match=r"^check_layer: declared: unknown weights format 'e4m3'; valid weights formats: int8, "):
        qcheck.check_layer(fp8_matmul, lambda x: x @ W, X, declared={"weights": "e4m3"})


# -- check_layer: mixed formats where nothing is declared ------------------------------------

SQUARE = [jnp.asarray((RNG.normal(size=(32, 32)) / np.sqrt(32)).astype(np.float32)) for _ in range(3)]


def _sites(*dtypes):
    def fn(x):
        for w, dtype in zip(SQUARE, dtypes):
            x = _fp8(x) @ _fp8(w, dtype)
        return x
    return fn


def _twin(n):
    def fn(x):
        for w in SQUARE[:n]:
            x = x @ w
        return x
    return fn


def test_check_layer_one_format_per_role_should_pass():
    figures = qcheck.check_layer(_sites(E4M3FN, E4M3FN, E4M3FN), _twin(3), X)
    assert figures.declared is None and figures.declared_from.startswith("nothing read: no reader")


def test_check_layer_mixed_formats_within_a_role_should_fail():
    """With nothing read from the layer (a plain function), operands of one role must share one narrow type."""
    with pytest.raises(AssertionError, match=r"formats: dot_general at .*test_declared_quantization.py:\d+ .*: its "
                                             r"weight operand is float8_e4m3fnuz where 2 other weight operands are "
                                             r"float8_e4m3fn: formats mixed within one role"):
        qcheck.check_layer(_sites(E4M3FN, E4M3FNUZ, E4M3FN), _twin(3), X)
    with pytest.raises(AssertionError, match=r"weight operands of one layer are cast to float8_e4m3fn, "
                                             r"float8_e4m3fnuz: float8_e4m3fn at .*; float8_e4m3fnuz at "):
        qcheck.check_layer(_sites(E4M3FN, E4M3FNUZ), _twin(2), X)
    qcheck.check_layer(_sites(E4M3FN, E4M3FNUZ), _twin(2), X, declared=False)  # nothing held: "quantized somehow"


def test_check_layer_declared_true_with_nothing_to_read_is_one_line():
    with pytest.raises(ValueError, match=r"^check_layer: declared=True, but no reader \(qcheck_declaration, MaxText, gemma, "
                                         r"haliax, qwix, Keras, EasyDeL\) finds a declaration on it of function; declare it by hand: "
                                         r"declared='fp8' \(a recipe\) or declared=\{'weights': 'int8', "
                                         r"'activations': 'int8'\}$") as info:
        qcheck.check_layer(_sites(E4M3FN, E4M3FN, E4M3FN), _twin(3), X, declared=True)
    assert "\n" not in str(info.value)


def test_check_layer_declared_fails_naming_the_site():
    with pytest.raises(AssertionError, match=r"coverage: assert_quantized: 1 of 2 matmuls differ from the declared "
                                             r"quantization .*\n.*test_declared_quantization.py:\d+"):
        qcheck.check_layer(_sites(E4M3FN, E4M3FNUZ), _twin(2), X, declared=FP8_BOTH)


# -- qcheck's own layers: their recipe's declaration holds, bitwise ---------------------------

def _exact_defect(recipe, model: str, path: str):
    for d in recipe.expect.known_defects:
        if (d.invariant == "exact" and path in d.paths and (not d.models or model in d.models)
                and d.dropping in (None, False) and d.seen_here):
            return d
    return None


@pytest.mark.parametrize("path", ["dense", "sparse"])
@pytest.mark.parametrize("model", ["mixtral", "gemma"])
@pytest.mark.parametrize("name", [n for n in recipe_names() if n != "none"])
def test_own_layers_pass_their_recipes_declaration(name, model, path):
    recipe = get_recipe(name)
    if path not in recipe.expect.paths or (recipe.lhs is None):
        pytest.skip(f"{name} runs no {path} case or declares no formats")
    layer = qcheck.build_moe(model, name, path=path)
    x = jax.random.normal(jax.random.key(1), (2, 32, layer.config.emb))
    records = qcheck.coverage(layer, x, declared=name)
    quantized = [r for r in records if r.quantized]
    assert quantized, "the recipe's layer has no quantized site: the declaration checked nothing"
    found = [f for r in quantized for f in r.findings]
    defect = _exact_defect(recipe, model, path)
    if defect is None:
        assert not found, f"{name}-{model}-{path}: a correct site fails its own recipe's declaration: {found}"
    else:  # the library's known defect shows here too, as what it is
        assert found and all("shared across axis 0" in f for f in found), found


# -- the diagnosis names another rule of the same width ----------------------------------------------------

def _int8_aqt_rows(x):
    """AQT's default int8 (absmax / 127.5, round half to even, clip ±127), one scale per row: qcheck's int8_aqt."""
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    scale = jnp.where(amax == 0, 1.0, amax) / 127.5
    codes = jnp.clip(jnp.round(x * jax.lax.reciprocal(scale)), -127, 127).astype(jnp.int8)
    return codes.astype(jnp.float32) * scale


@pytest.mark.parametrize("declared, other", [("int8", "int8_aqt"), ("int8_aqt", None)])
def test_codes_of_another_int8_rule_are_named_should_fail(declared, other):
    fn = lambda x: _int8_aqt_rows(x) @ W  # noqa: E731 - activations only: the weights stay float
    if other is None:  # the control: declared as what it computes, it holds bitwise
        (r,) = qcheck.assert_quantized(fn, X, declared={"activations": declared})
        assert r.lhs_hold.bitwise
        return
    _assert_fails(fn, X, declared={"activations": declared},
                  match=rf"codes are not {declared}'s: .*; they are {other}'s codes: another rule of the same kind "
                        rf"and width")


# -- a reader's stored codes: weights a library keeps only as codes (Keras's quantize("int8")) ---------------

def _stored_int8(x, codes, scale):
    """Keras's int8 call in small: the input quantized in the call by int8_keras, the kernel given as stored codes."""
    q = formats.quantize(x, "int8_keras", axis=-1)
    return (q.codes.astype(jnp.int32) @ codes.astype(jnp.int32)).astype(jnp.float32) / (q.scales["slice"] * scale)


def test_stored_weights_a_reader_declares_are_held_by_type_accepted_with_its_reason_should_pass():
    """A reader that says the library stores a role's codes (Declaration.stored) accepts their hold by type, with
    its reason; the activations are still held bitwise."""
    from qcheck.libraries import Declaration, RoleFormat

    kernel = formats.quantize(W, "int8_keras", axis=0)
    decl = Declaration({"weights": RoleFormat("int8_keras"), "activations": RoleFormat("int8_keras")}, "a reader",
                       stored={"weights": "stored as codes"})
    codes, scale = qcheck.weights(kernel.codes), qcheck.weights(kernel.scales["slice"])
    (site,) = qcheck.assert_quantized(_stored_int8, X, codes, scale, declared=decl)
    assert site.lhs_hold.bitwise and (site.rhs_hold.strength, site.rhs_hold.accepted_by) == ("type", "stored as codes")


def test_stored_weights_declared_by_hand_fail_held_by_type_only():
    """The should-fail twin: the same declaration by hand (no stored role) fails, saying the kernel's codes are held
    by their type only."""
    kernel = formats.quantize(W, "int8_keras", axis=0)
    with pytest.raises(AssertionError, match=r"rhs \(weight\) held by its type only, not bitwise as int8_keras fixes "
                                             r"its bits: its codes do not trace back to a quantizer"):
        qcheck.assert_quantized(_stored_int8, X, qcheck.weights(kernel.codes), qcheck.weights(kernel.scales["slice"]),
                                declared={"weights": "int8_keras", "activations": "int8_keras"})


# -- int4 and int8 codes told apart: each declared as the other names the format its codes are ----------------

def _keras_absmax(x, top, dtype):
    """Keras's abs_max_quantize in the call (quantizers.py:111-119): an encode scale top / (absmax + 1e-7), codes
    clipped to [-top - (top == 7), top] and cast to ``dtype``; int4 values (-8..7) held in int8, as Keras's
    AbsMaxQuantizer(value_range=(-8, 7), output_dtype="int8") leaves them, or int8 codes."""
    scale = top / (jnp.max(jnp.abs(x), axis=-1, keepdims=True) + 1e-7)
    codes = jnp.clip(jnp.round(x * scale), -8 if top == 7 else -top, top).astype(dtype)
    return codes.astype(jnp.float32) / scale


@pytest.mark.parametrize("top, dtype, declared, named", [
    (7, jnp.int8, "int8_keras", r"codes are not int8_keras's: .*; they are int4_keras's codes: another rule of "
                                r"the same kind, int4 codes"),
    (7, jnp.int4, "int8_keras", r"is cast to int4; declared int8_keras, whose codes and scales are int8; they are "
                                r"the codes of int4_keras"),
    (127, jnp.int8, "int4_keras", r"is cast to int8; declared int4_keras, whose codes and scales are int4; they are "
                                  r"the codes of int8, int8_keras"),
], ids=["int4-values-in-int8", "int4-declared-int8", "int8-declared-int4"])
def test_int4_and_int8_codes_declared_as_each_other_fail_naming_the_format_they_are(top, dtype, declared, named):
    """The should-fail half: int4 codes (in int8 or int4) declared int8_keras, and int8 codes declared int4_keras,
    each fail at the site naming the format the codes are."""
    with pytest.raises(AssertionError, match=named):
        qcheck.assert_quantized(lambda x: _keras_absmax(x, top, dtype) @ W, X,
                                declared={"activations": declared, "weights": None})


@pytest.mark.parametrize("top, dtype, declared", [(7, jnp.int4, "int4_keras"), (127, jnp.int8, "int8_keras")])
def test_int4_and_int8_codes_declared_as_they_are_pass_bitwise_should_pass(top, dtype, declared):
    (site,) = qcheck.assert_quantized(lambda x: _keras_absmax(x, top, dtype) @ W, X,
                                      declared={"activations": declared, "weights": None})
    assert site.lhs_hold.bitwise, site.lhs_hold


def _qwix_rule_by_hand(bound: float):
    """qwix's int8 written by hand (absmax / bound per row, round half to even, a saturating cast to -128..127),
    on both operands: with bound 127.5 it is qwix's rule, with 127 a true division by qcheck's int8 bound."""
    def quantize(v):
        scale = jnp.max(jnp.abs(v), axis=-1, keepdims=True) / bound
        return jnp.clip(jnp.round(v / scale), -128, 127).astype(jnp.int8), scale

    def matmul(x, w):
        (cx, sx), (cw, sw) = quantize(x), quantize(w.T)
        return (cx.astype(jnp.float32) * sx) @ (cw.astype(jnp.float32) * sw).T

    return matmul


_QWIX_OPERANDS = (np.random.default_rng(11).standard_normal((16, 64)).astype(np.float32),
                  np.random.default_rng(12).standard_normal((64, 8)).astype(np.float32))


def test_qwix_rule_by_hand_held_to_int8_qwix_in_the_form_xla_computes_should_pass():
    # jax 0.10.2 to 0.12.0.1 compute both divisions by the reciprocal, 0.12.1 keeps x / scale a division: either
    # is one admissible form, held over the whole tensor.
    from qcheck.suite._toolchain import division_form

    records = qcheck.assert_quantized(_qwix_rule_by_hand(127.5), *_QWIX_OPERANDS, declared="int8_qwix")
    assert all(r.lhs_hold.bitwise and r.rhs_hold.bitwise for r in records)
    # The hold names the form it found, the one this toolchain computes (qcheck --version).
    assert {str(h) for r in records for h in (r.lhs_hold, r.rhs_hold)} == {f"bitwise (its divisions {division_form()})"}


def test_a_true_division_by_127_declared_int8_qwix_should_fail():
    # A real rule change fails in every form: absmax / 127 where qwix's rule takes 127.5.
    with pytest.raises(AssertionError, match=r"codes are not int8_qwix's: \d+ of \d+ codes differ from the "
                                             r"referee's; .*they are int8's codes: another rule of the same kind"):
        qcheck.assert_quantized(_qwix_rule_by_hand(127.0), *_QWIX_OPERANDS, declared="int8_qwix")


# -- format parameters: int4_keras_grouped's group size -----------------------------------------------------------

def test_a_block_size_is_a_parameter_of_the_grouped_format_only_bad_input():
    """``block`` is int4_keras_grouped's parameter (its record's ``parameters``): declared on another format, or
    given the referee for one, it is a one-line ValueError naming it; a non-positive block likewise."""
    assert formats.get_format("int4_keras_grouped").parameters == ("block",)
    x = np.ones((4, 8), np.float32)
    for spec, match in (({"format": "int8", "block": 64}, r"weights: block is no parameter of format 'int8'"),
                        ({"format": "int4_keras_grouped", "block": 0}, r"weights: block must be a positive int")):
        with pytest.raises(ValueError, match=match) as e:
            qcheck.assert_quantized(lambda v: v @ v.T, x, declared={"weights": spec, "activations": None})
        assert "\n" not in str(e.value), e.value
    with pytest.raises(ValueError, match=r"^block: format 'int8' takes no block size"):
        qcheck.referees.reference_quantize(x, "int8", axis=0, block=64)


def test_the_grouped_referee_at_another_block_groups_by_it_should_pass():
    """The referee at block 64 is the rule with groups of 64: on 256 inputs, four scales per column, where the
    default's (128) two; at 256 inputs the two group sizes part on codes (the control: block 128 is the default)."""
    w = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    c64, s64 = qcheck.referees.reference_quantize(w, "int4_keras_grouped", axis=0, block=64)
    c128, s128 = qcheck.referees.reference_quantize(w, "int4_keras_grouped", axis=0)
    again, _ = qcheck.referees.reference_quantize(w, "int4_keras_grouped", axis=0, block=128)
    assert s64["block"].shape == (4, 4) and s128["block"].shape == (4, 2)
    assert np.array_equal(c128.astype(np.int8), again.astype(np.int8))
    assert not np.array_equal(c64.astype(np.int8), c128.astype(np.int8))
