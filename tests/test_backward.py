"""assert_site_backward_exact on einsum and ragged sites: every recipe's gradients pass, each planted bug fails."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck import checks, formats, get_recipe
from qcheck.checks._backward import flat_uniforms, assert_site_backward_exact
from qcheck.checks._probes import probe_grad, probe_nvfp4
from qcheck.checks._format_matches import nvfp4_uniforms
from qcheck.layers.bridge import QuantSite
from qcheck.recipes import NVFP4, DelayedScalingFp8, Recipe, Reference
from qcheck.recipes._nvfp4 import NVFP4Site
from qcheck.recipes._sites import FormatSite, fake_quant_matmul
from tests.helpers import SkipGradFp8, WrongAxesNVFP4

# A Mixtral-like wi site, small: dense BSM,EMH->BSEH; sparse ragged_dot([T, M], [E, M, H]).
EQN = "BSM,EMH->BSEH"
DENSE = {"lhs": ((2, 16, 32), (2,)), "rhs": ((4, 32, 32), (1,)), "g": ((2, 16, 4, 32), (2, 3), (0, 1))}
SPARSE = {"lhs": ((64, 32), (1,)), "rhs": ((4, 32, 32), (1,)), "g": ((64, 32), (1,), (0,))}
GROUP_SIZES = np.array([20, 30, 14, 0], np.int32)


@functools.cache
def probes(kind: str, nvfp4: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    spec = DENSE if kind == "dense" else SPARSE
    if nvfp4:  # blocks along every axis set each tensor is quantized on decode exactly
        return tuple(probe_nvfp4(i, shape, *axes) for i, (shape, *axes) in enumerate(spec.values()))
    lhs, rhs = checks.probe_operands(0, spec["lhs"][0], spec["rhs"][0])
    return lhs, rhs, probe_grad(1, spec["g"][0])


def run(site: QuantSite, recipe: Recipe, kind: str, lhs=None, rhs=None, g=None) -> dict[str, int]:
    plhs, prhs, pg = probes(kind, recipe.grad == "nvfp4")
    lhs, rhs, g = (plhs if lhs is None else lhs), (prhs if rhs is None else rhs), (pg if g is None else g)
    if kind == "dense":
        return assert_site_backward_exact(site, EQN, lhs, rhs, g, recipe=recipe)
    return assert_site_backward_exact(site, checks.Ragged(GROUP_SIZES), lhs, rhs, g, recipe=recipe)


@functools.cache
def site_of(recipe: Recipe) -> QuantSite:
    return QuantSite(recipe, "wi_0", rngs=nnx.Rngs(0))


# -- should pass: every built-in and plug-in recipe with formats, both site kinds ---------

RECIPES = ["fp8", "nanoo_fp8", "nvfp4", "fp8_current", "mxfp8", "int8"]


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("name", RECIPES)
def test_site_backward_exact_should_pass(name, kind):
    # int8 has no grad format: g passes straight through, and both gradients equal,
    # bitwise, the matmuls of unquantized g against the int8-quantized operands.
    recipe = get_recipe(name)
    margins = run(site_of(recipe), recipe, kind)
    # Both gradients matched the reference while every known bug's gradient differed from it somewhere.
    assert set(margins) == {"dgrad", "wgrad"} and min(margins.values()) > 0, margins


def test_site_backward_exact_should_pass_with_a_library_int8_grad():
    # The wrong-axes neighbour of a per-slice g format is told apart on the probes (see the failing twin below).
    recipe = Recipe("int8_aqt_g", lhs="int8", rhs="int8", grad="int8_aqt")
    assert min(run(QuantSite(recipe, "wi_0", rngs=nnx.Rngs(0)), recipe, "dense").values()) > 0


# -- should fail: one planted bug each ----------------------------------------------------


class _UnsaltedNVFP4Site(NVFP4Site):
    def matmul(self, op, lhs, rhs, axes):
        from qcheck.recipes._nvfp4 import nvfp4_matmul
        return nvfp4_matmul(op, axes, lhs, rhs, self.make_rng("params"))  # the bug: no per-quantizer salt


class _UnsaltedNVFP4(NVFP4):
    def site_module(self, name):
        return _UnsaltedNVFP4Site(quantizer=name)


class _UnquantizedResidualSite(FormatSite):
    def matmul(self, op, lhs, rhs, axes):
        q = lambda x, ax: formats.qdq(x, self.lhs, axis=ax)  # noqa: E731

        @jax.custom_vjp
        def f(a, b):
            return op(q(a, axes.lhs), q(b, axes.rhs))

        def bwd(res, g):  # the bug: gradients against the unquantized operands
            return jax.vjp(op, *res)[1](g)

        f.defvjp(lambda a, b: (f(a, b), (a, b)), bwd)
        return f(lhs, rhs)


class _UnquantizedResidualInt8(Recipe):
    def site_module(self, name):
        return _UnquantizedResidualSite(lhs="int8", rhs="int8")


class _OriginalOperandsInt8(_UnquantizedResidualInt8):
    """Declares what its site does: gradients against the operands as received (as qwix's QAT)."""

    reference = Reference(grad_operands="original")


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_site_backward_exact_original_operands_should_pass(kind):
    recipe = _OriginalOperandsInt8("int8_original", lhs="int8", rhs="int8")
    margins = run(QuantSite(recipe, "wi_0", rngs=nnx.Rngs(0)), recipe, kind)
    assert min(margins.values()) > 0


def test_layer_backward_names_quantized_operands_where_the_original_ones_are_declared():
    from qcheck.checks._layer_backward import assert_layer_sites_backward_exact
    from qcheck.suite import cases

    layer = qcheck.build_moe("mixtral", Recipe("int8_ste", lhs="int8", rhs="int8"), path="dense", seed=cases.SEED)
    x = cases.layer_input("mixtral")
    assert_layer_sites_backward_exact(layer, x, Recipe("int8_ste", lhs="int8", rhs="int8"), label="healthy")
    with pytest.raises(AssertionError, match=r"bug: assert_layer_sites_backward_exact: site '\w+' einsum .* in the "
                       r"layer's backward \(g unquantized \(straight through to the original operands\)\).*equals "
                       r"the gradient with the quantized operands \(straight through the quantizers\) bitwise"):
        assert_layer_sites_backward_exact(layer, x, _OriginalOperandsInt8("int8_original", lhs="int8", rhs="int8"),
                                          label="bug")


def test_unknown_grad_operands_lists_the_valid_ones():
    # Refused where it is declared, before any site runs.
    with pytest.raises(ValueError, match=r"^grad_operands must be one of quantized, original, got 'originals'$"):
        Reference(grad_operands="originals")


class _WrongAxesGradSite(FormatSite):
    def matmul(self, op, lhs, rhs, axes):
        return fake_quant_matmul(
            op, lhs, rhs, None,
            q_lhs=lambda x: formats.qdq(x, self.lhs, axis=axes.lhs),
            q_rhs=lambda x: formats.qdq(x, self.rhs, axis=axes.rhs),
            q_dgrad=lambda g, _: formats.qdq(g, self.grad, axis=axes.wgrad),  # the bug: WGRAD's axes
            q_wgrad=lambda g: formats.qdq(g, self.grad, axis=axes.wgrad),
        )


class _WrongAxesGrad(Recipe):
    def site_module(self, name):
        return _WrongAxesGradSite(lhs=self.lhs, rhs=self.rhs, grad=self.grad)


E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ = jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e5m2, jnp.float8_e5m2fnuz

# (id, site's recipe, recipe checked against, kind, message)
FAILS = [
    ("fp8-g-in-e4m3", lambda: DelayedScalingFp8("fp8", e4m3_dtype=E4M3FN, e5m2_dtype=E4M3FN), None, "dense",
     r"site 'wi_0' dgrad \(g in float8_e5m2\): differs .* first at \(.*got .*expected .*"
     r"equals the gradient with g in float8_e4m3fn \(the forward flavour\)"),
    ("nanoo-g-in-e4m3", lambda: DelayedScalingFp8("nanoo_fp8", e4m3_dtype=E4M3FNUZ, e5m2_dtype=E4M3FNUZ), None,
     "sparse", r"assert_site_backward_exact: site 'wi_0' dgrad \(g in float8_e5m2fnuz\).*"
     r"equals the gradient with g in float8_e4m3fnuz \(the forward flavour\)"),
    ("nanoo-g-wrong-fnuz", lambda: DelayedScalingFp8("nanoo_fp8", e4m3_dtype=E4M3FNUZ, e5m2_dtype=E5M2), None,
     "dense", r"dgrad \(g in float8_e5m2fnuz\).*equals the gradient with g in float8_e5m2 \(the other fnuz"),
    ("fp8-g-skipped", lambda: SkipGradFp8("fp8", e4m3_dtype=E4M3FN, e5m2_dtype=E5M2), None, "sparse",
     r"dgrad \(g in float8_e5m2\).*equals the gradient with unquantized g bitwise"),
    ("mxfp8-g-skipped", lambda: Recipe("mxfp8", lhs="mxfp8", rhs="mxfp8"), "mxfp8", "dense",
     r"dgrad \(g in mxfp8 along axes \(2, 3\)\).*equals the gradient with unquantized g bitwise"),
    ("nvfp4-dgrad-wrong-axes", lambda: WrongAxesNVFP4(), None, "dense",
     r"dgrad \(g in nvfp4 along axes \(2, 3\), stochastic\).*equals the gradient with g in nvfp4 along the "
     r"wgrad axes \(0, 1\) bitwise"),
    ("nvfp4-dgrad-wrong-axes-sparse", lambda: WrongAxesNVFP4(), None, "sparse",
     r"dgrad \(g in nvfp4 along axes \(1,\), stochastic\).*along the wgrad axes \(0,\) bitwise"),
    # int8_aqt scales per slice, so g along the other gradient's axes is a bug the check must name: it
    # does only where formats.AXIS_FORMATS holds the library int8 variants (the backward path once had
    # its own copy without them, and called this "none of the known bugs").
    ("int8_aqt-dgrad-wrong-axes", lambda: _WrongAxesGrad("int8_aqt_g", lhs="int8", rhs="int8", grad="int8_aqt"),
     None, "dense", r"dgrad \(g in int8_aqt along axes \(2, 3\)\).*equals the gradient with g in int8_aqt along the "
     r"wgrad axes \(0, 1\) bitwise"),
    ("nvfp4-unsalted-key", lambda: _UnsaltedNVFP4(), None, "dense",
     r"dgrad .*stochastic\).*rounded with the unsalted key bitwise"),
    ("int8-unquantized-residuals", lambda: _UnquantizedResidualInt8("int8", lhs="int8", rhs="int8"), "int8",
     "sparse", r"dgrad \(g unquantized \(straight through\)\).*equals the gradient with unquantized operands"),
    ("int8-original-operands-declared", lambda: Recipe("int8", lhs="int8", rhs="int8"),
     _OriginalOperandsInt8("int8_original", lhs="int8", rhs="int8"), "dense",
     r"dgrad \(g unquantized \(straight through to the original operands\)\).*equals the gradient with the "
     r"quantized operands \(straight through the quantizers\) bitwise"),
]


@pytest.mark.parametrize(("planted", "claimed", "kind", "match"), [f[1:] for f in FAILS], ids=[f[0] for f in FAILS])
def test_site_backward_exact_should_fail(planted, claimed, kind, match):
    recipe = planted()
    checked = recipe if claimed is None else get_recipe(claimed)
    with pytest.raises(AssertionError, match=match):
        run(QuantSite(recipe, "wi_0", rngs=nnx.Rngs(0)), checked, kind)


# -- the controls: inputs that cannot tell the reference from a bug are refused ----------


def test_refuses_g_that_fp8_represents_exactly():
    with pytest.raises(ValueError, match=r"dgrad \(g in float8_e5m2\).*equals the gradient with unquantized g"):
        run(site_of(get_recipe("fp8")), get_recipe("fp8"), "dense", g=np.ones(DENSE["g"][0], np.float32))


def test_refuses_g_where_e5m2_flavours_agree():
    # Above 2^-14 e5m2 and e5m2fnuz round alike: a wrong fnuz flavour would pass.
    g = checks.probe_operands(3, DENSE["g"][0])[0]
    with pytest.raises(ValueError, match=r"float8_e5m2fnuz.*g in float8_e5m2 \(the other fnuz flavour\)"):
        run(site_of(get_recipe("nanoo_fp8")), get_recipe("nanoo_fp8"), "dense", g=g)


def test_refuses_block_g_that_hides_wrong_axes():
    # probe_nvfp4 (blocks along both gradients' axes) has power-of-two block amaxes;
    # an mxfp8 scale is then a power of two that moves no element's rounding, so
    # blocking along the wrong axes gives the same values.
    g = probe_nvfp4(4, DENSE["g"][0], (2, 3), (0, 1))
    with pytest.raises(ValueError, match=r"g in mxfp8 along the wgrad axes \(0, 1\) bitwise, so that bug"):
        run(site_of(get_recipe("mxfp8")), get_recipe("mxfp8"), "dense", g=g)


def test_refuses_nvfp4_operands_whose_decode_order_matters():
    lhs = checks.probe_operands(5, DENSE["lhs"][0])[0]
    with pytest.raises(ValueError, match=r"lhs has nvfp4 blocks along axes \(2,\).*not a power of two"):
        run(site_of(get_recipe("nvfp4")), get_recipe("nvfp4"), "dense", lhs=lhs)


def test_bad_input_names_the_argument():
    site, recipe = site_of(get_recipe("fp8")), get_recipe("fp8")
    lhs, rhs, g = probes("dense", False)
    with pytest.raises(ValueError, match=r"g has shape \(2, 16\), the matmul's output has shape \(2, 16, 4, 32\)"):
        assert_site_backward_exact(site, EQN, lhs, rhs, g[:, :, 0, 0], recipe=recipe)
    with pytest.raises(TypeError, match="lhs must be a float32 array, got dtype float64"):
        assert_site_backward_exact(site, EQN, lhs.astype(np.float64), rhs, g, recipe=recipe)
    with pytest.raises(ValueError, match="recipe 'none' declares no operand formats"):
        assert_site_backward_exact(site, EQN, lhs, rhs, g, recipe=get_recipe("none"))
    with pytest.raises(TypeError, match="recipe must be a qcheck.Recipe, got str"):
        assert_site_backward_exact(site, EQN, lhs, rhs, g, recipe="fp8")


def test_refuses_shapes_the_format_cannot_block():
    # mxfp8's WGRAD blocks of 32 run over B*S; 1 x 16 tokens hold half a block.
    lhs, rhs = checks.probe_operands(6, (1, 16, 32), (4, 32, 32))
    with pytest.raises(ValueError, match=r"site 'wi_0': the referee cannot quantize.*mxfp8.*16 elements"):
        assert_site_backward_exact(site_of(get_recipe("mxfp8")), EQN, lhs, rhs, probe_grad(6, (1, 16, 4, 32)),
                                   recipe=get_recipe("mxfp8"))


def test_flat_uniforms_are_the_ones_nvfp4_draws():
    key = jax.random.key(7)
    for shape, axes in (((2, 16, 4, 32), (2, 3)), ((2, 16, 4, 32), (0, 1)), ((64, 32), (0,))):
        assert np.array_equal(flat_uniforms(key, shape, axes), nvfp4_uniforms(key, shape, axes))


def test_probe_nvfp4_blocks_have_power_of_two_encode_scales():
    from qcheck import referees

    g = probe_nvfp4(0, DENSE["g"][0], (2, 3), (0, 1))
    for axes in ((2, 3), (0, 1)):
        _, s = referees.reference_quantize(g, "nvfp4", axis=axes)
        assert s["tensor"] == np.float32(448.0)
        assert np.all(np.frexp(s["tensor"] / s["block"].astype(np.float32))[0] == 0.5)
