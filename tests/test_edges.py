"""Edge rows: ``check_layer`` runs its compiled program again on ``x`` with one token row replaced by zeros, tiny
values, one huge value and the format's saturation edge, and on ``x`` scaled into a whole tensor of tiny values,
where quantizers break.

Should-pass / should-fail pairs on a user's own fp8 NNX layer, each failing on an ordinary normal ``x`` through
the documented call, naming the edge kind and the site: per-token current scaling without a zero guard (an
all-zero row: scale 0, then 0 / 0 = NaN), a delayed-scaling cast without saturation (a value of 1e5 at scale
1: NaN in e4m3fn), and per-tensor current scaling whose scale 448 / amax is guarded at 0 only (a tensor of tiny
values: scale inf, then 0 · inf = NaN; no token row reaches it). Their guarded twins pass. qcheck's own layers pass
every edge, their codes held bitwise there.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck.checks import harness
from qcheck.checks._compiles import counting_compilations
from qcheck.layers.moe import UNQUANTIZED_BY_DESIGN

X = jax.random.normal(jax.random.key(1), (2, 8, 32))
FP8 = {"weights": "e4m3fn", "activations": "e4m3fn"}
ZEROS = "edges: token row of zeros"
HUGE = "edges: token row with one value far beyond the format's range (1e5)"


class UserFp8(nnx.Module):
    """x @ w with both operands e4m3fn and straight-through gradients: per-token current scaling
    (amax / 448 per row, with or without the zero guard) or delayed scaling at a fresh layer's scale of 1 (with
    or without the clip to ±448 before the cast)."""

    def __init__(self, *, delayed: bool = False, guard: bool = True, saturate: bool = True):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (32, 16)) / 6)
        self.delayed, self.guard, self.saturate = delayed, guard, saturate

    def quantize(self, v, per_row: bool):
        if self.delayed:
            scale = jnp.ones((1,) * v.ndim, v.dtype)
        else:
            scale = jnp.max(jnp.abs(v), axis=-1 if per_row else None, keepdims=True) / 448.0
            if self.guard:
                scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
        y = v / scale
        if self.saturate:
            y = jnp.clip(y, -448.0, 448.0)
        q = y.astype(jnp.float8_e4m3fn).astype(v.dtype) * scale
        return v + jax.lax.stop_gradient(q - v)

    def __call__(self, x):
        return self.quantize(x, True) @ self.quantize(self.w[...], False)


class Twin(nnx.Module):
    def __init__(self, w):
        self.w = nnx.Param(w)

    def __call__(self, x):
        return x @ self.w[...]


def _check(layer, **kwargs):
    return qcheck.check_layer(layer, Twin(layer.w[...]), X, **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"delayed": True}], ids=["current scaling", "delayed scaling"])
def test_guarded_saturating_fp8_layer_passes_every_edge_row_should_pass(kwargs):
    figures = _check(UserFp8(**kwargs))
    assert dict(figures.edges) == {"zeros": "run", "tiny": "run", "huge": "run",
                                   "saturation": "not run: no fp8 cast format declared for the activations",
                                   "tiny_tensor": "run"}
    # Declared, each row's codes are held bitwise too (the same compiled programs, run again).
    figures = _check(UserFp8(**kwargs), declared=FP8)
    assert set(figures.edges.values()) == {"run, codes held bitwise"}


def test_no_zero_guard_fails_on_a_row_of_zeros_naming_the_site_should_fail():
    with pytest.raises(AssertionError) as info:
        _check(UserFp8(guard=False))
    message = str(info.value)
    assert f"{ZEROS}: not finite: the output (16 of 256)" in message, message
    assert f"{ZEROS}: site dot_general at tests/test_edges.py:" in message and "(UserFp8.__call__): its output " \
           "is the first not finite (lhs [float8_e4m3fn], rhs [float8_e4m3fn])" in message, message
    # A tiny row slips past no guard either: its amax / 448 flushes to zero.
    assert "edges: token row of tiny values" in message
    # Declared, the site says what went wrong: its activation's scale is 0.
    with pytest.raises(AssertionError, match=r"token row of zeros: site .*lhs \(activation\): its scale is 0 at 1 "
                                             r"of 16 scale values \(codes NaN\)"):
        _check(UserFp8(guard=False), declared=FP8)


def test_cast_without_saturation_fails_on_a_huge_value_naming_the_site_should_fail():
    with pytest.raises(AssertionError) as info:
        _check(UserFp8(delayed=True, saturate=False))
    message = str(info.value)
    assert message.startswith("check_layer: 2 check(s) failed:\n") and f"{HUGE}: not finite: the output" in message
    assert f"{HUGE}: site dot_general at tests/test_edges.py:" in message, message
    with pytest.raises(AssertionError, match=r"far beyond the format's range \(1e5\): site .*lhs \(activation\): "
                                             r"codes are not e4m3fn's: 1 of 512 codes differ from the referee's; "
                                             r"first at \[0, 0, 0\]: nan where the referee gives 448"):
        _check(UserFp8(delayed=True, saturate=False), declared=FP8)


def test_a_row_kind_turned_off_with_a_reason_should_pass_and_say_so():
    figures = _check(UserFp8(guard=False), skip_edges={"zeros": "zero rows never reach this layer",
                                                       "tiny": "nor tiny ones", "tiny_tensor": "nor tiny tensors"})
    assert figures.edges["zeros"] == "skipped: zero rows never reach this layer" and figures.edges["huge"] == "run"


class UserCurrentFp8(nnx.Module):
    """x @ w, each operand e4m3fn under per-tensor current scaling (TransformerEngine's Float8CurrentScaling):
    scale 448 / amax, guarded at amax 0, and ``capped`` at 2^126 as ``e4m3fn_current`` is, or not: below
    448 / float32's max (1.3e-36) the uncapped scale overflows to inf, and a 0 of the tensor codes 0 · inf = NaN."""

    def __init__(self, *, capped: bool = True):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (32, 16)) / 6)
        self.capped = capped

    def quantize(self, v):
        amax = jnp.max(jnp.abs(v))
        scale = jnp.float32(448.0) / amax
        if self.capped:
            scale = jnp.minimum(scale, jnp.float32(qcheck.formats.CURRENT_MAX_SCALE))
        scale = jnp.where(amax > 0, scale, jnp.float32(1.0))
        q = jnp.clip(v * scale, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(v.dtype) * (1 / scale)
        return v + jax.lax.stop_gradient(q - v)

    def __call__(self, x):
        return self.quantize(x) @ self.quantize(self.w[...])


CURRENT = {"weights": "e4m3fn_current", "activations": "e4m3fn_current"}
TINY_TENSOR = ("edges: whole tensor of tiny values (x scaled by a power of two below every format's smallest guarded "
               "amax)")


def test_capped_current_scaling_passes_the_tiny_tensor_with_its_codes_held_should_pass():
    assert _check(UserCurrentFp8()).edges["tiny_tensor"] == "run"
    assert _check(UserCurrentFp8(), declared=CURRENT).edges["tiny_tensor"] == "run, codes held bitwise"


def test_current_scaling_guarded_at_zero_only_fails_on_the_tiny_tensor_alone_should_fail():
    with pytest.raises(AssertionError) as info:
        _check(UserCurrentFp8(capped=False))
    message = str(info.value)
    assert f"{TINY_TENSOR}: not finite: the output (" in message, message
    assert f"{TINY_TENSOR}: site dot_general at tests/test_edges.py:" in message, message
    assert "token row" not in message  # one row leaves the tensor's amax, all its scale sees, normal
    with pytest.raises(AssertionError, match=r"tiny values \(.*\): site .*lhs \(activation\): its scale is not "
                                             r"finite at 1 of 1 scale values \(codes not finite\)"):
        _check(UserCurrentFp8(capped=False), declared=CURRENT)
    # Turned off with a reason, it says so and passes.
    figures = _check(UserCurrentFp8(capped=False), skip_edges={"tiny_tensor": "no batch is ever that small"})
    assert figures.edges["tiny_tensor"] == "skipped: no batch is ever that small"


def test_the_tiny_tensor_is_x_scaled_by_a_power_of_two_just_below_every_formats_guard():
    guards = [f.guarded_below for f in qcheck.formats.FORMATS if f.guarded_below is not None]
    assert qcheck.formats.get_format("nvfp4").guarded_below == qcheck.formats.NVFP4_MIN_AMAX > min(guards)
    tiny = np.asarray(harness.format_edge_rows(X, None, {"tiny_tensor": None})["tiny_tensor"])
    x = np.asarray(X)
    amax = float(np.max(np.abs(tiny)))
    assert min(guards) / 2 <= amax < min(guards) and tiny.shape == x.shape and tiny.dtype == x.dtype
    # x times one power of two, exactly; what would be a float32 subnormal is 0, as XLA's CPU reads it.
    k = np.log2(np.max(np.abs(x)) / amax)
    assert k == int(k)
    kept = tiny != 0
    assert np.array_equal(tiny[kept], x[kept] * np.float32(2.0**-k))
    assert np.all(np.abs(x[~kept]) * 2.0**-k < np.finfo(np.float32).tiny) and 0 < np.mean(~kept) < 0.5
    # A type with no normal value that small does not run it, and says why; bfloat16 has float32's exponents.
    half = harness.format_edge_rows(X.astype(jnp.float16), None, {"tiny_tensor": None})["tiny_tensor"]
    assert half == f"not run: float16 has no normal value below the smallest guarded amax ({min(guards):.3g})"
    bf16 = harness.format_edge_rows(X.astype(jnp.bfloat16), None, {"tiny_tensor": None})["tiny_tensor"]
    assert bf16.dtype == jnp.bfloat16 and 0 < float(jnp.max(jnp.abs(bf16.astype(jnp.float32)))) < min(guards)


def test_the_tiny_tensor_compiles_nothing_check_layer_did_not_compile_already():
    # The same shapes as x: one more run of the layer's step. Each call has a shape of its own, so neither
    # finds the other's programs; the tally is the same with the tiny tensor as without it.
    tallies = {}
    for n, skip in ((40, {"tiny_tensor": "tallied without it"}), (48, None)):
        layer = qcheck.build_moe("mixtral", "fp8")
        twin = qcheck.copy_params_into(layer, qcheck.build_moe("mixtral", "none"))
        x = np.random.default_rng(n).normal(size=(1, n, 32)).astype(np.float32)
        with counting_compilations() as log:
            figures = qcheck.check_layer(layer, twin, x, skip=qcheck.skip_functions(*UNQUANTIZED_BY_DESIGN),
                                         skip_edges=skip)
        tallies[n] = sorted(k.split(" ", 1)[0] for k in log.elements())
        assert figures.edges["tiny_tensor"] == ("run, codes held bitwise" if skip is None else
                                                "skipped: tallied without it")
    assert tallies[40] == tallies[48], tallies


def test_the_suites_edges_compile_nothing_after_the_cases_own_programs():
    from qcheck.suite import cases, invariants

    case = cases.Case("int8", cases.Variant("mixtral", "dense", False))
    # The programs `exact`, `backward` and `grads` compile, which the edges run again.
    invariants.run_exact(case)
    invariants.run_backward(case)
    invariants.run_grads(case)
    with counting_compilations() as log:
        assert invariants.run_edges(case) == len(harness.EDGE_ROWS)
    assert sum(log.values()) == 0, dict(log)


@pytest.mark.parametrize("skip_edges, match", [
    ({"zero": "x"}, r"^check_layer: skip_edges: unknown edge kind 'zero'; valid edge kinds: zeros, tiny, huge, "
                    r"saturation, tiny_tensor$"),
    ({"zeros": ""}, r"^check_layer: skip_edges\['zeros'\] needs a reason \(a non-empty str\), got ''$"),
    ({"tiny_tensor": None}, r"^check_layer: skip_edges\['tiny_tensor'\] needs a reason \(a non-empty str\), "
                            r"got None$"),
    (["zeros"], r"^check_layer: skip_edges must map edge kinds \(zeros, tiny, huge, saturation, tiny_tensor\) to "
                r"reasons, got list$"),
])
def test_skip_edges_usage_errors_are_one_line(skip_edges, match):
    with pytest.raises(ValueError, match=match):
        _check(UserFp8(), skip_edges=skip_edges)


@pytest.mark.parametrize("recipe", ["fp8", "int8", "nvfp4"])
def test_qcheck_layers_pass_every_edge_row_with_their_codes_held_bitwise(recipe):
    layer = qcheck.build_moe("mixtral", recipe, path="sparse")
    twin = qcheck.copy_params_into(layer, qcheck.build_moe("mixtral", "none", path="sparse"))
    x = jax.random.normal(jax.random.key(1), (2, 32, layer.config.emb))
    figures = qcheck.check_layer(layer, twin, x, max_rel_norm=0.35, skip=qcheck.skip_functions(*UNQUANTIZED_BY_DESIGN))
    ran = {k: v for k, v in figures.edges.items() if k != "saturation" or recipe == "fp8"}
    assert set(ran.values()) == {"run, codes held bitwise"}, dict(figures.edges)


def test_edge_rows_stay_finite_in_the_inputs_own_type():
    # float16 tops out at 65504: the huge row's value is beyond every fp8 range and still a float16.
    from qcheck.checks._edges import edge_rows, check_skip_edges

    rows = edge_rows(X.astype(jnp.float16), None, check_skip_edges(None))
    huge = np.asarray(rows["huge"]).reshape(-1, 32)[0, 0]
    assert np.isfinite(huge) and huge > 448 and rows["huge"].dtype == jnp.float16


# -- the suite's `edges` invariant: the same rows on each case's compiled programs ----------------------------------
# Its should-fail twins are the catalogue's edge rows (tests/test_catalogue.py: a block without a zero guard, a guard
# on the amax, a cast without its clip, an e8m0 code 0 read as zero); its should-pass controls, every recipe's
# `edges` cell of the suite.


@pytest.mark.parametrize("fmt, top", [("e4m3fn", 448.0), ("int8", 127.0), ("nvfp4", 6.0), ("mxfp8", 448.0)])
def test_the_saturation_row_sits_at_the_declared_formats_largest_code(fmt, top):
    rows = harness.format_edge_rows(X, fmt, dict.fromkeys(harness.EDGE_ROWS))
    row = np.asarray(rows["saturation"]).reshape(-1, 32)
    assert np.array_equal(np.abs(row[0]), np.full(32, top, np.float32)) and np.array_equal(row[1:], X.reshape(-1, 32)[1:])


class _UndeclaredInt8(qcheck.Recipe):
    """int8 at every site, declared nowhere (no lhs=/rhs=): a plug-in ``exact`` cannot hold."""

    def site_module(self, name):
        from qcheck.recipes._sites import FormatSite

        return FormatSite(lhs="int8", rhs="int8")


def test_the_suite_runs_four_edges_where_no_format_is_declared_and_says_why_should_pass():
    from qcheck.suite import cases, invariants

    rows = harness.format_edge_rows(X, None, dict.fromkeys(harness.EDGE_ROWS))
    assert rows["saturation"] == "not run: no activation format declared, so no largest code to sit at"
    with qcheck.registered(_UndeclaredInt8("int8_undeclared")):
        case = cases.Case("int8_undeclared", cases.Variant("mixtral", "dense", False))
        assert invariants.run_edges(case) == 4  # finite on the other four; no codes to hold


class UserInt8(nnx.Module):
    """x @ w, each operand int8 per row: absmax / 127, codes int8. ``guard``: "scale" (a zero scale becomes 1),
    "quotient" (a zero scale's quotient is masked to code 0: the scale is 0 but divides nothing kept) or None."""

    def __init__(self, *, guard: str | None = "scale"):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (32, 16)) / 6)
        self.guard = guard

    def quantize(self, v, axis):
        scale = jnp.max(jnp.abs(v), axis=axis, keepdims=True) / 127.0
        if self.guard == "scale":
            scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
        codes = jnp.round(v / scale)
        if self.guard == "quotient":
            codes = jnp.where(scale > 0, codes, 0.0)
        q = jnp.clip(codes, -127, 127).astype(jnp.int8).astype(v.dtype) * scale
        return v + jax.lax.stop_gradient(q - v)

    def __call__(self, x):
        return self.quantize(x, -1) @ self.quantize(self.w[...], 0)


