"""Root conftest: strict settings for the whole suite. The fixtures come from qcheck's pytest plugin."""

import os
import shutil
import tempfile

from qcheck import _xla_env

_xla_env.configure()  # before anything starts a JAX backend

import jax  # noqa: E402
import pytest  # noqa: E402

# pytester's in-process runs (the plugin's and the guide's tests) unload every
# module first imported during them, which would leave a second copy of these
# behind for later tests, and monkeypatches on one copy that the other ignores.
import qcheck.golden  # noqa: E402, F401
import qcheck.invariants  # noqa: E402, F401
from hypothesis import HealthCheck, settings  # noqa: E402

pytest_plugins = ("pytester",)  # the plugin's own tests run pytest inside pytest

# Implicit rank promotion hides shape bugs in einsum-heavy code.
jax.config.update("jax_numpy_rank_promotion", "raise")

# Derandomized for CI (same examples every run, whatever the worker); no deadline
# since the first example of a test pays for JIT compilation.
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=20, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("QCHECK_HYPOTHESIS_PROFILE", "ci"))

# The xdist workers of one run share a compilation cache that lives only as long
# as the run, so a program two workers need (an unquantized twin, an eager op) is
# compiled once: 144 s -> 110 s of CPU on 2 cores. Runs stay cold: the controller
# makes a new directory per run, the workers inherit its path, and it is removed
# at the end. QCHECK_XLA_CACHE=DIR opts into a cache that persists across runs
# instead (see the README's Speed section for what it buys).
_CACHE_ENV = "QCHECK_RUN_XLA_CACHE"
if os.environ.get(_xla_env.PERSISTENT_CACHE_ENV):
    _xla_env.use_compilation_cache(os.environ[_xla_env.PERSISTENT_CACHE_ENV])
elif os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_CACHE_ENV):
    _xla_env.use_compilation_cache(os.environ[_CACHE_ENV])

# For bench/run_suite.py: each process counts its compile requests and leaves
# them in this directory at the end of the session.
_COUNT_ENV = "QCHECK_COUNT_COMPILES"
_COUNTS = pytest.StashKey[object]()
_counting = None


def pytest_sessionstart(session):
    global _counting
    if os.environ.get(_COUNT_ENV):
        from qcheck._compiles import counting_compilations

        _counting = counting_compilations()
        session.config.stash[_COUNTS] = _counting.__enter__()


def pytest_sessionfinish(session):
    if _counting is not None and _COUNTS in session.config.stash:
        import json

        log = session.config.stash[_COUNTS]
        counts = {"requests": dict(log), "cache_hits": log.cache_hits}
        _counting.__exit__(None, None, None)
        who = os.environ.get("PYTEST_XDIST_WORKER", "main")
        out = os.path.join(os.environ[_COUNT_ENV], f"{who}-{os.getpid()}.json")
        with open(out, "w") as f:
            json.dump(counts, f)


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and config.getoption("numprocesses", None):
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="qcheck-xla-")


def pytest_unconfigure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and (path := os.environ.pop(_CACHE_ENV, None)):
        shutil.rmtree(path, ignore_errors=True)
