"""A user's own format, registered as a recipe is: a Format record and the user's numpy referee.

The user's format here is an int8 variant, absmax / 100 per slice with codes
±100. Registered with its referee, a layer quantizing that way passes
``declared="myfmt"`` bitwise and fails ``declared="int8"`` naming the operand;
the name is unknown outside the block, and bad registrations are one-line errors.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qcheck
from qcheck import formats, referees
from qcheck.recipes import registered
from qcheck.recipes._sites import FormatSite
from qcheck.suite import cases, invariants

LEVELS = 100
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(16, 32)).astype(np.float32))
W = jnp.asarray(RNG.normal(size=(32, 24)).astype(np.float32))
VARIANT = cases.Variant("mixtral", "dense", False)


def _quantize(x, axes, fmt, rng):  # the user's JAX quantizer: what their layer runs
    scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / LEVELS
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    return jnp.clip(jnp.round(x / scale), -LEVELS, LEVELS).astype(jnp.int8), {"slice": scale}


def _dequantize(q, fmt):
    return (q.codes.astype(q.scales["slice"].dtype) * q.scales["slice"]).astype(q.dtype)


def _referee(x, axes, *, ftz, xla_reciprocal):  # the user's numpy referee, from the format's definition
    f32 = np.float32
    # A bool (both divisions by the reciprocal, or neither), or a Form naming each (its record lists every form).
    constant = getattr(xla_reciprocal, "constant", xla_reciprocal)
    operand = getattr(xla_reciprocal, "operand", xla_reciprocal)
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    scale = (amax * (f32(1) / f32(LEVELS)) if constant else amax / f32(LEVELS)).astype(f32)
    if ftz:  # XLA's CPU backend flushes float32 subnormals
        scale = np.where(scale < np.finfo(f32).tiny, f32(0), scale)
    scale = np.where(scale > 0, scale, f32(1)).astype(f32)
    q = (x * (f32(1) / scale) if operand else x / scale).astype(f32)
    return np.clip(np.round(q), -LEVELS, LEVELS).astype(np.int8), {"slice": scale}


MYFMT = formats.Format("myfmt", "int", np.dtype(np.int8), None, {"slice": np.dtype(np.float32)},
                       "absmax / 100 per slice, codes ±100", ("int8",), _quantize, _dequantize,
                       forms=formats.ALL_FORMS)


def layer(x):
    qx, qw = formats.quantize(x, "myfmt", axis=1), formats.quantize(W, "myfmt", axis=0)
    return formats.dequantize(qx) @ formats.dequantize(qw)


def test_a_users_format_declared_should_pass_bitwise():
    with formats.registered_formats((MYFMT, _referee)):
        (r,) = qcheck.assert_quantized(layer, X, declared="myfmt")
        assert r.rhs_declared == "myfmt" and r.rhs_hold.bitwise and r.rhs_hold.form in formats.ALL_FORMS
        # The referee is consulted where qcheck's own are.
        codes, scales = referees.reference_quantize(np.asarray(X), "myfmt", axis=1)
        assert np.abs(codes).max() == LEVELS and set(scales) == {"slice"}
        assert "myfmt" in formats.format_names() and formats.get_format("myfmt") is MYFMT
    assert "myfmt" not in formats.format_names() and "myfmt" not in referees.referee_format_names()


def test_a_users_format_declared_as_int8_should_fail_naming_the_operand():
    with formats.registered_formats((MYFMT, _referee)), pytest.raises(
            AssertionError, match=r"(?s)dot_general at \S*test_plugin_formats.py:\d+ \(layer\):.*rhs \(weight\): codes "
                                  r"are not int8's: .*they are myfmt's codes"):
        qcheck.assert_quantized(layer, X, declared="int8")


def test_a_users_referee_that_disagrees_should_fail():
    """The control: the declared check reads the user's referee, so one off by a level fails the layer."""
    def wrong(x, axes, *, ftz, xla_reciprocal):
        codes, scales = _referee(x, axes, ftz=ftz, xla_reciprocal=xla_reciprocal)
        return np.clip(codes, -LEVELS + 1, LEVELS - 1).astype(np.int8), scales

    with formats.registered_formats((MYFMT, wrong)), pytest.raises(AssertionError, match=r"codes are not myfmt's"):
        qcheck.assert_quantized(layer, X, declared="myfmt")


def test_an_unregistered_format_name_lists_the_valid_ones():
    valid = re.escape(", ".join(formats.format_names()))
    with pytest.raises(ValueError, match=rf"^assert_quantized: declared: unknown recipe 'myfmt'; .*formats: {valid}$"):
        qcheck.assert_quantized(layer, X, declared="myfmt")
    with pytest.raises(ValueError, match=r"^unknown format 'myfmt'; valid formats: int8, e4m3fn, "):
        formats.get_format("myfmt")


