"""qwix's fp8 and fp4 formats against qcheck's referees, bit for bit (qwix 0.1.8, jax 0.10.2, CPU).

qwix's rule, read from qwix/_src/core/qarray.py (``calibrate``,
``compute_scale_zero_point``, ``quantize_with_scale_zero_point``) and
numerics.py (``get_symmetric_bound``, ``convert_to``): scale = absmax / bound
(bound: the element type's max, 448 for e4m3fn and mxfp8, 6 for nvfp4); a scale
below sqrt(float32 tiny) = 2^-63 becomes 1; mxfp8 rounds the scale up to
2^ceil(log2 scale), nvfp4 casts it to e4m3fn; codes = x / scale, clipped to the
element type's range and cast. qcheck.referees._libraries writes that rule in
numpy, and the exact check names a site that equals it; the models below are
those functions on qwix's own layouts, each pinned bitwise against qwix, so a
diagnosis made with one is the library's, not a guess. XLA may compute a division by a constant (absmax /
bound) and x / scale each as a product with its float32 reciprocal (jax 0.10.2 rewrites both under jit and the
constant's eager; 0.12.1 the constant's under jit only): the models take the form (qcheck.referees.FORMS), and
a model equals qwix when it does in one form over the whole array.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck import checks, referees
from qcheck.referees._libraries import (QWIX_MIN_SCALE, quantize_qwix_mxfp8, quantize_qwix_nvfp4, qwix_cast, qwix_divide,
                                    qwix_per_tensor_e4m3fn, qwix_scale)
from qcheck.checks._site import assert_site_exact

from tests.helpers import extra_missing, requires_extra

if extra_missing("qwix"):  # pragma: no cover - depends on the environment; the module stays importable for its names
    qwix = None
else:
    import qwix
pytestmark = requires_extra("qwix")

F32 = np.float32
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
RUNS = {"eager": lambda f: f, "jit": jax.jit}

_rng = np.random.default_rng(17)
#: A batch of 24 tensors (axis 0), each with its own magnitude 2^k, k in [-50, 60]: above qwix's floor.
WIDE = (_rng.standard_normal((24, 16, 64)) * np.exp2(_rng.integers(-50, 60, (24, 1, 1)))).astype(F32)
#: The same rescaled so each tensor's amax is exactly 448 · 2^k: both scale rules are then powers of two.
_AMAX = np.max(np.abs(WIDE), axis=(1, 2), keepdims=True)
POW2 = (WIDE / _AMAX * (F32(448) * np.exp2(_rng.integers(-50, 60, (24, 1, 1))).astype(F32))).astype(F32)
#: Tensors whose amax straddles qwix's floor, 448 · 2^-63 (about 4.9e-17).
TINY = (_rng.standard_normal((4, 16, 64)) * F32([1e-18, 1e-17, 1e-15, 1e-12])[:, None, None]).astype(F32)
#: Blocks of 32 (mxfp8) / 16 (nvfp4) along the last axis, magnitudes 2^±30 per row.
BLOCKS = (_rng.standard_normal((32, 64)) * np.exp2(_rng.integers(-30, 30, (32, 1)))).astype(F32)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_same_bits(what: str, qcheck_side, qwix_side) -> None:
    """``qcheck_side`` and ``qwix_side`` are the same array, bitwise; else name the first difference."""
    got, want = np.asarray(qcheck_side), np.asarray(qwix_side)
    if (got.dtype, got.shape) != (want.dtype, want.shape):
        raise AssertionError(f"{what}: qcheck {got.dtype}{list(got.shape)}, qwix {want.dtype}{list(want.shape)}")
    off = _bits(got) != _bits(want)
    if off.any():
        i = tuple(int(j) for j in np.argwhere(off)[0])
        raise AssertionError(f"{what} differ at index {i}: qcheck {got[i]!r} vs qwix {want[i]!r}; "
                             f"{int(off.sum())} of {off.size} differ ({got.dtype})")


# -- the numpy models of qwix's rule ------------------------------------------------------------


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def model_e4m3fn_per_tensor(x: np.ndarray, xla_reciprocal, bound: float = 448.0) -> tuple[np.ndarray, np.ndarray]:
    """qwix.quantize(x, float8_e4m3fn, channelwise_axes=(0,)): one scale per x[i]."""
    return qwix_per_tensor_e4m3fn(x, (1, 2), xla_reciprocal, bound)


def assert_model_in_some_form(what: str, model, x: np.ndarray, codes, scale) -> str:
    """The model's codes and scales are qwix's bitwise in one referee form, the whole array in it; returns the
    form, else an AssertionError naming each form's first difference."""
    failures = []
    for form in referees.FORMS:
        want_codes, want_scale = model(x, xla_reciprocal=form)
        try:
            assert_same_bits(f"{what}: codes", want_codes, codes)
            assert_same_bits(f"{what}: scales", want_scale.reshape(np.shape(scale)), scale)
        except AssertionError as e:
            failures.append(f"[{form}] {e}")
            continue
        return form
    raise AssertionError("; ".join(failures))


def model_mxfp8(x: np.ndarray, xla_reciprocal) -> tuple[np.ndarray, np.ndarray]:
    """qwix.quantize(x, "mxfp8", channelwise_axes=(0,), tiled_axes={1: 32}) for 2-d ``x``."""
    return quantize_qwix_mxfp8(x, (x.ndim - 1,), xla_reciprocal)


def model_nvfp4(x: np.ndarray, xla_reciprocal) -> tuple[np.ndarray, np.ndarray]:
    """qwix.quantize(x, "nvfp4", channelwise_axes=(0,), tiled_axes={1: 16}) for 2-d ``x``: one level."""
    return quantize_qwix_nvfp4(x, (x.ndim - 1,), xla_reciprocal)


def _qwix_quantize(x: np.ndarray, qtype, run: str, **how):
    qa = RUNS[run](lambda v: qwix.quantize(v, qtype, **how))(x)
    return np.asarray(qa.qvalue), np.asarray(qa.scale), np.asarray(qwix.dequantize(qa))


def qwix_e4m3fn(x, run):
    return _qwix_quantize(x, jnp.float8_e4m3fn, run, channelwise_axes=(0,))