INT8 = {"weights": "int8", "activations": "int8"}


@pytest.mark.parametrize("guard", ["scale", "quotient"])
def test_guarded_int8_layer_holds_every_edge_row_bitwise_should_pass(guard):
    figures = _check(UserInt8(guard=guard), declared=INT8)
    assert {k: figures.edges[k] for k in ("zeros", "tiny", "huge")} == dict.fromkeys(
        ("zeros", "tiny", "huge"), "run, codes held bitwise"), figures.edges


def test_int8_without_a_zero_guard_fails_on_its_scale_though_its_output_stays_finite_should_fail():
    # 0 / 0 is NaN, and XLA's CPU casts a NaN to int8 as 0: the referee's code, and 0 · 0 keeps the output finite.
    # Only the scale tells, so only the declared check can: it holds every scale finite and nonzero.
    figures = _check(UserInt8(guard=None))
    assert figures.edges["zeros"] == "run"
    with pytest.raises(AssertionError, match=r"token row of zeros: site .*lhs \(activation\): its scale is 0 at 1 "
                                             r"of 16 scale values \(codes NaN\)"):
        _check(UserInt8(guard=None), declared=INT8)


# -- at size: from 512 token rows on, the edges run on a slice of x's first 64 token rows ----------------------

#: 512 token rows at emb 32: the edges run on 64 of them, by one more compiled step of the slice's shape.
X_LARGE = np.random.default_rng(0).normal(size=(2, 256, 32)).astype(np.float32)
SLICED = "run on 64 of 512 token rows"


