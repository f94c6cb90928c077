"""qcheck's int8 formats against the libraries they are named after, bit for bit.

``int8_aqt`` is AQT v2's default int8 (``aqt_quantizer.quantizer_make(8)``, as
``config_v4`` builds it), ``int8`` is AQT with ``preserve_max_val=True``, and
``int8_qwix`` is ``qwix.quantize(x, jnp.int8, ...)``. Skipped where aqtp or qwix
is not installed (checked with aqtp 0.9.0 and qwix 0.1.8). Each library runs
eager and jitted, as callers run it; codes, scales and the dequantized values
are compared.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcheck import formats
from tests.helpers import import_extra

F32 = np.float32
_rng = np.random.default_rng(11)
_WIDE = _rng.standard_normal((128, 64)) * np.exp2(_rng.integers(-60, 60, (128, 1)))
_TINY = np.resize(F32([1.0, -0.3, 0.01, 0.0]), (8, 64)) * F32([[1e-10], [1e-16], [1e-17], [1e-18], [1e-30],
                                                           [1e-35], [1e-37], [0.0]])

#: name -> (x, contraction axes): normal data; magnitudes 2^±60; the absmax/127.5 ties at scale
#: about 1 (both signs of the amax); slices around qwix's 2^-63 scale floor, AQT's subnormal
#: scale and all-zero slices; and two contraction axes of a 3-d operand.
OPERANDS = {
    "normal": ((_rng.standard_normal((256, 64)) * 10).astype(F32), (1,)),
    "wide": (_WIDE.astype(F32), (1,)),
    "ties": (np.resize(F32([127.5, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.0, 3.5, -127.5, 0.0]), (64, 64)), (1,)),
    "tiny": (_TINY.astype(F32), (1,)),
    "two-axes": ((_rng.standard_normal((4, 8, 32)) * 100).astype(F32), (1, 2)),
}
RUNS = {"eager": lambda f: f, "jit": jax.jit}


# One jitted (or eager) callable per library, format, axes and run, shared by every test that makes the same
# call: a fresh lambda under jax.jit is a fresh program, compiled again for the same computation.
def _aqt_default(axes, ndim):
    quantizer = import_extra("aqt", "aqt.jax.v2.aqt_quantizer").quantizer_make(8)
    return lambda v: quantizer.quant(v, calibration_axes=list(axes))[0]


def _aqt_preserve_max_val(axes, ndim):
    quantizer = import_extra("aqt", "aqt.jax.v2.aqt_quantizer").quantizer_make(8, preserve_max_val=True)
    return lambda v: quantizer.quant(v, calibration_axes=list(axes))[0]


def _qwix(axes, ndim):
    qwix = import_extra("qwix")
    keep = tuple(a for a in range(ndim) if a not in axes)
    return lambda v: qwix.quantize(v, jnp.int8, channelwise_axes=keep)


@functools.cache
def _library_call(library: str, axes: tuple[int, ...], ndim: int, run: str):
    return RUNS[run](LIBRARIES[library](axes, ndim))


@functools.cache
def _qcheck_call(fmt: str, axes: tuple[int, ...], run: str):
    return RUNS[run](lambda v: formats.quantize(v, fmt, axis=axes))


def _library_quantize(library: str, x, axes, run):
    """(codes, scale, dequantized values) of ``library``'s int8 quantization of ``x``."""
    out = _library_call(library, axes, x.ndim, run)(x)
    if library == "qwix":
        return out.qvalue, out.scale, import_extra("qwix").dequantize(out)
    return out.qvalue, out.scale[0], out.dequant()


LIBRARIES = {"AQT default": _aqt_default, "AQT preserve_max_val": _aqt_preserve_max_val, "qwix": _qwix}


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _assert_same(what: str, got, want, skip: np.ndarray | None = None) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if (got.dtype, got.shape) != (want.dtype, want.shape):
        raise AssertionError(f"{what}: qcheck {got.dtype}{list(got.shape)}, library {want.dtype}{list(want.shape)}")
    off = _bits(got) != _bits(want)
    if skip is not None:
        off &= ~skip
    if off.any():
        i = tuple(int(j) for j in np.argwhere(off)[0])
        raise AssertionError(f"{what} differ at index {i}: qcheck {got[i]!r} vs library {want[i]!r}; "
                             f"{int(off.sum())} of {off.size} differ ({got.dtype})")