def qwix_mxfp8(x, run):
    return _qwix_quantize(x, "mxfp8", run, channelwise_axes=(0,), tiled_axes={1: 32})


def qwix_nvfp4(x, run):
    return _qwix_quantize(x, "nvfp4", run, channelwise_axes=(0,), tiled_axes={1: 16})


# -- each model equals qwix bitwise (should pass), on every input set -----------------------------

MODELS = {
    "e4m3fn": (qwix_e4m3fn, model_e4m3fn_per_tensor, {"wide": WIDE, "pow2": POW2, "tiny": TINY}),
    "mxfp8": (qwix_mxfp8, model_mxfp8, {"blocks": BLOCKS, "tiny": TINY[:, 0]}),
    "nvfp4": (qwix_nvfp4, model_nvfp4, {"blocks": BLOCKS, "tiny": TINY[:, 0], "big": BLOCKS[:4] * F32(1e4)}),
}
MODEL_ROWS = [(fmt, data) for fmt, (_, _, sets) in MODELS.items() for data in sets]


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("fmt, data", MODEL_ROWS)
def test_qwix_equals_its_numpy_model_should_pass(fmt, data, run):
    library, model, sets = MODELS[fmt]
    x = sets[data]
    codes, scale, _ = library(x, run)
    assert_model_in_some_form(f"qwix {fmt} model ({run})", model, x, codes, scale)


def test_qwix_model_forms_part_on_its_inputs():
    # Not vacuous: on these inputs the forms give other scales, so "in some form" still picks one.
    amax = np.max(np.abs(WIDE), axis=(1, 2), keepdims=True)
    assert not np.array_equal(qwix_scale(amax, 448.0, True), qwix_scale(amax, 448.0, False))


def test_qwix_model_fails_with_another_types_bound_in_every_form():
    # A real rule change fails whatever form XLA picks: e4m3fnuz's bound (240) where qwix's e4m3fn takes 448.
    codes, scale, _ = qwix_e4m3fn(WIDE, "jit")
    with pytest.raises(AssertionError, match=r"\[as written\] qwix e4m3fn model \(jit\): codes differ .*; "
                                             r"\[all by reciprocal\] .*; \[constant by reciprocal\] .*"):
        assert_model_in_some_form("qwix e4m3fn model (jit)", lambda x, xla_reciprocal: model_e4m3fn_per_tensor(
            x, xla_reciprocal, bound=240.0), WIDE, codes, scale)


# -- 1. per-tensor e4m3fn: qcheck's e4m3fn_current, but for the floor and the division order -----


def _referee_per_tensor(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # e4m3fn_current is one scale per tensor: each x[i] is its own tensor.
    out = [referees.reference_quantize(t, "e4m3fn_current", axis=(0, 1)) for t in x]
    codes = np.stack([c for c, _ in out])
    encode = np.stack([s["tensor"] for _, s in out]).reshape(-1, 1, 1)
    deq = np.stack([referees.reference_dequantize(c, s, "e4m3fn_current", axis=(0, 1)) for c, s in out])
    return codes, encode, deq


@pytest.mark.parametrize("run", RUNS)
def test_qwix_e4m3fn_per_tensor_equals_e4m3fn_current_at_power_of_two_scales_should_pass(run):
    # Where both scales are powers of two, qwix's x / (amax/448) and qcheck's x · (448/amax) are exact:
    # same tensor amax, same bound, same saturating cast, so the same codes and values.
    codes, scale, deq = qwix_e4m3fn(POW2, run)
    ref_codes, encode, ref_deq = _referee_per_tensor(POW2)
    assert np.all(np.frexp(scale)[0] == 0.5), "the inputs reach what they are for: power-of-two scales"
    assert_same_bits(f"qwix e4m3fn vs e4m3fn_current ({run}): codes", ref_codes, codes)
    assert_same_bits(f"qwix e4m3fn vs e4m3fn_current ({run}): decode scales", F32(1) / encode, scale)
    assert_same_bits(f"qwix e4m3fn vs e4m3fn_current ({run}): dequantized values", ref_deq, deq)


def _midpoints() -> np.ndarray:
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(E4M3).astype(F32)))
    grid = grid[np.isfinite(grid)]
    return ((grid[:-1] + grid[1:]) / 2).astype(F32)  # exact: e4m3 values have 4 significant bits


def _ties() -> np.ndarray:
    # 64 tensors, each amax 448 · (random, not a power of two) with every other element a rounding tie of
    # e4m3fn in qcheck's units (m / encode): the two division orders round them up to an ulp apart.
    rng = np.random.default_rng(5)
    mids = _midpoints()
    amax = (F32(448) * rng.uniform(1.0, 2.0, 64) * np.exp2(rng.integers(-20, 20, 64))).astype(F32)
    x = (rng.choice(mids, (64, 8, 32)) * rng.choice(F32([-1, 1]), (64, 8, 32)) / (F32(448) / amax)[:, None, None])
    x = x.astype(F32)
    x[:, 0, 0] = amax
    return x


def test_qwix_e4m3fn_per_tensor_rounds_some_ties_otherwise_than_e4m3fn_current():
    """qwix 0.1.8: x / fl(amax · fl(1/448)) against qcheck's x · fl(448 / amax); near an e4m3 rounding tie
    the two quotients fall on either side. A fact, not a defect: both are the same rule rounded otherwise."""
    x = _ties()
    codes, _, _ = qwix_e4m3fn(x, "eager")
    ref_codes, encode, _ = _referee_per_tensor(x)
    with pytest.raises(AssertionError, match=r"qwix e4m3fn vs e4m3fn_current \(eager\): codes differ at index "
                                             r"\(\d+, \d+, \d+\): qcheck .* vs qwix .*; \d+ of 16384 differ"):
        assert_same_bits("qwix e4m3fn vs e4m3fn_current (eager): codes", ref_codes, codes)
    # Every difference is a tie: qcheck's scaled value is within 2 float32 ulps of an e4m3 midpoint,
    # and the two codes are the neighbours either side of it.
    off = _bits(ref_codes) != _bits(codes)
    v = (x * encode)[off]
    lo, hi = np.minimum(codes[off], ref_codes[off]).astype(F32), np.maximum(codes[off], ref_codes[off]).astype(F32)
    mid = (lo + hi) / 2
    assert np.all(np.abs(v - mid) <= 2 * np.spacing(np.abs(mid))), "every difference is at a rounding tie"
    assert np.all(np.isin(np.abs(mid), _midpoints())), "the two codes are neighbours"


