"""Adapters: the libraries people ship (Flax fp8, AQT v2) run through qcheck's checks as recipes.

Facts these tests pin were measured with jax 0.10.2 / flax 0.12.8 (Python 3.11) and
jax 0.12.0.1 / flax 0.12.12 (Python 3.12), aqtp 0.9.0, ml_dtypes 0.6.0, CPU.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qcheck
from qcheck import checks
from qcheck.layers import step
from qcheck.adapters import flax_fp8, flax_fp8_recipe, flax_nanoo_fp8, ragged_dot_from_einsum
from qcheck.checks import assert_amax_histories_follow_operands, assert_ragged_groups_independent
from qcheck.layers.bridge import QuantSite
from qcheck.suite import cases, invariants
from tests.helpers import QWIX_WARNS, import_extra, requires_extra

BATCH, SEQ = 2, 8

RECIPES = {
    "flax_fp8": flax_fp8,
    "flax_nanoo_fp8": flax_nanoo_fp8,
    "flax_direct_fp8": lambda: flax_fp8_recipe(
        "flax_direct_fp8", nn.Fp8DirectDotGeneralOp, e4m3_dtype=jnp.float8_e4m3fn, e5m2_dtype=jnp.float8_e5m2),
    # The NANOO flavour asked of Fp8Einsum / Fp8DirectDotGeneralOp, which cast to e4m3fn regardless.
    "flax_einsum_fnuz": lambda: flax_fp8_recipe(
        "flax_einsum_fnuz", nn.Fp8Einsum, e4m3_dtype=jnp.float8_e4m3fnuz, e5m2_dtype=jnp.float8_e5m2fnuz),
    "flax_direct_fnuz": lambda: flax_fp8_recipe(
        "flax_direct_fnuz", nn.Fp8DirectDotGeneralOp, e4m3_dtype=jnp.float8_e4m3fnuz,
        e5m2_dtype=jnp.float8_e5m2fnuz),
}


@functools.cache
def _recipe(name: str):
    return RECIPES[name]()


@functools.cache
def _layer(recipe: str, path: str):
    return qcheck.build_moe("mixtral", _recipe(recipe), path=path)


@functools.cache
def _input() -> np.ndarray:
    emb = qcheck.MODELS["mixtral"].emb
    return np.random.default_rng(0).standard_normal((BATCH, SEQ, emb)).astype(np.float32)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, x):
    return nnx.merge(graphdef, state, copy=True)(x)


def _output(layer) -> np.ndarray:
    # Jitted, as a train step runs it; the graph definition must hash for that.
    graphdef, state = nnx.split(layer)
    return np.asarray(_apply(graphdef, state, _input()))


@functools.cache
def _reference_output(path: str) -> np.ndarray:
    return _output(qcheck.build_moe("mixtral", "none", path=path))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _site_einsum(graphdef, eqn, state, lhs, rhs):
    return nnx.merge(graphdef, state, copy=True)(eqn, lhs, rhs)


@functools.partial(jax.jit, static_argnums=0)
def _site_ragged_dot(graphdef, state, lhs, rhs, group_sizes):
    return nnx.merge(graphdef, state, copy=True).ragged_dot(lhs, rhs, group_sizes)


def _group_sizes(rows: int, groups: int, seed: int) -> np.ndarray:
    # Uneven, with the last group empty.
    rng = np.random.default_rng(seed)
    return np.bincount(rng.integers(0, groups - 1, rows), minlength=groups).astype(np.int32)


def _assert_sites_cast_exact(layer, cast_dtype) -> None:
    for i, (name, spec) in enumerate(layer.site_specs(BATCH, SEQ).items()):
        lhs, rhs = checks.probe_operands(i, spec.lhs_shape, spec.rhs_shape)
        graphdef, state = nnx.split(layer.get_einsum(name))
        matmul = spec.matmul if isinstance(spec.matmul, checks.Einsum) else checks.Ragged(
            _group_sizes(lhs.shape[0], rhs.shape[0], i))
        if isinstance(matmul, checks.Einsum):
            def op(eqn, a, b):
                return _site_einsum(graphdef, eqn, state, a, b)
        else:
            def op(a, b, gs):
                return _site_ragged_dot(graphdef, state, a, b, gs)
        try:
            checks.assert_fresh_cast_exact(op, matmul, lhs, rhs, cast_dtype=cast_dtype)
        except AssertionError as e:
            raise AssertionError(f"site {name!r}: {e}") from e


# -- the grouped matmul built from an einsum ------------------------------------


def test_ragged_dot_from_einsum_equals_lax_ragged_dot_bitwise():
    lhs, rhs = checks.probe_operands(0, (24, 32), (4, 32, 8))
    for sizes in ([6, 10, 8, 0], [0, 24, 0, 0], [5, 5, 5, 0]):  # the last leaves 9 rows past the end
        gs = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(ragged_dot_from_einsum(jnp.einsum, jnp.asarray(lhs), jnp.asarray(rhs), gs))
        want = np.asarray(jax.lax.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), gs))
        assert got.tobytes() == want.tobytes(), sizes


def test_ragged_dot_from_einsum_gradients_sum_in_another_order_than_lax_ragged_dot():
    """Why the backward invariant leaves the Flax recipes' sparse path out (Expect.backward_paths).

    Unquantized, the emulation's forward equals jax.lax.ragged_dot bitwise but its
    gradients do not (summation order, jax 0.10.2 and 0.12.0.1 on CPU): the input
    gradient on some CPUs, the weight gradient on others, which kernel XLA picks.
    When both agree, the Flax recipes can drop their backward_paths override.
    """
    lhs, rhs = checks.probe_operands(0, (64, 32), (4, 32, 16))
    gs = jnp.asarray([20, 30, 14, 0], jnp.int32)
    ct = np.random.default_rng(3).standard_normal((64, 16)).astype(np.float32)

    def vjp(f):
        return jax.jit(lambda a, b, c: jax.vjp(lambda a, b: f(a, b, gs), a, b)[1](c))(lhs, rhs, ct)

    want = vjp(jax.lax.ragged_dot)
    got = vjp(functools.partial(ragged_dot_from_einsum, jnp.einsum))
    assert any(np.asarray(a).tobytes() != np.asarray(b).tobytes() for a, b in zip(got, want))
    # Rounding only: float32 sums of the same products in another order.
    assert all(checks.rel_norm(np.asarray(a), np.asarray(b)) < 1e-6 for a, b in zip(got, want))


@pytest.mark.parametrize(
    "recipe, paths",
    [("flax_fp8", ("dense",)), ("flax_nanoo_fp8", ("dense",)), ("aqt_int8", ()), ("qwix_int8", ("dense",)),
     ("fp8", ("dense", "sparse"))],
)
def test_backward_invariant_applies_on_the_declared_paths(recipe, paths):
    if recipe == "aqt_int8":
        _aqt()
    if recipe == "qwix_int8":
        _qwix()
    from qcheck.suite import invariants
    from qcheck.suite.cases import VARIANTS

    (backward,) = (inv for inv in invariants.INVARIANTS if inv.name == "backward")
    r = qcheck.get_recipe(recipe)
    assert r.expect.backward_paths == paths
    assert {v.path for v in VARIANTS if backward.applies(r, v)} == set(paths)


# A caller's Expect gives bounds and targets; it does not switch on a backward reference the library lacks,
# nor drop a refusal. One test per library, so each runs where its extra is installed.
GIVEN = qcheck.Expect(max_rel_norm=0.3, fp8_target="mi300")


def test_flax_and_jax_limits_survive_a_callers_expect():
    from qcheck.adapters import JaxScaledDotRecipe

    flax = flax_fp8_recipe("f", nn.Fp8Einsum, e4m3_dtype=jnp.float8_e4m3fnuz, e5m2_dtype=jnp.float8_e5m2fnuz,
                           expect=GIVEN)
    assert (flax.expect.max_rel_norm, flax.expect.fp8_target, flax.expect.backward_paths) == (0.3, "mi300", ("dense",))
    assert JaxScaledDotRecipe("j", "nvfp4", expect=GIVEN).expect.backward_paths == ()


def test_aqt_limits_survive_a_callers_expect():
    aqt = _aqt()
    ragged = aqt.aqt_recipe("a", ragged="aqt", lhs="int8_aqt", rhs="int8_aqt", expect=GIVEN)
    assert (ragged.expect.backward_paths, ragged.expect.unsupported, ragged.expect.known_defects[0]) == (
        (), (aqt.AQT_RAGGED_NO_GRADIENT,), aqt.AQT_RAGGED_SHARED_SCALE)
    # The same shared scale, as the coverage map holding the codes to int8_aqt sees it.
    assert [d.invariant for d in ragged.expect.known_defects] == ["exact", "coverage"]


def test_qwix_limits_survive_a_callers_expect():
    qwix = _qwix()
    from qcheck.adapters import QwixRecipe

    rule = dict(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8)
    assert QwixRecipe("q", [qwix.QtRule(**rule)], expect=GIVEN).expect.backward_paths == ("dense",)
    assert QwixRecipe("q", [qwix.QtRule(**rule, bwd_qtype=jnp.int8)], expect=GIVEN).expect.backward_paths == ()


#: The jax releases whose CPU kernels sum Flax's sparse backward in another order than the reference (measured);
#: jax 0.12.1 sums it as the reference does, bitwise.
FLAX_SPARSE_BACKWARD_ROUNDS_APART = ("0.9.2", "0.10.2", "0.11.2", "0.12.0.1")


def test_flax_sparse_backward_misses_the_exact_reference_by_rounding():
    from qcheck.suite import invariants

    if jax.__version__ not in FLAX_SPARSE_BACKWARD_ROUNDS_APART:
        invariants.assert_sites_backward_exact(_layer("flax_fp8", "sparse"), _recipe("flax_fp8"), label="flax_fp8")
        return
    # dgrad or wgrad, as the CPU's kernels order the sums (test_ragged_dot_from_einsum_gradients_sum_...)
    with pytest.raises(AssertionError, match=r"site 'wi_0' [dw]grad \(g in float8_e5m2\): differs from the "
                                             r"reference .*it matches none of the known bugs"):
        invariants.assert_sites_backward_exact(_layer("flax_fp8", "sparse"), _recipe("flax_fp8"),
                                               label="flax_fp8-sparse")


def test_aqt_backward_has_no_reference():
    """aqt_int8 declares its forward formats (int8_aqt), not its gradients: config_v4 quantizes dlhs with its own
    stochastic rounding, which the straight-through reference does not model, so backward_paths is ()."""
    from qcheck.suite import invariants

    with pytest.raises(AssertionError, match=r"aqt_int8: assert_sites_backward_exact: site 'wi_0' dgrad "
                                             r"\(g unquantized \(straight through\)\): differs from the reference at "
                                             r"2048 of 2048 elements.*matches none of the known bugs"):
        invariants.assert_sites_backward_exact(_aqt_layer("einsum", "dense"), _aqt_recipe("einsum"), label="aqt_int8")


@pytest.mark.parametrize(
    "recipe, paths",
    [("flax_fp8", ("dense", "sparse")), ("aqt_int8", ("dense", "sparse")), ("aqt_int8_ragged", ()),
     ("qwix_int8", ("dense", "sparse"))],
)
def test_grads_invariant_trains_library_recipes_wherever_their_library_has_gradients(recipe, paths):
    """Without an exact reference for a library's gradients, `grads` still holds them to the none twin's;
    only AQT's ragged_dot, which has no backward pass (a declared cell), does not train."""
    if extra := {"aqt_int8": "aqt", "aqt_int8_ragged": "aqt", "qwix_int8": "qwix"}.get(recipe):
        import_extra(extra)
    from qcheck.suite.cases import VARIANTS

    (grads,) = (inv for inv in invariants.INVARIANTS if inv.name == "grads")
    r = qcheck.get_recipe(recipe)
    assert {v.path for v in VARIANTS if grads.applies(r, v) and v.path in r.expect.paths} == set(paths)


