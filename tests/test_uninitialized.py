"""Reads of memory a program never wrote (``jax.lax.empty``'s buffers): each should-fail beside its control.

On CPU ``jax.lax.empty`` reads as zeros, so a layer that leaves rows of such a
buffer unwritten passes every CPU test, and check_layer's comparison with the
twin cannot see it when both run the same unpermute (maxtext#4905); on GPU the
rows are garbage. The check fills each such buffer with NaN and with a large
finite value and holds every output to the bits of the normal run.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import qcheck
from qcheck.checks import assert_no_uninitialized_reads
from qcheck.checks._compiles import counting_compilations
from tests.helpers import (CHECK_LAYER_X, MOE_FULL_PRECISION, sparse_moe, unpermute_into_empty, unpermute_moe)

ROWS = np.arange(24, dtype=np.float32).reshape(8, 3) - 10.0


def _line(fn, text: str) -> str:
    """``file:line`` of the first line of ``fn`` holding ``text``, as a message names it (any directory)."""
    lines, start = inspect.getsourcelines(fn)
    at = start + next(i for i, line in enumerate(lines) if text in line)
    return r"\S*" + re.escape(f"{Path(fn.__code__.co_filename).name}:{at}")


EMPTY_LINE = _line(unpermute_into_empty, "jax.lax.empty(")
READS = r"reads memory the layer never wrote, the buffer of jax\.lax\.empty float32\[{shape}\] at {line} \({fn}\)"


def reads(shape: str) -> str:
    """The message's words for a read of :func:`unpermute_into_empty`'s buffer of ``shape``."""
    return READS.format(shape=shape, line=EMPTY_LINE, fn="unpermute_into_empty")


# -- check_layer: the bug in code the layer and its twin share ---------------------------------------------

def test_check_layer_should_fail_on_rows_of_empty_that_layer_and_twin_leave_unwritten():
    with pytest.raises(AssertionError) as info:
        qcheck.check_layer(unpermute_moe("fp8"), unpermute_moe("none"), CHECK_LAYER_X, skip=MOE_FULL_PRECISION)
    message = str(info.value)
    # Every other check passes: on CPU the unwritten rows are zeros in both, so they agree.
    assert message.startswith("check_layer: 2 check(s) failed:\n"), message
    for who in ("layer", "reference"):
        # 2 sequences of 32 tokens, each leaving its last token's row: 64 of the 2048 output values.
        assert re.search(rf"\n  uninitialized \({who}\): output {reads('128, 32')}: filled with NaN, then with a "
                         rf"large finite value, it changes output in 64 and 64 of its 2048 values, .*gradient of the "
                         rf"input x in 64 and 64 of its 2048 values.* \(on CPU it reads as zeros, on GPU and TPU as "
                         rf"whatever the memory held\)", message), message


def test_check_layer_should_pass_with_every_row_of_empty_written():
    figures = qcheck.check_layer(unpermute_moe("fp8", unwritten=0), unpermute_moe("none", unwritten=0),
                                 CHECK_LAYER_X, skip=MOE_FULL_PRECISION)
    assert 0 < figures.rel_norm <= 0.22


def test_check_layer_should_fail_on_an_unpermute_jitted_inside_the_layer():
    with pytest.raises(AssertionError, match=rf"uninitialized \(layer\): output "
                                             rf"{reads('128, 32')}"
                                             rf": .* changes output in 128 and 128 of its 2048 values"):
        qcheck.check_layer(unpermute_moe("fp8", unwritten=2, nested_jit=True),
                           unpermute_moe("none", unwritten=2, nested_jit=True), CHECK_LAYER_X, skip=MOE_FULL_PRECISION)


def test_check_layer_runs_nothing_again_for_a_program_without_unspecified_buffers():
    layer, twin = sparse_moe("fp8"), sparse_moe("none")
    qcheck.check_layer(layer, twin, CHECK_LAYER_X, skip=MOE_FULL_PRECISION)
    with counting_compilations() as log:
        qcheck.check_layer(layer, twin, CHECK_LAYER_X, skip=MOE_FULL_PRECISION)
    assert not [k for k in log if k.startswith("jit(uninitialized_check)")], log
    # The control: the same log sees the reruns of a program that holds a jax.lax.empty buffer.
    fn = jax.jit(lambda x: unpermute_into_empty(x, jnp.arange(8), 4, 4))
    with counting_compilations() as log:
        assert assert_no_uninitialized_reads(fn, ROWS) == 1
    # One program: the normal run and the two filled copies, compiled together.
    assert sum(n for k, n in log.items() if k.startswith("jit(uninitialized_check)")) == 1, log


# -- the assertion on any function ---------------------------------------------------------------------------

def _unpermute(rows, written=8):
    """``ROWS`` in reverse order, copied into an empty buffer; only rows below ``written`` are copied."""
    return unpermute_into_empty(rows, jnp.arange(7, -1, -1), 8, written)


def test_should_fail_on_a_function_reading_rows_it_never_wrote():
    with pytest.raises(AssertionError, match=rf"^assert_no_uninitialized_reads: output "
                                             rf"{reads('8, 3')}"
                                             rf": filled with NaN, then with a large finite value, it changes output "
                                             rf"in 6 and 6 of its 24 values"):
        assert_no_uninitialized_reads(lambda x: _unpermute(x, written=6) * 2.0, ROWS)


def test_should_pass_on_the_same_function_writing_every_row():
    figures = assert_no_uninitialized_reads(lambda x: _unpermute(x) * 2.0, ROWS)
    assert figures == 1 and figures["buffers"] == 1


def test_a_program_without_unspecified_buffers_passes_with_none_found():
    assert assert_no_uninitialized_reads(lambda x: jnp.zeros_like(x).at[:6].set(x[:6]), ROWS) == 0


def _mesh():
    # Auto: the unsharded rows need no resharding to enter shard_map.
    return jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


#: Where the buffer may be created: each wraps a function of the rows that returns rows.
NESTINGS = {
    "jit": lambda f: jax.jit(f),
    "scan": lambda f: lambda x: jax.lax.scan(lambda c, r: (c, f(r)), 0.0, x[None])[1][0],
    "cond": lambda f: lambda x: jax.lax.cond(x.sum() < 1e9, f, lambda r: r, x),
    "while": lambda f: lambda x: jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, f(c[1])), (0, x))[1],
    "custom_jvp": lambda f: _custom_jvp(f),
    "custom_vjp": lambda f: _custom_vjp(f),
    "checkpoint": lambda f: jax.checkpoint(f),
    "shard_map": lambda f: jax.shard_map(f, mesh=_mesh(), in_specs=P("d"), out_specs=P("d")),
}


def _custom_jvp(f):
    g = jax.custom_jvp(f)
    g.defjvp(lambda primals, tangents: (g(*primals), tangents[0]))
    return g


def _custom_vjp(f):
    g = jax.custom_vjp(f)
    g.defvjp(lambda x: (g(x), None), lambda _, ct: (ct,))
    return g


@pytest.mark.parametrize("nesting", NESTINGS)
def test_should_fail_on_a_buffer_created_inside_a_nested_body(nesting):
    wrap = NESTINGS[nesting]
    assert assert_no_uninitialized_reads(wrap(_unpermute), ROWS) == 1  # the control: every row written
    with pytest.raises(AssertionError, match=rf"^assert_no_uninitialized_reads: output "
                                             rf"{reads('8, 3')}"
                                             rf": .* changes output in 3 and 3 of its 24 values"):
        assert_no_uninitialized_reads(wrap(lambda x: _unpermute(x, written=7)), ROWS)


def _backward_into_empty(written):
    """The identity, whose backward pass copies the cotangent into an empty buffer (as a ragged all-to-all's may)."""
    @jax.custom_vjp
    def identity(x):
        return x

    identity.defvjp(lambda x: (x, None), lambda _, ct: (unpermute_into_empty(ct, jnp.arange(8), 8, written),))
    return identity


def test_grads_should_fail_on_a_backward_pass_reading_rows_it_never_wrote():
    bad = _backward_into_empty(written=5)
    assert assert_no_uninitialized_reads(bad, ROWS) == 0  # the forward alone has no buffer
    with pytest.raises(AssertionError, match=r"^assert_no_uninitialized_reads: gradient of args\[0\] reads memory the "
                                             r"layer never wrote, .*jax\.lax\.empty float32\[8, 3\].* changes gradient "
                                             r"of args\[0\] in 9 and 9 of its 24 values"):
        assert_no_uninitialized_reads(bad, ROWS, grads=True)


def test_grads_should_pass_on_a_backward_pass_writing_every_row():
    assert assert_no_uninitialized_reads(_backward_into_empty(written=8), ROWS, grads=True) == 1


def test_only_the_buffer_read_is_named():
    def two(x):
        whole = jax.lax.empty(x.shape, x.dtype).at[:].set(x)
        return whole + _unpermute(x, written=7)

    with pytest.raises(AssertionError) as info:
        assert_no_uninitialized_reads(two, ROWS)
    assert re.search(rf"the buffer of jax\.lax\.empty float32\[8, 3\] at {EMPTY_LINE} \(unpermute_into_empty\): ",
                     str(info.value)), str(info.value)
    assert "(two)" not in str(info.value)


def test_a_read_that_a_select_hides_passes_and_one_times_zero_does_not():
    def masked(x, hide):
        y = _unpermute(x, written=7)
        return jnp.where(jnp.arange(8)[:, None] < 7, y, 0.0) if hide else y * (jnp.arange(8)[:, None] < 7)

    assert assert_no_uninitialized_reads(lambda x: masked(x, hide=True), ROWS) == 1
    # NaN * 0 is NaN; a large value times 0 is 0: only the NaN fill shows this read.
    with pytest.raises(AssertionError, match=r"changes output in 3 and 0 of its 24 values"):
        assert_no_uninitialized_reads(lambda x: masked(x, hide=False), ROWS)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float4_e2m1fn, jnp.int32, jnp.uint8,
                                   jnp.bool_])
