"""The exact check's probes tell every declared format from its sibling, on both matmul forms.

A user's ``Recipe("my_e5m2", lhs="e5m2", rhs="e5m2")`` once failed ``exact`` on
every case with a ValueError: on the plain probes (2^-4..2^10) e5m2 and
e5m2fnuz round alike, so the check refused its own operands. The probes now
fill some contraction fibres of an e5m2-class operand from the binade where the
two part (qcheck.checks._probes.PARTING_BINADES). The property below holds that for
every format qcheck knows and every sibling the check must rule out, with
references computed here from the numpy referees and a plain JAX matmul; the
suite's ``exact`` then passes such a recipe and fails one that computes in the
sibling, naming it. The same holds for the public fp8 cast check
(``checks.probe_operands(cast_dtype=, contract=)``) and for declared e5m2
gradients (``backward``).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import qcheck
from qcheck import checks, formats, referees
from qcheck.checks._probes import PARTING_BINADES
from qcheck.checks._site import NEIGHBOURS, probe_site_operands
from qcheck.layers.moe import MODELS, MoE
from qcheck.recipes import einsum_axes, registered
from qcheck.recipes._axes import RAGGED_AXES
from qcheck.recipes._sites import FormatSite
from qcheck.suite import cases, invariants
from qcheck.recipes import uneven_group_sizes

FTZ = jax.default_backend() == "cpu"  # as the check's referee: XLA's CPU backend flushes float32 subnormals
# Every (format, sibling) the check rules out; nvfp4 has none, and is held by the should-pass below.
PAIRS = [(fmt, other) for fmt, others in NEIGHBOURS.items() for other in others]


def _specs(ragged: bool):
    """The suite's own site shapes, (eqn or None, lhs shape, rhs shape), one form at a time."""
    out = set()
    for model in MODELS:
        for variant in (v for v in cases.VARIANTS if v.model == model):
            layer = MoE(MODELS[model], qcheck.get_recipe("none"), path=variant.path,
                        capacity_factor=variant.capacity_factor, rngs=nnx.Rngs(0))
            out |= {(getattr(s.matmul, "eqn", None), s.lhs_shape, s.rhs_shape)
                    for s in layer.site_specs(cases.BATCH, cases.SEQ).values()
                    if isinstance(s.matmul, checks.Ragged) == ragged}
    return sorted(out, key=repr)


SPECS = {"einsum": _specs(False), "ragged_dot": _specs(True)}


@functools.partial(jax.jit, static_argnums=0)
def _einsum(eqn, a, b):
    return jnp.einsum(eqn, a, b)


@jax.jit
def _ragged(a, b, sizes):
    return jax.lax.ragged_dot(a, b, sizes)


def _axes(eqn, lhs_shape, rhs_shape):
    return RAGGED_AXES if eqn is None else einsum_axes(eqn, len(lhs_shape), len(rhs_shape))


def _reference(eqn, sizes, axes, lhs, rhs, lhs_fmt, rhs_fmt):
    """The matmul of referee-quantized operands (numpy/ml_dtypes), run by JAX as the check's reference is."""
    a = referees.reference_qdq(lhs, lhs_fmt, axis=axes.lhs, ftz=FTZ, xla_reciprocal=True)
    b = referees.reference_qdq(rhs, rhs_fmt, axis=axes.rhs, ftz=FTZ, xla_reciprocal=True)
    return np.asarray(_ragged(a, b, sizes) if eqn is None else _einsum(eqn, a, b))


def _bits(x):
    return np.ascontiguousarray(x).view(np.uint32)


def test_every_format_qcheck_knows_has_its_siblings_declared():
    assert set(NEIGHBOURS) == set(formats.format_names()) == set(referees.referee_format_names())
    assert set(PARTING_BINADES) <= set(NEIGHBOURS)


@pytest.mark.parametrize("form", sorted(SPECS))
@given(seed=st.integers(0, 2**16), pick=st.integers(0, 2**8))
def test_probes_part_every_format_from_its_sibling(form, seed, pick):
    eqn, lhs_shape, rhs_shape = SPECS[form][pick % len(SPECS[form])]
    axes = _axes(eqn, lhs_shape, rhs_shape)
    sizes = None if eqn is not None else uneven_group_sizes(lhs_shape[0], rhs_shape[0], seed)
    for fmt in NEIGHBOURS:
        lhs, rhs = probe_site_operands(seed, lhs_shape, rhs_shape, axes, lhs_format=fmt, rhs_format=fmt)
        want = _bits(_reference(eqn, sizes, axes, lhs, rhs, fmt, fmt))
        for other in NEIGHBOURS[fmt]:
            for bug, (lf, rf) in (("lhs", (other, fmt)), ("rhs", (fmt, other)), ("both", (other, other))):
                got = _bits(_reference(eqn, sizes, axes, lhs, rhs, lf, rf))
                assert not np.array_equal(got, want), (
                    f"{form} {eqn} {lhs_shape} x {rhs_shape}, seed {seed}: {bug} in {other} instead of {fmt} "
                    "gives the reference bitwise")