def _aqt_grads(recipe) -> dict[str, np.ndarray]:
    return invariants.grad_leaves(step.train_step(qcheck.build_moe("mixtral", recipe, path="dense", seed=cases.SEED),
                                                          cases.layer_input("mixtral")).grads)


def _none_grads() -> dict[str, np.ndarray]:
    return invariants.grad_leaves(cases.layer_step(cases.Case("none", cases.Variant("mixtral", "dense", False))).grads)


def test_aqt_gradients_track_unquantized_should_pass():
    figure = invariants.assert_grads_track(_aqt_grads(_aqt_recipe("einsum")), _none_grads(), max_grad_rel_norm=0.3,
                                           distinct=False, label="aqt_int8")
    assert 0 < figure < 0.05


def test_aqt_two_bit_gradients_fail_grads():
    """A config whose gradient matmuls quantize to 2 bits (config_v4(dlhs_bits=2, drhs_bits=2)): its forward is
    aqt_int8's, so tracks and exact pass, and AQT's stochastic gradient rounding has no exact reference; the
    gradient bound catches it (wi_0 0.76 from the twin, aqtp 0.9.0, jax 0.10.2)."""
    _aqt()
    from aqt.jax.v2 import config

    two_bit = _aqt().aqt_recipe("aqt_2bit_grads", functools.partial(config.config_v4, dlhs_bits=2, drhs_bits=2))
    with pytest.raises(AssertionError, match=r"^aqt_2bit_grads: assert_grads_track: gradient of wi_0 \(float32\) "
                                             r"is 0\.[5-9]\d* from the none twin's \(relative norm; bound 0\.3\)"):
        invariants.assert_grads_track(_aqt_grads(two_bit), _none_grads(), max_grad_rel_norm=0.3, distinct=False,
                                      label="aqt_2bit_grads")


