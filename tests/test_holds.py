"""A verdict as strong as it reads: the declaration read by default, each site's hold, and the walk through bodies.

Should-pass / should-fail pairs for each way a check could quietly weaken:

* the declaration is read from the layer with no ``declared=`` argument (a
  wrong fp8 flavour on one site of a qcheck fp8 layer fails, unasked), and
  ``declared=True`` with nothing to read is an error, not a pass;
* an int8 weight scale shared across experts is held bitwise wherever the
  matmul sits: behind ``custom_vmap_call`` (tokamax's ragged dot), behind a
  user's ``custom_vjp`` inside ``shard_map`` (MaxText's sparse path), inside a
  ``scan``; and where the codes cannot be read (a while loop), the site fails
  saying why, unless the user accepts the weaker hold by name;
* a ``grads`` role is held on the backward pass: e4m3 output gradients where
  e5m2 is declared, and the reverse, fail; the right ones pass.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.custom_batching import custom_vmap
from jax.sharding import Mesh, PartitionSpec as P

import qcheck
from qcheck.layers.moe import UNQUANTIZED_BY_DESIGN

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(16, 32)).astype(np.float32))
# Experts' weights whose scales differ per expert: one scale shared across them changes most codes.
WE = jnp.asarray((RNG.normal(size=(4, 32, 24)) * np.array([1, 3, 10, 30])[:, None, None]).astype(np.float32))
GROUPS = jnp.asarray([4, 4, 4, 4], jnp.int32)
INT8 = {"weights": "int8", "activations": "int8"}
SHARED = "they match one scale shared across axis 0 (size 4)"


def _int8(v, axis):
    scale = jnp.max(jnp.abs(v), axis=axis, keepdims=True) / 127
    return jnp.clip(jnp.round(v / scale), -127, 127).astype(jnp.int8).astype(jnp.float32) * scale


@custom_vmap
def _grouped(x, w, groups):
    """A grouped matmul behind custom_vmap, as tokamax 0.0.17's ragged_dot runs on CPU (custom_vjp_call, then
    custom_vmap_call, then ragged_dot_general)."""
    return jax.lax.ragged_dot(x, w, groups)


@_grouped.def_vmap
def _grouped_rule(axis_size, in_batched, x, w, groups):
    return _grouped(x, w, groups), True


@jax.custom_vjp
def _vjp_grouped(x, w, groups):
    return _grouped(x, w, groups)


def _vjp_grouped_fwd(x, w, groups):
    return _grouped(x, w, groups), (x, w, groups)


def _vjp_grouped_bwd(res, g):
    x, w, groups = res
    return jax.lax.ragged_dot(g, jnp.swapaxes(w, 1, 2), groups), None, None


_vjp_grouped.defvjp(_vjp_grouped_fwd, _vjp_grouped_bwd)


class _Experts(nnx.Module):
    """Experts whose int8 weight scale is per expert (reduced over k alone), or one shared by all (the plant)."""

    def __init__(self, shared: bool, wrap=lambda f: f):
        self.w = nnx.Param(WE)
        self.shared, self.wrap = shared, wrap

    def __call__(self, x):
        def body(x, w):
            return _vjp_grouped(_int8(x, 1), _int8(w, (0, 1) if self.shared else 1), GROUPS)
        return self.wrap(body)(x, self.w[...])


def _in_shard_map(body):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))


def _in_scan(body):
    def scanned(x, w):
        return jax.lax.scan(lambda c, _: (c, body(x, w)), 0.0, None, length=2)[1]
    return scanned


WHERE = {"custom_vjp and custom_vmap": lambda f: f, "shard_map": _in_shard_map, "scan": _in_scan}


@pytest.mark.parametrize("where", list(WHERE))
def test_per_expert_scale_is_held_bitwise_should_pass(where):
    records = qcheck.assert_quantized(_Experts(False, WHERE[where]), X, declared=INT8)
    assert [(r.lhs_hold.strength, r.rhs_hold.strength) for r in records] == [("bitwise", "bitwise")]


@pytest.mark.parametrize("where", list(WHERE))
def test_scale_shared_across_experts_should_fail_through_any_body(where):
    with pytest.raises(AssertionError, match=r"1 of 1 matmuls differ from the declared quantization") as info:
        qcheck.assert_quantized(_Experts(True, WHERE[where]), X, declared=INT8)
    assert f"rhs (weight)" in str(info.value) and SHARED in str(info.value)
    if where != "custom_vjp and custom_vmap":  # a body's run is named
        assert {"shard_map": "(shard 0)", "scan": "(iteration 0)"}[where] in str(info.value)


def _in_while(body):
    def looped(x, w):
        return jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, body(x, w)), (0, body(x, w)))[1]
    return looped


def test_a_site_whose_codes_cannot_be_read_fails_saying_why():
    """A while loop's quantizers are not kept per iteration: the body's site is held by type, and that fails."""
    with pytest.raises(AssertionError, match=r"rhs \(weight\) held by its type only, not bitwise as int8 fixes its "
                                             r"bits: inside a while loop's body: its quantizers' values are not kept "
                                             r"per iteration"):
        qcheck.assert_quantized(_Experts(False, _in_while), X, declared=INT8)


def test_a_weaker_hold_accepted_by_name_should_pass_and_say_so():
    records = qcheck.assert_quantized(_Experts(False, _in_while), X, declared=INT8,
                                      accept_weaker=qcheck.skip_functions("_Experts.__call__"))
    held = [r for r in records if r.rhs_hold is not None and not r.rhs_hold.bitwise]
    assert held and all(r.rhs_hold.accepted_by == "skip_functions('_Experts.__call__')" for r in held)
    assert "(accepted by skip_functions('_Experts.__call__'))" in qcheck.format_coverage(records)
    qcheck.assert_quantized(_Experts(False, _in_while), X, declared=INT8, accept_weaker=True)


def test_weaker_hold_usage_errors_are_one_line():
    with pytest.raises(ValueError, match=r"^assert_quantized: accept_weaker: skip_functions\('_Experts.__call__'\) "
                                         r"matches no site held less than bitwise .*: drop it$"):
        qcheck.assert_quantized(_Experts(False), X, declared=INT8,
                                accept_weaker=qcheck.skip_functions("_Experts.__call__"))
    with pytest.raises(ValueError, match=r"^assert_quantized: accept_weaker accepts weaker holds of a declaration, "
                                         r"and none is held \(declared=False: no declaration held\)$"):
        qcheck.assert_quantized(_Experts(False), X, declared=False, accept_weaker=True)
    with pytest.raises(ValueError, match=r"^coverage: declared=True, but no reader \(qcheck_declaration, MaxText, gemma, "
                                         r"haliax, qwix, Keras, EasyDeL\) finds a declaration on it of _Experts; declare it by hand"):
        qcheck.coverage(_Experts(False), X, declared=True)


# -- the declaration read by default -----------------------------------------------------------

def _fp8_layer_with_a_nanoo_site(path: str) -> qcheck.MoE:
    """An fp8 (e4m3fn) layer whose wo site was wired from the nanoo_fp8 recipe (e4m3fnuz): the seed's bug."""
    layer = qcheck.build_moe("mixtral", "fp8", path=path)
    layer.sites["wo"] = qcheck.build_moe("mixtral", "nanoo_fp8", path=path).sites["wo"]
    return layer


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_wrong_flavour_on_one_site_fails_with_no_declared_argument(path):
    x = jax.random.normal(jax.random.key(1), (2, 32, 32))
    skip = qcheck.skip_functions(*UNQUANTIZED_BY_DESIGN)
    with pytest.raises(AssertionError) as info:
        qcheck.assert_quantized(_fp8_layer_with_a_nanoo_site(path), x, skip=skip)
    message = str(info.value)
    assert "1 of 5 matmuls differ from the declared quantization" in message and "in sites/wo" in message
    assert "is cast to float8_e4m3fnuz; declared e4m3fn" in message
    assert message.endswith("declared: read from the fn: the layer's recipe 'fp8'")
    # The control: the layer as its recipe builds it is held bitwise at every site.
    records = qcheck.assert_quantized(qcheck.build_moe("mixtral", "fp8", path=path), x, skip=skip)
    held = [h for r in records if r.quantized for h in (r.lhs_hold, r.rhs_hold)]
    assert len(held) == 6 and all(h.bitwise for h in held)
    assert records.declared_from == "read from the fn: the layer's recipe 'fp8'"