def test_qwix_e4m3fn_quantizes_a_tensor_below_its_scale_floor_to_zeros():
    """qwix 0.1.8 (qarray.compute_scale_zero_point): a scale below 2^-63 becomes 1, so a tensor whose amax is
    below 448 · 2^-63 (about 4.9e-17) casts unscaled to e4m3fn and comes back zero; e4m3fn_current scales it."""
    codes, _, deq = qwix_e4m3fn(TINY, "eager")
    ref_codes, _, ref_deq = _referee_per_tensor(TINY)
    with pytest.raises(AssertionError, match=r"qwix e4m3fn vs e4m3fn_current \(eager\): codes differ at index "
                                             r"\(0, 0, 0\): .*; 2048 of 4096 differ"):
        assert_same_bits("qwix e4m3fn vs e4m3fn_current (eager): codes", ref_codes, codes)
    for i, amax in enumerate(np.max(np.abs(TINY), axis=(1, 2))):
        assert checks.assert_tracks(ref_deq[i], TINY[i], max_rel_norm=0.05) > 0
        if amax < F32(448) * QWIX_MIN_SCALE:
            with pytest.raises(AssertionError, match=r"assert_tracks: relative norm 1\.0000 exceeds the bound 0\.05"):
                checks.assert_tracks(deq[i], TINY[i], max_rel_norm=0.05)
        else:
            assert_same_bits("qwix e4m3fn vs e4m3fn_current above the floor: codes", ref_codes[i], codes[i])


# -- 2. MXFP8: qwix rounds the scale up from amax / 448; OCP MX takes floor(log2 amax) - 8 ---------


def _significand(a: np.ndarray) -> np.ndarray:
    return 2 * np.frexp(a)[0]  # a = s · 2^e with s in [1, 2)


def test_qwix_mxfp8_scale_is_ceil_of_amax_over_448_not_ocp_mx():
    """qwix 0.1.8 mxfp8 scale: 2^ceil(log2(amax / 448)) (qarray.compute_scale_zero_point), not OCP MX v1.0's
    2^(floor(log2 amax) - 8) as qcheck's mxfp8 referee computes it: a block whose amax's significand is above
    1.75 (448 = 1.75 · 2^8) gets twice OCP's scale, so qwix never saturates where OCP clips to 448."""
    codes, scale, _ = qwix_mxfp8(BLOCKS, "eager")
    ref_codes, ref_scales = referees.reference_quantize(BLOCKS, "mxfp8", axis=1)
    ocp = np.ldexp(F32(1), ref_scales["block"].view(np.uint8).astype(np.int32) - 127).astype(F32)
    with pytest.raises(AssertionError, match=r"qwix mxfp8 vs qcheck mxfp8 \(OCP MX\): scales differ at index "
                                             r"\(\d+, \d+\): qcheck np.float32\(.*\) vs qwix np.float32\(.*\); "
                                             r"\d+ of 64 differ"):
        assert_same_bits("qwix mxfp8 vs qcheck mxfp8 (OCP MX): scales", ocp, scale)
    # The diagnosis, exactly: the blocks apart are those whose amax's significand is above 1.75, by a factor 2.
    amax = np.max(np.abs(_blocks(BLOCKS, 32)), axis=-1)
    above = _significand(amax) > F32(1.75)
    assert 0 < above.sum() < above.size, "the inputs reach both cases"
    np.testing.assert_array_equal(scale != ocp, above)
    np.testing.assert_array_equal(scale[above], 2 * ocp[above])
    # Where the scales agree the codes do (a power-of-two scale divides exactly); elsewhere they differ.
    same_codes = np.all(_blocks(_bits(codes) == _bits(ref_codes), 32), axis=-1)
    np.testing.assert_array_equal(same_codes, ~above)
    # And the ceil rule, written in numpy, is qwix's bitwise (the models above), the floor rule is not.
    assert_same_bits("qwix mxfp8 vs the ceil rule: scales", model_mxfp8(BLOCKS, False)[1], scale)


class _Dense(nnx.Module):
    def __init__(self, w):
        self.w = nnx.Param(jnp.asarray(w))

    def __call__(self, x):
        return jnp.einsum("tk,kn->tn", x, self.w[...])


def _qwix_site(qtype: str, tile_size: int):
    """A user's dense layer under a qwix rule, as an ``einsum(eqn, lhs, rhs)`` site for qcheck's exact check."""
    provider = qwix.QtProvider([qwix.QtRule(module_path=".*", weight_qtype=qtype, act_qtype=qtype,
                                            tile_size=tile_size)])

    def einsum(eqn, lhs, rhs):
        assert eqn == "tk,kn->tn"
        return qwix.quantize_model(_Dense(rhs), provider, lhs)(lhs)

    return einsum


def _model_dequantized(model, x: np.ndarray, block: int) -> np.ndarray:
    codes, scale = model(x, False)
    return (_blocks(codes.astype(F32), block) * scale[..., None]).reshape(x.shape)