def test_ragged_dot_from_einsum_rejects_wrong_ranks():
    with pytest.raises(ValueError, match=r"expects lhs \[m, k\], rhs \[g, k, n\]"):
        ragged_dot_from_einsum(jnp.einsum, jnp.ones((4, 3)), jnp.ones((3, 2)), jnp.ones((1,), jnp.int32))


# -- Flax: the exact check, and the flavour defect --------------------------------


@pytest.mark.parametrize("path", ["dense", "sparse"])
@pytest.mark.parametrize("recipe", ["flax_fp8", "flax_nanoo_fp8", "flax_direct_fp8"])
def test_flax_recipe_sites_cast_exact_should_pass(recipe, path):
    _assert_sites_cast_exact(_layer(recipe, path), _recipe(recipe).reference.cast_dtype)


@pytest.mark.parametrize("path", ["dense", "sparse"])
@pytest.mark.parametrize("recipe", ["flax_einsum_fnuz", "flax_direct_fnuz"])
def test_flax_fnuz_request_fails_exact_check_wrong_flavour(recipe, path):
    """Flax's Fp8Einsum and Fp8DirectDotGeneralOp ignore e4m3_dtype/e5m2_dtype.

    ``fp8_scaled_dot_general`` hard-codes float8_e4m3fn (forward) and float8_e5m2
    (``quantized_dot_bwd``); checked in flax 0.12.8 (jax 0.10.2) and flax 0.12.12
    (jax 0.12.0.1). Asked for fnuz, the result is the e4m3fn one, bitwise.
    When Flax fixes it, this test fails and the recipe's check passes.
    """
    assert _recipe(recipe).reference.cast_dtype == np.dtype(jnp.float8_e4m3fnuz)
    with pytest.raises(AssertionError, match=r"float8_e4m3fnuz-cast reference .* equals the "
                                             r"float8_e4m3fn-cast reference bitwise \(wrong fp8 flavour\)"):
        _assert_sites_cast_exact(_layer(recipe, path), _recipe(recipe).reference.cast_dtype)


@pytest.mark.parametrize(
    "recipe, path, max_rel_norm",
    [
        ("flax_fp8", "dense", 0.22),
        ("flax_fp8", "sparse", 0.22),
        ("flax_nanoo_fp8", "dense", 0.22),
        ("flax_nanoo_fp8", "sparse", 0.22),
    ],
)
def test_flax_recipe_tracks_unquantized_should_pass(recipe, path, max_rel_norm):
    out = _output(_layer(recipe, path))
    assert checks.assert_tracks(out, _reference_output(path), max_rel_norm=max_rel_norm) > 0


def _fp8_cast_dtypes_of_a_grad(recipe) -> dict[str, set[str]]:
    """The fp8 types each operand of every matmul of one grad of ``tm,mh->th`` is cast to, per qcheck.coverage.

    Forward: the one matmul's lhs and rhs. Backward: the two matmuls whose lhs is the output gradient.
    """
    graphdef, state = nnx.split(QuantSite(recipe, "wi_0", rngs=nnx.Rngs(0)))
    x, w = checks.probe_operands(2, (8, 16), (16, 4))

    def grad(x, w):  # the value too: a forward matmul whose result nothing uses is no site of the program
        return jax.value_and_grad(lambda x, w: jnp.sum(nnx.merge(graphdef, state, copy=True)("tm,mh->th", x, w)),
                                  argnums=(0, 1))(x, w)

    records = qcheck.coverage(grad, x, w)
    assert len(records) == 3 and all(r.quantized for r in records), qcheck.format_coverage(records)
    forward = [r for r in records if r.lhs_shape == (8, 16)]
    backward = [r for r in records if r.lhs_shape == (8, 4)]
    return {"forward": {q.dtype for r in forward for q in (r.lhs, r.rhs)},
            "gradient": {r.lhs.dtype for r in backward}}


def test_flax_nanoo_casts_to_the_fnuz_flavours_forward_and_backward_should_pass():
    assert _fp8_cast_dtypes_of_a_grad(_recipe("flax_nanoo_fp8")) == {
        "forward": {"float8_e4m3fnuz"}, "gradient": {"float8_e5m2fnuz"}}


def test_flax_fp8einsum_casts_gradients_to_e5m2_when_asked_for_e5m2fnuz():
    """Fp8Einsum(e5m2_dtype=float8_e5m2fnuz): quantized_dot_bwd hard-codes float8_e5m2 (flax 0.12.8, 0.12.12).

    e5m2 and e5m2fnuz round normal numbers alike, so on CPU (which flushes
    subnormals) no bitwise gradient shows it; qcheck.coverage reads the cast types.
    """
    got = _fp8_cast_dtypes_of_a_grad(_recipe("flax_einsum_fnuz"))
    assert got == {"forward": {"float8_e4m3fn"}, "gradient": {"float8_e5m2"}}, got


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_flax_fp8einsum_for_mi300_casts_to_nvidia_types_forward_and_backward(path):
    """Fp8Einsum(e4m3_dtype=e4m3fnuz, e5m2_dtype=e5m2fnuz) for MI300 multiplies e4m3fn forward, e5m2 backward.

    flax 0.12.8 and 0.12.12: fp8_scaled_dot_general hard-codes float8_e4m3fn and
    quantized_dot_bwd float8_e5m2, neither of which MI300 multiplies. The check
    reads the casts from a traced forward and backward pass against the target.
    """
    recipe = flax_fp8_recipe("flax_einsum_mi300", nn.Fp8Einsum, e4m3_dtype=jnp.float8_e4m3fnuz,
                             e5m2_dtype=jnp.float8_e5m2fnuz, expect=qcheck.Expect(fp8_target="mi300"))
    checks.assert_recipe_fp8_native(recipe)  # the declaration is right: only the program is not
    layer = qcheck.build_moe("mixtral", recipe, path=path)
    with pytest.raises(AssertionError, match=r"^assert_fp8_dtypes_native: \d+ operand casts to fp8 types not native "
                       r"to target 'mi300' \(native fp8: float8_e4m3fnuz, float8_e5m2fnuz\):\n  forward: ") as info:
        checks.assert_fp8_dtypes_native(layer, _input(), target="mi300")
    found = {(line.split(":", 1)[0].strip(), line.rsplit(" cast to ", 1)[1])
             for line in str(info.value).splitlines()[1:]}
    assert found == {("forward", "float8_e4m3fn"), ("backward", "float8_e4m3fn"), ("backward", "float8_e5m2")}