@pytest.mark.parametrize("args, error, match", [
    ((MYFMT, None), TypeError, r"^register_format: referee must be a numpy function referee\(x, axes, \*, ftz, "
                               r"xla_reciprocal\) -> \(codes, scales\) for format 'myfmt' .*got NoneType$"),
    ((dataclasses.replace(MYFMT, name="int8"), _referee), ValueError,
     r"^register_format: record.name 'int8' is one of qcheck's own formats; choose another name than int8, e4m3fn"),
    (("myfmt", _referee), TypeError, r"^register_format: record must be a qcheck.formats.Format, got str$"),
    ((dataclasses.replace(MYFMT, name="My-Fmt"), _referee), ValueError,
     r"^register_format: record.name must match \[a-z\]\[a-z0-9_\]\*, got 'My-Fmt'$"),
    ((dataclasses.replace(MYFMT, kind="slice"), _referee), ValueError,
     r"^register_format: unknown record.kind 'slice'; valid record.kinds: cast, int, current, block$"),
    ((dataclasses.replace(MYFMT, siblings=("int9",)), _referee), ValueError,
     r"^register_format: 'myfmt': unknown sibling or grad format 'int9'; valid .*: int8, e4m3fn"),
    # No tensor of normal float32 values fits below 1e-40 (the edge checks' tiny tensor must).
    ((dataclasses.replace(MYFMT, guarded_below=1e-40), _referee), ValueError,
     r"^register_format: record.guarded_below must be None or a number of at least twice float32's smallest normal "
     r"\(2\.351e-38\), got 1e-40$"),
    ((dataclasses.replace(MYFMT, guarded_below="1e-30"), _referee), ValueError,
     r"^register_format: record.guarded_below must be None .*, got '1e-30'$"),
])
def test_bad_registrations_are_one_line_errors_and_register_nothing(args, error, match):
    before = formats.format_names(), referees.referee_format_names()
    with pytest.raises(error, match=match):
        with formats.registered_formats(args):
            pytest.fail("the block ran")
    assert (formats.format_names(), referees.referee_format_names()) == before


def test_a_users_guarded_below_puts_the_tiny_tensor_below_it_should_pass():
    from qcheck.checks import harness

    def amax() -> float:
        return float(jnp.max(jnp.abs(harness.format_edge_rows(X, None, {"tiny_tensor": None})["tiny_tensor"])))

    builtin = min(f.guarded_below for f in formats.FORMATS if f.guarded_below is not None)
    assert builtin / 2 <= amax() < builtin
    with formats.registered_formats((dataclasses.replace(MYFMT, guarded_below=builtin / 8), _referee)):
        assert builtin / 16 <= amax() < builtin / 8
    assert builtin / 2 <= amax()  # the format gone, its guard too


def test_a_name_registered_twice_is_refused():
    with formats.registered_formats((MYFMT, _referee)):
        with pytest.raises(ValueError, match=r"^register_format: a format named 'myfmt' is already registered; "
                                             r"registered formats: int8, .*, myfmt$"):
            formats.register_format(MYFMT, _referee)
    assert "myfmt" not in formats.format_names()


class _In127(qcheck.Recipe):
    """Declares myfmt and computes in int8 (absmax / 127): the sibling its record names."""

    def site_module(self, name):
        return FormatSite(lhs="int8", rhs="int8")


def test_a_recipe_declaring_a_users_format_should_pass_exact():
    with formats.registered_formats((MYFMT, _referee)):
        recipe = qcheck.Recipe("my_int8_100", lhs="myfmt", rhs="myfmt")
        with registered(recipe):
            invariants.run_exact(cases.Case(recipe.name, VARIANT))


def test_a_recipe_declaring_a_users_format_computing_int8_should_fail_exact_naming_it():
    with formats.registered_formats((MYFMT, _referee)):
        recipe = _In127("my_int8_100_in_127", lhs="myfmt", rhs="myfmt")
        with registered(recipe), pytest.raises(AssertionError, match=r"site 'wi_0' .*\(myfmt x myfmt\): differs .*"
                                                                     r"it equals both operands in int8 instead of myfmt"):
            invariants.run_exact(cases.Case(recipe.name, VARIANT))


def test_a_name_registered_again_with_another_record_is_that_record_under_jit():
    """A program compiled for the first record under the name is not reused for the second (no stale codes)."""
    def halved(x, axes, fmt, rng):
        codes, scales = _quantize(x, axes, fmt, rng)
        return (codes // 2).astype(jnp.int8), {"slice": scales["slice"] * 2}

    def qdq(v):  # a new program each time: qdq's own nested program is what is shared
        return jax.jit(lambda u: formats.qdq(u, "myfmt", axis=1))(v)

    with formats.registered_formats((MYFMT, _referee)):
        first = np.asarray(qdq(X))
    with formats.registered_formats((dataclasses.replace(MYFMT, quantize=halved), _referee)):
        second = np.asarray(qdq(X))
    assert not np.array_equal(first, second)
