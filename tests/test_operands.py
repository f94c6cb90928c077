"""site_operands: what a call site fed its matmul, against numpy/ml_dtypes referees."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn

from qcheck import referees
from qcheck.layers.bridge import QuantSite
from qcheck.recipes import Recipe
from qcheck.recipes._sites import SiteOps
from qcheck.suite import cases
from qcheck.suite._operands import site_operands

EQN = "tm,mh->th"


def operands() -> tuple[np.ndarray, np.ndarray]:
    # Magnitudes in [0.05, 600): some saturate e4m3fn (448), none is subnormal in it
    # (the CPU flushes those), so the referee needs no model of XLA's flushing.
    rng = np.random.default_rng(3)
    mag = lambda shape: np.exp(rng.uniform(np.log(0.05), np.log(600), shape)).astype(np.float32)  # noqa: E731
    sign = lambda shape: np.where(rng.random(shape) < 0.5, -1, 1).astype(np.float32)  # noqa: E731
    return mag((4, 32)) * sign((4, 32)), mag((32, 16)) * sign((32, 16))


def site(recipe: str):
    return cases.layer(cases.Case(recipe, cases.Variant("mixtral", "dense", False))).get_einsum("wi_0")


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_an_fp8_site_feeds_its_matmul_the_saturated_e4m3fn_casts():
    lhs, rhs = operands()
    got = site_operands(site("fp8"), EQN, lhs, rhs)
    assert sorted(got) == ["lhs", "lhs.float8_e4m3fn", "rhs", "rhs.float8_e4m3fn"]
    for side, x in (("lhs", lhs), ("rhs", rhs)):
        codes, _ = referees.reference_quantize(x, "e4m3fn")
        assert bits_equal(got[f"{side}.float8_e4m3fn"], codes)
        assert bits_equal(got[side], codes.astype(np.float32))


def test_an_int8_site_feeds_per_slice_codes_along_each_contraction():
    lhs, rhs = operands()
    got = site_operands(site("int8"), EQN, lhs, rhs)
    for side, x, axis in (("lhs", lhs, 1), ("rhs", rhs, 0)):
        codes, scales = referees.reference_quantize(x, "int8", axis=axis, xla_reciprocal=True)
        assert bits_equal(got[f"{side}.int8"], codes)
        assert bits_equal(got[side], referees.reference_dequantize(codes, scales, "int8", axis=axis))


class E5m2Site(SiteOps, nn.Module):
    def quantize_operands(self, lhs, rhs, axes):
        q = lambda x: jnp.clip(x, -57344, 57344).astype(jnp.float8_e5m2).astype(x.dtype)  # noqa: E731
        return q(lhs), q(rhs)


class Undeclared(Recipe):
    """A plug-in that declares no formats: only its site says what it does."""

    def __init__(self):
        super().__init__("undeclared_e5m2")

    def site_module(self, name):
        return E5m2Site()


def test_a_plug_in_without_declared_formats_records_its_sites_codes():
    lhs, rhs = operands()
    got = site_operands(QuantSite(Undeclared(), "wi_0", rngs=None), EQN, lhs, rhs)
    assert sorted(got) == ["lhs", "lhs.float8_e5m2", "rhs", "rhs.float8_e5m2"]
    assert bits_equal(got["lhs.float8_e5m2"], lhs.astype(ml_dtypes.float8_e5m2))


class NoMatmulSite(SiteOps, nn.Module):
    def matmul(self, op, lhs, rhs, axes):
        return jnp.zeros((lhs.shape[0], rhs.shape[-1]), lhs.dtype)


class NoMatmul(Recipe):
    def __init__(self):
        super().__init__("no_matmul")

    def site_module(self, name):
        return NoMatmulSite()


def test_a_site_that_reaches_no_matmul_is_named():
    lhs, rhs = operands()
    with pytest.raises(ValueError, match=r"site_operands: QuantSite\('tm,mh->th'\) reached no matmul"):
        site_operands(QuantSite(NoMatmul(), "wi_0", rngs=None), EQN, lhs, rhs)