_SITE_OPERANDS = tuple(np.random.default_rng(3).standard_normal(s).astype(F32) for s in ((8, 64), (64, 16)))


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
@pytest.mark.parametrize("qtype, block, model, named", [
    ("mxfp8", 32, model_mxfp8, r"qwix's mxfp8 \(block scale 2\^ceil\(log2\(amax / 448\)\), not OCP MX's "),
    ("nvfp4", 16, model_nvfp4, r"qwix's one-level nvfp4 \(e4m3fn block scales of amax / 6, no per-tensor scale\)"),
])
def test_qwix_site_fails_exact_against_qcheck_format_and_equals_qwix_rule(qtype, block, model, named):
    """qwix 0.1.8: a dense einsum under an mxfp8 / nvfp4 rule, through qcheck's exact site check with that format,
    fails it (qcheck's referees are OCP MX v1.0's floor rule and two-level NVFP4), and the check names qwix's rule
    (qcheck.referees._libraries); the same site is, bitwise, the float64-summed matmul of operands quantized by qwix's
    rule (ceil scale / one level), so that rule and nothing else is the difference."""
    lhs, rhs = _SITE_OPERANDS
    site = _qwix_site(qtype, block)
    with pytest.raises(AssertionError, match=rf"assert_site_exact: site 'qwix {qtype}' einsum 'tk,kn->tn' "
                                             rf"\({qtype} x {qtype}\): differs from the referee-quantized reference "
                                             rf"at \d+ of 128 elements, .*it equals both operands in {named}"):
        assert_site_exact(site, "tk,kn->tn", lhs, rhs, lhs_format=qtype, rhs_format=qtype, site=f"qwix {qtype}")
    a = _model_dequantized(model, lhs, block)
    b = _model_dequantized(model, np.ascontiguousarray(rhs.T), block).T  # qwix tiles rhs along k, its axis 0
    want = (a.astype(np.float64) @ b.astype(np.float64)).astype(F32)  # exact products; the sums round once
    assert_same_bits(f"qwix {qtype} site vs the matmul of qwix-rule operands", want, site("tk,kn->tn", lhs, rhs))


# -- 3. NVFP4: one level (e4m3 block scales of amax / 6), no per-tensor scale -----------------------


def test_qwix_nvfp4_is_one_level_without_a_tensor_scale():
    """qwix 0.1.8 nvfp4: the block scale is amax / 6 cast to e4m3fn (qarray.compute_scale_zero_point), with no
    per-tensor scale; qcheck's nvfp4 referee (NVIDIA's two-level NVFP4) scales the blocks by 6 · 448 / amax first.
    Blocks whose amax / 6 is above 448 saturate their scale, and below e4m3's range flush it."""
    codes, scale, _ = qwix_nvfp4(BLOCKS, "eager")
    ref_codes, ref_scales = referees.reference_quantize(BLOCKS, "nvfp4", axis=1)
    assert scale.shape == ref_scales["block"].shape and ref_scales["tensor"].shape == ()  # no second level in qwix
    with pytest.raises(AssertionError, match=r"qwix nvfp4 vs qcheck nvfp4 \(two-level\): codes differ at index "
                                             r"\(\d+, \d+\): .*; \d+ of 2048 differ \(float4_e2m1fn\)"):
        assert_same_bits("qwix nvfp4 vs qcheck nvfp4 (two-level): codes", ref_codes, codes)
    assert_same_bits("qwix nvfp4 vs the one-level rule: scales", model_nvfp4(BLOCKS, False)[1], scale)


@pytest.mark.parametrize(
    "magnitude, qwix_error",
    [
        (1.0, None),
        (1e4, r"relative norm 0\.[3-9]\d+ exceeds the bound 0\.15"),
        (1e-4, r"relative norm 1\.0000 exceeds"),
    ],
    ids=["in-range", "scales-saturate", "scales-flush"],
)
def test_qwix_nvfp4_tracks_only_in_e4m3s_range(magnitude, qwix_error):
    """qwix 0.1.8's one-level nvfp4 against qcheck's two-level referee, through ``checks.assert_tracks``."""
    x = (BLOCKS / np.max(np.abs(BLOCKS), axis=1, keepdims=True) * F32(magnitude)).astype(F32)
    _, _, deq = qwix_nvfp4(x, "eager")
    assert checks.assert_tracks(referees.reference_qdq(x, "nvfp4", axis=1), x, max_rel_norm=0.15) > 0
    if qwix_error is None:
        assert checks.assert_tracks(deq, x, max_rel_norm=0.15) > 0
    else:
        with pytest.raises(AssertionError, match="assert_tracks: " + qwix_error):
            checks.assert_tracks(deq, x, max_rel_norm=0.15)


# -- 4. MXFP8 and NVFP4 rules on ragged_dot: tile_size is ignored, and qwix refuses its own format ----


class _Experts(nnx.Module):
    def __init__(self, w):
        self.w = nnx.Param(jnp.asarray(w))

    def __call__(self, x, group_sizes):
        return jax.lax.ragged_dot(x, self.w[...], group_sizes)


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
@pytest.mark.parametrize("qtype, tile_size, error", [
    ("mxfp8", 32, r"Format mxfp8 requires `tiled_axes` to be specified"),
    ("nvfp4", 16, r"Format nvfp4 requires `tiled_axes` to be specified"),
    ("int8", None, None),
])
def test_qwix_ragged_dot_crashes_on_mxfp8_and_nvfp4_rules(qtype, tile_size, error):
    """qwix 0.1.8 ragged_dot_qt builds HowToQuantize(channelwise_axes=[0] / [2]) without tiled_axes, whatever the
    rule's tile_size, and HowToQuantize refuses mxfp8/nvfp4 without tiles; int8 runs (the control)."""
    lhs, rhs = checks.probe_operands(0, (12, 64), (3, 64, 32))
    gs = jnp.asarray([5, 7, 0], jnp.int32)
    rule = qwix.QtRule(module_path=".*", weight_qtype=qtype, act_qtype=qtype, tile_size=tile_size)
    if error is None:
        model = qwix.quantize_model(_Experts(rhs), qwix.QtProvider([rule]), lhs, gs)
        assert checks.assert_tracks(np.asarray(model(lhs, gs)), np.asarray(jax.lax.ragged_dot(lhs, rhs, gs)),
                                    max_rel_norm=0.05) > 0
        return
    with pytest.raises(ValueError, match=error):
        qwix.quantize_model(_Experts(rhs), qwix.QtProvider([rule]), lhs, gs)


# -- asymmetric (zero-point) int8: qwix's minmax calibration --------------------------------------------------

def _qwix_minmax(x):
    """qwix 0.1.8's asymmetric int8 of ``x`` per row (calibration_method="minmax": codes, a scale and a zero
    point, dequantized as (q - zp) · s in qarray.dequantize), dequantized."""
    from qwix._src.core import qarray

    how = qarray.HowToQuantize(qtype=jnp.int8, channelwise_axes=(0,), tiled_axes={}, calibration_method="minmax")
    return qarray.dequantize(qarray.quantize(x, how))


W_ZP = np.random.default_rng(3).normal(size=(32, 16)).astype(F32)
X_ZP = (np.random.default_rng(4).normal(size=(8, 32)) + 0.5).astype(F32)


