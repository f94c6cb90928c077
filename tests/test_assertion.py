"""The checks' shared parts: one message wrapper, one matmul description, format tables defined once."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcheck import checks, formats, referees
from qcheck.checks._assertion import assertion, judged_as
from qcheck.suite import golden, invariants

# Every public assertion of qcheck.checks but assert_quantized: it forwards every other keyword to the
# function it traces (a label would be taken from that function), and lives below qcheck.checks.
WRAPPED = sorted(n for n in checks.__all__ if n.startswith("assert_") and n != "assert_quantized")


@pytest.mark.parametrize("name", WRAPPED)
def test_every_assertion_goes_through_the_wrapper_with_a_label(name):
    fn = getattr(checks, name)
    assert fn.__qcheck_assertion__ == name
    label = inspect.signature(fn).parameters["label"]
    assert (label.kind, label.default) == (inspect.Parameter.KEYWORD_ONLY, "")


# The suite's checks too, but assert_layer_quantized: it puts its label in front of assert_quantized's message,
# which names itself.
SUITE_WRAPPED = [(m, n) for m in (invariants, golden) for n in sorted(m.__all__)
                 if n.startswith("assert_") and n != "assert_layer_quantized"]


@pytest.mark.parametrize("module, name", SUITE_WRAPPED, ids=[n for _, n in SUITE_WRAPPED])
def test_every_suite_check_goes_through_the_wrapper_with_a_label(module, name):
    fn = getattr(module, name)
    assert fn.__qcheck_assertion__ == name
    label = inspect.signature(fn).parameters["label"]
    assert (label.kind, label.default) == (inspect.Parameter.KEYWORD_ONLY, "")


X = np.linspace(1.0, 2.0, 16, dtype=np.float32)

# (call, exception, message): label first, then the check's name, then the check's own words and figure.
PREFIXES = [
    (lambda: checks.assert_tracks(X * 1.5, X, max_rel_norm=0.1), AssertionError,
     r"^assert_tracks: relative norm 0\.5000 exceeds the bound 0\.1$"),
    (lambda: checks.assert_tracks(X * 1.5, X, max_rel_norm=0.1, label="wo"), AssertionError,
     r"^wo: assert_tracks: relative norm 0\.5000 exceeds the bound 0\.1$"),
    (lambda: checks.assert_tracks(X, np.zeros_like(X), label="wo"), ValueError,
     r"^wo: assert_tracks: the reference is all zeros; a relative bound cannot judge it$"),
    (lambda: checks.assert_tracks(X.copy(), X, label="wo"), AssertionError,
     r"^wo: assert_tracks: actual is bitwise equal to the unquantized reference"),
    (lambda: checks.assert_no_recompiles(lambda: jax.jit(lambda v: v + 1)(X), label="bug"), AssertionError,
     r"^bug: assert_no_recompiles: the second run compiled 1 programs again"),
]


@pytest.mark.parametrize("call, exc, match", PREFIXES)
def test_prefix_and_label_should_fail(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_prefix_and_label_should_pass():
    # A passing call with a label returns the check's figure, untouched by the wrapper.
    assert checks.assert_tracks(X * 1.01, X, label="wo") == pytest.approx(0.01, rel=1e-3)


def test_a_check_inside_a_check_is_named_once():
    @assertion
    def assert_inner(*, label: str = ""):
        raise AssertionError("figure 3")

    @assertion
    def assert_outer(*, label: str = ""):
        assert_inner()

    with pytest.raises(AssertionError, match=r"^assert_inner: figure 3$"):
        assert_outer(label="x")


def test_a_judgement_run_on_values_computed_elsewhere_speaks_as_its_check():
    # The suite's one program per case computes every site's result; each check's judgement of them is named
    # as the check a user calls, with the suite's label.
    def judge(got, *, want):
        if got != want:
            raise AssertionError(f"got {got}, expected {want}")
        return got

    assert judged_as(checks.assert_site_exact, judge, 1, want=1) == 1
    with pytest.raises(AssertionError, match=r"^case: assert_site_exact: got 2, expected 1$"):
        judged_as(checks.assert_site_exact, judge, 2, want=1, label="case")
    with pytest.raises(TypeError, match=r"^judged_as: 'test_.*<locals>.judge' is not a check made by @assertion"):
        judged_as(judge, judge, 2, want=1)


def test_the_wrapper_refuses_a_check_without_a_keyword_only_label():
    with pytest.raises(TypeError, match="assert_unlabelled must take a keyword-only label"):
        @assertion
        def assert_unlabelled(x, label=""):
            pass


# -- one description of a matmul ------------------------------------------------------------------

LHS, RHS = checks.probe_operands(0, (12, 32), (3, 32, 16))


@pytest.mark.parametrize("eqn", ["ij->ji", "ij,jk,kl->il", "ij,jk", "i...,jk->ik", "ij,jk->i k,"])
def test_einsum_that_is_not_a_two_operand_einsum_is_refused(eqn):
    with pytest.raises(ValueError, match=r"^matmul must be a two-operand einsum with an explicit output"):
        checks.Einsum(eqn)
    with pytest.raises(ValueError, match=r"^assert_fresh_cast_exact: matmul must be a two-operand einsum"):
        checks.assert_fresh_cast_exact(jnp.einsum, eqn, LHS, LHS, cast_dtype=jnp.float8_e4m3fn)


@pytest.mark.parametrize(
    "check",
    [lambda mm: checks.assert_fresh_cast_exact(jax.lax.ragged_dot, mm, LHS, RHS, cast_dtype=jnp.float8_e4m3fn),
     lambda mm: checks.assert_site_exact(jax.lax.ragged_dot, mm, LHS, RHS, lhs_format="int8", rhs_format="int8")],
    ids=["fresh", "site"])
@pytest.mark.parametrize(
    "sizes, match",
    [([5, 7, 1], r"group_sizes sum to 13, lhs \(12, 32\) has 12 rows"),
     ([5, 7], r"group_sizes has 2 groups, rhs \(3, 32, 16\) has 3")])
def test_group_sizes_that_do_not_fit_the_operands_are_refused(check, sizes, match):
    with pytest.raises(ValueError, match=r"^assert_\w+: " + match):
        check(checks.Ragged(np.asarray(sizes)))


@pytest.mark.parametrize(
    "sizes, match",
    [([[5, 7, 0]], r"int64\[1, 3\] \[\[5, 7, 0\]\]$"),
     ([5.0, 7.0, 0.0], r"float64\[3\] \[5.0, 7.0, 0.0\]$"),
     ([13, -1, 0], r"int64\[3\] \[13, -1, 0\]$"),
     ([], r"float64\[0\] \[\]$")])
def test_group_sizes_that_are_not_sizes_are_refused(sizes, match):
    with pytest.raises(ValueError, match=r"^group_sizes must be a non-empty 1-D array of non-negative integers, "
                                         r"got " + match):
        checks.Ragged(np.asarray(sizes))


def test_einsum_operands_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match=r"^assert_site_exact: rhs has shape \(3, 32, 16\), but einsum 'ij,jk->ik' "
                                         r"gives it 2 axes"):
        checks.assert_site_exact(jnp.einsum, "ij,jk->ik", LHS, RHS, lhs_format="int8", rhs_format="int8")
    with pytest.raises(ValueError, match=r"^assert_site_exact: matmul must be an einsum string, qcheck.checks.Einsum\(eqn\) or "
                                         r"qcheck.checks.Ragged\(group_sizes\), got tuple"):
        checks.assert_site_exact(jnp.einsum, ("ij,jk->ik",), LHS, LHS.T, lhs_format="int8", rhs_format="int8")


def test_matmul_descriptions_compare_by_value():
    assert checks.Ragged(np.array([5, 7, 0], np.int32)) == checks.Ragged([5, 7, 0])
    assert hash(checks.Ragged([5, 7, 0])) == hash(checks.Ragged((5, 7, 0)))
    assert checks.Einsum("ij,jk->ik") == checks.Einsum("ij,jk->ik")
    assert checks.Ragged([5, 7, 0]).axes() == checks.Ragged([1]).axes(2, 3)


# -- format tables defined once ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", formats.format_names())
def test_axis_formats_are_the_formats_whose_quantization_depends_on_the_axes(fmt):
    # The referee's quantization of one tensor along its rows and along its columns: equal bits for a
    # format that scales the whole tensor alike, different ones for a per-slice or per-block format.
    # Rows and columns scaled by different powers of two, so that block amaxes (and power-of-two block
    # scales rounded up, as mxfp8_jax's) differ along either axis.
    i, j = np.indices((32, 32))
    x = (checks.probe_operands(3, (32, 32))[0] * np.exp2(i % 8 - (j % 5) * 2.0)).astype(np.float32)
    along = [referees.reference_qdq(x, fmt, axis=a) for a in (0, 1)]
    assert (not np.array_equal(along[0].view(np.uint32), along[1].view(np.uint32))) == (fmt in formats.AXIS_FORMATS)


def test_fp8_siblings_pair_each_fp8_format_with_its_other_fnuz_flavour():
    names = {n.removeprefix("float8_") for n in formats.FP8_DTYPES}
    assert set(formats.FP8_SIBLINGS) == names
    for fmt, sib in formats.FP8_SIBLINGS.items():
        assert sib in formats.FP8_SIBLINGS and sib != fmt
        if f"{fmt[:4]}fnuz" not in names and f"{fmt[:4]}fn" not in names:  # no fnuz twin (e3m4): the common type
            assert sib == "e4m3fn"
            continue
        assert formats.FP8_SIBLINGS[sib] == fmt
        assert fmt[:4] == sib[:4] and fmt.endswith("fnuz") != sib.endswith("fnuz")  # same family, other flavour


# -- one result type ------------------------------------------------------------------------------


def test_figures_is_its_main_figure_and_names_every_figure():
    import json
    import pickle

    fig = checks.Figures(3, dgrad=3, wgrad=5)
    assert fig == 3 and float(fig) == 3.0 and f"{fig:.1f}" == "3.0" and json.dumps(fig) == "3.0"
    assert dict(fig.items()) == {"dgrad": 3, "wgrad": 5} and set(fig) == {"dgrad", "wgrad"} and fig["wgrad"] == 5
    again = pickle.loads(pickle.dumps(fig))
    assert isinstance(again, checks.Figures) and again == 3 and dict(again.figures) == dict(fig.figures)
    with pytest.raises(KeyError, match="no figure 'margin'; figures: dgrad, wgrad"):
        fig["margin"]


def test_measuring_checks_return_figures_should_pass():
    rel = checks.assert_tracks(X * 1.01, X, label="wo")
    assert isinstance(rel, checks.Figures) and rel == rel["rel_norm"]
    lhs, rhs = checks.probe_operands(1, (12, 32), (3, 32, 16))
    rows = checks.assert_ragged_groups_independent(jax.lax.ragged_dot, lhs, rhs, np.array([5, 7, 0], np.int32))
    assert isinstance(rows, checks.Figures) and rows == rows["rows"] == 7


def test_figures_print_as_the_number_they_replaced():
    assert f"{checks.Figures(7, rows=7)} rows" == "7 rows" and str(checks.Figures(np.float32(0.5))) == "0.5"
