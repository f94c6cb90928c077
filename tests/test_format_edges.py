"""Every number format on the inputs where quantizers break, against its numpy referee, bitwise.

One row each (a block of 32 along the quantized axis): all zeros, tiny values around float32's smallest normal
and below it (a subnormal amax that must not pass an ``== 0`` guard into 0 / 0), values at the format's largest
finite code and beyond it (a cast that does not saturate gives NaN), and the largest float32 values (E8M0's top
scale codes). A normal draw holds none of them. Each row: codes finite, an all-zero row's codes zero (its zero point
where the format has one) with finite
scales, values beyond the range saturated to the largest code, and qcheck's quantizer equal to the referee's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qcheck import formats, referees
from qcheck.checks import harness
from tests import format_properties

N = 32  # one MXFP8 block, two NVFP4 blocks
TINY = float(np.finfo(np.float32).tiny)
SIGNS = np.where(np.arange(N) % 2 == 0, 1.0, -1.0)


def _top(fmt: formats.Format) -> float:
    """The format's largest finite code value (at scale 1 for the cast formats)."""
    if jnp.issubdtype(fmt.element, jnp.integer):  # numpy's issubdtype sees no integer in ml_dtypes' int4
        return float(ml_dtypes.iinfo(fmt.element).max)
    return float(ml_dtypes.finfo(fmt.element).max)


def rows(fmt: formats.Format) -> dict[str, np.ndarray]:
    top = _top(fmt)
    return {
        "zeros": np.zeros(N),
        "tiny": SIGNS * np.where(np.arange(N) % 4 < 2, 4 * TINY, TINY / 8),
        "at the largest code": SIGNS * top,
        "beyond the largest code": SIGNS * top * 4,
        "float32's largest": SIGNS * float(np.finfo(np.float32).max) / 2,
    }


@functools.cache
def quantizer(name: str):
    return jax.jit(lambda x: formats.quantize(x, name, axis=-1))


def _flt(codes) -> np.ndarray:
    return np.asarray(codes).astype(np.float32)


#: Rows where a format's rule itself stores a scale of inf, by format: EasyDeL's int8 stores its scale in float16,
#: which overflows for a group spanning more than 65504 · 255 (about 1.7e7): its decode is then inf or NaN, EasyDeL's
#: defect (tests/test_easydel.py); the referee computes the same inf, held below with the rest.
INF_SCALE_ROWS = {"int8_easydel": {"float32's largest"}}


@pytest.mark.parametrize("fmt", formats.FORMATS, ids=lambda f: f.name)
def test_every_format_on_its_edge_rows_matches_the_referee_and_stays_finite(fmt):
    table = rows(fmt)
    x = np.stack(list(table.values())).astype(np.float32)
    q = quantizer(fmt.name)(jnp.asarray(x))
    codes, scales = _flt(q.codes), {k: np.asarray(v, np.float32) for k, v in q.scales.items()}
    ftz = jax.default_backend() == "cpu"
    defect = format_properties.FORMAT_DEFECTS.get(fmt.name)
    # JAX's MXFP8 on jax 0.12.1: the zero row, and the tiny row's flushed elements, are NaN, as declared.
    nan_rows = {"zeros", "tiny"} if defect is not None and defect.seen_here else set()
    if nan_rows:
        assert np.all(np.isnan(codes[0])), f"{fmt.name}: {defect.reason}, but the zero row's codes are {codes[0][:4]}"
    # Held in one of the format's admissible forms (XLA may divide by a scale or multiply by its reciprocal, each
    # division on its own), the whole array in it.
    refs = [referees.reference_quantize(x, fmt.name, axis=-1, ftz=ftz, xla_reciprocal=f) for f in fmt.forms]
    ref_codes, ref_scales = next(((c, r) for c, r in refs if np.array_equal(codes, _flt(c), equal_nan=True)),
                                 refs[0])
    for i, kind in enumerate(table):
        if kind in nan_rows:
            continue
        assert np.all(np.isfinite(codes[i])), f"{fmt.name}, row {kind}: codes {codes[i][:4]} not finite"
        for name, s in scales.items():
            row = s[i] if s.ndim and s.shape[0] == x.shape[0] else s
            if kind in INF_SCALE_ROWS.get(fmt.name, ()) and name == "block":
                assert np.all(np.isinf(row)), f"{fmt.name}, row {kind}: {name} scale {row}, where its rule gives inf"
                continue
            assert np.all(np.isfinite(row)), f"{fmt.name}, row {kind}: {name} scale {row} not finite"
    if not nan_rows:  # an all-zero row's codes are the code of 0: 0, or the row's zero point
        zero = scales["zero_point"][0] if "zero_point" in scales else 0
        assert np.all(codes[0] == zero), f"{fmt.name}: an all-zero row's codes are {codes[0][:4]}, not {zero}"
    if fmt.kind == "cast":  # scale 1: beyond the range is the largest code, saturated
        assert np.array_equal(np.abs(codes[3]), np.full(N, _top(fmt), np.float32)), (fmt.name, codes[3][:4])
    differ = ~((codes == _flt(ref_codes)) | (np.isnan(codes) & np.isnan(_flt(ref_codes))))
    assert not differ.any(), (f"{fmt.name}: codes differ from the referee's on rows "
                              f"{sorted({list(table)[i] for i in np.argwhere(differ)[:, 0]})}")
    for name, s in scales.items():
        assert np.array_equal(s, np.asarray(ref_scales[name], np.float32), equal_nan=True), (
            f"{fmt.name}: {name} scales {s.ravel()} differ from the referee's {np.ravel(ref_scales[name])}")


