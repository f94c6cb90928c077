"""Codes packed into integers of any width (issue 55, item 5): fields of 2, 4 or 8 bits in a uint8, uint16, uint32
or int32 word, in offset binary (code + 2^(bits-1), EasyDeL's and ejkernel's layout) or two's complement, unpacked
by shifts, masks and a subtraction, read as codes of the field's width and held like any other codes: bitwise
where the walk saw their quantizer, by type where they are stored. Integer arithmetic that unpacks no codes (an
index masked to a byte, a hash mixed by shifts, a float's bits) stays full precision."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcheck

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(8, 32)).astype(np.float32)
W = _RNG.normal(size=(32, 16)).astype(np.float32)
INT8 = {"weights": "int8", "activations": "int8"}
FULL_PRECISION = r"1 of 1 matmuls reach full precision"


def _int8(x, axis):
    scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


# -- the reproduction: int8 codes, four to a uint32, offset binary ------------------------------------

def packed_uint32(x):
    """int8 codes with a scale per column, packed four to a uint32 (code + 128, lowest first) as EasyDeL and
    ejkernel store them, unpacked by shifts and masks and 128 subtracted before the matmul."""
    xc, xs = _int8(x, -1)
    wc, ws = _int8(W, 0)
    u = (wc.astype(jnp.int32) + 128).astype(jnp.uint32).reshape(8, 4, 16)
    words = u[:, 0] | (u[:, 1] << 8) | (u[:, 2] << 16) | (u[:, 3] << 24)
    fields = (words[:, None, :] >> (jnp.arange(4, dtype=jnp.uint32)[None, :, None] * 8)) & 0xFF
    codes = (fields.astype(jnp.int32) - 128).reshape(32, 16)
    return (xc.astype(jnp.float32) * xs) @ (codes.astype(jnp.float32) * ws)


def test_int8_codes_packed_four_to_a_uint32_read_as_int8_and_held_bitwise_should_pass():
    """They read full precision before (a false "unquantized"), and with values the walk crashed on c + 128 (a
    raw TypeError from lax.add); now the unpacked field reads as int8 codes, held bitwise to int8 (absmax/127
    per column), and the error figure is the matmul's against its float operands."""
    (r,) = qcheck.coverage(packed_uint32, X)
    assert (str(r.rhs), r.rhs_casts) == ("int8 unpack", frozenset({"int8"})), (r.rhs, r.rhs_casts)
    (r,) = qcheck.coverage(packed_uint32, X, errors=True)
    assert r.error is not None and 0 < r.error < 0.02, qcheck.format_coverage([r])
    (r,) = qcheck.assert_quantized(packed_uint32, X, declared=INT8)
    assert r.lhs_hold.bitwise and r.rhs_hold.bitwise, (r.lhs_hold, r.rhs_hold)


def _packed_plant(x, *, axis=0, rounding=jnp.round, offset=128, counts=(0, 8, 16, 24)):
    xc, xs = _int8(x, -1)
    scale = jnp.max(jnp.abs(W), axis=axis, keepdims=True) / 127
    wc = jnp.clip(rounding(W / scale), -127, 127).astype(jnp.int8)
    u = (wc.astype(jnp.int32) + 128).astype(jnp.uint32).reshape(8, 4, 16)
    words = u[:, 0] | (u[:, 1] << 8) | (u[:, 2] << 16) | (u[:, 3] << 24)
    fields = (words[:, None, :] >> jnp.asarray(counts, jnp.uint32)[None, :, None]) & 0xFF
    codes = (fields.astype(jnp.int32) - offset).reshape(32, 16)
    return (xc.astype(jnp.float32) * xs) @ (codes.astype(jnp.float32) * scale)


@pytest.mark.parametrize("plant, match", [
    (dict(axis=None), r"rhs \(weight\): codes are not int8's: .* they match one scale for the whole tensor"),
    (dict(rounding=jnp.floor), r"rhs \(weight\): codes are not int8's: \d+ of 512 codes differ"),
    # Two fields read back in each other's place: the packing moved codes, which differ from the referee's.
    (dict(counts=(8, 0, 16, 24)), r"rhs \(weight\): codes are not int8's: \d+ of 512 codes differ"),
    # 127 subtracted, not 128: no signed field, the bytes minus a zero point, which int8 does not have.
    (dict(offset=127), r"rhs \(weight\) is cast to uint8; declared int8"),
], ids=["one-scale-for-all-columns", "codes-rounded-down", "fields-swapped", "wrong-offset"])
def test_a_packed_uint32_plant_fails_naming_its_site_should_fail(plant, match):
    with pytest.raises(AssertionError, match=match) as info:
        qcheck.assert_quantized(functools.partial(_packed_plant, **plant), X, declared=INT8)
    assert "dot_general at tests/test_packed_codes.py:" in str(info.value).replace("\\", "/"), str(info.value)
    assert "(_packed_plant)" in str(info.value)