def test_qwix_zero_point_int8_reads_as_quantized_should_pass():
    """qwix 0.1.8: a zero point subtracted from the codes keeps them on their grid, shifted per row; the operand
    reads int8, not full precision (the false alarm on a correct layer the issue names)."""
    import qcheck

    (r,) = qcheck.coverage(lambda x: _qwix_minmax(x) @ W_ZP, X_ZP)
    assert r.lhs.dtype == "int8" and not r.rhs.dtype, (r.lhs, r.rhs)


def test_codes_minus_a_full_size_value_read_full_precision_should_fail():
    """The control: what is subtracted from the codes is as large as they are (not a zero point, one per slice),
    so the operand is off any grid and reads full precision."""
    import qcheck

    offset = np.random.default_rng(5).normal(size=X_ZP.shape).astype(F32)
    with pytest.raises(AssertionError, match=r"1 of 1 matmuls reach full precision"):
        qcheck.assert_quantized(lambda x: (_qwix_minmax(x) - offset) @ _qwix_minmax(W_ZP.T).T, X_ZP, declared=False)


# -- int8_qwix_minmax: qwix's asymmetric int8 as a qcheck format, held bitwise to its referee ------------------

_rz = np.random.default_rng(23)
#: Rows (one scale and zero point each) of every kind minmax treats apart: lopsided (min far from -max), all
#: positive (min clipped to 0: zero point -128), all negative (max clipped to 0: zero point 127), all zero, below
#: qwix's floor (span / 255 < 2^-63: scale 1), and magnitudes 2^±40.
MINMAX = np.concatenate([
    (_rz.standard_normal((40, 64)) * np.exp2(_rz.integers(-40, 40, (40, 1)))
     + _rz.standard_normal((40, 1)) * np.exp2(_rz.integers(-40, 40, (40, 1)))),
    np.abs(_rz.standard_normal((4, 64))), -np.abs(_rz.standard_normal((4, 64))), np.zeros((2, 64)),
    _rz.standard_normal((2, 64)) * 1e-18,
]).astype(F32)


def qwix_minmax_int8(x, run):
    """qwix.quantize(x, int8, channelwise_axes=(0,), calibration_method="minmax"): codes, scale, zero point."""
    f = lambda v: qwix.quantize(v, jnp.int8, channelwise_axes=(0,), calibration_method="minmax")  # noqa: E731
    qa = RUNS[run](f)(x)
    return np.asarray(qa.qvalue), np.asarray(qa.scale), np.asarray(qa.zero_point), np.asarray(qwix.dequantize(qa))


def _referee_minmax(x, xla_reciprocal=True):
    return referees.reference_quantize(x, "int8_qwix_minmax", axis=-1, ftz=jax.default_backend() == "cpu",
                                       xla_reciprocal=xla_reciprocal)


@pytest.mark.parametrize("run", RUNS)
def test_qwix_minmax_int8_equals_the_referee_bitwise_should_pass(run):
    """qwix 0.1.8 (qarray.calibrate 'minmax', compute_scale_zero_point, quantize_with_scale_zero_point, dequantize;
    numerics.get_asymmetric_bound(int8) = (-128, 127)): codes, scales, zero points and dequantized values are
    qcheck's int8_qwix_minmax referee's, with XLA's reciprocal of 255 and of the scale, bit for bit, eager too
    (measured: the definition's IEEE division by 255 misses 30 of these 52 scales; on 4000 rows of 64 other
    values an IEEE x / scale moved one eager code); and qcheck's own quantizer is both."""
    codes, scale, zero_point, deq = qwix_minmax_int8(MINMAX, run)

    def minmax_model(x, xla_reciprocal):
        c, s = _referee_minmax(x, xla_reciprocal)
        return np.concatenate([c, s["zero_point"]], axis=-1), s["slice"]

    form = assert_model_in_some_form(f"int8_qwix_minmax referee vs qwix ({run})", minmax_model, MINMAX,
                                     np.concatenate([codes, zero_point], axis=-1), scale)
    ref_codes, ref_scales = _referee_minmax(MINMAX, form)
    ref_deq = referees.reference_dequantize(ref_codes, ref_scales, "int8_qwix_minmax", ftz=True)
    assert_same_bits(f"int8_qwix_minmax referee vs qwix ({run}): dequantized", ref_deq, deq)
    # The rows reach what they are for: all positive and all zero at zero point -128, all negative at 127.
    assert np.all(zero_point[40:44] == -128) and np.all(zero_point[44:48] == 127), zero_point[40:].ravel()
    assert np.all(zero_point[48:50] == -128) and np.all(codes[48:50] == -128), "an all-zero row: codes -128"
    assert np.all(scale[-2:] == 1), "the rows below the floor reach it"
    from qcheck import formats

    q = RUNS[run](lambda v: formats.quantize(v, "int8_qwix_minmax", axis=-1))(MINMAX)
    assert_same_bits(f"qcheck int8_qwix_minmax vs qwix ({run}): codes", np.asarray(q.codes), codes)
    assert_same_bits(f"qcheck int8_qwix_minmax vs qwix ({run}): zero points", np.asarray(q.scales["zero_point"]),
                     zero_point)


def _minmax_unrounded_zero_point(x):
    """A wrong rule: the zero point -128 - min / scale left a float, added to x / scale before the rounding."""
    lo, hi = np.minimum(x.min(-1, keepdims=True), F32(0)), np.maximum(x.max(-1, keepdims=True), F32(0))
    scale = ((hi - lo) * (F32(1) / F32(255))).astype(F32)
    scale = np.where(scale < QWIX_MIN_SCALE, F32(1), scale)
    return np.clip(np.round(x * (F32(1) / scale) + (F32(-128) - lo / scale)), -128, 127).astype(np.int8)


def _minmax_symmetric_scale(x):
    """A wrong rule: qwix's symmetric int8 (absmax / 127.5) where minmax was asked for."""
    return referees.reference_quantize(x, "int8_qwix", axis=-1, ftz=True, xla_reciprocal=True)[0]


@pytest.mark.parametrize("rule", [_minmax_unrounded_zero_point, _minmax_symmetric_scale],
                         ids=["unrounded-zero-point", "symmetric-scale"])
