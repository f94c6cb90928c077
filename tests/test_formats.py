"""Number formats: qdq in each named format, saturation, and the errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qcheck import formats


@pytest.mark.parametrize(
    "fmt, big, expected",
    [("e4m3fn", 1e6, 448.0), ("e4m3fnuz", 1e6, 240.0), ("e5m2", 1e9, 57344.0), ("e5m2fnuz", 1e9, 57344.0)],
)
def test_fp8_qdq_saturates(fmt, big, expected):
    out = np.asarray(formats.qdq(jnp.array([big, -big, 1.0]), fmt))
    np.testing.assert_array_equal(out, [expected, -expected, 1.0])


def test_fp8_qdq_rounds_to_the_format_grid():
    x = np.float32(1.0 + 2.0**-4 + 2.0**-6)  # between two e4m3 values
    assert formats.qdq(jnp.array([x]), "e4m3fn")[0] == np.float32(x).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def test_int8_qdq_is_symmetric_absmax_per_slice_with_round_half_even():
    x = jnp.array([[127.0, 0.5, -1.5, 2.5], [1.0, 0.0, 0.0, 0.0]])
    out = np.asarray(formats.qdq(x, "int8", axis=-1))
    # Row 0: scale 1 -> RNE rounding of the halves; row 1: scale 1/127, exact.
    np.testing.assert_array_equal(out[0], [127.0, 0.0, -2.0, 2.0])
    np.testing.assert_allclose(out[1], [1.0, 0.0, 0.0, 0.0])


def test_int8_qdq_scales_over_the_contraction_axes():
    x = jnp.array([[1.0, 100.0], [127.0, 50.0]])
    # Column 0's absmax is 127, so its scale is 1 and 1.0 is exact; row 0's is 100.
    assert formats.qdq(x, "int8", axis=0)[0, 0] == 1.0
    assert formats.qdq(x, "int8", axis=1)[0, 0] == np.float32(100.0 / 127.0)


def test_int8_qdq_keeps_an_all_zero_slice_zero():
    out = formats.qdq(jnp.zeros((2, 3)), "int8")
    assert np.array_equal(out, np.zeros((2, 3))) and not np.any(np.isnan(out))


def test_unknown_format_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown format 'fp4'; valid formats: int8, e4m3fn, e4m3fnuz, e5m2"):
        formats.qdq(jnp.ones(3), "fp4")


def test_qdq_rejects_integer_input_and_bad_axis():
    with pytest.raises(TypeError, match="floating-point array, got dtype int32"):
        formats.qdq(jnp.ones(3, jnp.int32), "int8")
    with pytest.raises(ValueError, match="axis 2 is out of range for an array of rank 2"):
        formats.qdq(jnp.ones((2, 2)), "int8", axis=2)


def test_int8_slice_with_a_subnormal_scale_stays_finite():
    # Found by the property tests: amax/127 is subnormal here and XLA on CPU may
    # flush it to zero, which used to divide by zero and return NaN.
    x = jnp.array([[np.finfo(np.float32).tiny, 0.0, -np.finfo(np.float32).tiny, 0.0]])
    out = np.asarray(jax.jit(lambda v: formats.qdq(v, "int8"))(x))
    assert np.all(np.isfinite(out)) and out[0, 1] == 0.0
