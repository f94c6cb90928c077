"""The matrix, the pytest plugin and qcheck.testing give every cell of a plug-in recipe the same verdict.

The recipe declares a known defect on one invariant: the bound ``tracks``
holds it to is far too tight on its one path, so the check fails there as
declared. Every front end must treat that cell as declared (the invariant runs
and must fail as the declaration says), never as an ordinary failing test.
"""

from __future__ import annotations

import unittest

import pytest

from qcheck.recipes import import_recipes, registered
from qcheck.suite import golden, matrix
from tests.helpers import INNER

RECIPE = "planted_tight"
RECIPE_MODULE = f'''
import qcheck

qcheck.register_recipe(qcheck.Recipe(
    {RECIPE!r}, lhs="int8", rhs="int8",
    expect=qcheck.Expect(paths=("sparse",), max_rel_norm=1e-4, known_defects=(qcheck.KnownDefect(
        "planted", "tracks", ("sparse",), "the bound is planted far below int8's error",
        match=r"assert_tracks: relative norm [0-9.]+ exceeds the bound 0.0001"),))))
'''
MODEL = "mixtral"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The user's project: the recipe module, and golden cases of its mixtral cases (so golden is checked too)."""
    root = tmp_path_factory.mktemp("project")
    module = root / "planted_recipes.py"
    module.write_text(RECIPE_MODULE)
    with registered():
        import_recipes(str(module))
        cases = [c for c in golden.golden_cases((RECIPE,)) if c.model == MODEL]
        golden.write_cases(cases, root / "golden", overwrite=False)
        yield root


def _matrix(project) -> dict[tuple[str, str], str]:
    from qcheck.suite.invariants import RunEnv

    rows = matrix.run_matrix((RECIPE,), models=(MODEL,), env=RunEnv(project / "golden"))
    return {(r.case.id, n): c.status for r in rows for n, c in r.cells.items() if c.status != "n/a"}


def _pytest(project, pytester) -> dict[tuple[str, str], str]:
    import importlib

    suite = importlib.import_module("qcheck.suite.tests.test_invariants")
    invariant_of = {name: next((m.args[0] for m in getattr(fn, "pytestmark", []) if m.name == "qcheck_invariant"),
                               None) for name, fn in vars(suite).items() if name.startswith("test_")}
    pytester.chdir()
    reprec = pytester.inline_run(*INNER, f"--qcheck-recipes={project / 'planted_recipes.py'}",
                                 f"--golden-dir={project / 'golden'}", "-k", MODEL)
    verdicts = {}
    for report in reprec.getreports("pytest_runtest_logreport"):
        if report.when != "call" and not (report.failed or report.skipped):
            continue
        name, param = report.nodeid.split("::")[-1].rstrip("]").split("[")
        if name.startswith("test_declared"):
            case_id, invariant = param.rsplit("-", 1)
            verdict = "known" if report.passed else "fail"
        elif name == "test_golden_case":
            case_id, invariant, verdict = param, "golden", report.outcome
        else:
            case_id, invariant, verdict = param, invariant_of[name], report.outcome
        verdicts[(case_id, invariant)] = {"passed": "pass", "failed": "fail"}.get(verdict, verdict)
    return verdicts


def _testing(project) -> dict[tuple[str, str], str]:
    from qcheck import testing
    from qcheck.suite.cases import cases

    suite = type("PlantedSuite", (testing.InvariantTestCase,), {
        "qcheck_recipes": (RECIPE,), "qcheck_models": (MODEL,), "qcheck_golden_dir": project / "golden"})
    ids = {f"_{testing.testcase_name(c)}": c.id for c in cases((RECIPE,), models=(MODEL,))}
    verdicts = {}
    for name in unittest.TestLoader().getTestCaseNames(suite):
        test, result = suite(name), unittest.TestResult()
        test.run(result)
        (case_suffix,) = (s for s in ids if name.endswith(s))
        invariant = name.removeprefix("test_").removesuffix(case_suffix)
        outcome = "fail" if result.failures or result.errors else "skip" if result.skipped else "pass"
        if outcome == "pass" and "declared" in (test.shortDescription() or ""):
            outcome = "known"
        verdicts[(ids[case_suffix], invariant)] = outcome
    return verdicts


def test_the_three_front_ends_agree_on_a_declared_known_defect(project, pytester):
    with registered():
        import_recipes(str(project / "planted_recipes.py"))
        by_matrix = _matrix(project)
        by_pytest = _pytest(project, pytester)
        by_testing = _testing(project)
    assert {k for k, v in by_matrix.items() if v == "known"} == {(f"{RECIPE}-{MODEL}-sparse", "tracks")}, by_matrix
    assert "fail" not in by_matrix.values(), by_matrix
    assert by_pytest == by_matrix
    assert by_testing == by_matrix
