"""The coverage map and assert_quantized: hand-written functions first, then qcheck's own layers."""

from __future__ import annotations

import functools
import linecache
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck import checks, formats
from qcheck._coverage import (
    MatmulRecord,
    assert_quantized,
    coverage,
    format_coverage,
    skip_functions,
)

_RNG = np.random.default_rng(0)
A = _RNG.normal(size=(8, 32)).astype(np.float32)
B = _RNG.normal(size=(32, 16)).astype(np.float32)
E4M3 = jnp.float8_e4m3fn


def _source(record: MatmulRecord) -> str:
    """The text of the line a record points at, read from the file itself."""
    path, line = record.location.rsplit(":", 1)
    return linecache.getline(path, int(line))


# -- hand-written functions ---------------------------------------------------

def _int8(x):
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    codes = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
    return codes.astype(jnp.float32) * scale


def int8_chain(a, b):
    return _int8(a) @ _int8(b.T).T


def fp8_cast(a, b):
    return jnp.dot(a.astype(E4M3), b.astype(E4M3), preferred_element_type=jnp.float32)


def fp8_cast_and_back(a, b):
    return a.astype(E4M3).astype(jnp.float32) @ b.astype(E4M3).astype(jnp.float32)


def emulated_rounding(a, b):
    return (jnp.round(a * 4) / 4) @ (jnp.floor(b * 4) * 0.25)


def nested_jit(a, b):
    return jax.jit(lambda x, y: x @ y)(a.astype(E4M3).astype(jnp.float32), _int8(b.T).T)


@jax.custom_vjp
def _ste_fp8(x):
    return x.astype(E4M3).astype(x.dtype)


_ste_fp8.defvjp(lambda x: (_ste_fp8(x), None), lambda _, g: (g,))


def custom_vjp(a, b):
    return _ste_fp8(a) @ _ste_fp8(b)


def scanned(a, b):
    def body(carry, row):
        return carry + row @ _ste_fp8(b), None
    return jax.lax.scan(body, jnp.zeros(b.shape[1]), _ste_fp8(a))[0]


@jax.custom_jvp
def _fp8_jvp(x):
    return x.astype(E4M3).astype(x.dtype)


_fp8_jvp.defjvp(lambda primals, tangents: (_fp8_jvp(primals[0]), tangents[0]))


def custom_jvp(a, b):
    return jax.checkpoint(lambda x, y: _fp8_jvp(x) @ _fp8_jvp(y))(a, b)


def in_a_cond(a, b):
    return jax.lax.cond(a[0, 0] > 0, lambda x: _ste_fp8(x), lambda x: -_ste_fp8(x), a) @ _ste_fp8(b)


def in_a_while(a, b):
    def body(c):
        return c[0] + 1, c[1] + _ste_fp8(a) @ _ste_fp8(b)
    return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, jnp.zeros((a.shape[0], b.shape[1]))))[1]


def cond_one_branch_unquantized(a, b):
    return jax.lax.cond(a[0, 0] > 0, lambda x: _ste_fp8(x), lambda x: x, a) @ _ste_fp8(b)


def scanned_rhs_unquantized(a, b):
    def body(carry, row):
        return carry + row @ b, None
    return jax.lax.scan(body, jnp.zeros(b.shape[1]), _ste_fp8(a))[0]


def widening_only(a, b):
    # bf16 -> f32 is a conversion, not a quantization: nothing was rounded onto a narrow grid.
    return a.astype(jnp.bfloat16).astype(jnp.float32) @ b


def through_an_add(a, b):
    return (a.astype(E4M3).astype(jnp.float32) + 1.0) @ b.astype(E4M3).astype(jnp.float32)


def rhs_forgotten(a, b):
    return _int8(a) @ b