def test_at_size_the_edges_run_on_a_slice_and_say_so_codes_held_bitwise_should_pass():
    layer = UserFp8()
    figures = qcheck.check_layer(layer, Twin(layer.w[...]), X_LARGE, declared=FP8)
    assert set(figures.edges.values()) == {f"{SLICED}, codes held bitwise"}, dict(figures.edges)
    assert figures.determinism == SLICED  # its second call too: on the slice, not the whole batch again
    # Below 512 rows, the layer's own program runs them, as on every tiny layer.
    small = _check(UserFp8(), declared=FP8)
    assert set(small.edges.values()) == {"run, codes held bitwise"} and small.determinism == "run"


class CalledFp8(UserFp8):
    """UserFp8 that hands each x it is called on to a host callback (an effect): the count by shape."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __call__(self, x):
        jax.debug.callback(lambda v: self.calls.update([v.shape]), x)
        return super().__call__(x)


def test_at_size_a_run_of_the_slice_runs_the_layers_effects_as_a_run_of_the_whole_batch_does_should_pass():
    # Seven runs on the slice (its own, five edge rows, the determinism check's second call), one of the whole
    # batch. The weights' walk outputs come from a program of their own, which ran the callback an eighth time
    # until it was pruned to the equations with no effect.
    layer = CalledFp8()
    figures = qcheck.check_layer(layer, Twin(layer.w[...]), X_LARGE, declared=FP8)
    assert set(figures.edges.values()) == {f"{SLICED}, codes held bitwise"}, dict(figures.edges)
    assert layer.calls[(1, 64, 32)] == 7 * layer.calls[X_LARGE.shape] > 0, layer.calls


class NoisyFp8(UserFp8):
    """UserFp8 with fresh noise on every call: a second call on the same input gives other bits."""

    def __init__(self):
        super().__init__()
        self.noise = nnx.Rngs(noise=1)

    def __call__(self, x):
        y = super().__call__(x)
        return y + 1e-3 * jax.random.normal(self.noise.noise(), y.shape, y.dtype)


@pytest.mark.parametrize("skip_edges, on, values", [
    (None, " (on 64 of 512 token rows)", "1024 of 1024"),
    # No edge runs, so no slice: the second call is the whole batch's, as below 512 rows.
    (dict.fromkeys(("zeros", "tiny", "huge", "saturation", "tiny_tensor"), "not this layer's"), "", "8192 of 8192")])
def test_at_size_a_non_deterministic_layer_fails_on_the_slice_or_the_whole_batch_saying_which(skip_edges, on, values):
    layer = NoisyFp8()
    with pytest.raises(AssertionError, match=re.escape(f"check_layer: 1 check(s) failed:\n  determinism: a second call "
                                                       f"on the same input{on} changed {values} output values "
                                                       "(float32; worst by ")):
        qcheck.check_layer(layer, Twin(layer.w[...]), X_LARGE, skip_edges=skip_edges)


def test_at_size_a_zero_row_still_fails_on_the_slice_naming_the_site_should_fail():
    layer = UserFp8(guard=False)
    with pytest.raises(AssertionError) as info:
        qcheck.check_layer(layer, Twin(layer.w[...]), X_LARGE)
    message = str(info.value)
    # The same row as on the whole x: its 16 outputs of the slice's 64 x 16, the first not finite at the same site.
    assert f"{ZEROS} (on 64 of 512 token rows): not finite: the output (16 of 1024)" in message, message
    assert f"{ZEROS} (on 64 of 512 token rows): site dot_general at tests/test_edges.py:" in message, message
    with pytest.raises(AssertionError, match=r"token row of zeros \(on 64 of 512 token rows\): site .*lhs "
                                             r"\(activation\): its scale is 0 at 1 of 64 scale values \(codes NaN\)"):
        qcheck.check_layer(layer, Twin(layer.w[...]), X_LARGE, declared=FP8)


class StaticBatchFp8(UserFp8):
    """UserFp8 on x reshaped to a batch size fixed in the layer (as a config's shape fixes it): no other shape
    traces."""

    def __call__(self, x):
        return super().__call__(x.reshape(512, 32)).reshape(2, 256, 16)


class StaticBatchTwin(Twin):
    def __call__(self, x):
        return super().__call__(x.reshape(512, 32)).reshape(2, 256, 16)


@pytest.mark.parametrize("guard", [True, False], ids=["guarded should pass", "unguarded should fail"])
def test_a_layer_that_does_not_trace_on_the_slice_runs_the_edges_on_every_row_and_says_so(guard):
    layer = StaticBatchFp8(guard=guard)
    if guard:
        figures = qcheck.check_layer(layer, StaticBatchTwin(layer.w[...]), X_LARGE)
        assert figures.edges["zeros"].startswith("run on all 512 token rows (a slice of 64 did not run: "), \
            dict(figures.edges)
        assert len(set(figures.edges.values()) - {"not run: no fp8 cast format declared for the activations"}) == 1
        assert figures.determinism == "run"  # no slice ran: the second call is the whole batch's
        return
    with pytest.raises(AssertionError) as info:
        qcheck.check_layer(layer, StaticBatchTwin(layer.w[...]), X_LARGE)
    # The whole batch ran: the zero row's 16 outputs of all 512 x 16.
    assert f"{ZEROS}: not finite: the output (16 of 8192)" in str(info.value), str(info.value)


def test_at_size_a_gradient_an_edge_row_breaks_is_counted_on_the_slice_should_fail():
    # The slice's program counts each gradient's values that are not finite where the gradient was: the count
    # and size read as the whole batch's program reads them.
    layer = UserFp8(guard=False)
    with pytest.raises(AssertionError) as info:
        qcheck.check_layer(layer, Twin(layer.w[...]), X_LARGE)
    assert re.search(r"token row of zeros \(on 64 of 512 token rows\): not finite: the output \(16 of 1024\), "
                     r"gradient of w \(512 of 512\), gradient of \(input x\) \(\d+ of 2048\)", str(info.value)), \
        str(info.value)


class XScaledInt8(UserInt8):
    """UserInt8 whose weight operand is scaled by x: twice w where a value of x passes 1e4 (a smoothing factor
    read from the activations), once otherwise. ``stale``: its scale is w's own, not the scaled weight's, so the
    codes clip there: wrong only on the huge row, right on every ordinary x."""

    def __init__(self, *, stale: bool):
        super().__init__()
        self.stale = stale

    def __call__(self, x):
        w = self.w[...] * jnp.where(jnp.max(jnp.abs(x)) > 1e4, 2.0, 1.0)
        amax = jnp.max(jnp.abs(self.w[...] if self.stale else w), axis=0, keepdims=True)
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8).astype(w.dtype) * scale
        return self.quantize(x, -1) @ (w + jax.lax.stop_gradient(q - w))


@pytest.mark.parametrize("stale", [False, True], ids=["its own scale (should pass)", "w's scale (should fail)"])
def test_at_size_a_weight_quantizer_that_reads_x_is_judged_on_each_edge_row(stale):
    # The slice's runs take the weights' quantizer values from one run where the quantizer reads nothing of x.
    # This one reads x (so the walk names its operand an activation), and each edge row's own codes are judged:
    # wrong on the huge row alone.
    layer = XScaledInt8(stale=stale)
    if not stale:
        figures = qcheck.check_layer(layer, Twin(layer.w[...]), X_LARGE, declared=INT8)
        assert figures.edges["huge"] == f"{SLICED}, codes held bitwise", dict(figures.edges)
        return
    with pytest.raises(AssertionError, match=r"check_layer: 1 check\(s\) failed:\n  edges: token row with one value "
                                             r"far beyond the format's range \(1e5\) \(on 64 of 512 token rows\): site "
                                             r".*: rhs \(activation\): codes are not int8's"):
        qcheck.check_layer(layer, Twin(layer.w[...]), X_LARGE, declared=INT8)
