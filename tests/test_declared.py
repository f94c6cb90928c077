"""Cells a recipe declares: its library's refusals (Unsupported) and defects a check catches (KnownDefect).

Measured with aqtp 0.9.0 on jax 0.10.2 (CPU).
"""

from __future__ import annotations

import json

import pytest

from qcheck.recipes import KnownDefect, Unsupported, assert_still_unsupported
from qcheck.suite import invariants, matrix
from qcheck.suite._declared_cells import run_declared, declared as declared_for
from qcheck.suite.cases import Case, Variant
from tests.helpers import INNER, import_extra

import_extra("aqt")
from qcheck.adapters import AQT_RAGGED_NO_GRADIENT, AQT_RAGGED_SHARED_SCALE  # noqa: E402


def test_aqt_ragged_dot_still_refuses_gradients_should_pass():
    note = assert_still_unsupported(AQT_RAGGED_NO_GRADIENT)
    assert note.startswith('not supported by aqtp 0.9.0: aqt_ragged_dot.ragged_dot has no backward pass ("Currently '
                           'only forward pass is supported") (IndexError: index 1 is out of bounds'), note


def _declaration(**kwargs) -> Unsupported:
    fields = dict(library="aqtp", kind="gradient", paths=("sparse",), reason="r", reproduce=lambda: None,
                  raises=IndexError)
    return Unsupported(**(fields | kwargs))


def test_a_refusal_upstream_fixed_fails_saying_to_drop_it_should_fail():
    with pytest.raises(AssertionError, match=r"aqt: assert_still_unsupported: aqtp 0.9.0 gradient on sparse: the "
                                             r"library ran the refused case without raising IndexError; it is "
                                             r"supported now: drop this Unsupported declaration"):
        assert_still_unsupported(_declaration(), "aqt")


def test_a_refusal_with_another_message_fails_should_fail():
    def raise_other():
        raise IndexError("something else")

    with pytest.raises(AssertionError, match=r"still raises IndexError, but not matching 'out of bounds': "
                                             r"something else"):
        assert_still_unsupported(_declaration(reproduce=raise_other, match="out of bounds"))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [(dict(kind="forward"), ValueError, r"unknown unsupported kind 'forward'; valid unsupported kinds: gradient"),
     (dict(paths="sparse"), TypeError, r"paths must be a non-empty tuple of dense, sparse"),
     (dict(paths=("ragged",)), ValueError, r"unknown path 'ragged'; valid paths: dense, sparse"),
     (dict(reproduce=None), TypeError, r"reproduce must be a callable that runs aqtp"),
     (dict(reason=" "), ValueError, r"reason must say why")],
)
def test_unsupported_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        _declaration(**kwargs)


def test_known_defect_bad_input():
    with pytest.raises(ValueError, match=r"match must be a pattern of the expected failure message"):
        KnownDefect("aqtp", "exact", ("sparse",), "r", "")


SPARSE = Case("aqt_int8_ragged", Variant("mixtral", "sparse", False))


@pytest.mark.parametrize(
    "invariant, declared",
    [("backward", AQT_RAGGED_NO_GRADIENT), ("grads", AQT_RAGGED_NO_GRADIENT), ("state", None), ("train", None),
     ("exact", AQT_RAGGED_SHARED_SCALE), ("tracks", None), ("golden", None)],
)
def test_aqt_int8_ragged_declares_its_sparse_cells(invariant, declared):
    from qcheck.recipes import get_recipe

    recipe = get_recipe("aqt_int8_ragged")
    assert declared_for(recipe, SPARSE.variant, invariant) == declared
    assert declared_for(recipe, Variant("mixtral", "dense", False), invariant) is None


def test_known_defect_still_fails_should_pass():
    note = run_declared(SPARSE, "exact")
    assert note.startswith("known defect of aqtp 0.9.0: aqt_ragged_dot.ragged_dot shares one weight scale across "
                           "all experts (aqt_int8_ragged-mixtral-sparse: assert_sites_exact: site 'wi_0'"), note


def test_a_known_defect_that_passes_fails_saying_to_drop_it_should_fail(monkeypatch):
    (exact,) = (i for i in invariants.INVARIANTS if i.name == "exact")
    fixed = invariants.Invariant("exact", exact.applies, lambda case: None)  # upstream fixed the scale
    monkeypatch.setattr(invariants, "INVARIANTS", (fixed,))
    with pytest.raises(AssertionError, match=r"aqt_int8_ragged-mixtral-sparse: exact passes where aqtp 0.9.0 has "
                                             r"the declared defect \(aqt_ragged_dot.ragged_dot shares one weight "
                                             r"scale across all experts\): fixed upstream\? drop the KnownDefect"):
        run_declared(SPARSE, "exact")


def test_matrix_names_the_refusal_and_the_defect_in_notes():
    (row,) = matrix.run_matrix(("aqt_int8_ragged",), models=("mixtral",), paths=("sparse",))
    cells = {n: c.status for n, c in row.cells.items()}
    # AQT's shared weight scale shows twice: the coverage map holds the codes to int8_aqt, exact the products.
    assert cells == {"sites": "pass", "coverage": "known", "exact": "known", "backward": "unsupported",
                     "tracks": "pass", "grads": "unsupported", "edges": "pass", "state": "n/a", "train": "n/a",
                     "rng": "n/a", "sharded": "pass", "referee": "n/a", "golden": "pass"}, cells
    assert row.ok
    table = matrix.format_table([row])
    assert "known defect [1]" in table and "known defect [2]" in table and "not supported [3]" in table
    assert "not supported [4]" in table
    assert "[3] aqt_int8_ragged-mixtral-sparse backward:\n    not supported by aqtp 0.9.0: aqt_ragged_dot" in table
    detail = json.loads(matrix.to_json([row]))["aqt_int8_ragged-mixtral-sparse"]["grads"]
    assert detail["status"] == "unsupported" and detail["detail"].startswith("not supported by aqtp 0.9.0: ")


def test_plugin_moves_declared_cells_from_their_invariant_test_to_the_declared_test(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.qcheck_invariant("exact")
        def test_exact(qcheck_case):
            pass

        def test_declared(qcheck_declared):
            pass
        """
    )
    result = pytester.runpytest("--collect-only", "-q", *INNER, "--qcheck-recipe=aqt_int8_ragged")
    # Only this file's items: the plugin adds its own suite modules to a run that selects recipes.
    ids = {line.split("::", 1)[1] for line in result.outlines if line.startswith("test_plugin_moves")}
    # The recipe runs only the sparse path (its dense path is aqt_int8's), where exact is a declared defect.
    assert not {i for i in ids if i.startswith("test_exact")}
    assert {i for i in ids if i.startswith("test_declared")} == {
        f"test_declared[aqt_int8_ragged-{m}-sparse-{n}]" for m in ("mixtral", "gemma")
        for n in ("coverage", "exact", "backward", "grads")}


def test_matrix_summary_counts_the_declared_cells(capsys):
    from qcheck.suite.cli import main

    assert main(["--recipe", "aqt_int8_ragged", "--model", "mixtral", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(
        "all 1 cases pass (2 cells not supported and 2 known defects, as their recipes declare)"), out[-300:]