def test_a_wrong_minmax_rule_differs_from_qwix_should_fail(rule):
    codes, _, _, _ = qwix_minmax_int8(MINMAX, "jit")
    assert_same_bits("int8_qwix_minmax referee vs qwix (jit): codes", _referee_minmax(MINMAX)[0], codes)
    with pytest.raises(AssertionError, match=r"wrong rule vs qwix: codes differ at index \(\d+, \d+\): qcheck "
                                             r"np.int8\(-?\d+\) vs qwix np.int8\(-?\d+\); \d+ of 3328 differ"):
        assert_same_bits("wrong rule vs qwix: codes", rule(MINMAX), codes)


# -- a qwix minmax layer held to int8_qwix_minmax through the declaration -------------------------------------

MINMAX_ROLES = {"weights": "int8_qwix", "activations": "int8_qwix_minmax"}


def _minmax_dense():
    """A dense nnx layer under qwix's rule of minmax (asymmetric) int8 activations and absmax int8 weights
    (qwix 0.1.8 takes one asymmetric operand at most: dot_general.py, "Only one operand can be asymmetric").
    qwix multiplies the codes in int32 and subtracts the zero point's own product with the weight codes."""
    rule = qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8, act_calibration_method="minmax")
    return qwix.quantize_model(_Dense(W_ZP), qwix.QtProvider([rule]), X_ZP)


def _dense_line() -> str:
    import inspect

    lines, start = inspect.getsourcelines(_Dense.__call__)
    return f"test_qwix_formats.py:{start + next(i for i, l in enumerate(lines) if 'jnp.einsum' in l)}"


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
def test_qwix_minmax_layer_holds_int8_qwix_minmax_bitwise_should_pass():
    """qwix 0.1.8: x / scale + zero point, rounded, cast: one quantizer of x, whose codes and zero points are
    int8_qwix_minmax's bit for bit; the zero point's correction matmul is held to the referee's zero points."""
    import qcheck

    records = qcheck.assert_quantized(_minmax_dense(), X_ZP, declared=MINMAX_ROLES)
    assert len(records) == 2, qcheck.format_coverage(records)  # the codes' matmul and the zero point's
    for r in records:
        assert r.findings == () and r.lhs_hold.bitwise and r.rhs_hold.bitwise, (r.findings, r.lhs_hold, r.rhs_hold)


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
def test_qwix_minmax_layer_declared_symmetric_int8_qwix_should_fail():
    """The same layer declared qwix's symmetric int8: the codes' site fails naming int8_qwix_minmax, the zero
    point's site fails as a zero point int8_qwix has none of."""
    import qcheck

    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(_minmax_dense(), X_ZP, declared={"weights": "int8_qwix", "activations": "int8_qwix"})
    message = str(failure.value).replace("\\", "/")
    assert "2 of 2 matmuls differ from the declared quantization" in message, message
    assert _dense_line() in message, message
    assert ("lhs (activation): codes are not int8_qwix's:" in message
            and "they are int8_qwix_minmax's codes: another rule of the same kind and width" in message), message
    assert "lhs (activation): its codes are a zero point" in message and "declared int8_qwix, which has none" in message


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
def test_qwix_minmax_layer_with_a_floored_zero_point_should_fail(monkeypatch):
    """A zero point planted in qwix (qarray.compute_scale_zero_point): floor(-128 - min / scale) instead of its
    rounding, so a slice's min lands a step below -128 and saturates. Both the codes and the zero points fail."""
    import qcheck
    from qwix._src.core import qarray

    model = _minmax_dense()
    rounded = qarray.compute_scale_zero_point

    def floored(calibration, qtype):
        scale, zero_point = rounded(calibration, qtype)
        if zero_point is not None:
            zero_point = jnp.floor(-128.0 - calibration["min"] / scale).astype(zero_point.dtype)
        return scale, zero_point

    monkeypatch.setattr(qarray, "compute_scale_zero_point", floored)
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(model, X_ZP, declared=MINMAX_ROLES)
    message = str(failure.value)
    assert "2 of 2 matmuls differ from the declared quantization" in message, message
    assert re.search(r"lhs \(activation\): codes are not int8_qwix_minmax's: \d+ of 256 codes differ", message), message
    assert re.search(r"lhs \(activation\): zero point is not int8_qwix_minmax's: [1-8] of 8 differ from the "
                     r"referee's; first at \[\d, 0\]: (-?\d+) where the referee gives", message), message


# -- the qwix reader: the rules qwix.quantize_model was given, read off the model it hands back ------------------

class _Block(nnx.Module):
    """Two dense layers, one inside a submodule; ``by_hand`` quantizes the input itself (qwix's int8, dequantized)
    before the layers, whatever qwix's rules say."""

    def __init__(self, by_hand: bool = False):
        rngs = nnx.Rngs(0)
        self.inner = _Inner(rngs)
        self.out = nnx.Linear(16, 8, use_bias=False, rngs=rngs)
        self.by_hand = by_hand

    def __call__(self, x):
        if self.by_hand:
            x = qwix.dequantize(qwix.quantize(x, jnp.int8, channelwise_axes=(0,)))
        return self.out(self.inner(x))


