"""Declared upstream defects: the cell still runs and must fail as declared (matrix and pytest plugin)."""

import pytest

from qcheck.recipes import KnownDefect
from qcheck.suite import invariants, matrix, plugin
from qcheck.suite._known_defects import assert_known_defect_reproduces, known_defect
from qcheck.suite.cases import Case, Variant

DEFECT = KnownDefect("sharded", "mixtral-sparse", match=r"differs at \d+ of 2048", reason="library bug")


def _fails(message):
    def check(*_):
        raise AssertionError(message)
    return check


def test_known_defect_reproduces_should_pass():
    assert assert_known_defect_reproduces(_fails("case: differs at 3 of 2048"), DEFECT, "case") == (
        "case: differs at 3 of 2048")


@pytest.mark.parametrize("check, match", [
    (lambda: 0.0, r"^case: known defect no longer reproduces: sharded passes \(library bug\); remove it"),
    (_fails("case: NaN in output"), r"^case: known defect \(library bug\): sharded failed, but not with a message "
                                    r"matching 'differs at \\\\d\+ of 2048': case: NaN in output"),
])
def test_known_defect_reproduces_should_fail(check, match):
    with pytest.raises(AssertionError, match=match):
        assert_known_defect_reproduces(check, DEFECT, "case")


@pytest.mark.parametrize("kwargs, match", [
    (dict(invariant=""), r"KnownDefect.invariant must be a non-empty string, got ''"),
    (dict(reason=None), r"KnownDefect.reason must be a non-empty string, got None"),
])
def test_known_defect_bad_fields_are_named(kwargs, match):
    fields = dict(invariant="sharded", variant="mixtral-sparse", match="x", reason="r") | kwargs
    with pytest.raises(TypeError, match=match):
        KnownDefect(**fields)


class _Declared:
    known_defects = (DEFECT,)


def test_known_defect_is_found_by_invariant_and_variant():
    assert known_defect(_Declared(), "sharded", Variant("mixtral", "sparse", False)) is DEFECT
    assert known_defect(_Declared(), "sharded", Variant("gemma", "sparse", False)) is None
    assert known_defect(_Declared(), "tracks", Variant("mixtral", "sparse", False)) is None


@pytest.fixture
def declared(monkeypatch):
    monkeypatch.setattr(matrix, "get_recipe", lambda name: _Declared())
    return Case("declared", Variant("mixtral", "sparse", False))


def test_matrix_cell_of_a_declared_defect_reads_defect_should_pass(declared):
    inv = invariants.Invariant("sharded", lambda r, v: True, _fails("declared-mixtral-sparse: differs at 9 of 2048"))
    cell = matrix._cell(inv, declared, invariants.RunEnv())
    assert (cell.status, cell.text(1)) == ("defect", "defect [1]")
    assert cell.detail == "known upstream defect: library bug\ndeclared-mixtral-sparse: differs at 9 of 2048"


def test_matrix_cell_of_a_declared_defect_that_passes_fails(declared):
    inv = invariants.Invariant("sharded", lambda r, v: True, lambda case, env: 0.0)
    cell = matrix._cell(inv, declared, invariants.RunEnv())
    assert cell.status == "fail" and "known defect no longer reproduces" in cell.detail


def test_plugin_runs_a_declared_defect_as_a_strict_expected_failure():
    (mark,) = plugin._known_defect_marks(_Declared(), "sharded", Variant("mixtral", "sparse", False))
    assert mark.name == "xfail" and mark.kwargs["strict"] and mark.kwargs["raises"] is AssertionError
    assert plugin._known_defect_marks(_Declared(), "sharded", Variant("gemma", "sparse", False)) == []