@pytest.mark.parametrize("fn, primitive, lhs, rhs", [
    (int8_chain, "dot_general", "int8", "int8"),
    (fp8_cast, "dot_general", "float8_e4m3fn", "float8_e4m3fn"),
    (fp8_cast_and_back, "dot_general", "float8_e4m3fn", "float8_e4m3fn"),
    (emulated_rounding, "dot_general", "emulated(round)", "emulated(floor)"),
    (nested_jit, "dot_general", "float8_e4m3fn", "int8"),
    (custom_vjp, "dot_general", "float8_e4m3fn", "float8_e4m3fn"),
    (custom_jvp, "dot_general", "float8_e4m3fn", "float8_e4m3fn"),
    (in_a_cond, "dot_general", "float8_e4m3fn", "float8_e4m3fn"),
    (in_a_while, "dot_general", "float8_e4m3fn", "float8_e4m3fn"),
    (scanned, "dot_general", "float8_e4m3fn", "float8_e4m3fn"),
    (widening_only, "dot_general", "full precision", "full precision"),
    (through_an_add, "dot_general", "full precision", "float8_e4m3fn"),
    (rhs_forgotten, "dot_general", "int8", "full precision"),
])
def test_coverage_names_each_operands_quantization(fn, primitive, lhs, rhs):
    (record,) = coverage(fn, A, B)
    assert (record.primitive, str(record.lhs), str(record.rhs)) == (primitive, lhs, rhs)
    assert record.quantized == (lhs != "full precision" and rhs != "full precision")
    # The location is the line of this file that multiplies, read back from the file.
    assert record.location.startswith("tests/test_coverage.py:")
    assert "@" in _source(record) or "jnp.dot" in _source(record)


@pytest.mark.parametrize("fn", [int8_chain, fp8_cast, emulated_rounding, nested_jit, custom_vjp, custom_jvp, scanned,
                                in_a_cond, in_a_while])
def test_assert_quantized_should_pass(fn):
    assert len(assert_quantized(fn, A, B)) == 1


@pytest.mark.parametrize("fn, operand", [
    (widening_only, "lhs and rhs"),
    (through_an_add, "lhs"),
    (rhs_forgotten, "rhs"),
    (cond_one_branch_unquantized, "lhs"),
])
def test_assert_quantized_should_fail(fn, operand):
    (record,) = coverage(fn, A, B)
    message = (
        f"assert_quantized: 1 of 1 matmuls reach full precision:\n  dot_general at {record.location} "
        f"({fn.__name__}): lhs (8, 32) float32 [{record.lhs}], rhs (32, 16) float32 [{record.rhs}]: "
        f"{operand} unquantized"
    )
    with pytest.raises(AssertionError, match=re.escape(message)):
        assert_quantized(fn, A, B)


def test_assert_quantized_should_fail_inside_a_scan():
    with pytest.raises(AssertionError, match=r"dot_general at tests/test_coverage.py:\d+ "
                                             r"\(scanned_rhs_unquantized.<locals>.body\): lhs \(32,\) float32 "
                                             r"\[float8_e4m3fn\], rhs \(32, 16\) float32 \[full precision\]"):
        assert_quantized(scanned_rhs_unquantized, A, B)


def test_assert_quantized_skip_spares_the_selected_matmuls():
    assert assert_quantized(rhs_forgotten, A, B, skip=skip_functions("rhs_forgotten"))
    with pytest.raises(AssertionError, match="rhs_forgotten"):
        assert_quantized(rhs_forgotten, A, B, skip=skip_functions("some_other_function"))


