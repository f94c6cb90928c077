"""Helpers shared by several test modules."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

import qcheck
from qcheck.bridge import QuantSite

EQN = "bd,de->be"


def conversion_probes(dtype) -> np.ndarray:
    """Every finite value of ``dtype``, its rounding midpoints and their float32 neighbours, both signs, and underflow."""
    if dtype == ml_dtypes.bfloat16:
        grid = np.random.default_rng(0).normal(size=4096).astype(dtype)
    else:
        grid = np.arange(2 ** (ml_dtypes.finfo(dtype).bits), dtype=np.uint8).view(dtype)
    grid = np.unique(grid.astype(np.float32)[np.isfinite(grid.astype(np.float32))])
    mids = (grid[1:] + grid[:-1]) / 2
    near = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    tiny = np.array([1e-30, 1e-9, float(ml_dtypes.finfo(dtype).smallest_subnormal) / 3], np.float32)
    values = np.concatenate([grid, near, tiny, -grid, -near, -tiny, [0.0, -0.0]]).astype(np.float32)
    return np.abs(values) if dtype == ml_dtypes.float8_e8m0fnu else values  # e8m0 has no sign


@functools.cache
def nvfp4_dgrad(site_name: str, seed: int) -> np.ndarray:
    """The lhs gradient through one NVFP4 site, whose stream starts from ``seed``."""
    site = QuantSite(qcheck.get_recipe("nvfp4"), site_name, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(site)
    lhs, rhs = (jax.random.normal(jax.random.key(i), s) for i, s in ((1, (16, 32)), (2, (32, 16))))

    def loss(a):
        return jnp.sum(nnx.merge(graphdef, state, copy=True)(EQN, a, rhs) * jnp.linspace(0.1, 1.0, 16)[None, :])

    return np.asarray(jax.jit(jax.grad(loss))(lhs))


#: Arguments for a pytest run inside this one (pytester.inline_run), as a user's project
#: runs qcheck's suite. The outer session has imported qcheck's plugin already, so the inner
#: one cannot assertion-rewrite it (with an editable install that warning is an error under
#: the project's filterwarnings); and the suite's modules lie inside this checkout, whose
#: root conftest the inner run must not load as if it were the user's.
INNER = ("-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning", "--noconftest")


#: The native-GEMM probes' einsum: lhs [M, K] against rhs [N, K], K last on both
#: as jax.nn.scaled_matmul wants it.
NATIVE_EQN = "mk,nk->mn"


@functools.cache
def native_operands(m: int = 128, n: int = 128, k: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Operands for the native-GEMM checks.

    Sides are multiples of 128 (cuBLASLt's and cuDNN's tile shapes); values
    reach about ±700, so e4m3fn (448) and e4m3fnuz (240) both saturate somewhere.
    """
    rng = np.random.default_rng(7)
    return (rng.standard_normal((m, k)).astype(np.float32) * 150,
            rng.standard_normal((n, k)).astype(np.float32) * 150)


def unquantized_product(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return np.einsum(NATIVE_EQN, lhs.astype(np.float64), rhs.astype(np.float64))


def documented_scaled_matmul(a, b, a_scales, b_scales, preferred_element_type=jnp.float32):
    """``jax.nn.scaled_matmul`` as its docstring defines it: scales repeated over their blocks, then BMK,BNK->BMN."""
    a = a.astype(jnp.float32) * jnp.repeat(a_scales.astype(jnp.float32), a.shape[-1] // a_scales.shape[-1], axis=-1)
    b = b.astype(jnp.float32) * jnp.repeat(b_scales.astype(jnp.float32), b.shape[-1] // b_scales.shape[-1], axis=-1)
    return jnp.einsum("BMK,BNK->BMN", a, b, preferred_element_type=preferred_element_type)
