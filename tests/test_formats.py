"""Number formats: qdq in each named format, saturation, and the errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qcheck import formats, referees
from qcheck.formats import _codec
from tests.helpers import conversion_probes

# Jitted once per format and axis: the tests below run one program each instead
# of dozens of eager ops. Eager execution is pinned where it is the subject.
qdq_jit = jax.jit(formats.qdq, static_argnames=("fmt", "axis"))
quantize_jit = jax.jit(formats.quantize, static_argnames=("fmt", "axis"))
dequantize_jit = jax.jit(formats.dequantize)


@pytest.mark.parametrize(
    "fmt, big, expected",
    [("e4m3fn", 1e6, 448.0), ("e4m3fnuz", 1e6, 240.0), ("e5m2", 1e9, 57344.0), ("e5m2fnuz", 1e9, 57344.0)],
)
def test_fp8_qdq_saturates(fmt, big, expected):
    out = np.asarray(qdq_jit(jnp.array([big, -big, 1.0]), fmt))
    np.testing.assert_array_equal(out, [expected, -expected, 1.0])


def test_fp8_qdq_rounds_to_the_format_grid():
    x = np.float32(1.0 + 2.0**-4 + 2.0**-6)  # between two e4m3 values
    assert qdq_jit(jnp.array([x]), "e4m3fn")[0] == np.float32(x).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def test_int8_qdq_is_symmetric_absmax_per_slice_with_round_half_even():
    x = jnp.array([[127.0, 0.5, -1.5, 2.5], [1.0, 0.0, 0.0, 0.0]])
    out = np.asarray(qdq_jit(x, "int8", axis=-1))
    # Row 0: scale 1 -> RNE rounding of the halves; row 1: scale 1/127, exact.
    np.testing.assert_array_equal(out[0], [127.0, 0.0, -2.0, 2.0])
    np.testing.assert_allclose(out[1], [1.0, 0.0, 0.0, 0.0])


def test_int8_qdq_scales_over_the_contraction_axes():
    x = jnp.array([[1.0, 100.0], [127.0, 50.0]])
    # Column 0's absmax is 127, so its scale is 1 and 1.0 is exact; row 0's is 100.
    assert qdq_jit(x, "int8", axis=0)[0, 0] == 1.0
    assert qdq_jit(x, "int8", axis=1)[0, 0] == np.float32(100.0 / 127.0)


def test_int8_qdq_keeps_an_all_zero_slice_zero():
    out = qdq_jit(jnp.zeros((2, 3)), "int8")
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
    # amax/127 is subnormal here and XLA on CPU may flush it to zero: dividing by
    # that scale would return NaN.
    x = jnp.array([[np.finfo(np.float32).tiny, 0.0, -np.finfo(np.float32).tiny, 0.0]])
    out = np.asarray(jax.jit(lambda v: formats.qdq(v, "int8"))(x))
    assert np.all(np.isfinite(out)) and out[0, 1] == 0.0


def test_int8_has_no_negative_zero():
    # An int8 code carries no sign at zero, so a small negative value comes back +0.0.
    out = np.asarray(qdq_jit(jnp.array([-0.1, 127.0]), "int8"))
    assert out[0] == 0.0 and not np.signbit(out[0])


# -- references: numpy/ml_dtypes from the formats' definitions ------------------


def _mxfp8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OCP MX v1.0 MXFP8 along the last axis: (dequantized, e4m3fn codes, e8m0 scale bits)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    _, e = np.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
    exp = np.where(amax > 0, np.clip(e - 1 - 8, -127, 127), -127).astype(np.int32)
    codes = np.clip(np.ldexp(blocks, -exp), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    out = np.ldexp(codes.astype(np.float32), exp)
    return out.reshape(x.shape), codes.reshape(x.shape), (exp[..., 0] + 127).astype(np.uint8)


def _current_reference(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """TransformerEngine's current scaling: (dequantized, codes, scale = fmax / amax)."""
    amax = np.float32(np.max(np.abs(x)))
    fmax = np.float32(ml_dtypes.finfo(dtype).max)
    scale = fmax / amax if amax > 0 else np.float32(1.0)
    codes = np.clip(x * scale, -fmax, fmax).astype(dtype)
    return codes.astype(np.float32) * (np.float32(1.0) / scale), codes, scale


