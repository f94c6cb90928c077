"""A library defect keyed on the versions it was seen on: still shown where seen, said so where not, checked as
any cell from the version that fixed it; and a version qcheck cannot parse is one line naming it. No JAX programs:
the invariant is a stand-in that passes or fails as the test says."""

from __future__ import annotations

import importlib.metadata

import pytest

from qcheck.recipes import Expect, KnownDefect
from qcheck.suite import _declared_cells
from qcheck.suite.cases import Case, Variant
from qcheck.suite.invariants import Invariant

JAX = importlib.metadata.version("jax")
CELL = Case("declares", Variant("mixtral", "sparse", False))


def _defect(**kw) -> KnownDefect:
    return KnownDefect(**(dict(library="jax", invariant="tracks", paths=("sparse",), reason="a planted defect",
                               match=r"planted failure") | kw))


def _run(monkeypatch, defects: tuple[KnownDefect, ...], fails: bool) -> str:
    class Declares:
        name = "declares"
        expect = Expect(known_defects=defects)

    def run(case):
        if fails:
            raise AssertionError("planted failure at site 'wi_0'")

    monkeypatch.setattr(_declared_cells, "get_recipe", lambda name: Declares())
    return _declared_cells.run_declared(CELL, Invariant("tracks", lambda r, v: True, run))


def test_a_defect_seen_here_still_fails_as_declared_should_pass(monkeypatch):
    note = _run(monkeypatch, (_defect(seen=(JAX,)),), fails=True)
    assert note.startswith(f"known defect of jax {JAX} (seen on {JAX}): a planted defect (planted failure")


def test_a_defect_seen_here_that_now_passes_says_to_drop_it_should_fail(monkeypatch):
    with pytest.raises(AssertionError, match=rf"declares-mixtral-sparse: tracks passes where jax {JAX} has the "
                                             r"declared defect .*fixed upstream\? drop the KnownDefect"):
        _run(monkeypatch, (_defect(seen=(JAX,)),), fails=False)


def test_a_defect_never_seen_on_this_version_that_passes_says_so(monkeypatch):
    note = _run(monkeypatch, (_defect(seen=("0.0.1",)),), fails=False)
    assert note == (f"known defect of jax (seen on 0.0.1) does not show on jax {JAX}: tracks passes (a planted "
                    f"defect); if it is fixed there, declare fixed_in='{JAX}'")


def test_a_failure_other_than_the_declared_one_is_a_failure_on_any_version(monkeypatch):
    defect = _defect(seen=("0.0.1",), match=r"another message")
    with pytest.raises(AssertionError, match=r"tracks fails, but not as the declared jax defect"):
        _run(monkeypatch, (defect,), fails=True)


def test_from_the_version_that_fixed_it_the_cell_is_checked_as_any_other():
    class Declares:
        expect = Expect(known_defects=(_defect(seen=("0.0.1",), fixed_in="0.0.2"),))

    assert _declared_cells.declared(Declares(), CELL.variant, "tracks") is None
    Declares.expect = Expect(known_defects=(_defect(seen=("0.0.1",), fixed_in="999.0"),))  # the control
    assert _declared_cells.declared(Declares(), CELL.variant, "tracks") is Declares.expect.known_defects[0]


def test_of_two_defects_on_one_cell_the_one_seen_here_answers():
    other, here = _defect(seen=("0.0.1",), match="old"), _defect(seen=(JAX,), match="new")

    class Declares:
        expect = Expect(known_defects=(other, here))

    assert _declared_cells.declared(Declares(), CELL.variant, "tracks") is here


@pytest.mark.parametrize("kw, error, message", [
    (dict(seen=("latest",)), ValueError,
     r"^KnownDefect of jax \(tracks\), seen: 'latest' is not a version qcheck can parse \(a release such as "
     r"'0\.12\.1'\)$"),
    (dict(fixed_in="0.12.x"), ValueError, r"^KnownDefect of jax \(tracks\), fixed_in: '0\.12\.x' is not a version"),
    (dict(seen="0.12.1"), TypeError, r"^KnownDefect of jax \(tracks\): seen must be a tuple of version strings"),
    (dict(seen=("0.12.1",), fixed_in="0.12.1"), ValueError,
     r"^KnownDefect of jax \(tracks\): seen on 0\.12\.1, at or after fixed_in 0\.12\.1$"),
])
def test_a_version_qcheck_cannot_parse_is_one_line_naming_it(kw, error, message):
    with pytest.raises(error, match=message):
        _defect(**kw)