def _np_rel_norm(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _np_int8(x: np.ndarray) -> np.ndarray:
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127
    return np.clip(np.round(x / scale), -127, 127) * scale  # np.round is half to even, as XLA's


def _np_fp8(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


# The reference is numpy/ml_dtypes in float64; the program accumulates in float32
# and XLA's CPU flushes e4m3 subnormals, hence the row's tolerance.
@pytest.mark.parametrize("fn, lhs_ref, rhs_ref, rtol", [
    (fp8_cast, _np_fp8, _np_fp8, 1e-3),
    (int8_chain, _np_int8, lambda b: _np_int8(b.T).T, 1e-4),
    (custom_vjp, _np_fp8, _np_fp8, 1e-3),
    (in_a_while, _np_fp8, _np_fp8, 1e-3),  # its body's matmul, the same in both iterations
])
def test_error_is_the_rel_norm_against_the_unquantized_product(fn, lhs_ref, rhs_ref, rtol):
    (record,) = coverage(fn, A, B, errors=True)
    a, b = A.astype(np.float64), B.astype(np.float64)
    expected = _np_rel_norm(lhs_ref(a) @ rhs_ref(b), a @ b)
    assert expected > 1e-3  # the quantization is visible, so the figure can tell
    np.testing.assert_allclose(record.error, expected, rtol=rtol)


@pytest.mark.parametrize("fn", [widening_only])
def test_error_is_none_without_quantized_operands_or_values(fn):
    (record,) = coverage(fn, A, B, errors=True)
    assert record.error is None


def _fp8_inputs():
    return jnp.asarray(A, E4M3), jnp.asarray(B, E4M3)


@pytest.mark.parametrize("fn, args, primitive, operand", [
    (lambda a, b: jnp.dot(a.T.T, b, preferred_element_type=jnp.float32), _fp8_inputs, "dot_general",
     "float8_e4m3fn input"),
    (lambda a, b: jnp.dot(a.astype(jnp.int32), b.astype(jnp.int32)),
     lambda: (jnp.asarray(A * 10, jnp.int8), jnp.asarray(B * 10, jnp.int8)), "dot_general", "int8 input"),
    (lambda a, b: jax.nn.scaled_matmul(a[None], b.T[None], jnp.ones((1, 8, 1), jnp.float8_e8m0fnu),
                                       jnp.ones((1, 16, 1), jnp.float8_e8m0fnu)),
     _fp8_inputs, "scaled_matmul_wrapper", "float8_e4m3fn input"),
    (lambda a, b: jax.lax.scaled_dot(a, b, lhs_scale=jnp.ones((8, 1), jnp.float8_e8m0fnu),
                                     rhs_scale=jnp.ones((1, 16), jnp.float8_e8m0fnu)),
     _fp8_inputs, "scaled_dot", "float8_e4m3fn input"),
])
def test_narrow_inputs_count_as_quantized_with_no_error_figure(fn, args, primitive, operand):
    (record,) = coverage(fn, *args(), errors=True)
    assert (record.primitive, str(record.lhs), str(record.rhs), record.error) == (primitive, operand, operand, None)


def test_format_coverage_is_one_line_per_matmul():
    records = coverage(lambda a, b: (fp8_cast(a, b), widening_only(a, b)), A, B)
    lines = format_coverage(records).splitlines()
    assert len(lines) == 4 and lines[0].startswith("primitive")
    assert "float8_e4m3fn" in lines[1] and " yes " in lines[1]
    assert "full precision" in lines[2] and " NO " in lines[2]
    # What was held, in one line: a plain function states no declaration.
    assert lines[3].startswith("declared: nothing read: no reader (qcheck_declaration, MaxText, gemma, haliax, qwix, Keras, EasyDeL) finds a "
                               "declaration")


class _Noisy(nnx.Module):
    """Draws from an RNG stream on every call, so a mutating trace would show in the stream's count."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 16)))
        self.rngs = rngs

    def __call__(self, x):
        x = x + 0.01 * jax.random.normal(self.rngs.noise(), x.shape)
        return _ste_fp8(x) @ _ste_fp8(self.w[...])


def test_coverage_of_an_nnx_module_leaves_its_state_unchanged():
    module = _Noisy(nnx.Rngs(params=0, noise=1))
    before = jax.tree.map(np.asarray, nnx.state(module, nnx.RngCount))
    (record,) = coverage(module, A)
    assert record.quantized and record.function == "_Noisy.__call__"
    after = jax.tree.map(np.asarray, nnx.state(module, nnx.RngCount))
    assert jax.tree.leaves(before) == jax.tree.leaves(after)
    # The control: calling the module does advance the count the check watches.
    module(A)
    assert jax.tree.leaves(nnx.state(module, nnx.RngCount)) != jax.tree.leaves(before)


class _ReachesOut(nnx.Module):
    """Mutates the original module in place during the call, out of Flax's sight: what the guard is for."""

    def __init__(self):
        self.w = nnx.Param(np.array(B))  # a numpy array: += changes it in place

    def __call__(self, x):
        _ORIGINAL[0].w.get_value().__iadd__(1.0)  # Flax refuses `w[...] = ...` from inside a trace
        return _ste_fp8(x) @ _ste_fp8(self.w[...])


_ORIGINAL: list[nnx.Module] = []


def test_coverage_refuses_a_call_that_mutates_the_module():
    module = _ReachesOut()
    _ORIGINAL[:] = [module]
    try:
        with pytest.raises(RuntimeError, match="coverage: tracing changed the module's state"):
            coverage(module, A)
    finally:
        _ORIGINAL.clear()


@pytest.mark.parametrize("call, error", [
    (lambda: coverage(42, A), r"coverage: fn must be callable or an flax.nnx.Module, got int"),
    (lambda: assert_quantized(fp8_cast, A, B, skip="router"), r"assert_quantized: skip must be a callable"),
    (lambda: skip_functions(), r"skip_functions needs one or more function names"),
])
def test_bad_input_names_the_argument(call, error):
    with pytest.raises((TypeError, ValueError), match=error):
        call()


# -- qcheck's own layers --------------------------------------------------------

X = jnp.asarray(_RNG.normal(size=(2, 32, 32)), jnp.float32)  # seq 32: whole MX blocks when dispatch contracts it
QUANTIZED = ("int8", "fp8", "nanoo_fp8", "nvfp4", "fp8_current", "mxfp8")
SITES = {"dense": ("wi_0", "wi_1", "wo"), "sparse": ("wi_0", "wi_1", "wo"),
         "dropping": ("dispatch", "wi_0", "wi_1", "wo", "combine")}


@functools.cache
def _layer(recipe: str, path: str, model: str = "mixtral") -> qcheck.MoE:
    if path == "dropping":
        return qcheck.build_moe(model, recipe, path="dense", capacity_factor=1.0)
    return qcheck.build_moe(model, recipe, path=path)


def _sites(records: list[MatmulRecord]) -> list[str | None]:
    """The call site each record's line of qcheck/layers/moe.py calls; wi_0 and wi_1 share a line, in that order."""
    seen: dict[str, int] = {}
    names = []
    for r in records:
        on_line = re.findall(r's\["(\w+)"\]', _source(r))
        k = seen[r.location] = seen.get(r.location, -1) + 1
        names.append(on_line[k] if k < len(on_line) else None)
    return names


def _not_a_site(record: MatmulRecord) -> bool:
    # qcheck's router and its combine/mask einsums are meant to stay in full precision.
    return not re.search(r's\["\w+"\]', _source(record))


# Gemma's sites are built by the same code as Mixtral's; two recipes suffice there.
@pytest.mark.parametrize("recipe, model, path", [
    *[(r, "mixtral", p) for r in ("none", *QUANTIZED) for p in ("dense", "sparse", "dropping")],
    ("none", "gemma", "sparse"), ("fp8", "gemma", "sparse"),
])
def test_every_call_site_of_a_layer_is_quantized_and_the_router_is_not(recipe, model, path):
    records = coverage(_layer(recipe, path, model), X)
    assert all(r.location.startswith("qcheck/layers/moe.py:") for r in records), format_coverage(records)
    sites = _sites(records)
    assert [s for s in sites if s] == list(SITES[path]), format_coverage(records)
    for r, site in zip(records, sites):
        expected = site is not None and recipe != "none"
        assert (r.lhs.quantized, r.rhs.quantized) == (expected, expected), format_coverage(records)
    (router,) = [r for r in records if r.function == "MoE.route"]
    assert not router.lhs.quantized and not router.rhs.quantized


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_assert_quantized_on_a_layer_should_pass(recipe):
    assert assert_quantized(_layer(recipe, "sparse"), X, skip=_not_a_site)


def test_assert_quantized_on_a_layer_should_fail_for_none():
    with pytest.raises(AssertionError, match=r"assert_quantized: 3 of 5 matmuls reach full precision:\n"
                                             r"  ragged_dot_general at qcheck/layers/moe.py:\d+ \(MoE._sparse\)"):
        assert_quantized(_layer("none", "sparse"), X, skip=_not_a_site)
    # The router alone is spared by name; the combine einsum then fails too.
    with pytest.raises(AssertionError, match=r"assert_quantized: 4 of 5 matmuls"):
        assert_quantized(_layer("none", "sparse"), X, skip=skip_functions("MoE.route"))


def _forward(layer: qcheck.MoE, x: jax.Array) -> np.ndarray:
    graphdef, state = nnx.split(layer)
    return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x))