# -- the backward pass under a declaration ------------------------------------------------------

W = jnp.asarray(RNG.normal(size=(32, 24)).astype(np.float32))


def _fp8_matmul_grads_in(grad_dtype):
    """x @ w with both operands e4m3fn and the output gradient cast to ``grad_dtype`` for both gradient matmuls."""

    def q(v, dtype):
        top = float(jnp.finfo(dtype).max)
        return jnp.clip(v, -top, top).astype(dtype).astype(jnp.float32)

    @jax.custom_vjp
    def mm(x, w):
        return q(x, jnp.float8_e4m3fn) @ q(w, jnp.float8_e4m3fn)

    def fwd(x, w):
        xq, wq = q(x, jnp.float8_e4m3fn), q(w, jnp.float8_e4m3fn)
        return xq @ wq, (xq, wq)

    def bwd(res, g):
        xq, wq = res
        gq = q(g, grad_dtype)
        return gq @ wq.T, xq.T @ gq

    mm.defvjp(fwd, bwd)

    def layer(x):
        return mm(x, W)
    return layer


E5M2_GRADS = {"weights": "e4m3fn", "activations": "e4m3fn", "grads": "e5m2"}
E4M3_GRADS = {"weights": "e4m3fn", "activations": "e4m3fn", "grads": "e4m3fn"}