# -- other widths and encodings ----------------------------------------------------------------------------------

def _pack(codes, bits, container, offset):
    """``codes`` [k, n] packed along k, as many to a word as fit, the first in the lowest bits: offset binary
    (code + 2^(bits-1)) or two's complement (the code's low bits)."""
    per = np.iinfo(container).bits // bits
    lanes = codes.astype(jnp.int32) + 2 ** (bits - 1) if offset else codes.astype(jnp.int32) & (2 ** bits - 1)
    u = lanes.astype(container).reshape(-1, per, codes.shape[1])
    word = u[:, 0]
    for i in range(1, per):
        word = word | (u[:, i] << (bits * i))
    return word


def _unpack_offset(words, bits):
    """Each field shifted down by a constant array of counts and masked, then 2^(bits-1) subtracted."""
    per = np.iinfo(words.dtype).bits // bits
    fields = (words[:, None, :] >> (jnp.arange(per, dtype=words.dtype)[None, :, None] * bits)) & (2 ** bits - 1)
    return (fields.astype(jnp.int32) - 2 ** (bits - 1)).reshape(-1, words.shape[1])


def _unpack_sign_extended(words, bits):
    """Two's complement fields of a signed word, each shifted to the top and back down arithmetically, one
    literal count per field, stacked."""
    top = np.iinfo(words.dtype).bits
    per = top // bits
    fields = [jnp.left_shift(words, top - bits * (i + 1)) >> (top - bits) if i < per - 1 else words >> (top - bits)
              for i in range(per)]
    return jnp.stack(fields, axis=1).reshape(-1, words.shape[1])


def _unpack_xor(words, bits):
    """Two's complement fields masked, made signed by (u ^ half) - half, as Keras's unpack_int4 does a nibble."""
    half, per = 2 ** (bits - 1), np.iinfo(words.dtype).bits // bits
    fields = [((words >> (bits * i) if i else words) & (2 ** bits - 1)).astype(jnp.int32) for i in range(per)]
    return jnp.stack([(f ^ half) - half for f in fields], axis=1).reshape(-1, words.shape[1])


def _int4(w):
    # int4_keras: an encode scale 7 / (absmax + 1e-7) per output column, codes rounded and clipped to [-8, 7].
    scale = 7 / (jnp.max(jnp.abs(w), axis=0, keepdims=True) + 1e-7)
    return jnp.clip(jnp.round(w * scale), -8, 7).astype(jnp.int8), 1 / scale


LAYOUTS = {
    "int8-two-to-a-uint16-offset": (8, jnp.uint16, True, _unpack_offset),
    "int8-four-to-an-int32-sign-extended": (8, jnp.int32, False, _unpack_sign_extended),
    "int8-four-to-a-uint32-xor": (8, jnp.uint32, False, _unpack_xor),
    "int4-eight-to-a-uint32-offset": (4, jnp.uint32, True, _unpack_offset),
    "int4-two-to-a-uint8-sign-extended": (4, jnp.int8, False, _unpack_sign_extended),
}


def _layout_layer(layout, quantize=None):
    bits, container, offset, unpack = LAYOUTS[layout]
    quantize = quantize or (functools.partial(_int8, axis=0) if bits == 8 else _int4)

    def layer(x):
        wc, ws = quantize(W)
        codes = unpack(_pack(wc, bits, container, offset), bits)
        return x @ (codes.astype(jnp.float32) * ws)
    return layer


