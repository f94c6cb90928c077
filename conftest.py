"""Root conftest: strict settings for the whole suite. The fixtures come from qcheck's pytest plugin."""

import os

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
    "ci", derandomize=True, deadline=None, max_examples=60, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("QCHECK_HYPOTHESIS_PROFILE", "ci"))