def test_every_dtype_is_filled(dtype):
    def unpermute(x, written):
        return unpermute_into_empty(x.astype(dtype), jnp.arange(8), 8, written)

    assert assert_no_uninitialized_reads(lambda x: unpermute(x, 8), ROWS) == 1
    with pytest.raises(AssertionError, match=rf"jax\.lax\.empty {np.dtype(dtype).name}\[8, 3\] .* changes output in "
                                             rf"3 and 3 of its 24 values"):
        assert_no_uninitialized_reads(lambda x: unpermute(x, 7), ROWS)


def test_usage_and_user_code_errors():
    with pytest.raises(ValueError, match="^assert_no_uninitialized_reads: fn must be callable, got int$"):
        assert_no_uninitialized_reads(3, ROWS)
    with pytest.raises(ValueError, match="^assert_no_uninitialized_reads: grads=True, but no argument holds a "
                                         "floating-point array"):
        assert_no_uninitialized_reads(lambda i: i, np.arange(3), grads=True)
    with pytest.raises(ValueError, match="^assert_no_uninitialized_reads: grads=True, but the output holds no "
                                         "floating-point array") as info:
        assert_no_uninitialized_reads(lambda x: jnp.argmax(x), ROWS, grads=True)
    assert not isinstance(info.value, qcheck.UserCodeError)
    with pytest.raises(ValueError, match="^assert_no_uninitialized_reads: machinery must be a collection of package "
                                         "names, got 'jax'"):
        assert_no_uninitialized_reads(_unpermute, ROWS, machinery="jax")

    def broken(x):
        raise RuntimeError("the kernel gave up")

    with pytest.raises(qcheck.UserCodeError, match=r"^assert_no_uninitialized_reads: fn could not be traced and run "
                                                   r"on \w+: RuntimeError: the kernel gave up$"):
        assert_no_uninitialized_reads(broken, ROWS)