def _declared(layout):
    return {"weights": "int8" if LAYOUTS[layout][0] == 8 else "int4_keras", "activations": None}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_codes_packed_in_words_of_any_width_read_as_their_width_and_held_bitwise_should_pass(layout):
    bits = LAYOUTS[layout][0]
    (r,) = qcheck.coverage(_layout_layer(layout), X)
    assert str(r.rhs) == f"int{bits} unpack", r.rhs
    (r,) = qcheck.coverage(_layout_layer(layout), X, declared=_declared(layout))
    assert r.rhs_hold.bitwise and not r.findings, (r.rhs_hold, r.findings)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_codes_packed_in_words_of_any_width_one_scale_for_all_columns_fails_should_fail(layout):
    bits = LAYOUTS[layout][0]
    top = 127 if bits == 8 else 7

    def shared(w):  # the plant: one scale for the whole kernel
        scale = jnp.max(jnp.abs(w)) / top
        return jnp.clip(jnp.round(w / scale), -top, top).astype(jnp.int8), scale

    with pytest.raises(AssertionError, match=r"rhs \(weight\): codes are not int\w+'s: .*one scale for the whole"):
        qcheck.assert_quantized(_layout_layer(layout, shared), X, declared=_declared(layout))


# -- stored words: no quantizer in the program, held by type as stored codes are ----------------------------------

def _stored(bits, container):
    codes = _RNG.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), size=(32, 16)).astype(np.int8)
    return np.asarray(_pack(jnp.asarray(codes), bits, container, offset=True)), codes


@pytest.mark.parametrize("bits, container", [(2, jnp.uint8), (4, jnp.uint16), (8, jnp.uint32), (8, jnp.int32)],
                         ids=["int2-in-uint8", "int4-in-uint16", "int8-in-uint32", "int8-in-int32"])
def test_stored_packed_words_read_as_codes_and_are_held_by_type_should_pass(bits, container):
    words, codes = _stored(bits, container)
    assert np.array_equal(np.asarray(_unpack_offset(jnp.asarray(words), bits)), codes)

    def layer(x, words):
        xc, xs = _int8(x, -1)
        return (xc.astype(jnp.float32) * xs) @ (_unpack_offset(words, bits).astype(jnp.float32) * 0.01)

    (r,) = qcheck.assert_quantized(layer, X, qcheck.weights(words), declared=False)
    assert str(r.rhs) == f"int{bits} unpack", r.rhs
    if bits == 8:  # stored codes have no float source: held by type, and said so, as stored int8 codes are
        with pytest.raises(AssertionError, match=r"rhs \(weight\) held by its type only, not bitwise as int8"):
            qcheck.assert_quantized(layer, X, qcheck.weights(words), declared={"weights": "int8", "activations": None})


@pytest.mark.parametrize("unpack", [lambda w: _unpack_offset(w, 8) + 128, lambda w: _unpack_end_to_end(w, 32, 8).T],
                         ids=["shifts-and-masks", "end-to-end"])
def test_a_stored_word_passed_as_an_activation_is_no_codes_should_fail(unpack):
    """The same words as a call's argument (an activation, not marked as weights): no stored codes to read."""
    words, _ = _stored(8, jnp.uint32)

    def layer(x, w):
        xc, xs = _int8(x, -1)
        return (xc.astype(jnp.float32) * xs) @ (unpack(w).astype(jnp.float32) * 0.01)

    qcheck.assert_quantized(layer, X, qcheck.weights(words), declared=False)  # as weights: read
    with pytest.raises(AssertionError, match=FULL_PRECISION):
        qcheck.assert_quantized(layer, X, words, declared=False)


def _tiled(words, x, *, as_xs):
    """ejkernel's XLA quantized matmul (0.0.78) as its jaxpr runs it: the packed words padded to a tile, then
    unpacked inside a scan, taken whole as the loop's const or a tile per iteration as its xs."""
    padded = jnp.pad(words, ((0, words.shape[0]), (0, 0)))
    xc, xs = _int8(x, -1)
    x = xc.astype(jnp.float32) * xs

    def tile(w):
        return _unpack_offset(w[:words.shape[0]], 8).astype(jnp.float32) * 0.01

    if as_xs:
        return jax.lax.scan(lambda c, w: (c, x @ tile(w)), 0, padded[None])[1][0]
    return jax.lax.scan(lambda c, i: (c, x @ tile(padded)), 0, jnp.arange(1))[1][0]


@pytest.mark.parametrize("as_xs", [False, True], ids=["const", "xs"])
def test_stored_words_padded_and_unpacked_inside_a_scan_read_as_codes_should_pass(as_xs):
    words, _ = _stored(8, jnp.uint32)
    (r,) = qcheck.assert_quantized(lambda x, w: _tiled(w, x, as_xs=as_xs), X, qcheck.weights(words),
                                   declared=False)
    assert str(r.rhs) == "int8 unpack", r.rhs