def _amax_operands() -> tuple[np.ndarray, np.ndarray]:
    """``BSEH`` activations of amax 3 and ``EHM`` weights of amax 100."""
    rng = np.random.default_rng(0)
    act = rng.uniform(-3, 3, (2, 3, 4, 8)).astype(np.float32)
    act.flat[0] = 3.0
    weight = rng.uniform(-100, 100, (4, 8, 5)).astype(np.float32)
    weight.flat[0] = 100.0
    return act, weight


def _fp8_site(recipe) -> QuantSite:
    return QuantSite(recipe, "wo", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("recipe", ["fp8", "nanoo_fp8"])
def test_amax_histories_follow_operands_should_pass(recipe):
    act, weight = _amax_operands()
    got = assert_amax_histories_follow_operands(_fp8_site(qcheck.get_recipe(recipe)), "BSEH,EHM->BSEM", act, weight)
    assert sorted(got.values()) == [3.0, 100.0]


def test_flax_fp8einsum_amax_on_an_unswapped_einsum_should_pass():
    # Control: for ab,bc->ac jnp.einsum keeps the operand order, and Flax files both right.
    act, weight = _amax_operands()
    assert_amax_histories_follow_operands(_fp8_site(_recipe("flax_fp8")), "ab,bc->ac", act.reshape(6, 32),
                                          weight.reshape(32, 5))


def test_flax_fp8einsum_files_amax_under_the_other_operand():
    """Flax's Fp8Einsum binds its state positionally inside jnp.einsum's dot_general.

    For ``BSEH,EHM->BSEM`` jnp.einsum calls it as dot_general(weight, activation), so
    input_amax_history records the weight's amax 100 (flax 0.12.8 / jax 0.10.2 and
    flax 0.12.12 / jax 0.12.0.1). When Flax fixes it, this test fails.
    """
    act, weight = _amax_operands()
    with pytest.raises(AssertionError, match=r"input_amax_history holds 100 .*the lhs amax is 3; that is the "
                                             r"rhs's amax: fp8 state filed under the other operand"):
        assert_amax_histories_follow_operands(_fp8_site(_recipe("flax_fp8")), "BSEH,EHM->BSEM", act, weight,
                                              label="flax_fp8 site 'wo'")


@pytest.mark.parametrize(
    "site, lhs, rhs, match",
    [
        ("fp8", np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), r"both have amax 1.0"),
        ("int8", np.ones((2, 3), np.float32), 2 * np.ones((3, 4), np.float32), r"has no fp8 amax histories"),
    ],
)
def test_amax_histories_follow_operands_refuses_what_cannot_fail(site, lhs, rhs, match):
    with pytest.raises(ValueError, match=match):
        assert_amax_histories_follow_operands(_fp8_site(qcheck.get_recipe(site)), "ab,bc->ac", lhs, rhs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(module_cls=nn.Dense), TypeError, r"module_cls must be a flax.linen fp8 module class .*Fp8Einsum"),
        (dict(module_cls=nn.Fp8Einsum, e4m3_dtype=jnp.float8_e5m2), ValueError,
         r"e4m3_dtype must be one of float8_e4m3fn, float8_e4m3fnuz"),
        (dict(module_cls=nn.Fp8Einsum, e5m2_dtype=jnp.float32), ValueError,
         r"e5m2_dtype must be one of float8_e5m2, float8_e5m2fnuz"),
        (dict(module_cls=nn.Fp8Einsum, amax_history_length=0), ValueError,
         r"amax_history_length must be a positive int"),
    ],
)
def test_flax_fp8_recipe_bad_input(kwargs, error, match):
    args = dict(e4m3_dtype=jnp.float8_e4m3fn, e5m2_dtype=jnp.float8_e5m2) | kwargs
    with pytest.raises(error, match=match):
        flax_fp8_recipe("bad", **args)


# -- AQT v2 ----------------------------------------------------------------------

# aqtp 0.9.0 passes arrays to jnp.promote_types (aqt_dot_general.py:823), which jax
# 0.10 deprecates. Jitted, AQT never warns (the operands are tracers); an eager call
# warns, which the repository's "error" filter turns into a DeprecationWarning raised
# (measured on jax 0.10.2 without any qcheck hook). The one eager test allows it.
aqt_warns = pytest.mark.filterwarnings(
    "ignore:Implicit conversion of an array to a dtype is deprecated:DeprecationWarning")


def _aqt():
    """qcheck.adapters, or a skip naming the aqt extra."""
    import_extra("aqt")
    from qcheck import adapters

    return adapters


@functools.cache
def _aqt_recipe(kind: str):
    aqt = _aqt()
    from aqt.jax.v2 import config

    if kind == "off":  # AQT with quantization switched off: a silent fallback
        return aqt.aqt_recipe("aqt_off", lambda: config.config_v4(fwd_bits=None, dlhs_bits=None))
    # "aqt": AQT's own ragged_dot on the sparse path; "einsum": the shipped aqt_int8 (AqtEinsum per row).
    return aqt.aqt_recipe("aqt_int8_ragged", ragged="aqt") if kind == "aqt" else aqt.aqt_int8()


@functools.cache
def _aqt_layer(kind: str, path: str):
    return qcheck.build_moe("mixtral", _aqt_recipe(kind), path=path)


@pytest.mark.parametrize(
    "kind, path, max_rel_norm",
    [("aqt", "dense", 0.05), ("aqt", "sparse", 0.05), ("einsum", "sparse", 0.05)],
)
def test_aqt_recipe_tracks_unquantized_should_pass(kind, path, max_rel_norm):
    out = _output(_aqt_layer(kind, path))
    assert checks.assert_tracks(out, _reference_output(path), max_rel_norm=max_rel_norm) > 0


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_aqt_quantization_off_fails_tracks_silent_fallback(path):
    out = _output(_aqt_layer("off", path))
    with pytest.raises(AssertionError, match=r"bitwise equal to the unquantized reference .*silent fallback"):
        checks.assert_tracks(out, _reference_output(path))