def _wide_blocks(rows: int, seed: int) -> np.ndarray:
    """Rows of two 32-blocks: each block its own binade, from 2^-110 to 2^110, zeros and saturating amaxes."""
    r = np.random.default_rng(seed)
    x = r.uniform(-2.0, 2.0, (rows, 2, 32)) * np.exp2(r.integers(-110, 111, (rows, 2, 1)))
    x *= np.exp2(-r.integers(0, 14, x.shape))  # small elements inside a block: e4m3 subnormals and zeros
    x[0, 0] = 0.0  # an all-zero block
    x[1, 0, 5] = 1.9 * np.abs(x[1, 0]).max()  # an amax past e4m3's 1.75 · 2^k: saturates
    x[2, 1] = np.exp2(-125) * r.uniform(1.0, 2.0, 32)  # amax below 2^-119: the scale clamps to 2^-127
    return x.astype(np.float32).reshape(rows, 64)


def _bits(a) -> bytes:
    return np.asarray(a).tobytes()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mxfp8_matches_the_ocp_reference_bitwise(jit):
    x = _wide_blocks(8, seed=0)
    f = (lambda v, ax: jax.jit(lambda u: formats.qdq(u, "mxfp8", axis=ax))(v)) if jit else (
        lambda v, ax: formats.qdq(v, "mxfp8", axis=ax))
    ref, _, _ = _mxfp8_reference(x)
    assert _bits(f(x, -1)) == _bits(ref)
    # Along axis 0 the blocks run down the columns.
    assert _bits(f(np.ascontiguousarray(x.T), 0)) == _bits(np.ascontiguousarray(ref.T))


def test_mxfp8_codes_and_scales_match_the_reference():
    x = _wide_blocks(8, seed=1)
    _, codes, scale_bits = _mxfp8_reference(x)
    q = quantize_jit(x, "mxfp8")
    assert _bits(q.codes) == _bits(codes)
    assert np.array_equal(np.asarray(q.scales["block"]).view(np.uint8), scale_bits)


def test_mxfp8_scale_bits_are_127_plus_floor_log2_amax_minus_8():
    # Block amaxes m · 2^k with floor(log2) = k by construction, m at both ends of
    # [1, 2): a float log2 of (2 - 2^-23) · 2^k rounds up to k + 1.
    ks = np.array([-100, -20, -1, 0, 3, 8, 9, 60, 120])
    ms = np.array([1.0, np.nextafter(np.float32(2.0), np.float32(0.0))], np.float32)
    amax = (ms[None, :] * np.exp2(ks)[:, None].astype(np.float32)).astype(np.float32)  # [k, m]
    x = np.zeros((*amax.shape, 32), np.float32)
    x[..., 7] = -amax
    x[..., 3] = amax / 3
    bits = np.asarray(quantize_jit(x.reshape(-1, 32), "mxfp8").scales["block"]).view(np.uint8)
    expected = np.broadcast_to(127 + ks[:, None] - 8, amax.shape).reshape(-1, 1)
    np.testing.assert_array_equal(bits, expected)


def test_mxfp8_smallest_scale_keeps_normal_values():
    # Limit: 2^-127, e8m0's smallest scale, is subnormal in float32 and XLA on CPU
    # flushes subnormals; dequantize applies it in two normal halves instead.
    x = np.zeros((2, 32), np.float32)
    x[0, :9] = np.exp2(-127) * np.linspace(2.0, 4.0, 9)  # e4m3 codes 2, 2.25, ..., 4 at 2^-127: normal floats
    x[0, 9:18] = -x[0, :9]
    q = quantize_jit(x, "mxfp8")
    # Block amax 2^-125 asks for 2^(-125 - 8), clamped to 2^-127; the all-zero row 1 gets it too.
    assert np.asarray(q.scales["block"]).view(np.uint8).tolist() == [[0], [0]]
    assert _bits(dequantize_jit(q)) == _bits(x)


