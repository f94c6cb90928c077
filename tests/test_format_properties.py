"""Property tests (hypothesis) for every format in qcheck.formats, and each property's failing twin.

ml_dtypes types have no hypothesis strategy: examples are float32 arrays, cast
inside the code under test. Shapes are fixed so each format compiles once.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given

from qcheck import formats, referees
from tests import format_properties as fp

VALUES = fp.VALUES


@functools.cache
def jitted(fmt: str, stochastic: bool = False):
    if stochastic:
        f = jax.jit(lambda x, key: formats.qdq(x, fmt, rng=key))
        return lambda x: np.asarray(f(jnp.asarray(x), jax.random.key(int(np.abs(x).sum()) % 1000)))
    f = jax.jit(lambda x: formats.qdq(x, fmt))
    return lambda x: np.asarray(f(jnp.asarray(x)))


def test_every_format_has_a_property_row():
    assert {f.name for f in fp.FORMATS} == set(formats.format_names())


@pytest.mark.parametrize("prop", fp.PROPERTIES, ids=lambda p: p.__name__.removeprefix("assert_"))
@pytest.mark.parametrize("fmt", fp.FORMATS, ids=lambda f: f.name)
@given(x=VALUES)
def test_format_property(fmt, prop, x):
    if why := dict(fmt.not_held).get(prop.__name__.removeprefix("assert_")):
        pytest.skip(f"{fmt.name} does not keep {prop.__name__.removeprefix('assert_')}: {why}")
    prop(jitted(fmt.name), fp.with_normal_block_scales(x, fmt), fmt)


@pytest.mark.parametrize(("fmt", "prop"), [(f, p) for f in fp.FORMATS for p, _ in f.not_held],
                         ids=lambda v: getattr(v, "name", v))
def test_a_property_a_format_does_not_keep_fails_on_it(fmt, prop):
    """The twin of each skip above: the property does fail on the format's rule (so the skip hides no pass), on one
    of a few fixed inputs at least."""
    failures = []
    for seed in range(8):
        x = np.random.default_rng(seed).normal(size=fp.SHAPE) * 10.0 ** (seed % 4)
        try:
            getattr(fp, f"assert_{prop}")(jitted(fmt.name), fp.with_normal_block_scales(x.astype(np.float32), fmt),
                                          fmt)
        except AssertionError as e:
            failures.append(str(e))
    assert failures and all(f.startswith(f"{fmt.name}: ") for f in failures), failures


@given(x=VALUES)
def test_nvfp4_stochastic_rounding_lands_on_a_neighbour(x):
    fmt = fp.BY_NAME["nvfp4"]
    fp.assert_stochastic_lands_on_neighbours(jitted("nvfp4", stochastic=True), fp.with_normal_block_scales(x, fmt), fmt)


def test_nvfp4_flushes_a_block_far_below_the_tensor_amax():
    x = np.zeros(fp.SHAPE, np.float32)
    x[0, 0], x[0, 16:] = 1000.0, 1000.0 * 2.0**-20  # second block: scale underflows e4m3
    out = jitted("nvfp4")(x)
    assert out[0, 0] == pytest.approx(1000.0, rel=0.1) and not np.any(out[0, 16:])


def test_int8_qwix_flushes_a_slice_below_its_scale_floor():
    # Limit of qwix's int8: a scale below 2^-63 becomes 1, so the slice's codes round to 0.
    x = np.zeros(fp.SHAPE, np.float32)
    x[0, 0], x[1, 0] = 127.5 * 2.0**-64, 127.5 * 2.0**-62
    out = jitted("int8_qwix")(x)
    assert out[0, 0] == 0.0 and out[1, 0] == pytest.approx(127.5 * 2.0**-62, rel=0.01)


@pytest.mark.parametrize("fmt", ["int8_aqt", "int8_qwix"])
def test_absmax_over_127_5_is_not_idempotent(fmt):
    # Why these rows have idempotent_ulps=None: the absmax lands on code 127 (127.5 clipped),
    # so a second qdq's scale is 127/127.5 of the first and every value shrinks with it.
    strict = dataclasses.replace(fp.BY_NAME[fmt], idempotent_ulps=4)
    with pytest.raises(AssertionError, match=rf"{fmt}: qdq\(qdq\(x\)\) moved .* ulps, allowed 4\)"):
        fp.assert_idempotent(jitted(fmt), PROBE, strict)


def _keras_codes(x):
    """Keras 3.15.1's int8 codes, written here from keras/src/quantizers/quantizers.py (abs_max_quantize):
    clip(round(x · 127 / (absmax + 1e-7)), -127, 127) per row, in float32."""
    scale = np.float32(127) / (np.max(np.abs(x), axis=-1, keepdims=True) + np.float32(1e-7))
    return np.clip(np.round(x * scale), -127, 127)


def test_int8_keras_keeps_an_all_zero_row_zero_where_no_epsilon_gives_nan():
    # Keras's epsilon is its zero guard: a zero row's scale is 127 / 1e-7 (finite) and its codes 0. The
    # should-fail twin, the same rule with no epsilon (127 / 0 = inf, 0 · inf = NaN), fails the same property.
    x = PROBE.copy()
    x[1] = 0.0
    out = jitted("int8_keras")(x)
    assert not np.any(out[1]) and np.all(np.isfinite(out))
    q = formats.quantize(x, "int8_keras")
    assert not np.any(np.asarray(q.codes)[1]) and float(np.asarray(q.scales["slice"])[1, 0]) == np.float32(127 / 1e-7)
    fp.assert_finite(jitted("int8_keras"), x, fp.BY_NAME["int8_keras"])

    def no_epsilon(x):
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.float32(127) / np.max(np.abs(x), axis=-1, keepdims=True)
            return (np.clip(np.round(x * scale), -127, 127) / scale).astype(np.float32)

    with pytest.raises(AssertionError, match="non-finite outputs"):
        fp.assert_finite(no_epsilon, x, fp.BY_NAME["int8_keras"])


@pytest.mark.parametrize("amax", [1e-5, 1e-6, 1e-8])
def test_int8_keras_on_a_tiny_amax_reaches_fewer_codes_than_int8(amax):
    # Limit of Keras's int8: the epsilon is 1e-7 of absolute value, so a row of small values maps its absmax below
    # 127 (126 near 1e-5, 115 at 1e-6, 9 at 1e-8): its codes are not int8's (absmax / 127 reaches ±127). The
    # codes equal Keras's rule written here and the referee's, bitwise.
    x = (np.linspace(-1.0, 1.0, 128, dtype=np.float32).reshape(fp.SHAPE) * np.float32(amax)).astype(np.float32)
    codes = np.asarray(jax.jit(lambda v: formats.quantize(v, "int8_keras").codes)(x))
    top = int(np.round(127 * np.float32(amax) / (np.float32(amax) + np.float32(1e-7))))
    assert np.array_equal(codes, _keras_codes(x)) and int(np.abs(codes).max()) == top < 127
    ref, _ = referees.reference_quantize(x, "int8_keras", ftz=jax.default_backend() == "cpu")
    assert np.array_equal(codes, ref)
    assert not np.array_equal(codes, np.asarray(formats.quantize(x, "int8").codes))  # int8 reaches ±127
    assert int(np.abs(np.asarray(formats.quantize(x, "int8").codes)).max()) == 127


# -- failing twins: each property on the quantizer bug it exists for -------------

PROBE = np.linspace(-600.0, 600.0, 128, dtype=np.float32).reshape(fp.SHAPE) + 0.3


def _astype(dtype):
    return lambda x: np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def _truncating_e4m3fn(x):
    # Rounds toward zero instead of to nearest: same grid, wrong rounding.
    out = _astype(ml_dtypes.float8_e4m3fn)(np.clip(x, -448, 448))
    step = fp.fp8_half_step(out, np.dtype(ml_dtypes.float8_e4m3fn)) * 2
    return np.where(np.abs(out) > np.abs(x), out - np.sign(out) * step, out).astype(np.float32)


def _mxfp8(block_exponent, *, saturate=True, block=formats.MX_BLOCK):
    """MXFP8 qdq in numpy with the block exponent rule plugged in, for the bugs in it."""

    def qdq(x):
        blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, block)
        exp = block_exponent(np.max(np.abs(blocks), axis=-1, keepdims=True)).astype(np.int32)
        v = np.ldexp(blocks, -exp)
        codes = (np.clip(v, -448, 448) if saturate else v).astype(ml_dtypes.float8_e4m3fn)
        return np.ldexp(codes.astype(np.float32), exp).reshape(x.shape)

    return qdq


def _current(dtype, amax_of):
    """Current-scaled fp8 qdq in numpy with the amax taken by ``amax_of``, for the bugs in it."""

    def qdq(x):
        fmax = np.float32(ml_dtypes.finfo(dtype).max)
        scale = fmax / np.float32(amax_of(np.asarray(x, np.float32)))
        codes = np.clip(x * scale, -fmax, fmax).astype(dtype)
        return codes.astype(np.float32) * (np.float32(1) / scale)

    return qdq


def _absmax_int8(bound, lo, hi, *, wrap=False):
    """absmax/``bound`` int8 qdq in numpy (float64), codes clipped to [lo, hi] or wrapped like a C cast."""

    def qdq(x):
        b = np.asarray(x, np.float64).reshape(x.shape[0], -1, 32)
        scale = np.max(np.abs(b), axis=-1, keepdims=True) / bound
        codes = np.round(b / np.where(scale > 0, scale, 1.0))
        codes = (codes + 128) % 256 - 128 if wrap else np.clip(codes, lo, hi)
        return (codes * scale).astype(np.float32).reshape(x.shape)

    return qdq


def _minmax_unrounded_zero_point(x):
    """qwix's minmax int8 in numpy with the zero point left a float (not rounded to an integer code)."""
    b = np.asarray(x, np.float64).reshape(x.shape[0], -1, 32)
    lo, hi = np.minimum(b.min(-1, keepdims=True), 0), np.maximum(b.max(-1, keepdims=True), 0)
    scale = (hi - lo) / 255
    zero_point = -128 - lo / scale
    codes = np.clip(np.round(b / scale + zero_point), -128, 127)
    return ((codes - zero_point) * scale).astype(np.float32).reshape(x.shape)


