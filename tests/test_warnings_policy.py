"""The warnings policy of qcheck's own runs (conftest.py): a deprecation in an installed library's own code is
shown in the warnings summary, not raised; one in qcheck's code, a test, or a test tool still fails the test.

A warning's module is the ``__name__`` of the frame it is attributed to, so code run under a library's module name
is, to the filters, that library's code (numpy: a dependency of qcheck, installed wherever qcheck is).
"""

import textwrap
import warnings

import pytest

CATEGORIES = [DeprecationWarning, PendingDeprecationWarning, FutureWarning]


def _warn_as(module: str, category: type[Warning], message: str) -> None:
    """Warn from a frame whose module is ``module``, as that module's own code would."""
    code = compile(f"import warnings\nwarnings.warn({message!r}, {category.__name__})", f"<{module}>", "exec")
    exec(code, {"__name__": module})


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_deprecation_in_an_installed_librarys_own_code_is_reported_not_raised(category):
    with warnings.catch_warnings(record=True) as seen:  # the session's filters, the warnings kept instead of shown
        _warn_as("numpy._qcheck_probe", category, "old API")
    assert [(w.category, str(w.message)) for w in seen] == [(category, "old API")]


@pytest.mark.parametrize("module", [
    "qcheck._qcheck_probe",
    __name__,
    "hypothesis._qcheck_probe",  # a test tool: its deprecations are about qcheck's tests
    "numpy_lookalike",  # a name only beginning with a library's is no library
])
@pytest.mark.parametrize("category", CATEGORIES)
def test_a_deprecation_in_qchecks_code_or_its_tests_still_raises(module, category):
    with pytest.raises(category, match="old API"):
        _warn_as(module, category, "old API")


def test_pytest_shows_a_librarys_deprecation_in_its_summary_and_fails_a_tests(request, pytester):
    """The session's own ``filterwarnings`` lines (pyproject.toml's, and the ones conftest.py added) in a run of
    two tests: the library's deprecation passes and is listed under the warnings summary, the test's fails."""
    lines = request.config.getini("filterwarnings")
    assert lines[0] == "error" and any(line.startswith("default::DeprecationWarning:^(") for line in lines)
    pytester.makeini("[pytest]\nfilterwarnings =\n" + "".join(f"    {line}\n" for line in lines))
    pytester.makepyfile(test_probe=textwrap.dedent("""
        import warnings

        def test_library():
            exec("import warnings\\nwarnings.warn('the library is old', DeprecationWarning)",
                 {"__name__": "numpy._qcheck_probe"})

        def test_own():
            warnings.warn("the test is old", DeprecationWarning)
    """))
    # qcheck's plugin is imported already, so the inner run cannot assertion-rewrite it: that warning, under the
    # inner "error", would stop its configuration (tests/helpers.py's INNER ignores it too).
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning")
    result.assert_outcomes(passed=1, failed=1, warnings=1)
    result.stdout.fnmatch_lines(["*warnings summary*", "test_probe.py::test_library",
                                 "*DeprecationWarning: the library is old"])
    result.stdout.fnmatch_lines(["E * DeprecationWarning: the test is old", "*FAILED test_probe.py::test_own*"])