def test_aqt_ragged_dot_has_no_backward_pass():
    """aqt_ragged_dot.ragged_dot: "Currently only forward pass is supported" (aqtp 0.9.0).

    qcheck's train step (what the golden cases and the state invariant lower) fails
    while tracing the gradient; jax 0.10.2 and 0.12.0.1 alike.
    """
    layer = _aqt_layer("aqt", "sparse")
    with pytest.raises(IndexError, match="index 1 is out of bounds for axis 0 with size 1"):
        step.train_step(layer, _input())


def test_aqt_einsum_ragged_has_a_backward_pass_should_pass():
    grads = nnx.to_flat_state(step.train_step(_aqt_layer("einsum", "sparse"), _input()).grads)
    assert grads and all(np.all(np.isfinite(np.asarray(v.get_value()))) for _, v in grads)


def _ragged_site(recipe):
    graphdef, state = nnx.split(QuantSite(recipe, "wi_0", rngs=nnx.Rngs(0)))
    return lambda a, b, gs: _site_ragged_dot(graphdef, state, a, b, gs)


def _assert_experts_independent(recipe, label: str) -> int:
    lhs, rhs = checks.probe_operands(0, (12, 32), (3, 32, 8))
    return assert_ragged_groups_independent(_ragged_site(recipe), lhs, rhs, np.array([5, 7, 0], np.int32),
                                            label=label)


def test_aqt_ragged_dot_shares_one_weight_scale_across_experts():
    """AQT calibrates the ragged weight over [experts, contraction] (aqtp 0.9.0: "the same scale for all the
    experts"): expert 0's weights set expert 1's scale."""
    with pytest.raises(AssertionError, match=r"aqt ragged_dot: assert_ragged_groups_independent: scaling group 0's "
                                             r"weights by 1000 changed 7 of 7 rows of other groups .*one weight "
                                             r"scale shared across groups"):
        _assert_experts_independent(_aqt_recipe("aqt"), "aqt ragged_dot")


@pytest.mark.parametrize("recipe", ["aqt_einsum", "int8", "mxfp8"])
def test_ragged_groups_independent_should_pass(recipe):
    r = _aqt_recipe("einsum") if recipe == "aqt_einsum" else qcheck.get_recipe(recipe)
    assert _assert_experts_independent(r, recipe) == 7


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(group_sizes=np.array([0, 12, 0], np.int32)), r"leave group 0 or every other group empty"),
        (dict(group_sizes=np.array([12, 0, 0], np.int32)), r"leave group 0 or every other group empty"),
        (dict(group=3), r"group must lie in \[0, 3\), got 3"),
        (dict(factor=1.0), r"factor must be finite and not 1"),
        (dict(group_sizes=np.array([5, 9, 0], np.int32)), r"sum to 14, more than lhs's 12 rows"),
        (dict(rhs=np.ones((32, 8), np.float32)), r"expects lhs \[m, k\], rhs \[g, k, n\]"),
    ],
)
def test_ragged_groups_independent_bad_input(kwargs, match):
    lhs, rhs = checks.probe_operands(0, (12, 32), (3, 32, 8))
    args = dict(lhs=lhs, rhs=rhs, group_sizes=np.array([5, 7, 0], np.int32)) | kwargs
    with pytest.raises(ValueError, match=match):
        assert_ragged_groups_independent(jax.lax.ragged_dot, **args)


@aqt_warns
def test_aqt_default_ragged_config_is_one_mutated_object_and_sites_leave_theirs_alone():
    """AQT's ragged_dot default cfg is built once at import; each call writes its group sizes into it.

    aqtp 0.9.0. qcheck's sites give every call a config of their own.
    """
    aqt = _aqt()
    from aqt.jax.v2 import aqt_ragged_dot, config

    default = inspect.signature(aqt_ragged_dot.ragged_dot).parameters["cfg"].default
    aqt_ragged_dot.ragged_dot(jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 2], jnp.int32))
    assert isinstance(default.fwd.dot_general, aqt_ragged_dot.RaggedDot)
    made = []

    def factory():
        made.append(config.config_v4())
        return made[-1]

    site = QuantSite(aqt.aqt_recipe("aqt_counted", factory), "wi_0", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(site)
    lhs, rhs = checks.probe_operands(0, (12, 32), (3, 32, 8))
    _site_ragged_dot(graphdef, state, lhs, rhs, np.array([5, 7, 0], np.int32))
    # A config per call, each mutated once; AQT's default is not among them.
    assert made and all(cfg is not default for cfg in made)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(ragged="dense"), ValueError, r"ragged.*'dense'.*aqt.*einsum"),
        (dict(config_factory=42), TypeError, r"config_factory must be a callable"),
        (dict(config_factory=dict), TypeError, r"config_factory must return an aqt.jax.v2 DotGeneral config"),
    ],
)
def test_aqt_recipe_bad_input(kwargs, error, match):
    aqt = _aqt()
    with pytest.raises(error, match=match):
        aqt.aqt_recipe("bad", **kwargs)


def test_aqt_adapter_without_aqtp_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "qcheck.adapters._aqt", raising=False)
    monkeypatch.setitem(sys.modules, "aqt.jax.v2", None)
    with pytest.raises(ImportError, match=r"pip install 'qcheck\[aqt\]'"):
        importlib.import_module("qcheck.adapters._aqt")


def test_installed_recipes_include_aqt_when_aqtp_is_installed():
    _aqt()
    from qcheck.adapters import installed_recipes

    want = ["flax_fp8", "flax_nanoo_fp8", *_JAX_RECIPES(), "aqt_int8", "aqt_int8_ragged"]
    assert [r.name for r in installed_recipes()][:len(want)] == want


def test_installed_recipes_include_qwix_int8_when_qwix_is_installed():
    import_extra("qwix")
    from qcheck.adapters import installed_recipes

    assert [r.name for r in installed_recipes()][-1] == "qwix_int8"


def test_installed_recipes_leave_out_a_missing_library(monkeypatch):
    import qcheck.adapters as adapters

    monkeypatch.setattr(adapters, "_has", lambda module: False)
    assert [r.name for r in adapters.installed_recipes()] == ["flax_fp8", "flax_nanoo_fp8", *_JAX_RECIPES()]


def _JAX_RECIPES() -> list[str]:
    from qcheck.adapters import scaled_dot_general_runs

    return ["jax_mxfp8", "jax_nvfp4"] if scaled_dot_general_runs() else []