def test_mxfp8_subnormal_input_comes_back_zero_or_exact():
    # Limit: XLA on CPU reads a subnormal as zero; a backend that keeps them must be exact.
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = np.exp2(-125), np.exp2(-128)  # 2^-128 is code 0.5 at scale 2^-127, but subnormal
    out = np.asarray(qdq_jit(x, "mxfp8"))
    assert out[0, 0] == x[0, 0] and out[0, 1] in (0.0, x[0, 1]) and not np.any(out[0, 2:])


def test_mxfp8_on_an_axis_of_48_says_so():
    with pytest.raises(ValueError, match=r"mxfp8 needs whole blocks of 32 .* axis 1 has 48 elements"):
        formats.qdq(jnp.ones((2, 48)), "mxfp8")


@pytest.mark.parametrize("fmt, dtype", [("e4m3fn_current", ml_dtypes.float8_e4m3fn),
                                        ("e5m2_current", ml_dtypes.float8_e5m2)])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_current_scaling_matches_the_reference_bitwise(fmt, dtype, jit):
    r = np.random.default_rng(2)
    x = (r.standard_normal((6, 40)) * np.exp2(r.integers(-30, 20, (6, 40)))).astype(np.float32)
    x[0, :3] = 0.0
    f = jax.jit(lambda v: formats.quantize(v, fmt)) if jit else (lambda v: formats.quantize(v, fmt))
    # Many amaxes, so a scale that is one rounding off (fmax · (1 / amax)) shows.
    for factor in r.uniform(0.5, 2.0, 16).astype(np.float32):
        xs = x * factor
        ref, codes, scale = _current_reference(xs, dtype)
        q = f(xs)
        assert q.scales["tensor"].dtype == np.float32 and _bits(q.scales["tensor"]) == _bits(scale)
        assert _bits(q.codes) == _bits(codes)
        assert _bits(formats.dequantize(q)) == _bits(ref)
    # One scale for the whole tensor, whatever the contraction axis.
    assert _bits(formats.qdq(xs, fmt, axis=0)) == _bits(ref)


@pytest.mark.parametrize("fmt", ["e4m3fn_current", "e5m2_current"])
def test_current_scaling_all_zero_tensor_has_scale_one(fmt):
    q = quantize_jit(jnp.zeros((2, 8)), fmt)
    assert float(q.scales["tensor"]) == 1.0
    out = np.asarray(dequantize_jit(q))
    assert not np.any(out) and not np.any(np.isnan(out))


@pytest.mark.parametrize("fmt, dtype", [("e4m3fn_current", ml_dtypes.float8_e4m3fn),
                                        ("e5m2_current", ml_dtypes.float8_e5m2)])
def test_current_scale_is_capped_at_2_to_126(fmt, dtype):
    # Limit: below amax = fmax · 2^-126 the scale fmax / amax is capped at 2^126
    # (uncapped it overflows float32 to inf, and 1 / scale would be subnormal).
    x = (np.exp2(-120) * np.array([[1.5, -1.0, 0.75, 0.0]])).astype(np.float32)
    q = quantize_jit(x, fmt)
    assert float(q.scales["tensor"]) == 2.0**126
    codes = np.clip(x * np.float32(2.0**126), -448, 448).astype(dtype)
    assert _bits(q.codes) == _bits(codes)
    assert _bits(dequantize_jit(q)) == _bits(x)  # these values are on the grid: exact


# -- the quantize/dequantize API -----------------------------------------------