def test_a_silently_unquantized_sparse_site_passes_assert_tracks_but_fails_assert_quantized(monkeypatch):
    layer = qcheck.build_moe("mixtral", "fp8", path="sparse")  # not the cached one: undoing leaves an attribute
    # The silent fallback: the wo site's grouped matmul runs without its quantizer.
    monkeypatch.setattr(layer.sites["wo"], "ragged_dot", jax.lax.ragged_dot)
    checks.assert_tracks(_forward(layer, X), _forward(_layer("none", "sparse"), X), max_rel_norm=0.22)
    with pytest.raises(AssertionError) as info:
        assert_quantized(layer, X, skip=_not_a_site)  # held to the recipe the layer was built with
    message = str(info.value)
    (line,) = re.findall(r"ragged_dot_general at (qcheck/layers/moe.py:\d+) \(MoE._sparse\)", message)
    path, number = line.rsplit(":", 1)
    assert 's["wo"].ragged_dot(' in linecache.getline(path, int(number))
    assert message.startswith("assert_quantized: 1 of 5 matmuls differ from the declared quantization")
    assert "lhs (activation) reaches the matmul in full precision; declared e4m3fn" in message
    assert message.endswith("declared: read from the fn: the layer's recipe 'fp8'")
    with pytest.raises(AssertionError) as info:  # and with no declaration held, as "quantized somehow"
        assert_quantized(layer, X, skip=_not_a_site, declared=False)
    assert str(info.value).startswith("assert_quantized: 1 of 5 matmuls reach full precision:")
    assert "lhs and rhs unquantized" in str(info.value)