def test_parting_fills_whole_contraction_fibres_from_the_binade_and_leaves_other_formats_alone():
    eqn, lhs_shape, rhs_shape = "BSM,EMH->BSEH", (2, 32, 32), (8, 32, 64)
    axes = einsum_axes(eqn, 3, 3)
    plain = probe_site_operands(0, lhs_shape, rhs_shape, axes)
    assert all(np.array_equal(a, b) for a, b in zip(plain, probe_site_operands(
        0, lhs_shape, rhs_shape, axes, lhs_format="e4m3fn", rhs_format="int8")))
    lhs, rhs = probe_site_operands(0, lhs_shape, rhs_shape, axes, lhs_format="e5m2", rhs_format="e4m3fn")
    assert np.array_equal(rhs, plain[1])
    lo, hi = PARTING_BINADES["e5m2"]
    small = (np.abs(lhs) >= 2.0**lo) & (np.abs(lhs) < 2.0**hi)
    fibres = small.all(axis=axes.lhs)  # whole fibres along the contraction, or none of one
    assert np.array_equal(small, np.broadcast_to(np.expand_dims(fibres, axes.lhs), small.shape))
    assert 0 < fibres.mean() < 0.5
    assert np.array_equal(lhs[~small], plain[0][~small])


@pytest.mark.parametrize("fmt", sorted(PARTING_BINADES))
def test_xla_casts_the_parting_binade_as_the_referee_does(fmt):
    """The premise of the binade: XLA (here, the CPU backend) casts to e5m2's subnormals exactly, not flushed."""
    lo, hi = PARTING_BINADES[fmt]
    x = (np.exp2(np.linspace(lo, hi, 257)[:-1]) * np.resize([1.0, -1.0], 256)).astype(np.float32)
    got = np.asarray(jax.jit(lambda a: formats.qdq(a, fmt))(x))
    assert np.array_equal(_bits(got), _bits(referees.reference_qdq(x, fmt, ftz=FTZ)))
    other = NEIGHBOURS[fmt][0]
    assert np.mean(referees.reference_qdq(x, fmt) != referees.reference_qdq(x, other)) > 0.4


def test_probe_site_operands_names_an_unknown_format():
    with pytest.raises(ValueError, match=r"probe_site_operands: unknown format 'e5m3'; valid formats: int8, "):
        probe_site_operands(0, (4, 8), (2, 8, 4), RAGGED_AXES, lhs_format="e5m3")


# -- through the suite's exact check -------------------------------------------------------


class _RunsFnuz(qcheck.Recipe):
    """Declares e5m2 and computes in e5m2fnuz: the wrong flavour throughout."""

    def site_module(self, name):
        return FormatSite(lhs="e5m2fnuz", rhs="e5m2fnuz")


VARIANTS = [cases.Variant("mixtral", "dense", False), cases.Variant("gemma", "sparse", False)]


def _check_exact(recipe, variant):
    with registered(recipe):  # as a user's --recipes module registers it
        invariants.run_exact(cases.Case(recipe.name, variant))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.id)
def test_a_users_e5m2_recipe_should_pass_exact(variant):
    _check_exact(qcheck.Recipe("probe_my_e5m2", lhs="e5m2", rhs="e5m2"), variant)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.id)
def test_an_e5m2_recipe_computing_in_e5m2fnuz_should_fail_exact_naming_the_sibling(variant):
    form = "einsum 'BSM,EMH->BSEH'" if variant.path == "dense" else "ragged_dot"
    with pytest.raises(AssertionError, match=rf"^probe_runs_fnuz-{variant.id}: assert_sites?_\w+: site 'wi_0' {form} "
                       r"\(e5m2 x e5m2\): differs .*; it equals both operands in e5m2fnuz instead of e5m2 bitwise"):
        _check_exact(_RunsFnuz("probe_runs_fnuz", lhs="e5m2", rhs="e5m2"), variant)


def test_the_plain_probes_cannot_part_e5m2_from_e5m2fnuz():
    """The control: without the formats the probes are the plain ones, on which the property above fails."""
    eqn, lhs_shape, rhs_shape = SPECS["einsum"][0]
    axes = _axes(eqn, lhs_shape, rhs_shape)
    lhs, rhs = probe_site_operands(0, lhs_shape, rhs_shape, axes)
    assert np.array_equal(_bits(_reference(eqn, None, axes, lhs, rhs, "e5m2", "e5m2")),
                          _bits(_reference(eqn, None, axes, lhs, rhs, "e5m2fnuz", "e5m2fnuz")))