def test_installed_recipes_offer_jax_scaled_dot_only_where_it_lowers(monkeypatch):
    # jax 0.10.2 has no CPU lowering for scaled_matmul: there the recipes would fail every cell.
    import qcheck.adapters as adapters

    names = [r.name for r in adapters.installed_recipes()]
    assert ("jax_mxfp8" in names and "jax_nvfp4" in names) == adapters.scaled_dot_general_runs()
    monkeypatch.setattr(adapters, "scaled_dot_general_runs", lambda: False)
    assert not {"jax_mxfp8", "jax_nvfp4"} & {r.name for r in adapters.installed_recipes()}


# -- qwix ------------------------------------------------------------------------


def _qwix():
    return import_extra("qwix")


def _qwix_rule(**qtypes):
    qwix = _qwix()
    return qwix.QtProvider([qwix.QtRule(module_path=".*", **qtypes)])


class _Experts(nnx.Module):
    """A user's sparse experts: ragged_dot on its own weight, as qwix expects."""

    def __init__(self, w):
        self.w = nnx.Param(jnp.asarray(w))

    def __call__(self, x, group_sizes):
        return jax.lax.ragged_dot(x, self.w[...], group_sizes)


class _DenseExperts(nnx.Module):
    def __init__(self, w):
        self.w = nnx.Param(jnp.asarray(w))

    def __call__(self, x):
        return jnp.einsum("mk,gkn->mgn", x, self.w[...])


def _qwix_ragged_dot(a, b, gs):
    int8 = dict(weight_qtype=jnp.int8, act_qtype=jnp.int8)
    return _qwix().quantize_model(_Experts(b), _qwix_rule(**int8), a, gs)(a, gs)


def _qwix_dense_ragged_dot(a, b, gs):
    int8 = dict(weight_qtype=jnp.int8, act_qtype=jnp.int8)
    model = _qwix().quantize_model(_DenseExperts(b), _qwix_rule(**int8), a)
    return ragged_dot_from_einsum(lambda eqn, x, w: model(x), a, b, gs)


def _qwix_test(fn):
    """A test of qwix itself or of qcheck's qwix adapters: skipped, naming the extra, without qwix."""
    for mark in (requires_extra("qwix"), *QWIX_WARNS):
        fn = mark(fn)
    return fn


@_qwix_test
def test_qwix_ragged_dot_shares_one_weight_scale_across_experts():
    """qwix's ragged_dot quantizes the weight with channelwise_axes=[2] only (qwix/_src/core/ragged_dot_qt.py):
    one scale per output column across all experts (qwix 0.1.8)."""
    lhs, rhs = checks.probe_operands(0, (12, 32), (3, 32, 8))
    with pytest.raises(AssertionError, match=r"qwix ragged_dot: assert_ragged_groups_independent: scaling group 0's "
                                             r"weights by 1000 changed 7 of 7 rows .*one weight scale shared"):
        assert_ragged_groups_independent(_qwix_ragged_dot, lhs, rhs, np.array([5, 7, 0], np.int32),
                                         label="qwix ragged_dot")


@_qwix_test
def test_qwix_dense_einsum_scales_each_expert_should_pass():
    lhs, rhs = checks.probe_operands(0, (12, 32), (3, 32, 8))
    assert assert_ragged_groups_independent(_qwix_dense_ragged_dot, lhs, rhs, np.array([5, 7, 0], np.int32)) == 7


@_qwix_test
def test_qwix_ragged_dot_weight_only_rule_crashes():
    """A weight-only rule (act_qtype None) on ragged_dot: qwix 0.1.8 passes None on as the lhs qtype."""
    lhs, rhs = checks.probe_operands(0, (12, 32), (3, 32, 8))
    gs = jnp.asarray([5, 7, 0], jnp.int32)
    with pytest.raises(ValueError, match="Cannot use None as qtype"):
        _qwix().quantize_model(_Experts(rhs), _qwix_rule(weight_qtype=jnp.int8), lhs, gs)


class _OwnWeight(nnx.Module):
    def __init__(self, w):
        self.w = nnx.Param(jnp.asarray(w))

    def __call__(self, x):
        return jnp.einsum("tm,mh->th", x, self.w[...])


class _Child(nnx.Module):
    def __call__(self, x, w):
        return jnp.einsum("tm,mh->th", x, w)


class _ParentWeight(nnx.Module):
    """The weight is the parent's param; the einsum runs in a child module that receives it."""

    def __init__(self, w):
        self.w = nnx.Param(jnp.asarray(w))
        self.child = _Child()

    def __call__(self, x):
        return self.child(x, self.w[...])


def _qwix_weight_only(cls) -> tuple[np.ndarray, np.ndarray]:
    x, w = checks.probe_operands(1, (16, 64), (64, 32))
    model = _qwix().quantize_model(cls(w), _qwix_rule(weight_qtype=jnp.int8), x)
    return np.asarray(model(x)), np.asarray(jnp.einsum("tm,mh->th", x, w))


@_qwix_test
def test_qwix_weight_only_rule_tracks_on_the_modules_own_weight_should_pass():
    assert checks.assert_tracks(*_qwix_weight_only(_OwnWeight), max_rel_norm=0.02) > 0


@_qwix_test
def test_qwix_weight_only_rule_skips_a_weight_passed_to_a_child_module():
    """qwix 0.1.8 finds weights among the calling module's own params (flax_util.find_param); a weight that
    reaches the einsum as an argument counts as an activation, so a weight-only rule quantizes nothing."""
    with pytest.raises(AssertionError, match=r"assert_tracks: actual is bitwise equal to the unquantized reference"
                                             r" .*silent fallback"):
        checks.assert_tracks(*_qwix_weight_only(_ParentWeight))


@_qwix_test
def test_qwix_cannot_walk_a_qcheck_layer_and_qcheck_says_why():
    """qwix.quantize_model on any model holding nnx.bridge.ToNNX (qwix 0.1.8): every quantized qcheck layer does."""
    _qwix()
    from qcheck.adapters import qwix_quantize_model

    layer = qcheck.build_moe("mixtral", "int8")
    x = jnp.asarray(_input())
    provider = _qwix_rule(weight_qtype=jnp.int8, act_qtype=jnp.int8)
    with pytest.raises(ValueError, match=r"Cannot infer collection name from value: \('sites', 'wi_0'\)"):
        _qwix().quantize_model(layer, provider, x)
    with pytest.raises(TypeError, match=r"qwix_quantize_model: model MoE holds nnx.bridge.ToNNX modules at "
                                        r"sites/\w+, .*cannot place a bridged Linen module's variables"):
        qwix_quantize_model(layer, provider, x)