def _twin(x):
    return x @ W


@pytest.mark.parametrize("computed, declared", [(jnp.float8_e4m3fn, E5M2_GRADS), (jnp.float8_e5m2, E4M3_GRADS)])
def test_output_gradients_in_another_type_than_declared_should_fail(computed, declared):
    with pytest.raises(AssertionError) as info:
        qcheck.check_layer(_fp8_matmul_grads_in(computed), _twin, X, declared=declared)
    message = str(info.value)
    # One gradient matmul: the input's (W is a constant of the function, so it has no gradient to compute).
    assert "backward declared: assert_quantized: 1 of 2 matmuls differ from the declared quantization" in message
    assert f"(grad) is cast to {np.dtype(computed).name}; declared {declared['grads']}" in message
    with pytest.raises(AssertionError, match=f"is cast to {np.dtype(computed).name}; declared {declared['grads']}"):
        qcheck.assert_quantized(_fp8_matmul_grads_in(computed), X, declared=declared, backward=True)


@pytest.mark.parametrize("computed, declared", [(jnp.float8_e5m2, E5M2_GRADS), (jnp.float8_e4m3fn, E4M3_GRADS)])
def test_output_gradients_as_declared_should_pass_bitwise(computed, declared):
    figures = qcheck.check_layer(_fp8_matmul_grads_in(computed), _twin, X, declared=declared)
    grads = [h for r in figures.backward for h in (r.lhs_hold, r.rhs_hold) if h is not None]
    assert len(grads) == 1 and all(h.bitwise for h in grads), grads
    records = qcheck.assert_quantized(_fp8_matmul_grads_in(computed), X, declared=declared, backward=True)
    assert sum(r.backward for r in records) == 1


# -- weights passed as arguments -------------------------------------------------------------------

def _ptq(codes, scale, x):
    """A matmul on post-training-quantized weights handed in as arguments: int8 codes and their scale."""
    return _int8(x, 1) @ (codes.astype(jnp.float32) * scale)


SCALE = jnp.max(jnp.abs(W), axis=0, keepdims=True) / 127
CODES = jnp.clip(jnp.round(W / SCALE), -127, 127).astype(jnp.int8)
WEIGHT_ONLY = {"weights": "int8", "activations": None}


def test_weights_passed_as_arguments_take_the_weight_role_should_pass():
    (r,) = qcheck.coverage(_ptq, qcheck.weights(CODES), qcheck.weights(SCALE), X)
    assert (r.lhs_role, r.rhs_role) == ("activation", "weight")
    # Marked, a weight-only declaration holds the activations to full precision, where this function quantizes
    # them: the finding names the activation, and the weight (int8 codes that arrive so) is not one.
    with pytest.raises(AssertionError, match=r"lhs \(activation\) is quantized \(int8\) but declared full precision"):
        qcheck.assert_quantized(_ptq, qcheck.weights(CODES), qcheck.weights(SCALE), X, declared=WEIGHT_ONLY)


def test_weights_unmarked_read_as_activations_and_a_role_declaration_misfires_should_fail():
    (r,) = qcheck.coverage(_ptq, CODES, SCALE, X)
    assert r.rhs_role == "activation"  # what the walk sees without the mark: every argument is data
    with pytest.raises(AssertionError, match=r"rhs \(activation\) is quantized \(int8 input\) but declared full "
                                             r"precision"):
        qcheck.assert_quantized(_ptq, CODES, SCALE, X, declared=WEIGHT_ONLY)


def test_weights_around_a_non_array_is_one_line():
    with pytest.raises(ValueError, match=r"^qcheck.weights: \['lr'\] is a str, not an array \(numpy or JAX\); "
                                         r"mark arrays only$"):
        qcheck.weights({"lr": "0.1", "w": W})
    assert qcheck.coverage(lambda w, x: x @ W, qcheck.weights([]), X)  # nothing to mark (Keras's frozen list)


def _in_empty_scan(body):
    def scanned(x, w):
        return jax.lax.scan(lambda c, _: (c, body(x, w)), 0.0, None, length=0)[1]
    return scanned


def test_a_body_that_ran_no_iteration_holds_no_codes_and_says_so_should_fail():
    # A scan of length 0 runs its quantizers never: no codes to hold, so not bitwise (the control: length 2 above).
    with pytest.raises(AssertionError, match=r"rhs \(weight\) held by its type only, not bitwise as int8 fixes its "
                                             r"bits: inside a body that ran no iteration: no codes to hold"):
        qcheck.assert_quantized(_Experts(False, _in_empty_scan), X, declared=INT8)


