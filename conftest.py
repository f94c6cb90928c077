"""Root conftest: strict settings for the whole suite. The fixtures come from qcheck's pytest plugin."""

import os
import shutil
import tempfile

from qcheck import _xla_env

_xla_env.configure()  # before anything starts a JAX backend

import jax  # noqa: E402
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
# at the end.
_CACHE_ENV = "QCHECK_RUN_XLA_CACHE"
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_CACHE_ENV):
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and config.getoption("numprocesses", None):
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="qcheck-xla-")


def pytest_unconfigure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and (path := os.environ.pop(_CACHE_ENV, None)):
        shutil.rmtree(path, ignore_errors=True)