@_qwix_test
def test_qwix_quantize_model_passes_a_plain_model_through_should_pass():
    _qwix()
    from qcheck.adapters import qwix_quantize_model

    x, w = checks.probe_operands(1, (16, 64), (64, 32))
    model = qwix_quantize_model(_OwnWeight(w), _qwix_rule(weight_qtype=jnp.int8), x)
    assert checks.assert_tracks(np.asarray(model(x)), np.asarray(jnp.einsum("tm,mh->th", x, w)),
                                max_rel_norm=0.02) > 0


def test_qwix_quantize_model_bad_input():
    _qwix()
    from qcheck.adapters import qwix_quantize_model

    with pytest.raises(TypeError, match=r"model must be an nnx.Module, got Dense"):
        qwix_quantize_model(nn.Dense(3), None)


def test_qwix_adapter_without_qwix_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "qcheck.adapters._qwix", raising=False)
    monkeypatch.setitem(sys.modules, "qwix", None)
    with pytest.raises(ImportError, match=r"pip install 'qcheck\[qwix\]'"):
        importlib.import_module("qcheck.adapters._qwix")


# -- qwix as a qcheck recipe (qcheck.adapters.qwix_int8, an interception recipe) ----------------


def _qwix_int8_case(model: str, path: str):
    _qwix()
    return cases.Case("qwix_int8", cases.Variant(model, path, False))


@_qwix_test
def test_qwix_int8_recipe_sparse_layer_differs_on_a_mesh():
    """qwix 0.1.8 int8 (jax 0.10.2, 0.11.2 and 0.12.0.1, CPU): Mixtral's sparse qwix_int8 layer on the suite's 2 x 4
    mesh computes another function than on one device; the `sharded` invariant catches it, and the recipe declares
    it (its matrix cell reads "known defect"). On jax 0.12.1 the two agree: the declaration is keyed on jax."""
    from qcheck.adapters._qwix_recipe import QWIX_INT8_SHARDED_SPARSE

    if not QWIX_INT8_SHARDED_SPARSE.seen_here:
        assert invariants.run_sharded(_qwix_int8_case("mixtral", "sparse")) <= invariants.SHARDED_ATOL
        return
    with pytest.raises(AssertionError, match=QWIX_INT8_SHARDED_SPARSE.match + r", by up to 0\.0\d+"):
        invariants.run_sharded(_qwix_int8_case("mixtral", "sparse"))


@_qwix_test
def test_qwix_int8_recipe_sparse_layer_matches_on_a_mesh_for_gemma_should_pass():
    assert invariants.run_sharded(_qwix_int8_case("gemma", "sparse")) <= invariants.SHARDED_ATOL


@_qwix_test
def test_qwix_int8_recipe_sparse_site_shares_one_weight_scale_across_experts():
    """qwix 0.1.8 through qcheck's qwix_int8 recipe: the sparse path's call site (qwix's ragged_dot) scales all
    experts' weights together, as on a user's model (the row above)."""
    site = cases.layer(_qwix_int8_case("mixtral", "sparse")).get_einsum("wi_0")
    lhs, rhs = checks.probe_operands(0, (12, 32), (3, 32, 8))
    with pytest.raises(AssertionError, match=r"qwix_int8 site: assert_ragged_groups_independent: scaling group 0's "
                                             r"weights by 1000 changed 7 of 7 rows .*one weight scale shared"):
        assert_ragged_groups_independent(site.ragged_dot, lhs, rhs, np.array([5, 7, 0], np.int32),
                                         label="qwix_int8 site")


@_qwix_test
def test_qwix_int8_recipe_sparse_path_fails_exact_with_one_weight_scale_shared():
    """qwix 0.1.8 through qwix_int8: its sites equal int8_qwix codes multiplied in integer arithmetic, scales after
    (the dense path, below), but the sparse path's ragged_dot is exact only against one weight scale shared across
    experts, which the `exact` check names (declared: its matrix cell reads "known defect")."""
    from qcheck.adapters._qwix_recipe import QWIX_INT8_RAGGED_SHARED_SCALE

    with pytest.raises(AssertionError, match=r"qwix_int8-gemma-sparse: assert_sites_exact: site 'wi_0' "
                                             r"ragged_dot \(int8_qwix x int8_qwix, integer matmul\): .*"
                                             + QWIX_INT8_RAGGED_SHARED_SCALE.match):
        invariants.run_exact(_qwix_int8_case("gemma", "sparse"))


@_qwix_test
@pytest.mark.parametrize("model", ["mixtral", "gemma"])
def test_qwix_int8_recipe_dense_path_is_exact_in_integer_arithmetic_should_pass(model):
    # The twin above: the same invariant fails on the sparse path, naming qwix's shared weight scale.
    from qcheck.suite.cells import run_cell

    verdict = run_cell(_qwix_int8_case(model, "dense"), "exact")
    assert verdict.status == "pass", verdict.detail