# -- the public fp8 cast check, and gradients --------------------------------------------

E5M2, E5M2FNUZ = (np.dtype(ml_dtypes.float8_e5m2), np.dtype(ml_dtypes.float8_e5m2fnuz))


def _cast_einsum(dtype):
    def einsum(eqn, a, b):
        q = lambda x: jnp.clip(x, -57344, 57344).astype(dtype).astype(x.dtype)  # noqa: E731
        return jnp.einsum(eqn, q(a), q(b))

    return einsum


def _cast_ragged(dtype):
    def ragged_dot(a, b, sizes):
        q = lambda x: jnp.clip(x, -57344, 57344).astype(dtype).astype(x.dtype)  # noqa: E731
        return jax.lax.ragged_dot(q(a), q(b), sizes)

    return ragged_dot


@pytest.mark.parametrize(("flavour", "sibling"), [(E5M2, E5M2FNUZ), (E5M2FNUZ, E5M2)], ids=["e5m2", "e5m2fnuz"])
def test_fresh_cast_exact_should_pass_on_the_e5m2_flavour_and_fail_on_its_sibling(flavour, sibling):
    lhs, rhs = checks.probe_operands(0, (8, 32), (32, 16), cast_dtype=flavour, contract=((1,), (0,)))
    checks.assert_fresh_cast_exact(_cast_einsum(flavour), "tm,mh->th", lhs, rhs, cast_dtype=flavour)
    with pytest.raises(AssertionError, match=rf"{sibling.name}-cast reference bitwise \(wrong fp8 flavour\)"):
        checks.assert_fresh_cast_exact(_cast_einsum(sibling), "tm,mh->th", lhs, rhs, cast_dtype=flavour)
    lhs, rhs = checks.probe_operands(1, (24, 32), (4, 32, 8), cast_dtype=flavour, contract=((1,), (1,)))
    sizes = np.array([10, 6, 8, 0], np.int32)
    checks.assert_fresh_cast_exact(_cast_ragged(flavour), checks.Ragged(sizes), lhs, rhs, cast_dtype=flavour)
    with pytest.raises(AssertionError, match=rf"ragged_dot differs .*{sibling.name}-cast reference bitwise"):
        checks.assert_fresh_cast_exact(_cast_ragged(sibling), checks.Ragged(sizes), lhs, rhs, cast_dtype=flavour)


def test_fresh_cast_exact_refuses_the_plain_probes_for_e5m2_and_probe_operands_asks_for_contract():
    lhs, rhs = checks.probe_operands(0, (8, 32), (32, 16))
    with pytest.raises(ValueError, match=r"float8_e5m2-cast reference equals the float8_e5m2fnuz-cast reference bitwise.*contract="):
        checks.assert_fresh_cast_exact(_cast_einsum(E5M2), "tm,mh->th", lhs, rhs, cast_dtype=E5M2)
    with pytest.raises(ValueError, match=r"probe_operands: cast_dtype float8_e5m2 .* give contract=, one tuple of "
                       r"contraction axes per shape \(2\), got None"):
        checks.probe_operands(0, (8, 32), (32, 16), cast_dtype=E5M2)


class _GradsInFnuz(qcheck.Recipe):
    """Declares e5m2 gradients and quantizes them in e5m2fnuz."""

    def site_module(self, name):
        return FormatSite(lhs="e5m2", rhs="e5m2", grad="e5m2fnuz")


def test_an_e5m2_gradient_recipe_should_pass_backward():
    recipe = qcheck.Recipe("probe_grad_e5m2", lhs="e5m2", rhs="e5m2", grad="e5m2")
    with registered(recipe):
        invariants.run_backward(cases.Case(recipe.name, VARIANTS[0]))


def test_an_e5m2_gradient_recipe_quantizing_g_in_e5m2fnuz_should_fail_backward_naming_the_sibling():
    recipe = _GradsInFnuz("probe_grad_fnuz", lhs="e5m2", rhs="e5m2", grad="e5m2")
    with registered(recipe), pytest.raises(AssertionError, match=r"-mixtral-dense: assert_sites_backward_exact: site 'wi_0' dgrad \(g in "
                       r"e5m2 along axes \(2, 3\)\): differs .*; it equals the gradient with g in e5m2fnuz instead "
                       r"of e5m2 bitwise"):
        invariants.run_backward(cases.Case(recipe.name, VARIANTS[0]))