# -- stored codes given their float source: qcheck.weights(codes, source=...) ------------------------------------


def _stored_pair(codes, scale, x):
    """Post-training-quantized weights as a plain (int8 codes, scale) pair, dequantized before the matmul."""
    return x @ (codes.astype(jnp.float32) * scale)


def _call_stored(pair, x):
    return _stored_pair(*pair, x)


def test_stored_codes_given_their_source_are_held_bitwise_should_pass():
    """qcheck.weights((codes, scale), source=w): the codes and scale are held bitwise to the declared format applied
    by the referee to w, in coverage, assert_quantized and check_layer on a function (its marked argument bound)."""
    (r,) = qcheck.assert_quantized(_call_stored, qcheck.weights((CODES, SCALE), source=W), X, declared=WEIGHT_ONLY)
    assert str(r.rhs_hold) == "bitwise: stored codes held bitwise against their source (qcheck.weights(..., source=))"
    (c,) = qcheck.coverage(_call_stored, qcheck.weights((CODES, SCALE), source=W), X, declared=WEIGHT_ONLY)
    assert c.rhs_hold.bitwise and not c.findings
    layer = functools.partial(_call_stored, qcheck.weights((CODES, SCALE), source=W))
    figures = qcheck.check_layer(layer, lambda x: x @ W, X, declared=WEIGHT_ONLY)
    assert [r.rhs_hold.bitwise for r in figures.coverage] == [True]


def test_stored_codes_without_a_source_are_held_by_type_and_fail_unless_accepted_should_fail():
    """The same codes marked without their source: no quantizer made them, so only their type is held; the
    declaration fails unless accept_weaker names the site."""
    with pytest.raises(AssertionError, match=r"rhs \(weight\) held by its type only, not bitwise as int8 fixes its "
                                             r"bits: its codes do not trace back to a quantizer"):
        qcheck.assert_quantized(_call_stored, qcheck.weights((CODES, SCALE)), X, declared=WEIGHT_ONLY)
    (r,) = qcheck.assert_quantized(_call_stored, qcheck.weights((CODES, SCALE)), X, declared=WEIGHT_ONLY,
                                   accept_weaker=True)
    assert r.rhs_hold.strength == "type" and r.rhs_hold.accepted_by


def test_stored_codes_rounded_down_fail_against_their_source_naming_the_site_should_fail():
    """The plant: codes rounded down (floor) under the right scale. The output tracks; the stored codes fail at
    their site, saying they are the referee's or one below it."""
    floor = jnp.clip(jnp.floor(W / SCALE), -127, 127).astype(jnp.int8)
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(_call_stored, qcheck.weights((floor, SCALE), source=W), X, declared=WEIGHT_ONLY)
    message = str(failure.value)
    assert re.search(r"dot_general at \S*test_holds\.py:\d+ \(_stored_pair\)", message), message
    assert ("rhs (weight): stored int8[32, 24] codes against their source (qcheck.weights(..., source=)): codes "
            "are not int8's" in message and "rounded down (floor), not to nearest" in message), message
    layer = functools.partial(_call_stored, qcheck.weights((floor, SCALE), source=W))
    with pytest.raises(AssertionError, match=r"rounded down \(floor\), not to nearest"):
        qcheck.check_layer(layer, lambda x: x @ W, X, declared=WEIGHT_ONLY)


def test_stored_codes_under_one_scale_for_the_whole_tensor_fail_naming_what_differs_should_fail():
    """The plant: one scale for the whole weight where int8's rule keeps one per output column."""
    one = jnp.max(jnp.abs(W)) / 127
    codes = jnp.clip(jnp.round(W / one), -127, 127).astype(jnp.int8)
    with pytest.raises(AssertionError, match=r"stored int8\[32, 24\] codes against their source .*: codes are not "
                                             r"int8's: .*they match one scale for the whole tensor"):
        qcheck.assert_quantized(_call_stored, qcheck.weights((codes, jnp.full((1, W.shape[1]), one)), source=W), X,
                                declared=WEIGHT_ONLY)


@pytest.mark.parametrize("source, says", [
    (W[:8], r"source \[8, 24\] must have the shape of the one integer array of stored codes it marks; the tree "
            r"holds int8\[32, 24\], float32\[1, 24\]"),
    (CODES, r"source must be the float weights the codes were made from \(a float array\), got an array of int8"),
    ("w", r"source must be the float weights the codes were made from \(a float array\), got a str"),
])
def test_weights_source_of_another_shape_or_not_float_is_one_line(source, says):
    with pytest.raises(ValueError, match=f"^qcheck.weights: {says}$"):
        qcheck.weights((CODES, SCALE), source=source)