# -- JAX's scaled_dot_general --------------------------------------------------------------------------------


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a fact of scaled_matmul's CPU lowering")
def test_jax_scaled_matmul_on_cpu_zeroes_a_block_whose_e8m0_scale_is_code_0():
    """jax 0.11.2 and 0.12.0.1 (the first with a CPU lowering): a block of 2^-124 and 0 takes the e8m0 scale code 0,
    2^-127, and codes 8 that stand for 2^-124 (the referee's, and qcheck's mxfp8_jax); scaled_matmul's CPU
    lowering casts that scale to float32, a subnormal XLA flushes, so the product is 0, not the referee's ~7.5e-37.
    The suite's `edges` declares it for jax_mxfp8 (JAX_MXFP8_TINY_BLOCKS). On jax 0.12.1 the quantizer's division
    by the flushed scale comes first, and the product is not finite (JAX_MXFP8_FLUSHED_DIVISION)."""
    from qcheck import referees
    from qcheck.adapters import scaled_dot_general_runs

    if not scaled_dot_general_runs():
        pytest.skip(f"jax {jax.__version__} has no CPU lowering for scaled_matmul (jax 0.10.2)")
    tiny = np.where(np.arange(32) % 2 == 0, 4 * np.finfo(np.float32).tiny, 0).astype(np.float32).reshape(1, 1, 32)
    ones = np.ones((1, 1, 32), np.float32)
    config = jax.nn.get_scaled_dot_general_config("mxfp8")
    got = jax.jit(lambda a, b: jax.nn.scaled_dot_general(a, b, (((2,), (2,)), ((0,), (0,))), configs=[config] * 3))(
        tiny, ones)
    codes, scales = referees.reference_quantize(tiny, "mxfp8_jax", axis=-1, ftz=True, xla_reciprocal=True)
    assert np.asarray(scales["block"]).view(np.uint8).item() == 0 and codes.astype(np.float32).max() == 8
    want = float(np.sum(referees.reference_qdq(tiny, "mxfp8_jax", axis=-1, ftz=True, xla_reciprocal=True)))
    from qcheck.adapters._jax import JAX_MXFP8_NAN_EDGES, JAX_MXFP8_TINY_BLOCKS

    if JAX_MXFP8_TINY_BLOCKS.seen_here:
        assert want > 1e-37 and float(np.asarray(got).item()) == 0.0, (want, got)
    else:  # jax 0.12.1: the division by the flushed 2^-127 comes first, x / 0 (JAX_MXFP8_FLUSHED_DIVISION)
        assert JAX_MXFP8_NAN_EDGES.seen_here and not np.isfinite(np.asarray(got).item()), got


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a fact of XLA's CPU backend (it flushes subnormals)")
def test_jax_nvfp4_on_cpu_flushes_the_product_of_the_two_global_scales():
    """jax 0.11.2, 0.12.0.1 and 0.12.1: scaled_dot_general in nvfp4 rescales the product by both operands' global
    scales multiplied first (scaled_matmul_stablehlo.py, scaled_dot_impl). For a tensor of tiny values (the edges'
    whole tensor, amax 3.5e-37: global scale 2^-126) times normal weights (2^-12) that factor is 2^-138, which XLA's
    CPU backend flushes: the product is 0 where the dequantized operands multiply to about 1e-37. The same operands
    2^40 larger (the control) give the referee's product bitwise. The suite's `edges` declares it for jax_nvfp4
    (JAX_NVFP4_TINY_TENSOR)."""
    from qcheck import referees
    from qcheck.adapters import scaled_dot_general_runs
    from qcheck.adapters._jax import JAX_NVFP4_TINY_TENSOR, scaled_dot_configs
    from qcheck.checks import harness

    if not scaled_dot_general_runs():
        pytest.skip(f"jax {jax.__version__} has no CPU lowering for scaled_matmul (jax 0.10.2)")
    rng = np.random.default_rng(3)
    tiny = np.asarray(harness.format_edge_rows(rng.normal(size=(1, 4, 32)).astype(np.float32), None,
                                               {"tiny_tensor": None})["tiny_tensor"])
    w = (rng.normal(size=(1, 2, 32)) / 4).astype(np.float32)
    assert float(qcheck.formats.jax_nvfp4_global_scale(tiny)) == 2.0**-126

    def matmul(a, b):
        return np.asarray(jax.jit(lambda a, b: jax.nn.scaled_dot_general(
            a, b, (((2,), (2,)), ((0,), (0,))), preferred_element_type=np.float32,
            configs=scaled_dot_configs("nvfp4", a, b)))(a, b))

    def referee(a, b):
        qa, qb = (referees.reference_qdq(v, "nvfp4_jax", axis=-1, ftz=True, xla_reciprocal=True) for v in (a, b))
        return np.einsum("bik,bjk->bij", qa.astype(np.float64), qb.astype(np.float64)).astype(np.float32)

    big = tiny * np.float32(2.0**40)
    assert np.array_equal(matmul(big, w), referee(big, w))  # the control: normal operands, the referee's product
    want, got = referee(tiny, w), matmul(tiny, w)
    assert JAX_NVFP4_TINY_TENSOR.seen_here
    assert np.all(np.abs(want) >= np.finfo(np.float32).tiny) and not np.any(got), (want, got)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a fact of XLA's CPU backend (it flushes subnormals)")
def test_jax_mxfp8_divides_an_all_zero_block_by_a_flushed_scale():
    """Plain JAX, on the versions JAX_MXFP8_FLUSHED_DIVISION was seen on (jax 0.12.1): an operand with an all-zero
    row (a block of 32 zeros) through scaled_dot_general's mxfp8 config is NaN there, beside a control without one;
    on jax 0.11.2 and 0.12.0.1 the same call is finite (XLA multiplied by 2^127 instead of dividing)."""
    from qcheck.adapters import scaled_dot_general_runs
    from qcheck.adapters._jax import JAX_MXFP8_NAN_GRADIENTS

    if not scaled_dot_general_runs():
        pytest.skip(f"jax {jax.__version__} has no CPU lowering for scaled_matmul (jax 0.10.2)")
    config = jax.nn.get_scaled_dot_general_config("mxfp8")
    ones = np.ones((1, 2, 32), np.float32)
    zero_row = ones.copy()
    zero_row[0, 0] = 0

    def matmul(a, b):
        return np.asarray(jax.jit(lambda a, b: jax.nn.scaled_dot_general(
            a, b, (((2,), (2,)), ((0,), (0,))), configs=[config] * 3))(a, b))

    assert np.all(np.isfinite(matmul(ones, ones)))  # the control
    assert np.all(np.isfinite(matmul(zero_row, ones))) != JAX_MXFP8_NAN_GRADIENTS.seen_here


def test_jax_nvfp4_divides_an_all_zero_block_by_its_zero_scale():
    """jax 0.11.2, 0.12.0.1 and 0.12.1: JAX's NVFP4 quantizer (jax/_src/cudnn/scaled_matmul_stablehlo.py, quantize)
    takes an all-zero block's scale clip(amax / 6, 0, 448) = 0 and divides the block by it: 0 / 0. The coverage
    check, which holds every scale finite and nonzero, names it on JAX's own call; a block of ones (the control)
    passes. The suite declares it for jax_nvfp4's dropping layer, whose dropped tokens are such blocks
    (JAX_NVFP4_ZERO_BLOCKS)."""
    from qcheck.adapters import scaled_dot_general_runs

    if not scaled_dot_general_runs():
        pytest.skip(f"jax {jax.__version__} has no CPU lowering for scaled_matmul (jax 0.10.2)")
    config = jax.nn.get_scaled_dot_general_config("nvfp4", global_scale=np.float32(1.0))
    ones = np.ones((1, 4, 32), np.float32)
    with_zeros = np.concatenate([np.zeros((1, 1, 32), np.float32), np.ones((1, 1, 32), np.float32)], axis=1)

    def matmul(a, b):
        return jax.nn.scaled_dot_general(a, b, (((2,), (2,)), ((0,), (0,))), configs=[config] * 3)

    qcheck.assert_quantized(matmul, ones, ones, declared="nvfp4_jax")  # should pass: no zero block
    with pytest.raises(AssertionError, match=r"lhs \(activation\): its scale is 0 at 2 of 4 scale values \(codes "
                                             r"NaN\): a scale must be finite and nonzero"):
        qcheck.assert_quantized(matmul, with_zeros, ones, declared="nvfp4_jax")