def assert_format_matches_library(fmt: str, library: str, x: np.ndarray, axes: tuple[int, ...], run: str,
                                  scale_skip: np.ndarray | None = None) -> None:
    """``formats.quantize(x, fmt)``'s codes, scales and dequantized values equal ``library``'s, bitwise."""
    q = _qcheck_call(fmt, axes, run)(x)
    codes, scale, dequantized = _library_quantize(library, x, axes, run)
    prefix = f"{fmt} vs {library} ({run})"
    _assert_same(f"{prefix}: codes", q.codes, codes)
    _assert_same(f"{prefix}: scales", q.scales["slice"], scale, scale_skip)
    _assert_same(f"{prefix}: dequantized values", formats.dequantize(q), dequantized)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("operands", OPERANDS)
@pytest.mark.parametrize("fmt, library", [("int8_aqt", "AQT default"), ("int8_qwix", "qwix")])
def test_int8_format_matches_its_library(fmt, library, operands, run):
    assert_format_matches_library(fmt, library, *OPERANDS[operands], run)


def _unscaled_slices(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    # Slices whose amax / 127 is zero or subnormal, and so is zero on XLA's CPU backend.
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    return amax < 127 * np.finfo(F32).tiny


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("operands", OPERANDS)
def test_int8_matches_aqt_with_preserve_max_val(operands, run):
    # Named exclusion: a slice whose scale would be zero or subnormal. qcheck's int8 gives it
    # scale 1, AQT 1/127 (an all-zero slice's amax becomes 1) or 0 (flushed); codes are 0
    # either way, and so are the values.
    x, axes = OPERANDS[operands]
    assert_format_matches_library("int8", "AQT preserve_max_val", x, axes, run, _unscaled_slices(x, axes))


def test_int8_scale_exclusion_is_needed_and_only_there():
    x, axes = OPERANDS["tiny"]
    unscaled = _unscaled_slices(x, axes)
    assert 0 < unscaled.sum() < unscaled.size
    with pytest.raises(AssertionError, match=r"int8 vs AQT preserve_max_val \(jit\): scales differ at index \(6, 0\): qcheck np.float32\(1.0\) vs library np.float32\(0.0\); 2 of 8"):
        assert_format_matches_library("int8", "AQT preserve_max_val", x, axes, "jit")
    assert_format_matches_library("int8", "AQT preserve_max_val", x, axes, "jit", unscaled)


# -- should fail: each comparison on the format it is not ------------------------------------


@pytest.mark.parametrize(
    "fmt, library, operands, message",
    [
        # qcheck's int8 is not AQT's default: absmax/127 against /127.5.
        ("int8", "AQT default", "normal",
         r"int8 vs AQT default \(jit\): codes differ at index \(\d+, \d+\): qcheck np.int8\(-?\d+\) vs library"),
        # Nor is AQT's default qwix's: qwix's negative amax is -128, and its quotient x / scale.
        ("int8_aqt", "qwix", "ties",
         r"int8_aqt vs qwix \(jit\): codes differ at index \(\d+, \d+\): qcheck np.int8\(-127\) vs library "
         r"np.int8\(-128\)"),
        # qwix's 2^-63 floor: a slice with amax 1e-17 is zero in qwix, quantized by AQT.
        ("int8_qwix", "AQT default", "tiny",
         r"int8_qwix vs AQT default \(jit\): codes differ at index \(2, 0\): qcheck np.int8\(0\) vs library"),
    ],
    ids=["int8-is-not-aqt-default", "aqt-is-not-qwix", "qwix-is-not-aqt"],
)
def test_library_comparison_fails_on_another_format(fmt, library, operands, message):
    with pytest.raises(AssertionError, match=message):
        assert_format_matches_library(fmt, library, *OPERANDS[operands], "jit")


def test_operands_reach_what_they_are_for():
    # The ties row's amax is a tie at 127.5; the tiny rows straddle qwix's floor (127.5 · 2^-63).
    x, _ = OPERANDS["tiny"]
    amax = np.max(np.abs(x), axis=1)
    floor = 127.5 * 2.0**-63
    assert (amax < floor).any() and (amax > floor).any() and (amax == 0).any()
    assert math.isclose(float(np.max(np.abs(OPERANDS["ties"][0]))), 127.5)