F32 = np.dtype(np.float32)
#: The shape each scale has for x of shape (4, 64) along axis -1, by its name.
#: A block format's scales (and zero points) are one per block, a last partial block too (int4_keras_grouped's
#: groups of 128 over 64 elements: one).
SCALE_SHAPES = {"slice": lambda f: (4, 1), "zero_point": lambda f: (4, -(-64 // f.block)) if f.block else (4, 1),
                "tensor": lambda f: (), "block": lambda f: (4, -(-64 // f.block))}
#: format -> (codes dtype, {scale name: (dtype, shape)}) for x of shape (4, 64) along axis -1, as its record
#: declares them.
LAYOUT = {f.name: (f.element, {k: (dt, SCALE_SHAPES[k](f)) for k, dt in f.scales.items()}) for f in formats.FORMATS}


def test_every_record_is_whole():
    # Adding a format is its record and its referee: each record names a referee, a way back from its codes
    # and siblings that are themselves records, so nothing else has to learn the new name.
    names = formats.format_names()
    assert names == tuple(f.name for f in formats.FORMATS) == referees.referee_format_names()
    for f in formats.FORMATS:
        assert formats.get_format(f.name) is f
        assert callable(f.quantize) and callable(f.dequantize), f.name
        assert set(f.siblings) <= set(names) - {f.name}, f.name
        assert (f.block is not None) == (f.kind == "block") == ("block" in f.scales), f.name
        assert f.scale_rule, f.name


def test_the_layouts_are_the_formats_own():
    # Spot checks of the records against the formats' definitions, so the derived table is not its own oracle.
    assert LAYOUT["int8_qwix"] == (np.dtype(np.int8), {"slice": (F32, (4, 1))})
    i8 = np.dtype(np.int8)
    assert LAYOUT["int8_qwix_minmax"] == (i8, {"slice": (F32, (4, 1)), "zero_point": (i8, (4, 1))})
    assert LAYOUT["e4m3fnuz"] == (np.dtype(ml_dtypes.float8_e4m3fnuz), {})
    assert LAYOUT["e5m2_current"] == (np.dtype(ml_dtypes.float8_e5m2), {"tensor": (F32, ())})
    e4m3fn, e8m0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)
    assert LAYOUT["nvfp4"] == (np.dtype(ml_dtypes.float4_e2m1fn), {"block": (e4m3fn, (4, 4)), "tensor": (F32, ())})
    assert LAYOUT["mxfp8_jax"] == (e4m3fn, {"block": (e8m0, (4, 2))})
    assert LAYOUT["int4_keras_grouped"] == (np.dtype(ml_dtypes.int4), {"block": (F32, (4, 1)),
                                                                       "zero_point": (i8, (4, 1))})


@pytest.mark.parametrize("fmt", LAYOUT)
def test_quantize_stores_codes_and_scales_in_their_types(fmt):
    x = np.random.default_rng(0).standard_normal((4, 64), np.float32) * 10
    q = jax.eval_shape(lambda x: formats.quantize(x, fmt), x)  # types and shapes: nothing to compile
    codes_dtype, scales = LAYOUT[fmt]
    assert (q.format, q.axis, q.dtype) == (fmt, (1,), np.dtype(np.float32))
    assert q.codes.dtype == codes_dtype and q.codes.shape == x.shape
    assert {k: (v.dtype, v.shape) for k, v in q.scales.items()} == scales


@pytest.mark.parametrize("fmt", LAYOUT)
@pytest.mark.parametrize("dtype, axis", [(np.float32, (1, 2)), (jnp.bfloat16, -1)])
def test_dequantize_of_quantize_is_qdq_bitwise(fmt, dtype, axis):
    # Jitted, each side its own program: one compilation instead of dozens of eager ops.
    x = (np.random.default_rng(1).standard_normal((3, 2, 64), np.float32) * 30).astype(dtype)
    out = jax.jit(lambda x: formats.dequantize(formats.quantize(x, fmt, axis=axis)))(x)
    assert out.dtype == x.dtype and _bits(out) == _bits(jax.jit(lambda x: formats.qdq(x, fmt, axis=axis))(x))


def test_nvfp4_stochastic_quantize_is_qdq_bitwise():
    x = np.random.default_rng(2).standard_normal((4, 64), np.float32)
    key = jax.random.key(5)
    # Each side one whole program: split into two jitted programs, XLA's
    # reciprocal rewrite moves a value by an ulp (see qcheck.formats' nvfp4_quantize).
    q = jax.jit(lambda v, k: formats.quantize(v, "nvfp4", rng=k))(x, key)
    round_trip = jax.jit(lambda v, k: formats.dequantize(formats.quantize(v, "nvfp4", rng=k)))(x, key)
    assert _bits(round_trip) == _bits(jax.jit(lambda v, k: formats.qdq(v, "nvfp4", rng=k))(x, key))
    # The codes are e2m1 values: exactly the grid, signed.
    assert np.all(np.isin(np.abs(np.asarray(q.codes, np.float32)), formats.E2M1_GRID))


def test_qdq_in_a_trace_is_traced_once_per_format_axes_and_operand_type(monkeypatch):
    traced = []
    quantize = _codec._quantize
    monkeypatch.setattr(_codec, "_quantize", lambda x, fmt, *rest: traced.append(fmt) or quantize(x, fmt, *rest))
    x = jnp.ones((3, 5, 7))  # a shape no other test quantizes: JAX's trace cache lives as long as the process
    jax.jit(lambda a, b: formats.qdq(a, "e5m2fnuz", axis=(1, 2)) + formats.qdq(b, "e5m2fnuz", axis=(1, 2)))(x, x)
    jax.jit(lambda a: formats.qdq(a, "e5m2fnuz", axis=(2, -2)) * 2)(x)  # another program, the same axes
    assert traced == ["e5m2fnuz"]  # inline, it was traced three times
    formats.qdq(x, "e5m2fnuz", axis=(1, 2))
    assert traced == ["e5m2fnuz"] * 2  # eager calls run op by op


@pytest.mark.parametrize("fmt", LAYOUT)
def test_qdq_nested_in_a_program_compiles_to_the_bits_of_qdq_inline(fmt):
    x = np.random.default_rng(3).standard_normal((4, 64), np.float32) * 30
    key = jax.random.key(7) if fmt == "nvfp4" else None
    # Operations on both sides of the call, so fusion could reach across it.
    inline = jax.jit(lambda v, k: formats.dequantize(_codec._quantize(v * 1.5, fmt, (1,), k)) * v)
    nested = jax.jit(lambda v, k: formats.qdq(v * 1.5, fmt, axis=1, rng=k) * v)
    assert _bits(nested(x, key)) == _bits(inline(x, key))


def test_nvfp4_flushed_tensor_has_zero_codes_and_block_scales():
    q = quantize_jit(jnp.full((2, 16), formats.NVFP4_MIN_AMAX / 2), "nvfp4")
    assert not np.any(np.asarray(q.codes, np.float32)) and not np.any(np.asarray(q.scales["block"], np.float32))
    assert not np.any(dequantize_jit(q))


def _round_e2m1_mismatches(round_fn) -> np.ndarray:
    v = conversion_probes(ml_dtypes.float4_e2m1fn)
    got = np.asarray(jax.jit(round_fn)(jnp.asarray(v)))
    want = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return v[got.view(np.uint32) != want.view(np.uint32)]


def test_round_e2m1_is_the_e2m1_cast_bitwise():
    # Every e2m1 value, every midpoint and its float32 neighbours, both signs, signed zeros.
    assert _round_e2m1_mismatches(formats.round_e2m1).size == 0


def test_round_e2m1_probes_catch_ties_rounded_away_from_zero():
    def half_away(v):
        a = jnp.abs(v)
        on_grid = jnp.where(a < 2, jnp.floor(a * 2 + 0.5) * 0.5,
                            jnp.where(a < 4, jnp.floor(a + 0.5), jnp.floor(a * 0.5 + 0.5) * 2))
        return jnp.copysign(on_grid, v)

    assert {0.25, 1.25, 2.5, 5.0} <= set(np.abs(_round_e2m1_mismatches(half_away)).tolist())