class _Inner(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(32, 16, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def _block(*rules, by_hand: bool = False):
    return qwix.quantize_model(_Block(by_hand), qwix.QtProvider(list(rules)), X_ZP)


_INT8_RULE = dict(weight_qtype=jnp.int8, act_qtype=jnp.int8)


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
@pytest.mark.parametrize("rules, read", [
    ([qwix.QtRule(module_path=".*", **_INT8_RULE)] if qwix else [],
     "module_path='.*': weights int8_qwix, activations int8_qwix"),
    ([qwix.QtRule(module_path="inner.*", act_calibration_method="minmax", **_INT8_RULE),
      qwix.QtRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn)] if qwix else [],
     "module_path='inner.*': weights int8_qwix, activations int8_qwix_minmax; module_path='.*': weights e4m3fn, "
     "activations e4m3fn"),
], ids=["int8", "minmax-inner-fp8-rest"])
def test_qwix_reader_holds_the_rules_read_bitwise_should_pass(rules, read):
    """qwix 0.1.8: the QtProvider's rules, per module path (the first whose module_path regex matches the module's
    path), read off the model quantize_model returns; by default and with declared=True, every site bitwise."""
    import qcheck

    model = _block(*rules)
    for declared in (None, True):
        records = qcheck.assert_quantized(model, X_ZP, declared=declared)
        assert records.declared_from == f"read from the fn: qwix QtProvider rules on 4 module(s) ({read})", \
            records.declared_from
        assert {r.scope for r in records} == {"inner/lin", "out"}, qcheck.format_coverage(records)
        for r in records:
            assert r.findings == () and r.lhs_hold.bitwise and r.rhs_hold.bitwise, (r.scope, r.lhs_hold, r.rhs_hold)


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
def test_qwix_int8_stock_layers_declared_qcheck_int8_should_fail():
    """Beside the control above (the stock int8 rule read, held bitwise in whichever form XLA computes: jax 0.10.2
    to 0.12.1): declared qcheck's int8 (absmax / 127), qwix's codes (absmax / 127.5) fail at every site, named."""
    import qcheck

    model = _block(qwix.QtRule(module_path=".*", **_INT8_RULE))
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(model, X_ZP, declared="int8")
    message = str(failure.value)
    assert "2 of 2 matmuls differ from the declared quantization" in message, message
    assert re.search(r"codes are not int8's: \d+ of \d+ codes differ from the referee's; .*; they are "
                     r"int8_(qwix|aqt)'s codes: another rule of the same kind and width", message), message


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
def test_qwix_reader_weights_only_rule_fails_where_activations_are_quantized_too_should_fail():
    """A weight-only rule read as such: the model quantizes its input to int8 by hand as well, so the first
    layer's activations are quantized where the rule declares them full precision; the site is named."""
    import qcheck

    model = _block(qwix.QtRule(module_path=".*", weight_qtype=jnp.int8), by_hand=True)
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(model, X_ZP, declared=True)
    message = str(failure.value)
    assert "1 of 2 matmuls differ from the declared quantization" in message, message
    assert re.search(r"\(_Inner\.__call__\), in inner/lin: lhs \(8, 32\) \[int8\], rhs \(32, 16\) \[int8\]\n"
                     r"\s+lhs \(activation\) is quantized \(int8\) but declared full precision", message), message
    assert message.endswith("declared: read from the fn: qwix QtProvider rules on 4 module(s) (module_path='.*': "
                            "weights int8_qwix, activations full precision)"), message


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
def test_qwix_reader_reads_nothing_from_a_subchannel_rule_and_says_so():
    """tile_size (subchannel scales) is no qcheck format: nothing is read, the reason is the figure, and
    declared=True fails naming it."""
    import qcheck

    model = _block(qwix.QtRule(module_path=".*", tile_size=8, **_INT8_RULE))
    why = ("the qwix reader: qwix QtRule(module_path='.*'): tile_size=8 (subchannel scales), which no qcheck "
           "format declares")
    assert qcheck.coverage(model, X_ZP).declared_from == f"nothing read: {why} (fn _Block); pass declared= to " \
                                                          f"hold its sites"
    with pytest.raises(ValueError, match=rf"coverage: declared=True, but {re.escape(why)} of _Block; declare it"):
        qcheck.coverage(model, X_ZP, declared=True)


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
def test_qwix_reader_says_so_where_the_provider_keeps_no_rules_list(monkeypatch):
    """The reader reads qwix 0.1.8's private ``_rules``: a qwix keeping them elsewhere is a reason, not a model that
    no rule reaches (which reads nothing quietly)."""
    import qcheck

    provider = qwix.QtProvider([qwix.QtRule(module_path=".*", **_INT8_RULE)])
    model = qwix.quantize_model(_Block(False), provider, X_ZP)
    monkeypatch.delattr(provider, "_rules")  # the object the model's calls go through
    why = "qwix QtProvider keeps no _rules list (qwix 0.1.8's): its rules cannot be read"
    with pytest.raises(ValueError, match=re.escape(why)):
        qcheck.coverage(model, X_ZP, declared=True)


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
def test_qwix_reader_holds_each_module_to_its_own_rule_should_pass():
    """A rule reaching one module only (module_path='inner.*', weight-only): that module's site is held to
    int8_qwix on its weights, and the module no rule reaches is read as declared full precision, as qwix leaves
    it; the declaration names the module declared otherwise."""
    import qcheck

    records = qcheck.assert_quantized(_block(qwix.QtRule(module_path="inner.*", weight_qtype=jnp.int8)), X_ZP)
    by_scope = {r.scope: r for r in records}
    assert (by_scope["inner/lin"].lhs_declared, by_scope["inner/lin"].rhs_declared) == ("full precision", "int8_qwix")
    assert by_scope["inner/lin"].rhs_hold.bitwise and by_scope["inner/lin"].findings == ()
    assert (by_scope["out"].lhs_declared, by_scope["out"].rhs_declared) == ("full precision", "full precision")
    assert str(records.declaration).startswith("weights full precision, activations full precision, module inner/lin: "
                                               "weights int8_qwix, activations full precision, module inner: "), \
        records.declaration


@pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning")
def test_qwix_reader_holds_a_module_no_rule_reaches_to_full_precision_should_fail():
    """The twin: the rule reaches ``out`` only, and the model quantizes its input by hand, so ``inner/lin`` (no
    rule: full precision) multiplies int8 activations: that site fails, named, while ``out`` holds its rule."""
    import qcheck

    model = _block(qwix.QtRule(module_path="out", **_INT8_RULE), by_hand=True)
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(model, X_ZP)
    message = str(failure.value)
    assert "1 of 2 matmuls differ from the declared quantization" in message, message
    assert re.search(r"\(_Inner\.__call__\), in inner/lin: .*\n\s+lhs \(activation\) is quantized \(int8\) but "
                     r"declared full precision", message), message
    assert "in out:" not in message, message


# -- qwix's serving path: PtqProvider keeps each weight as int8 codes and a scale ---------------------------------

class _PtqExperts(nnx.Module):
    """Per-expert weights in an einsum (experts, d, f), qwix's channelwise_axes [0, 2] (a scale per expert and
    output), then a Linear: what qwix.quantize_model(..., PtqProvider) stores as WithAux(QArray(qvalue, scale))."""

    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 32, 16)) * 0.1)
        self.lin = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.lin(jnp.einsum("btd,edf->btef", x, self.w[...]))