def test_error_of_each_quantized_site_lies_within_its_recipes_bound():
    recipe = qcheck.get_recipe("fp8")
    records = coverage(_layer("fp8", "sparse"), X, errors=True)
    errors = [r.error for r, site in zip(records, _sites(records)) if site]
    bound = recipe.expect.max_rel_norm
    assert len(errors) == 3 and all(0.0 < e <= bound for e in errors), format_coverage(records)
    assert all(r.error is None for r, site in zip(records, _sites(records)) if not site)


# -- packed int4 codes: two to a byte, unpacked by shifts and masks (Keras's quantize("int4")) ----------------

#: int4 codes -8..7 of a [32, 16] kernel, packed two to an int8 byte along the output axis as Keras's pack_int4 does
#: (keras 3.15.1, quantizers.py:624-752: the first of each pair in the low nibble, the second in the high one).
CODES4 = _RNG.integers(-8, 8, size=(32, 16)).astype(np.int8)
PACKED4 = ((CODES4[:, ::2] & 0x0F) | (CODES4[:, 1::2] << 4)).astype(np.int8)
SCALE4 = _RNG.uniform(1, 2, size=(1, 16)).astype(np.float32)


def _unpack_keras(p):
    # Keras's unpack_int4: each nibble masked, made signed by (u ^ 8) - 8, the halves interleaved back (stack).
    low = ((p & 0x0F) ^ 8) - 8
    high = (((p >> 4) & 0x0F) ^ 8) - 8
    return jnp.stack([low, high], axis=-1).reshape(p.shape[0], -1)


def _unpack_shifts(p):
    # The sign extension by shifts: (b << 4) >> 4 for the low nibble, b >> 4 (arithmetic) for the high one.
    return jnp.stack([jnp.left_shift(p, 4) >> 4, p >> 4], axis=-1).reshape(p.shape[0], -1)


@pytest.mark.parametrize("unpack", [_unpack_keras, _unpack_shifts], ids=["xor-sub", "shifts"])
def test_packed_int4_kernel_unpacked_reads_as_int4_should_pass(unpack):
    """A kernel stored as packed int4 codes reads as quantized, int4 unpacked (it read full precision before: the
    shifts and masks were no op the walk knew); the unpacking is exact, the codes Keras packed."""
    assert np.array_equal(np.asarray(unpack(jnp.asarray(PACKED4))), CODES4)
    (r,) = assert_quantized(lambda x, p: _int8(x) @ (unpack(p).astype(jnp.float32) / SCALE4), A, PACKED4,
                            declared=False)
    assert (str(r.rhs), r.rhs_casts) == ("int4 unpack", frozenset({"int4"})), (r.rhs, r.rhs_casts)