@pytest.mark.parametrize("as_xs", [False, True], ids=["const", "xs"])
def test_words_passed_as_an_activation_into_a_scan_are_no_codes_should_fail(as_xs):
    words, _ = _stored(8, jnp.uint32)
    with pytest.raises(AssertionError, match=FULL_PRECISION):
        qcheck.assert_quantized(lambda x, w: _tiled(w, x, as_xs=as_xs), X, words, declared=False)


# -- controls: integer arithmetic that unpacks no codes stays full precision -------------------------------------

IDS = _RNG.integers(0, 50_000, size=(8,)).astype(np.int32)
TABLE = _RNG.normal(size=(256, 16)).astype(np.float32)
SEEDS = _RNG.integers(0, 2 ** 32, size=(32, 16), dtype=np.uint64).astype(np.uint32)


def _one_hot(ids, table):
    return jax.nn.one_hot(ids & 0xFF, 256, dtype=jnp.float32) @ table


def _taken(ids, table):
    return table[ids & 0xFF] @ W.T


def _xorshift(x, seeds):
    h = seeds ^ (seeds << 13)
    h = h ^ (h >> 17)
    h = h ^ (h << 5)
    return x @ ((h & 0xFF).astype(jnp.float32) / 255)


def _jenkins(x, seeds):
    h = seeds + (seeds << 10)
    h = h ^ (h >> 6)
    return x @ (((h >> 8) & 0xFF).astype(jnp.float32) / 255)


def _float_bytes(x, w):
    """A float's bits split into bytes by shifts and masks and put back together: no codes, its value itself."""
    bits = jax.lax.bitcast_convert_type(w, jnp.uint32)
    parts = (bits[..., None] >> jnp.arange(0, 32, 8, dtype=jnp.uint32)[None, None, :]) & 0xFF
    word = parts[..., 0] | (parts[..., 1] << 8) | (parts[..., 2] << 16) | (parts[..., 3] << 24)
    return x @ jax.lax.bitcast_convert_type(word, jnp.float32)


def _float_truncated(x, w):
    """A float's low 16 bits shifted out and back: the bits of a bfloat16, read by no cast qcheck knows."""
    bits = jax.lax.bitcast_convert_type(w, jnp.uint32)
    return x @ jax.lax.bitcast_convert_type((bits >> 16) << 16, jnp.float32)


@pytest.mark.parametrize("fn, args", [
    (_one_hot, (IDS, TABLE)),  # token ids masked to a byte, one-hot
    (_one_hot, (qcheck.weights(IDS), TABLE)),  # an index table stored as a parameter: the same
    (_taken, (IDS, TABLE)),  # rows taken by the masked ids
    (_xorshift, (X, qcheck.weights(SEEDS))),
    (_jenkins, (X, qcheck.weights(SEEDS))),
    (_float_bytes, (X, W)),
    (_float_truncated, (X, W)),
], ids=["index-one-hot", "stored-index-one-hot", "index-gather", "xorshift-hash", "jenkins-hash", "float-bytes",
        "float-bits-truncated"])
def test_integer_arithmetic_that_unpacks_no_codes_stays_full_precision_should_fail(fn, args):
    with pytest.raises(AssertionError, match=FULL_PRECISION):
        qcheck.assert_quantized(fn, *args, declared=False)
    (r,) = qcheck.coverage(fn, *args)
    assert not r.lhs.quantized and not r.rhs.quantized, (r.lhs, r.rhs)


# -- a walk step that meets dtypes it does not expect ------------------------------------------------------------

def _codes_clipped_as_integers(bound):
    def layer(x):
        xc, xs = _int8(x, -1)
        wc, ws = _int8(W, 0)
        wc = jnp.clip(wc.astype(jnp.int32), -bound, bound)  # integer codes saturated against integer bounds
        return (xc.astype(jnp.float32) * xs) @ (wc.astype(jnp.float32) * ws)
    return layer


def test_integer_codes_saturated_by_integer_bounds_get_a_figure_and_a_bitwise_hold_should_pass():
    """The walk's value before quantization is a float, the bounds integers: a raw TypeError from lax.max before,
    computed in float now."""
    (r,) = qcheck.coverage(_codes_clipped_as_integers(127), X, errors=True)
    assert str(r.rhs) == "int8" and 0 < r.error < 0.02, qcheck.format_coverage([r])
    (r,) = qcheck.assert_quantized(_codes_clipped_as_integers(127), X, declared=INT8)
    assert r.rhs_hold.bitwise, r.rhs_hold


