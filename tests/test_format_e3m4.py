"""A format is its record, its referee row and its tolerances row: e3m4, added through those three alone.

``e3m4`` (ml_dtypes.float8_e3m4) was added to qcheck as a record in
``qcheck/formats/_table.py`` (its sibling e4m3fn, its gradient flavour e5m2), a
row of ``qcheck/referees/_formats.py`` and a row of tests/format_properties.py.
A user's plug-in recipe that casts to it at scale 1, as a fresh fp8 site does
(``cast_dtype``: the gradient reference is its record's ``grad``), then passes
the suite's ``exact`` and ``backward`` with no other edit; the twins compute in
the sibling and quantize the gradient in the other flavour, and fail naming it.
The recipe cannot be Flax's delayed scaling (``DelayedScalingFp8``): flax 0.12.8's
``fp8_ops.get_fp8_max`` (flax/linen/fp8_ops.py:125) asserts its type is one of
e4m3fn, e5m2, e4m3fnuz, e5m2fnuz, so its sites cast at scale 1 by the formats' names.
"""

import ml_dtypes
import numpy as np
import pytest

import qcheck
from qcheck import checks, formats
from qcheck.recipes import DelayedScalingFp8, registered
from qcheck.recipes._sites import FormatSite
from qcheck.suite import cases, invariants
from qcheck.suite.cells import run_cell

VARIANT = cases.Variant("mixtral", "dense", False)


def _e3m4(name: str, grad: str = "e5m2") -> qcheck.Recipe:
    """A user's recipe, as a --recipes module would declare it: both operands cast to e3m4 at scale 1, the output
    gradient to ``grad``, an fp8-class site (``cast_dtype``)."""
    return qcheck.Recipe(name, lhs="e3m4", rhs="e3m4", grad=grad,
                         reference=qcheck.Reference(cast_dtype=ml_dtypes.float8_e3m4))


def test_e3m4_is_its_record():
    record = formats.get_format("e3m4")
    assert (record.kind, record.element, record.grad, record.siblings) == (
        "cast", np.dtype(ml_dtypes.float8_e3m4), "e5m2", ("e4m3fn",))
    assert record.normal_range == (0.25, 15.5)
    assert formats.cast_format(ml_dtypes.float8_e3m4) is record


def test_e3m4_probes_stay_in_its_normal_range():
    lhs, rhs = checks.probe_operands(0, (8, 32), (32, 16), cast_dtype=ml_dtypes.float8_e3m4)
    for x in (lhs, rhs):
        assert np.abs(x).min() >= 0.25
    plain = checks.probe_operands(0, (8, 32), (32, 16))[0]
    assert np.abs(plain).min() < 0.25  # the control: the plain probes reach e3m4's subnormals
    lhs, rhs = checks.probe_operands(0, (8, 32), (32, 16), normal_in=("e3m4", "int8"))  # a recipe's operand formats
    assert np.abs(lhs).min() >= 0.25 and np.abs(rhs).min() < 0.25


def test_flax_delayed_scaling_refuses_e3m4_in_one_line():
    with pytest.raises(ValueError, match=r"^recipe 'my_e3m4': e4m3_dtype float8_e3m4 is not a type Flax's fp8 ops take "
                                         r"\(flax.linen.fp8_ops.get_fp8_max asserts it is one of float8_e4m3fn, "
                                         r"float8_e4m3fnuz, float8_e5m2, float8_e5m2fnuz\)$"):
        DelayedScalingFp8("my_e3m4", e4m3_dtype=ml_dtypes.float8_e3m4, e5m2_dtype=ml_dtypes.float8_e5m2)


def test_a_users_e3m4_recipe_should_pass_exact_and_backward():
    recipe = _e3m4("probe_my_e3m4")
    with registered(recipe):
        case = cases.Case(recipe.name, VARIANT)
        # As every front end runs a cell: both must apply to the case (not n/a) and pass.
        verdicts = {name: run_cell(case, name) for name in ("exact", "backward")}
    assert {name: v.status for name, v in verdicts.items()} == {"exact": "pass", "backward": "pass"}, verdicts


class _CastsToE4m3fn(qcheck.Recipe):
    """Declares e3m4 operands and casts them to e4m3fn, the sibling."""

    def site_module(self, name):
        return FormatSite(lhs="e4m3fn", rhs="e4m3fn")


def test_an_e3m4_recipe_computing_in_e4m3fn_should_fail_exact_naming_the_sibling():
    with registered(_CastsToE4m3fn("probe_e3m4_in_e4m3fn", lhs="e3m4", rhs="e3m4")), pytest.raises(
            AssertionError, match=r"site 'wi_0' .*\(e3m4 x e3m4\): differs .*; it equals both operands in e4m3fn "
                                  r"instead of e3m4 bitwise"):
        invariants.run_exact(cases.Case("probe_e3m4_in_e4m3fn", VARIANT))


def test_an_e3m4_recipe_with_e5m2fnuz_gradients_should_fail_backward_naming_the_flavour():
    recipe = _e3m4("probe_e3m4_fnuz_grads", grad="e5m2fnuz")
    with registered(recipe), pytest.raises(
            AssertionError, match=r"dgrad \(g in float8_e5m2\).*equals the gradient with g in float8_e5m2fnuz "
                                  r"\(the other fnuz flavour\)"):
        invariants.run_backward(cases.Case(recipe.name, VARIANT))
