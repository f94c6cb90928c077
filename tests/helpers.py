"""Helpers shared by several test modules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import qcheck
from qcheck.bridge import QuantSite

EQN = "bd,de->be"


@functools.cache
def nvfp4_dgrad(site_name: str, seed: int) -> np.ndarray:
    """The lhs gradient through one NVFP4 site, whose stream starts from ``seed``."""
    site = QuantSite(qcheck.get_recipe("nvfp4"), site_name, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(site)
    lhs, rhs = (jax.random.normal(jax.random.key(i), s) for i, s in ((1, (16, 32)), (2, (32, 16))))

    def loss(a):
        return jnp.sum(nnx.merge(graphdef, state, copy=True)(EQN, a, rhs) * jnp.linspace(0.1, 1.0, 16)[None, :])

    return np.asarray(jax.jit(jax.grad(loss))(lhs))


#: Arguments for a pytest run inside this one (pytester.inline_run) on the repository's
#: own test files. The outer session has imported qcheck's plugin already, so the inner
#: one cannot assertion-rewrite it; with an editable install that warning is an error
#: under the project's filterwarnings.
INNER = ("-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning")