def _ptq_pair():
    model = _PtqExperts(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 32)).astype(np.float32))
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8)]
    return qwix.quantize_model(model, qwix.PtqProvider(rules), x), model, x


def test_qwix_ptq_experts_stored_weights_are_held_bitwise_against_the_float_model_should_pass():
    """qwix 0.1.8: check_layer(ptq_model, float_model, x) gave a raw TypeError (grad of an int8 qvalue). Its integer
    parameters and the scales beside them are frozen, named, never given to grad; the PtqProvider rules are read
    (int8_qwix weights, activations full precision); each stored weight (the experts' and the Linear's) is held
    bitwise against the float model's parameter of its path."""
    ptq, model, x = _ptq_pair()
    figures = qcheck.check_layer(ptq, model, x)
    assert figures.declared_from == ("read from the layer: qwix PtqProvider rules on 2 module(s) (module_path='.*': "
                                     "weights int8_qwix, activations full precision)"), figures.declared_from
    assert sorted(figures.frozen) == ["lin/kernel", "w"], figures.frozen
    assert figures.frozen["w"].startswith("frozen in the layer (w/array/qvalue int8[4, 32, 16], w/array/scale "
                                          "float32[4, 1, 16], state: no gradient)"), figures.frozen["w"]
    holds = sorted(str(h) for r in figures.coverage for h, role in ((r.lhs_hold, r.lhs_role), (r.rhs_hold, r.rhs_role))
                   if role == "weight")
    assert holds == [f"bitwise: stored codes held bitwise against the reference's {p}" for p in ("lin/kernel", "w")]


def test_qwix_ptq_experts_sharing_one_scale_fail_naming_the_site_should_fail():
    """The plant: the experts' stored weights requantized under one scale per output shared by all experts (the
    scale EasyDeL-style fused MoE code computes when it reduces over the expert axis too). The output still
    tracks; the stored weight fails at the einsum's site, naming the axis its scale is shared across."""
    ptq, model, x = _ptq_pair()
    w = np.asarray(model.w[...])
    scale = (np.max(np.abs(w), axis=(0, 1), keepdims=True) / np.float32(127.5)).astype(np.float32)
    ptq.w.array.qvalue.set_value(jnp.asarray(np.clip(np.round(w / scale), -128, 127).astype(np.int8)))
    ptq.w.array.scale.set_value(jnp.asarray(np.broadcast_to(scale, (4, 1, 16)).copy()))
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(ptq, model, x)
    message = str(failure.value)
    assert re.search(r"dot_general at \S*test_qwix_formats\.py:\d+ \(_PtqExperts\.__call__\)", message), message
    assert ("(weight): stored w/array/qvalue against the reference's w: codes are not int8_qwix's" in message
            and "they match one scale shared across axis 0 (size 4)" in message), message
    assert "tracks" not in message and "lin" not in message.split("not compared")[0], message


# -- qwix.quantize'd weights passed to a function, given their float source ------------------------------------

_EXPERTS_W = jnp.asarray(np.random.default_rng(1).normal(size=(4, 32, 16)).astype(np.float32)
                         * np.array([1, 3, 10, 30], np.float32)[:, None, None])
_EXPERTS_X = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 32)).astype(np.float32))
_WEIGHT_ONLY = {"weights": "int8_qwix", "activations": None}


def _experts(qw, x):
    """Per-expert weights qwix.quantize'd once (a scale per expert and output) and dequantized in the call."""
    return jnp.einsum("btd,edf->btef", x, qwix.dequantize(qw))


def test_qwix_quantize_weights_given_their_source_are_held_bitwise_should_pass():
    """qwix.quantize(w, jnp.int8, channelwise_axes=[0, 2]) marked qcheck.weights(qw, source=w): the QArray's codes
    and scale are held bitwise to int8_qwix applied by the referee to w, reduced over the axis qwix does not keep."""
    qw = qwix.quantize(_EXPERTS_W, jnp.int8, channelwise_axes=[0, 2])
    (r,) = qcheck.assert_quantized(_experts, qcheck.weights(qw, source=_EXPERTS_W), _EXPERTS_X, declared=_WEIGHT_ONLY)
    assert r.rhs_role == "weight" and r.rhs_hold.bitwise and not r.findings, r
    figures = qcheck.check_layer(functools.partial(_experts, qcheck.weights(qw, source=_EXPERTS_W)),
                                 lambda x: jnp.einsum("btd,edf->btef", x, _EXPERTS_W), _EXPERTS_X,
                                 declared=_WEIGHT_ONLY)
    assert [str(r.rhs_hold) for r in figures.coverage] == [
        "bitwise: stored codes held bitwise against their source (qcheck.weights(..., source=))"]


def test_qwix_quantize_weights_sharing_one_scale_across_experts_fail_naming_the_site_should_fail():
    """The plant: the same QArray's codes made under one scale per output shared by all experts. The stored codes
    fail at the einsum's site, naming the axis the scale is shared across."""
    w = np.asarray(_EXPERTS_W)
    scale = (np.max(np.abs(w), axis=(0, 1), keepdims=True) / np.float32(127.5)).astype(np.float32)
    qw = qwix.quantize(_EXPERTS_W, jnp.int8, channelwise_axes=[0, 2])
    shared = qwix.QArray(jnp.asarray(np.clip(np.round(w / scale), -128, 127).astype(np.int8)),
                         jnp.asarray(np.broadcast_to(scale, (4, 1, 16)).copy()), None, qw.qtype)
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(_experts, qcheck.weights(shared, source=_EXPERTS_W), _EXPERTS_X,
                                declared=_WEIGHT_ONLY)
    message = str(failure.value)
    assert re.search(r"dot_general at \S*test_qwix_formats\.py:\d+ \(_experts\)", message), message
    assert ("rhs (weight): stored int8[4, 32, 16] codes against their source (qcheck.weights(..., source=)): codes "
            "are not int8_qwix's" in message and "they match one scale shared across axis 0 (size 4)" in message), \
        message