@pytest.mark.parametrize("weight", [
    # An int32 index computation masked to 4 bits: an integer, but no narrow integer's codes.
    lambda p: (jnp.arange(32 * 16, dtype=jnp.int32).reshape(32, 16) & 0x0F),
    # All of an int8's 8 bits shifted by 0: no field narrower than its type.
    lambda p: jnp.repeat(p >> 0, 2, axis=1),
    # Bits masked to 7: a field, but no type's codes.
    lambda p: jnp.repeat(p & 0x7F, 2, axis=1),
], ids=["int32-index-masked", "int8-shifted-by-0", "seven-bit-field"])
def test_integer_arithmetic_that_unpacks_no_int4_field_reads_full_precision_should_fail(weight):
    """The controls: integer arithmetic that is no narrow code unpacked stays full precision, and fails."""
    with pytest.raises(AssertionError, match=r"1 of 1 matmuls reach full precision"):
        assert_quantized(lambda x, p: _int8(x) @ weight(p).astype(jnp.float32), A, PACKED4, declared=False)
    (r,) = coverage(lambda x, p: _int8(x) @ weight(p).astype(jnp.float32), A, PACKED4)
    assert not r.rhs.quantized and "int4" not in r.rhs_casts, (r.rhs, r.rhs_casts)


#: Keras's grouped int4 in small (dequantize_with_sz_map, keras 3.15.1 quantizers.py:1196-1240): one zero point and
#: one scale per group of 8 inputs and per output, taken for each input row by its group index.
G_IDX4 = np.arange(32) // 8
ZERO4 = _RNG.integers(-2, 3, size=(4, 16)).astype(np.int8)
GSCALE4 = _RNG.uniform(1, 2, size=(4, 16)).astype(np.float32)


def _grouped(p, zero, scale, idx):
    codes = _unpack_keras(p).astype(jnp.float32)
    return (codes - jnp.take(zero, idx, axis=0).astype(jnp.float32)) * jnp.take(scale, idx, axis=0)


def test_grouped_int4_with_zero_points_taken_by_group_index_reads_as_int4_should_pass():
    """Per-group zero points and scales taken by a group index repeat fewer values, as a broadcast does: the
    dequantized kernel stays int4 (it read full precision at the subtraction before)."""
    (r,) = assert_quantized(lambda x, p: _int8(x) @ _grouped(p, ZERO4, GSCALE4, G_IDX4), A, PACKED4, declared=False)
    assert str(r.rhs) == "int4 unpack", r.rhs


def test_grouped_int4_minus_a_full_size_value_taken_by_index_reads_full_precision_should_fail():
    """The control: what is taken by index is as large as the codes (one value per element, no group repeated),
    so it is no zero point and the operand reads full precision."""
    table = _RNG.normal(size=(32, 16)).astype(np.float32)
    with pytest.raises(AssertionError, match=r"1 of 1 matmuls reach full precision"):
        assert_quantized(lambda x, p: _int8(x) @ _grouped(p, table, np.ones((32, 16), np.float32), np.arange(32)),
                         A, PACKED4, declared=False)


#: A kernel of 200 inputs: one group of 128 and a partial one of 72, as Keras's default int4 groups them.
W_GROUPED = jnp.asarray(_RNG.normal(size=(200, 8)).astype(np.float32))
X_GROUPED = _RNG.normal(size=(4, 200)).astype(np.float32)
#: Grouped along the contraction (axis 0), one scale set per output: the axis that keeps its own scales.
INT4_GROUPED_PER_OUTPUT = {"weights": {"format": "int4_keras_grouped", "per": (1,)}, "activations": None}


def _grouped_layer(rule):
    def layer(x):
        return x @ formats.qdq(W_GROUPED, rule, axis=0)
    return layer


def test_int4_keras_grouped_kernel_held_bitwise_as_declared_should_pass():
    """A JAX layer whose kernel goes through int4_keras_grouped's qdq is held bitwise when declared so, per the
    output axis (the axis that keeps its own scales: the walk reads the groups through the padding and reshape
    only as declared)."""
    (r,) = assert_quantized(_grouped_layer("int4_keras_grouped"), X_GROUPED, declared=INT4_GROUPED_PER_OUTPUT)
    assert r.rhs_hold.bitwise and r.rhs_declared.startswith("int4_keras_grouped"), r.rhs_hold


def test_int4_keras_grouped_declared_on_the_per_channel_rule_fails_naming_the_codes_should_fail():
    """The twin: the same layer quantizing its kernel by Keras's per-channel int4 fails, the codes that differ
    counted."""
    with pytest.raises(AssertionError, match=r"rhs \(weight\): codes are not int4_keras_grouped per axes \(1,\)'s: "
                                             r"\d+ of 1600 codes differ from the referee's"):
        assert_quantized(_grouped_layer("int4_keras"), X_GROUPED, declared=INT4_GROUPED_PER_OUTPUT)
