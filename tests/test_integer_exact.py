"""`exact` in integer arithmetic: AQT's int8 forward bitwise against a numpy reference, and its failing twins.

AQT (aqtp 0.9.0, config_v4) multiplies int8 codes with an int32 accumulator
and applies the dot_general lhs's scale, then the rhs's, to the float32 sum
(aqt_dot_general._qtensor_dot_general, QTensor.dequant). Measured with jax
0.10.2 on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck import referees
from qcheck.referees._integer import SCALE_ORDERS, dot_general_lhs, integer_einsum
from qcheck.checks import Ragged
from qcheck.checks._site import assert_site_exact, probe_site_operands
from qcheck.layers.bridge import QuantSite
from qcheck.recipes import einsum_axes
from qcheck.recipes._axes import RAGGED_AXES
from qcheck.recipes import uneven_group_sizes
from tests.helpers import import_extra

import_extra("aqt")
from qcheck.adapters import aqt_int8, aqt_int8_ragged  # noqa: E402

@functools.partial(jax.jit, static_argnums=(0, 1))
def _site_einsum(graphdef, eqn: str, state, lhs, rhs):
    return nnx.merge(graphdef, state, copy=True)(eqn, lhs, rhs)


@functools.partial(jax.jit, static_argnums=0)
def _site_ragged_dot(graphdef, state, lhs, rhs, group_sizes):
    return nnx.merge(graphdef, state, copy=True).ragged_dot(lhs, rhs, group_sizes)


# The mixtral layer's call sites: dot_general gets the einsum's lhs first for wi, its rhs first for wo.
SITES = [("wi_0", "BSM,EMH->BSEH", (2, 8, 32), (4, 32, 16), "lhs"),
         ("wo", "BSEH,EHM->BSEM", (2, 8, 4, 16), (4, 16, 32), "rhs")]
FMT = dict(lhs_format="int8_aqt", rhs_format="int8_aqt")


@functools.cache
def _aqt_site(ragged: bool = False):
    recipe = aqt_int8_ragged() if ragged else aqt_int8()
    graphdef, state = nnx.split(QuantSite(recipe, "wi_0", rngs=nnx.Rngs(0)))
    if ragged:
        return lambda a, b, gs: _site_ragged_dot(graphdef, state, a, b, gs)
    return lambda eqn, a, b: _site_einsum(graphdef, eqn, state, a, b)


def _probes(eqn, lhs_shape, rhs_shape, seed=0):
    return probe_site_operands(seed, lhs_shape, rhs_shape, einsum_axes(eqn, len(lhs_shape), len(rhs_shape)))


@pytest.mark.parametrize("site, eqn, lhs_shape, rhs_shape, first", SITES)
def test_dot_general_lhs_follows_jnp_einsum(site, eqn, lhs_shape, rhs_shape, first):
    assert dot_general_lhs(eqn, lhs_shape, rhs_shape) == first


@pytest.mark.parametrize("site, eqn, lhs_shape, rhs_shape, first", SITES)
def test_aqt_einsum_exact_in_integer_arithmetic_should_pass(site, eqn, lhs_shape, rhs_shape, first):
    lhs, rhs = _probes(eqn, lhs_shape, rhs_shape)
    assert_site_exact(_aqt_site(), eqn, lhs, rhs, site=site, arithmetic="integer", **FMT)


def test_aqt_ragged_via_einsum_exact_in_integer_arithmetic_should_pass():
    lhs, rhs = probe_site_operands(3, (16, 32), (4, 32, 8), RAGGED_AXES)
    graphdef, state = nnx.split(QuantSite(aqt_int8(), "wi_0", rngs=nnx.Rngs(0)))
    assert_site_exact(lambda a, b, gs: _site_ragged_dot(graphdef, state, a, b, gs), Ragged(uneven_group_sizes(16, 4, 3)),
                      lhs, rhs, arithmetic="integer", **FMT)


@pytest.mark.parametrize("site, eqn, lhs_shape, rhs_shape, first", SITES)
def test_aqt_fails_the_float_reference_by_one_ulp(site, eqn, lhs_shape, rhs_shape, first):
    """Why the mode exists: the float32 matmul of dequantized operands rounds elsewhere."""
    lhs, rhs = _probes(eqn, lhs_shape, rhs_shape)
    with pytest.raises(AssertionError, match=rf"site '{site}' einsum .*\(int8_aqt x int8_aqt\): differs from the "
                                             r"referee-quantized reference .*matches no known bug; relative norm to "
                                             r"the reference [0-9.]+e-08"):
        assert_site_exact(_aqt_site(), eqn, lhs, rhs, site=site, **FMT)


def _float_matmul_of_dequantized(eqn, a, b):
    axes = einsum_axes(eqn, a.ndim, b.ndim)
    qa, qb = (referees.reference_qdq(np.asarray(x), "int8_aqt", axis=ax, ftz=True, xla_reciprocal=True)
              for x, ax in ((a, axes.lhs), (b, axes.rhs)))
    return jnp.einsum(eqn, qa, qb)


def _scales_in_the_other_order(eqn, a, b):
    axes = einsum_axes(eqn, a.ndim, b.ndim)
    (cl, sl), (cr, sr) = ((c, s["slice"]) for c, s in (
        referees.reference_quantize(np.asarray(a), "int8_aqt", axis=axes.lhs, ftz=True, xla_reciprocal=True),
        referees.reference_quantize(np.asarray(b), "int8_aqt", axis=axes.rhs, ftz=True, xla_reciprocal=True)))
    return integer_einsum(eqn, cl, sl, cr, sr, axes, order=SCALE_ORDERS[1], ftz=True)


@pytest.mark.parametrize(
    "bug, match",
    [(_float_matmul_of_dequantized, r"it equals the float32 matmul of the dequantized operands \(arithmetic='float'\) "
                                    r"bitwise"),
     (_scales_in_the_other_order, r"it equals the scales applied in the other order \(dot_general rhs first\) "
                                  r"bitwise")],
)
@pytest.mark.parametrize("site, eqn, lhs_shape, rhs_shape, first", SITES)
def test_integer_exact_names_the_bug_should_fail(bug, match, site, eqn, lhs_shape, rhs_shape, first):
    lhs, rhs = _probes(eqn, lhs_shape, rhs_shape)
    with pytest.raises(AssertionError, match=rf"assert_site_exact: site '{site}' einsum .*\(int8_aqt x int8_aqt, "
                                             rf"integer matmul\): differs .*; {match}"):
        assert_site_exact(bug, eqn, lhs, rhs, site=site, arithmetic="integer", **FMT)


def test_aqt_ragged_dot_shared_weight_scale_fails_exact_naming_it():
    lhs, rhs = probe_site_operands(3, (16, 32), (4, 32, 8), RAGGED_AXES)
    with pytest.raises(AssertionError, match=r"ragged_dot \(int8_aqt x int8_aqt, integer matmul\): differs .*it "
                                             r"equals rhs with one weight scale shared across groups \(calibrated "
                                             r"over groups and contraction\), in integer arithmetic bitwise"):
        assert_site_exact(_aqt_site(ragged=True), Ragged(uneven_group_sizes(16, 4, 3)), lhs, rhs, arithmetic="integer",
                          **FMT)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(arithmetic="fixed"), r"unknown arithmetic 'fixed'; valid: float, integer"),
     (dict(arithmetic="integer", lhs_format="e4m3fn", rhs_format="int8_aqt"),
      r"arithmetic='integer' needs integer formats \(int8, int8_aqt, int8_qwix\), got e4m3fn"),
     # Keras's int8 stores an encode scale, which Keras divides by: not the integer reference's arithmetic.
     (dict(arithmetic="integer", lhs_format="int8_keras", rhs_format="int8_keras"),
      r"arithmetic='integer' needs integer formats \(int8, int8_aqt, int8_qwix\), got int8_keras, int8_keras")],
)
def test_integer_exact_bad_input(kwargs, match):
    eqn, lhs_shape, rhs_shape = SITES[0][1:4]
    lhs, rhs = _probes(eqn, lhs_shape, rhs_shape)
    with pytest.raises(ValueError, match=match):
        assert_site_exact(jnp.einsum, eqn, lhs, rhs, **(FMT | kwargs))


def test_aqt_recipes_declare_formats_and_integer_matmul():
    for recipe in (aqt_int8(), aqt_int8_ragged()):
        declared = (recipe.lhs, recipe.rhs, recipe.reference.matmul, recipe.expect.backward_paths)
        assert declared == ("int8_aqt", "int8_aqt", "integer", ())
    assert qcheck.get_recipe("int8").reference.matmul == "float"



def test_float_exact_names_a_weight_scale_shared_across_groups_should_fail():
    """The same neighbour on the float path: qcheck's int8 with the ragged weight calibrated over all experts."""
    lhs, rhs = probe_site_operands(3, (16, 32), (4, 32, 8), RAGGED_AXES)

    def shared(a, b, gs):
        qa = referees.reference_qdq(np.asarray(a), "int8", axis=(1,), ftz=True, xla_reciprocal=True)
        qb = referees.reference_qdq(np.asarray(b), "int8", axis=(0, 1), ftz=True, xla_reciprocal=True)
        return jax.lax.ragged_dot(qa, qb, gs)

    with pytest.raises(AssertionError, match=r"ragged_dot \(int8 x int8\): differs .*it equals rhs with one weight "
                                             r"scale shared across groups \(calibrated over groups and contraction\) "
                                             r"bitwise"):
        assert_site_exact(shared, Ragged(uneven_group_sizes(16, 4, 3)), lhs, rhs, lhs_format="int8", rhs_format="int8")