def test_integer_codes_saturated_short_of_their_range_fail_naming_the_site_should_fail():
    with pytest.raises(AssertionError, match=r"dot_general at \S*test_packed_codes.py:\d+ .*\n.*rhs \(weight\): "
                                             r"codes are not int8's: \d+ of 512 codes differ"):
        qcheck.assert_quantized(_codes_clipped_as_integers(100), X, declared=INT8)


def _integer_only_mul():
    """A primitive the walk reads by its name as codes times a scale, which takes integers only: the walk's float
    values before quantization are refused."""
    prim = jax.extend.core.Primitive("mul")

    def abstract(a, b):
        if not (jnp.issubdtype(a.dtype, jnp.integer) and jnp.issubdtype(b.dtype, jnp.integer)):
            raise TypeError(f"integers only, got {a.dtype} and {b.dtype}")
        return jax.core.ShapedArray(a.shape, a.dtype)

    prim.def_abstract_eval(abstract)
    return prim


def _integer_codes_scaled(x):
    wc, ws = _int8(W, 0)
    doubled = _integer_only_mul().bind(wc.astype(jnp.int32), jnp.full((1, 16), 2, jnp.int32))
    return x @ (doubled.astype(jnp.float32) * ws)


def test_a_walk_step_on_dtypes_it_does_not_expect_is_a_user_code_error_naming_the_site_should_fail():
    (r,) = qcheck.coverage(_integer_codes_scaled, X)  # without values, nothing is bound again: read as int8
    assert str(r.rhs) == "int8", r.rhs
    for kwargs in (dict(errors=True), dict(declared={"weights": "int8", "activations": None})):
        with pytest.raises(qcheck.UserCodeError, match=r"^coverage: the walk cannot follow mul \(int32, int32\) at "
                                                       r"\S*test_packed_codes.py:\d+ \(_integer_codes_scaled\): "
                                                       r"TypeError: integers only, got float32 and float32"):
            qcheck.coverage(_integer_codes_scaled, X, **kwargs)


# -- a general unpacker: codes of any width laid end to end in uint32 words, each read from its word and bit -----

def _unpack_end_to_end(words, n, bits):
    """The n codes of ``bits`` bits laid end to end in each row's uint32 words, lowest bits first (a code may span
    two words where 32 is no multiple of ``bits``), read back by computed word indices, shift counts and masks:
    a word taken by index, shifted down and masked, and the next word's low bits or'ed in above where a code
    spans two, selected where it does (ejkernel's ``_unpack_bits`` reads its stored weights so)."""
    start = jnp.arange(n, dtype=jnp.uint32)[None, :] * bits
    word, shift = (start[0] // 32).astype(jnp.int32), start % 32
    spans = shift + bits > 32
    low_bits = jnp.where(spans, 32 - shift, bits)
    low = (jnp.take(words, word, axis=-1) >> shift) & ((jnp.uint32(1) << low_bits) - 1)
    nxt = jnp.take(words, jnp.minimum(word + 1, words.shape[-1] - 1), axis=-1)
    high = jnp.where(spans, nxt & ((jnp.uint32(1) << (bits - low_bits)) - 1), jnp.uint32(0))
    return low | (high << low_bits)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_codes_laid_end_to_end_read_by_computed_shifts_read_as_unsigned_codes_should_pass(bits):
    """Unsigned affine codes (a float zero point and a scale per row) stored in uint32 words: the walk evaluates
    the word indices, shift counts and masks the program computes from jnp.arange, and reads the codes."""
    codes = _RNG.integers(0, 2 ** bits, size=(16, 32)).astype(np.uint32)
    starts = np.arange(32) * bits
    words = np.zeros((16, 32 * bits // 32), np.uint32)
    for i, s in enumerate(starts):
        words[:, s // 32] |= (codes[:, i] << np.uint32(s % 32)).astype(np.uint32)
    assert np.array_equal(np.asarray(_unpack_end_to_end(jnp.asarray(words), 32, bits)), codes)
    zero, scale = np.float32(2 ** (bits - 1)), _RNG.uniform(0.5, 1, size=(16, 1)).astype(np.float32)

    def layer(x, w):
        xc, xs = _int8(x, -1)
        q = _unpack_end_to_end(w, 32, bits).astype(jnp.float32)
        return (xc.astype(jnp.float32) * xs) @ ((q - zero) * scale).T

    (r,) = qcheck.assert_quantized(layer, X, qcheck.weights(words), declared=False)
    assert str(r.rhs) == f"uint{bits} unpack", r.rhs

