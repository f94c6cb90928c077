"""JAX's block-scaled dot (jax.nn.scaled_dot_general) against qcheck's referees, bit for bit, and its facts.

JAX's ``quantize`` (jax/_src/cudnn/scaled_matmul_stablehlo.py) is plain jnp and
runs on CPU in jax 0.10.2 and 0.12 alike: its codes and scales are held here
to ``mxfp8_jax`` / ``nvfp4_jax`` (qcheck.referees), and the difference from the
OCP / NVIDIA referees is pinned. The matmul itself (``scaled_matmul``) lowers
on CPU only from jax 0.12; tests that run it skip on 0.10.2, saying so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.cudnn.scaled_matmul_stablehlo import quantize as jax_quantize

from qcheck import coverage, formats, referees
from qcheck.adapters import jax_mxfp8, jax_nvfp4, scaled_dot_general_runs

F32 = np.float32
RUNS = scaled_dot_general_runs()
needs_lowering = pytest.mark.skipif(
    not RUNS, reason=f"jax {jax.__version__} has no {jax.default_backend()} lowering for scaled_matmul "
                     "(jax 0.10.2 on CPU: the jax_mxfp8 / jax_nvfp4 recipes are not offered there)")

_rng = np.random.default_rng(25)
#: Rows of 256 (8 mxfp8 blocks, 16 nvfp4 ones) at magnitudes 2^-20..2^20 per row, a zero block and a tiny one.
ROWS = (_rng.standard_normal((6, 4, 256)) * np.exp2(_rng.integers(-20, 21, (6, 4, 1)))).astype(F32)
ROWS[0, 0, :64] = 0
ROWS[1, 1, :16] *= F32(1e-6)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _jax(x: np.ndarray, mode: str):
    extra = (formats.jax_nvfp4_global_scale(x),) if mode == "nvfp4" else ()
    config = jax.nn.get_scaled_dot_general_config(mode, *extra)
    codes, scales = jax.jit(lambda v: jax_quantize(v, config))(x)
    return np.asarray(codes), np.asarray(scales)


@pytest.mark.parametrize("mode, fmt", [("mxfp8", "mxfp8_jax"), ("nvfp4", "nvfp4_jax")])
@pytest.mark.parametrize("t", range(len(ROWS)))
def test_jax_quantize_equals_its_referee_should_pass(mode, fmt, t):
    x = ROWS[t:t + 1]
    codes, scales = _jax(x, mode)
    # In one of the record's forms (XLA may keep x / scale a division, jax 0.12.1, or not), the whole array in it.
    forms = formats.get_format(fmt).forms
    refs = [referees.reference_quantize(x, fmt, axis=-1, ftz=jax.default_backend() == "cpu", xla_reciprocal=f)
            for f in forms]
    same = [(c, s) for c, s in refs if np.array_equal(_bits(codes), _bits(c))]
    assert same, f"{fmt} codes differ from JAX's in every form ({', '.join(forms)})"
    want_codes, want = same[0]
    assert np.array_equal(_bits(scales), _bits(want["block"])), f"{fmt} block scales differ from JAX's"
    q = jax.jit(lambda v: formats.quantize(v, fmt, axis=-1))(x)  # qcheck's own implementation, too
    assert np.array_equal(_bits(q.codes), _bits(want_codes)) and np.array_equal(_bits(q.scales["block"]),
                                                                                 _bits(want["block"]))


def test_jax_mxfp8_rounds_the_scale_up_where_ocp_saturates_should_fail():
    # A fact (jax 0.10.2 and 0.12.0.1): JAX's block scale is 2^ceil(log2(amax / 448)); OCP MX v1.0's,
    # 2^(floor(log2 amax) - 8), leaves a block whose amax significand exceeds 1.75 saturating at 448.
    x = np.full((1, 1, 32), 1.0, F32)
    x[0, 0, 0] = 480.0  # 1.875 · 2^8
    codes, scales = _jax(x, "mxfp8")
    ocp_codes, ocp = referees.reference_quantize(x, "mxfp8", axis=-1)
    assert float(scales.astype(F32).ravel()[0]) == 2.0 and float(ocp["block"].astype(F32).ravel()[0]) == 1.0
    assert float(codes.astype(F32)[0, 0, 0]) == 240.0 and float(ocp_codes.astype(F32)[0, 0, 0]) == 448.0
    with pytest.raises(AssertionError):  # the OCP referee is not JAX's rule
        assert np.array_equal(_bits(codes), _bits(ocp_codes))


def test_jax_nvfp4_differs_from_the_two_level_nvidia_referee():
    # The same global amax, but JAX divides x by g and then by an e4m3 block scale of amax_b / 6, where
    # qcheck's nvfp4 (NVIDIA's) scales x by s_enc / s_block with s_enc = 2688 / amax, not a power of two.
    x = ROWS[2:3]
    codes, _ = _jax(x, "nvfp4")
    nvidia, _ = referees.reference_quantize(x, "nvfp4", axis=-1)
    assert not np.array_equal(_bits(codes), _bits(nvidia))


def test_jax_nvfp4_global_scale_is_the_power_of_two_at_or_above_amax_over_2688():
    from qcheck.referees._formats import jax_global_scale

    for amax in (F32(2688), F32(2688.001), F32(1.0), F32(3e-30), F32(6e35)):
        x = np.array([amax, -amax / 3], F32)
        g = float(formats.jax_nvfp4_global_scale(x))
        assert g == float(jax_global_scale(x)), amax
        assert np.log2(g).is_integer() and g * 2688 >= amax > g * 1344, (amax, g)
    assert float(formats.jax_nvfp4_global_scale(np.zeros(4, F32))) == 1.0


def test_scaled_dot_general_lowers_on_cpu_from_jax_0_11():
    # A fact: jax 0.10.2 registers scaled_matmul's lowering for cuda and rocm only ("MLIR translation
    # rule for primitive 'scaled_matmul' not found for platform cpu"); jax 0.11.2 and 0.12 add a CPU one.
    if jax.default_backend() != "cpu":
        pytest.skip("the fact is about the CPU backend")
    assert scaled_dot_general_runs() == (tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11))


def test_coverage_names_scaled_matmul_records_with_their_block_formats():
    # Tracing only: it runs on jax 0.10.2 too.
    a, b = jnp.ones((2, 8, 64)), jnp.ones((2, 64, 32))
    dims = (((2,), (1,)), ((0,), (0,)))
    for mode, want in (("mxfp8", "mxfp8 (float8_e4m3fn, float8_e8m0fnu scales per 32)"),
                       ("nvfp4", "nvfp4 (float4_e2m1fn, float8_e4m3fn scales per 16)")):
        extra = (jnp.float32(1),) if mode == "nvfp4" else ()  # a scalar: see the rank-promotion test below
        configs = [jax.nn.get_scaled_dot_general_config(mode, *extra)] * 3
        (rec,) = coverage(lambda a, b: jax.nn.scaled_dot_general(a, b, dims, configs=configs), a, b)
        assert rec.primitive == "scaled_matmul_wrapper" and rec.quantized
        assert rec.lhs_block == rec.rhs_block == want


def test_coverage_names_scaled_dot_general_without_configs_full_precision_should_fail():
    a, b = jnp.ones((2, 8, 64)), jnp.ones((2, 64, 32))
    (rec,) = coverage(lambda a, b: jax.nn.scaled_dot_general(a, b, (((2,), (1,)), ((0,), (0,))), configs=None), a, b)
    assert rec.primitive == "dot_general" and not rec.quantized and rec.lhs_block is None


@needs_lowering
@pytest.mark.parametrize("recipe", [jax_mxfp8, jax_nvfp4])
def test_site_runs_scaled_dot_general_bitwise_to_the_referee(recipe):
    # One site, probes as the suite makes them: exact holds it to the referee (the suite covers the layer).
    from qcheck.checks._site import assert_site_exact, probe_site_operands
    from qcheck.adapters._jax import JaxScaledDotSite
    from qcheck.recipes import einsum_axes

    r = recipe()
    eqn = "BSM,EMH->BSEH"
    lhs, rhs = probe_site_operands(3, (2, 8, 64), (4, 64, 32), einsum_axes(eqn, 3, 3), spread=r.mode == "mxfp8")
    site = JaxScaledDotSite(mode=r.mode)
    einsum = jax.jit(lambda e, a, b: site.apply({}, e, a, b), static_argnums=0)
    assert_site_exact(einsum, eqn, lhs, rhs, lhs_format=r.lhs, rhs_format=r.rhs, site="probe")


#: The first jax whose default nvfp4 global scale broadcasts under strict rank promotion (seen: 0.11.2 and 0.12.0.1
#: refuse it, 0.12.1 runs it).
NVFP4_DEFAULT_SCALE_FIXED_IN = "0.12.1"


def test_jax_default_nvfp4_config_breaks_strict_rank_promotion_before_its_fix():
    # A fact (jax 0.11.2 and 0.12.0.1): get_scaled_dot_general_config("nvfp4") defaults its global scale
    # to ones((1,)), which quantize divides a rank-4 operand by: refused under
    # jax_numpy_rank_promotion="raise" (qcheck's tests run so). A scalar global scale passes. From
    # NVFP4_DEFAULT_SCALE_FIXED_IN on, the default passes too (the fix, pinned so its loss shows).
    from qcheck._versions import parse_version

    a = jnp.ones((1, 4, 16))
    dims = (((2,), (2,)), ((0,), (0,)))
    default = [jax.nn.get_scaled_dot_general_config("nvfp4")] * 3
    scalar = [jax.nn.get_scaled_dot_general_config("nvfp4", jnp.float32(1))] * 3
    fixed = parse_version(jax.__version__, "jax") >= parse_version(NVFP4_DEFAULT_SCALE_FIXED_IN, "fixed in")
    with jax.numpy_rank_promotion("raise"):
        if fixed:
            jax.eval_shape(lambda a: jax.nn.scaled_dot_general(a, a, dims, configs=default), a)
        else:
            with pytest.raises(ValueError, match=r"could not be broadcast together for true_divide on shapes "
                                                 r"\(1, 4, 1, 16\) \(1,\).*jax_numpy_rank_promotion='raise'"):
                jax.eval_shape(lambda a: jax.nn.scaled_dot_general(a, a, dims, configs=default), a)
        jax.eval_shape(lambda a: jax.nn.scaled_dot_general(a, a, dims, configs=scalar), a)


def test_bad_recipe_arguments_say_which_and_what_is_valid():
    from qcheck.adapters import JaxScaledDotRecipe
    from qcheck.adapters._jax import einsum_dimension_numbers

    with pytest.raises(ValueError, match=r"mode must be one of mxfp8, nvfp4, got 'mxfp4'"):
        JaxScaledDotRecipe("mine", "mxfp4")
    with pytest.raises(ValueError, match=r"einsum 'ab,bc->c': index 'a' is summed within one operand"):
        einsum_dimension_numbers("ab,bc->c")
    assert einsum_dimension_numbers("BSM,EMH->BSEH") == ((((2,), (1,)), ((), ())), (0, 1, 2, 3))
    assert einsum_dimension_numbers("EBCM,BSEC->BSM") == ((((0, 2), (2, 3)), ((1,), (0,))), (0, 2, 1))


@pytest.mark.skipif(RUNS, reason="the recipes are registered here")
def test_unknown_jax_recipe_says_why_it_is_not_offered():
    from qcheck import get_recipe

    with pytest.raises(ValueError, match=r"unknown recipe 'jax_nvfp4' \(offered only where "
                                         r"jax.nn.scaled_dot_general lowers .*jax 0.10.2\); registered recipes: "):
        get_recipe("jax_nvfp4")
