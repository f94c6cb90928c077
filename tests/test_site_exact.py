"""qcheck.checks._site: each forward exactness check passing on a healthy site and failing on its bug."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qcheck import formats, get_recipe, referees
from qcheck.referees._libraries import LIBRARY_RULES
from qcheck.checks import Einsum, Ragged
from qcheck.checks._site import (
    assert_layer_sites_exact,
    assert_site_exact,
    operand_formats,
    probe_site_operands,
)
from qcheck.layers.moe import MODELS, MoE
from qcheck.recipes import EINSUM_LAYOUTS, EINSUM_PARTIAL_SUMS, einsum_axes
from qcheck.recipes._axes import RAGGED_AXES
from qcheck.suite import cases

EQN = "BSM,EMH->BSEH"
LHS, RHS = (2, 32, 32), (8, 32, 64)


def _site(fmt_l, fmt_r, lhs_axes=None, rhs_axes=None):
    """An einsum quantizing with qcheck.formats along the given (default: contraction) axes."""
    axes = einsum_axes(EQN, 3, 3)

    @functools.partial(jax.jit, static_argnums=0)
    def einsum(eqn, a, b):
        a = a if fmt_l is None else formats.qdq(a, fmt_l, axis=lhs_axes or axes.lhs)
        b = b if fmt_r is None else formats.qdq(b, fmt_r, axis=rhs_axes or axes.rhs)
        return jnp.einsum(eqn, a, b)

    return einsum


def _probes(fmt):
    return probe_site_operands(0, LHS, RHS, einsum_axes(EQN, 3, 3), nvfp4=fmt == "nvfp4")


# Each row: the declared format, and a bug in the same family that must fail naming it.
ROWS = [
    ("int8", dict(fmt_l="int8_aqt", fmt_r="int8"), r"lhs in int8_aqt instead of int8"),
    ("int8_qwix", dict(fmt_l="int8_qwix", fmt_r="int8"), r"rhs in int8 instead of int8_qwix"),
    ("e4m3fn", dict(fmt_l="e4m3fn", fmt_r="e4m3fnuz"), r"rhs in e4m3fnuz instead of e4m3fn"),
    ("e4m3fn_current", dict(fmt_l="e4m3fn", fmt_r="e4m3fn_current"), r"lhs in e4m3fn instead of e4m3fn_current"),
    ("mxfp8", dict(fmt_l="mxfp8", fmt_r="mxfp8", rhs_axes=(2,)), r"rhs in mxfp8 along the wrong axes \(2,\)"),
    ("nvfp4", dict(fmt_l="nvfp4", fmt_r="nvfp4", lhs_axes=(1,)), r"lhs in nvfp4 along the wrong axes \(1,\)"),
    ("nvfp4", dict(fmt_l="nvfp4", fmt_r=None), r"rhs unquantized"),
]


@pytest.mark.parametrize("fmt", sorted({r[0] for r in ROWS}))
def test_assert_site_exact_should_pass(fmt):
    lhs, rhs = _probes(fmt)
    assert_site_exact(_site(fmt, fmt), EQN, lhs, rhs, lhs_format=fmt, rhs_format=fmt, site="s")


@pytest.mark.parametrize(("fmt", "bug", "why"), ROWS)
def test_assert_site_exact_should_fail(fmt, bug, why):
    lhs, rhs = _probes(fmt)
    with pytest.raises(AssertionError, match=rf"assert_site_exact: site 's' einsum '{EQN}' \({fmt} x {fmt}\): "
                       rf"differs .* first at \(.*\): got .*, expected .*; it equals {why}.* bitwise"):
        assert_site_exact(_site(**bug), EQN, lhs, rhs, lhs_format=fmt, rhs_format=fmt, site="s")


def _summed_in(parts: int, fmt: str, nudge: bool = False):
    """A site whose matmul sums its contraction into ``parts`` interleaved float32 partial sums, as XLA:CPU's
    dot may; ``nudge``: its first output one ulp off."""
    axes = einsum_axes(EQN, 3, 3)

    def einsum(eqn, a, b):
        a = np.asarray(formats.qdq(a, fmt, axis=axes.lhs))  # [B, S, M]
        b = np.asarray(formats.qdq(b, fmt, axis=axes.rhs))  # [E, M, H]
        sums = np.zeros((parts, a.shape[0], a.shape[1], b.shape[0], b.shape[2]), np.float32)
        for m in range(a.shape[2]):
            sums[m % parts] += a[:, :, None, m, None] * b[None, None, :, m, :]
        out = sums[0].copy()
        for part in sums[1:]:
            out += part
        if nudge:
            out.flat[0] = np.nextafter(out.flat[0], np.float32(np.inf))
        return out

    return einsum


def test_assert_site_exact_accepts_a_matmul_summed_in_interleaved_partial_sums():
    lhs, rhs = _probes("mxfp8")
    in_order, in_two = (_summed_in(k, "mxfp8")(EQN, lhs, rhs) for k in (1, 2))
    assert (in_order != in_two).sum() > 0  # the control: on these probes the sum order shows in the bits
    assert_site_exact(_summed_in(2, "mxfp8"), EQN, lhs, rhs, lhs_format="mxfp8", rhs_format="mxfp8", site="s")


@pytest.mark.parametrize(("parts", "nudge"), [(2, True), (3, False)])
def test_assert_site_exact_still_fails_one_ulp_off_or_an_order_it_does_not_know(parts, nudge):
    lhs, rhs = _probes("mxfp8")
    with pytest.raises(AssertionError, match=r"differs from the referee-quantized reference .*matches no known bug"):
        assert_site_exact(_summed_in(parts, "mxfp8", nudge), EQN, lhs, rhs, lhs_format="mxfp8", rhs_format="mxfp8",
                          site="s")


def test_sum_orders_are_tried_only_on_matmuls_small_enough_to_sum_in_numpy():
    # A failing check on a user's large matmul must not spend minutes summing it in numpy, five times over.
    assert set(EINSUM_PARTIAL_SUMS) <= set(Einsum(EQN).layouts(LHS, RHS))
    assert Einsum("ij,jk->ik").layouts((4096, 4096), (4096, 4096)) == EINSUM_LAYOUTS


def test_library_rules_name_a_failure_but_never_refuse_operands():
    """qwix's MXFP8 (ceil block scale, qcheck.referees._libraries) equals OCP's on blocks whose amax significand is at
    most 1.75: on such operands the reference cannot tell the two apart, yet a correct site still passes (the
    library rules only name failures), and a failing site is still named by the bug it does have."""
    axes = einsum_axes(EQN, 3, 3)
    lhs, rhs = _probes("mxfp8")

    def amax_significand_1_5(x, axis):
        return (x / np.max(np.abs(x), axis=axis, keepdims=True) * np.float32(1.5)).astype(np.float32)

    lhs, rhs = amax_significand_1_5(lhs, axes.lhs), amax_significand_1_5(rhs, axes.rhs)
    ((_, qwix_mxfp8),) = LIBRARY_RULES["mxfp8"]
    for x, ax in ((lhs, axes.lhs), (rhs, axes.rhs)):  # the control: here qwix's rule is OCP's, bitwise
        ocp = referees.reference_qdq(x, "mxfp8", axis=ax, ftz=True, xla_reciprocal=True)
        assert np.array_equal(qwix_mxfp8(x, ax, True).view(np.uint32), ocp.view(np.uint32))
    assert_site_exact(_site("mxfp8", "mxfp8"), EQN, lhs, rhs, lhs_format="mxfp8", rhs_format="mxfp8", site="s")
    with pytest.raises(AssertionError, match=r"it equals rhs unquantized bitwise"):
        assert_site_exact(_site("mxfp8", None), EQN, lhs, rhs, lhs_format="mxfp8", rhs_format="mxfp8", site="s")


def test_assert_site_exact_on_ragged_should_pass_and_fail():
    lhs, rhs = probe_site_operands(1, (128, 32), (8, 32, 64), RAGGED_AXES)
    sizes = np.array([20, 0, 30, 10, 40, 8, 20, 0], np.int32)

    def site(fmt_r):
        return jax.jit(lambda a, b, gs: jax.lax.ragged_dot(formats.qdq(a, "int8", axis=1),
                                                           formats.qdq(b, fmt_r, axis=1), gs))

    assert_site_exact(site("int8"), Ragged(sizes), lhs, rhs, lhs_format="int8", rhs_format="int8", site="r")
    with pytest.raises(AssertionError, match=r"site 'r' ragged_dot \(int8 x int8\).*rhs in int8_qwix instead"):
        assert_site_exact(site("int8_qwix"), Ragged(sizes), lhs, rhs, lhs_format="int8", rhs_format="int8", site="r")


def test_assert_site_exact_refuses_operands_that_cannot_tell_bugs_apart():
    lhs, rhs = (np.round(x) for x in _probes("int8"))  # small integers: e4m3fn and e4m3fnuz agree
    lhs, rhs = np.clip(lhs, -8, 8), np.clip(rhs, -8, 8)
    with pytest.raises(ValueError, match=r"site 's' .*the reference equals the unquantized matmul bitwise"):
        assert_site_exact(_site("e4m3fn", "e4m3fn"), EQN, lhs, rhs, lhs_format="e4m3fn", rhs_format="e4m3fn",
                          site="s")


def test_assert_site_exact_names_bad_arguments():
    lhs, rhs = _probes("int8")
    with pytest.raises(ValueError, match=r"unknown format 'int4'; valid formats: int8, "):
        assert_site_exact(_site("int8", "int8"), EQN, lhs, rhs, lhs_format="int4", rhs_format="int8")
    with pytest.raises(TypeError, match=r"assert_site_exact: lhs must be a float32 array, got dtype float64"):
        assert_site_exact(_site("int8", "int8"), EQN, lhs.astype(np.float64), rhs, lhs_format="int8",
                          rhs_format="int8")
    with pytest.raises(ValueError, match=r"recipe 'none' declares no operand formats"):
        operand_formats("none")


def test_assert_layer_sites_exact_should_pass_on_every_case_of_a_recipe():
    for case in cases.cases(("nvfp4",)):
        assert_layer_sites_exact(cases.layer(case), cases.layer_input(case.variant.model), "nvfp4", label=case.id)


def test_assert_layer_sites_exact_should_fail_on_a_site_swapped_for_an_unquantized_one():
    broken = MoE(MODELS["mixtral"], get_recipe("int8"), path="sparse", rngs=nnx.Rngs(cases.SEED), seed=cases.SEED)
    from qcheck.layers.bridge import QuantSite

    broken.sites["wo"] = QuantSite(get_recipe("none"), "wo", rngs=nnx.Rngs(7))
    with pytest.raises(AssertionError, match=r"^bug: assert_layer_sites_exact: site 'wo' ragged_dot \(int8 x int8\)"
                       r".*equals the unquantized matmul bitwise"):
        assert_layer_sites_exact(broken, cases.layer_input("mixtral"), "int8", label="bug")
