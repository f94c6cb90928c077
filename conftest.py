"""Root conftest: strict settings for qcheck's own test runs. The fixtures come from qcheck's pytest plugin.

Only for sessions rooted here: with an editable install, a user's session that
runs the invariant suite (``--qcheck-recipes``) collects the suite's modules
from this checkout, and pytest then loads this file too, late. The user's
process keeps its own settings (pytester, which the plugin's own tests need,
is enabled by ``addopts`` in pyproject.toml, read only in qcheck's own runs).
"""

import functools
import os
import re
import warnings
from importlib import metadata
from pathlib import Path

import pytest

from qcheck.suite import _process

_HERE = Path(__file__).resolve().parent


def _own_session(config: pytest.Config) -> bool:
    return Path(config.rootpath).resolve() == _HERE

# Local runs keep JAX's compilation cache across runs in a per-user directory
# (qcheck.suite._process.persistent_cache_dir; docs/performance.md says what it buys).
# Where it is off (QCHECK_XLA_CACHE=0, or CI=true) runs stay cold, but the xdist
# workers of one run still share a cache that lives only as long as the run
# (qcheck.suite._process.start_run_cache).


def _runs_tests(config: pytest.Config) -> bool:
    """False in pytest-xdist's controller, which hands tests to workers and needs no JAX (2-3 s of imports)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or not config.getoption("numprocesses", None)


def _configure_test_process() -> None:
    import jax
    from hypothesis import HealthCheck, settings

    # A test that uses pytester (the plugin's, the guide's, test_golden's) removes from
    # sys.modules, when it ends, every module first imported while it ran: pytester
    # snapshots sys.modules at setup and restores it at teardown (and around each
    # in-process run). The suite modules the plugin imports lazily would then be
    # imported afresh by later tests: a second copy with its own caches (its layers
    # built and compiled again) and its own globals (a monkeypatch on one copy that
    # the other ignores). Imported here, before any test, they stay one copy. (Not
    # an import-order fix: golden and invariants do not import each other.)
    import qcheck.suite.golden  # noqa: F401
    import qcheck.suite.invariants  # noqa: F401

    # Implicit rank promotion hides shape bugs in einsum-heavy code.
    jax.config.update("jax_numpy_rank_promotion", "raise")
    # On a GPU node only the hardware-marked tests run there, on arrays they put there.
    # The persistent cache, where on, wins over the run's own cache.
    worker = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    _process.setup(worker=worker, cache_dir=_process.persistent_cache_dir() or _process.run_cache_dir(), own=True)

    # Derandomized for CI (same examples every run, whatever the worker); no deadline
    # since the first example of a test pays for JIT compilation.
    settings.register_profile(
        "ci", derandomize=True, deadline=None, max_examples=20, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("dev", deadline=None, max_examples=200)
    settings.load_profile(os.environ.get("QCHECK_HYPOTHESIS_PROFILE", "ci"))


# A deprecation raised in an installed library's own code (qwix 0.1.8's Pallas module, which MaxText 0.2.5's
# megablox imports, using jax.pallas.GridSpec, which jax 0.12.1 deprecates) is the library's to fix: it is shown in
# the warnings summary, and a client stage does not fail on a release upstream. In qcheck's own code and tests a
# deprecation stays an error (pyproject.toml's "error"), and so does one that a library attributes to its caller
# there (JAX's deprecations name the caller's frame: stacklevel).
# Python's filters match the name of the module a warning is attributed to, not its file: the filter names every
# top-level module that an installed distribution other than qcheck and the test tools provides. FutureWarning is
# Python's deprecation category for end users.
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
#: Not libraries here: the test tools' deprecations are about how qcheck's tests and plugin, their callers in this
#: session, use them, and pytest and Hypothesis often attribute them to their own frames.
_NOT_LIBRARIES = {"qcheck-jax", "pytest", "pluggy", "pytest-xdist", "hypothesis"}


@functools.cache
def library_modules() -> tuple[str, ...]:
    """The top-level module names of every installed distribution but qcheck and the test tools, less any name this
    checkout holds (a distribution that ships a top-level ``tests`` package must not cover qcheck's tests)."""
    own = {p.stem for p in _HERE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    return tuple(sorted(
        name for name, dists in metadata.packages_distributions().items()
        if name.isidentifier() and name not in own
        and not any(re.sub(r"[-_.]+", "-", d).lower() in _NOT_LIBRARIES for d in dists)))


def library_module_pattern() -> str:
    """A regex matching those modules and their submodules (pytest takes an ini line's module field as a regex)."""
    return "^(" + "|".join(map(re.escape, library_modules())) + r")(\.|$)"


def _report_library_deprecations(config: pytest.Config) -> None:
    if not library_modules():
        return
    module = library_module_pattern()
    for category in DEPRECATIONS:
        # Added after pyproject.toml's "error", so it takes precedence: pytest applies the lines in order, each
        # going first, afresh around collection and each test. The filters in force now were set up before
        # pytest_configure ran: they get it directly, for what this configure imports (JAX, Flax).
        config.addinivalue_line("filterwarnings", f"default::{category.__name__}:{module}")
        warnings.filterwarnings("default", category=category, module=module)


def pytest_configure(config):
    if not _own_session(config):
        return
    _report_library_deprecations(config)
    _process.configure()  # before anything starts a JAX backend (the xdist workers, started later, inherit it)
    if _runs_tests(config):
        _configure_test_process()
    else:
        _process.start_run_cache(own=True)


def pytest_unconfigure(config):
    _process.end_run_cache()