def _floor_exponent(amax):
    return np.floor(np.log2(amax)) - 8  # the spec's rule; a float log2 is exact enough on PROBE


def _nearest_exponent(amax):
    return np.round(np.log2(amax)) - 8  # the bug: nearest power of two instead of floor


def _row_amax(x):
    return np.max(np.abs(x), axis=-1, keepdims=True)


@pytest.mark.parametrize(
    "prop, fmt, broken, message",
    [
        (fp.assert_finite, "e4m3fn", _astype(ml_dtypes.float8_e4m3fn), "non-finite outputs"),
        (fp.assert_on_grid, "e4m3fnuz", lambda x: jitted("e4m3fn")(x), "not representable in float8_e4m3fnuz"),
        (fp.assert_sign_symmetric, "e4m3fnuz", lambda x: jitted("e4m3fn")(x), "negative zero"),
        (fp.assert_sign_symmetric, "int8", lambda x: jitted("int8")(x + 0.5), r"qdq\(-x\) != -qdq\(x\)"),
        (fp.assert_error_within_half_step, "e4m3fn", _truncating_e4m3fn, "exceeds half a step"),
        (fp.assert_idempotent, "int8", lambda x: jitted("int8")(x) * np.float32(1.01), "ulps"),
        (fp.assert_zero_stays_zero, "nvfp4", lambda x: jitted("nvfp4")(x) + 1e-3, "zero inputs came back"),
        (fp.assert_monotonic, "int8", lambda x: jitted("int8")(x)[:, ::-1].copy(), "not monotonic"),
        (fp.assert_on_grid, "nvfp4", lambda x: jitted("nvfp4")(x) * np.float32(1.07) ** np.arange(32), "off the grid"),
        (fp.assert_stochastic_lands_on_neighbours, "nvfp4", lambda x: jitted("nvfp4")(x * 1.9), "not"),
        # Round log2(amax) to nearest instead of floor: amax 500 gets scale 2, 250 rounds up to 256,
        # and 512 is off e4m3's grid at the true scale 1.
        (fp.assert_on_grid, "mxfp8", _mxfp8(_nearest_exponent), "not representable in float8_e4m3fn"),
        # Elements cast without clipping: 500 at scale 1 is past 448, and e4m3fn overflow is NaN.
        (fp.assert_finite, "mxfp8", _mxfp8(_floor_exponent, saturate=False), "non-finite outputs"),
        # Blocks of 16 (NVFP4's): a half-row whose amax, 240, is below its row's gets scale 2^-1 and saturates.
        (fp.assert_error_within_half_step, "mxfp8", _mxfp8(_floor_exponent, block=16), "exceeds half a step"),
        # A stale amax (the previous step's, 500) instead of this tensor's (600.3): clipping beyond 500.
        (fp.assert_error_within_half_step, "e4m3fn_current", _current(fp.E4M3FN, lambda x: 500.0), "exceeds half"),
        # Each row's amax instead of the whole tensor's: codes at another scale than the tensor's.
        (fp.assert_on_grid, "e5m2_current", _current(fp.E5M2, _row_amax), "not representable in float8_e5m2"),
        # absmax/128 (the far edge of an even bucket count): a second qdq's codes grow by 128/127.
        (fp.assert_idempotent, "int8_aqt", _absmax_int8(128.0, -127, 127), "changed code"),
        # The absmax's 127.5 rounded to 128 and cast without saturating: it wraps to -128.
        (fp.assert_error_within_half_step, "int8_aqt", _absmax_int8(127.5, 0, 0, wrap=True), "exceeds half a step"),
        # Asymmetric beyond the extra negative code.
        (fp.assert_sign_symmetric, "int8_qwix", lambda x: jitted("int8_qwix")(x + 0.5), r"qdq\(-x\) != -qdq\(x\)"),
        # +absmax kept at 128 (no saturating cast): the codes are off the int8 grid.
        (fp.assert_on_grid, "int8_qwix", _absmax_int8(127.5, -128, 128), "off the grid"),
        # Keras's scale without the epsilon's 1e-7 on a row of amax 1e-6: codes 127 at the format's step
        # (absmax + 1e-7) / 127 are off its grid (127 · 1.1 = 139.7, past the top code).
        (fp.assert_on_grid, "int8_keras", _absmax_int8(127.0, -127, 127), "off the grid"),
        # qwix's minmax with a float zero point: the grid shifts by its fraction, off the step's multiples.
        (fp.assert_on_grid, "int8_qwix_minmax", _minmax_unrounded_zero_point, "off the grid"),
    ],
    ids=["no-saturation", "wrong-flavour-grid", "wrong-flavour-negzero", "asymmetric", "truncation",
         "drifting-scale", "zero-leak", "reversed", "off-grid", "far-from-neighbours",
         "mx-nearest-scale", "mx-no-saturation", "mx-block-16", "current-stale-amax", "current-row-amax",
         "aqt-edge-128", "aqt-wrapping-cast", "qwix-asymmetric", "qwix-unsaturated-128", "keras-no-epsilon",
         "minmax-unrounded-zero-point"],
)
def test_property_fails_on_its_bug(prop, fmt, broken, message):
    x = PROBE.copy()
    if prop is fp.assert_sign_symmetric and fmt == "e4m3fnuz":
        x[0, :4] = [-1e-6, 1e-6, -3e-7, 3e-7]  # tiny values that e4m3fn rounds to -0.0
    if fmt == "int8_keras":
        x[3] = x[3] * np.float32(1e-6 / 600.3)  # a row of amax 1e-6, where the epsilon is a tenth of the scale
    if fmt == "int8_qwix_minmax":
        x[:, 0] = 1000.0  # each row's max far from -min: a zero point with a fraction (PROBE's rows have none)
    if fmt == "mxfp8":
        # Block amaxes whose mantissa is past e4m3's 1.75 (448 = 1.75 · 2^8): row 1's 500
        # saturates at its scale 2^0; row 2's first half, 240, would at a 16-block's 2^-1.
        x[1, 0], x[2, 0] = -500.0, 240.0
    with pytest.raises(AssertionError, match=message):
        prop(broken, x, fp.BY_NAME[fmt])
    prop(jitted(fmt, stochastic=prop is fp.assert_stochastic_lands_on_neighbours), x, fp.BY_NAME[fmt])