def _no_zero_guard(x: np.ndarray) -> np.ndarray:
    """A planted int8 quantizer without its zero guard: an all-zero row's scale is 0, its codes 0 / 0."""
    scale = np.max(np.abs(x), axis=-1, keepdims=True) / 127
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.clip(np.round(x / scale), -127, 127)


def test_a_quantizer_without_a_zero_guard_gives_nan_codes_on_the_zero_row_should_fail():
    # The failing twin of the property above: what the zero row is there to catch.
    x = np.stack(list(rows(formats.get_format("int8")).values())).astype(np.float32)
    assert np.isnan(_no_zero_guard(x)[0]).all()
    assert np.isfinite(_flt(quantizer("int8")(jnp.asarray(x)).codes)[0]).all()


# -- the whole tensor of tiny values (the edge checks' tiny_tensor): below every format's smallest guarded amax ----

#: As check_layer and the suite build it, from a normal draw: x times a power of two, amax just below the lowest guard.
TINY_TENSOR = np.asarray(harness.format_edge_rows(
    np.random.default_rng(5).normal(size=(8, 128)).astype(np.float32), None, {"tiny_tensor": None})["tiny_tensor"])


@pytest.mark.parametrize("fmt", formats.FORMATS, ids=lambda f: f.name)
def test_every_format_on_a_whole_tensor_of_tiny_values_matches_the_referee_and_stays_finite(fmt):
    # A per-tensor scale sees this amax (nvfp4's tensor scale, current scaling's), below every format's guard.
    assert fmt.guarded_below is None or np.max(np.abs(TINY_TENSOR)) < fmt.guarded_below
    q = quantizer(fmt.name)(jnp.asarray(TINY_TENSOR))
    codes, scales = _flt(q.codes), {k: np.asarray(v, np.float32) for k, v in q.scales.items()}
    defect = format_properties.FORMAT_DEFECTS.get(fmt.name)
    if defect is not None and defect.seen_here:  # JAX's MXFP8 on jax 0.12.1 divides its tiny blocks by 0
        assert np.isnan(codes).any(), f"{fmt.name}: {defect.reason}, but no code is NaN"
        return
    assert np.all(np.isfinite(codes)) and all(np.all(np.isfinite(s)) for s in scales.values()), fmt.name
    ftz = jax.default_backend() == "cpu"
    refs = [referees.reference_quantize(TINY_TENSOR, fmt.name, axis=-1, ftz=ftz, xla_reciprocal=f) for f in fmt.forms]
    assert any(np.array_equal(codes, _flt(c)) and all(np.array_equal(s, np.asarray(r[k], np.float32))
                                                      for k, s in scales.items()) for c, r in refs), (
        f"{fmt.name}: codes or scales of the tiny tensor differ from the referee's in every form")


def test_an_nvfp4_tensor_scale_guarded_at_zero_only_gives_nan_codes_on_the_tiny_tensor_should_fail():
    # The failing twin: NVFP4's encode step with its tensor amax guarded against 0, not NVFP4_MIN_AMAX.
    amax = np.float32(np.max(np.abs(TINY_TENSOR)))
    assert 0 < amax < formats.NVFP4_MIN_AMAX
    with np.errstate(over="ignore", invalid="ignore"):
        s_enc = np.float32(formats.NVFP4_RANGE) / amax  # overflows: inf
        assert np.isinf(s_enc) and np.isnan(TINY_TENSOR * s_enc).any()  # its zeros code 0 · inf
    assert not np.any(_flt(quantizer("nvfp4")(jnp.asarray(TINY_TENSOR)).codes))  # guarded: flushed to 0
