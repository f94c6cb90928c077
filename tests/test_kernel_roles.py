"""Opaque kernels read by their operands' roles, and only contractions counted as matmuls.

A small Pallas matmul of qcheck's own (interpreted, so it runs on CPU) with a
scalar-prefetch operand, as MaxText's megablox has: its prefetched row-tile
ids (int32) come first, its codes and their scales after. Declared roles
(``qcheck.KernelRoles``) read it quantized when it is fed codes and full
precision when it is fed float32; undeclared, its roles are unknown and it
never passes. An elementwise einsum (``...k,k->...k``) is no matmul, beside
a real contraction that is.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import qcheck

TM = 8  # rows per tile
_RNG = np.random.default_rng(0)
A = _RNG.normal(size=(16, 32)).astype(np.float32)
B = _RNG.normal(size=(32, 16)).astype(np.float32)
#: The kernel's inputs after its scalar-prefetch operand: codes, their scale, codes, their scale.
ROLES = qcheck.KernelRoles("scaled_matmul_kernel", lhs=0, rhs=2, lhs_scale=1, rhs_scale=3)
CODES = {"int8": jnp.int8, "e4m3fn": jnp.float8_e4m3fn}


def scaled_matmul_kernel(rows_ref, a_ref, sa_ref, b_ref, sb_ref, o_ref):
    a = a_ref[...].astype(jnp.float32) * sa_ref[...]
    b = b_ref[...].astype(jnp.float32) * sb_ref[...]
    o_ref[...] = jnp.dot(a, b, preferred_element_type=jnp.float32)


def _call(rows, a, sa, b, sb):
    """The kernel over row tiles, each tile's rows chosen by the prefetched ``rows`` (the identity here)."""
    m, k = a.shape
    n = b.shape[1]
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(m // TM,),
        in_specs=[pl.BlockSpec((TM, k), lambda i, rows: (rows[i], 0)),
                  pl.BlockSpec((TM, 1), lambda i, rows: (rows[i], 0)),
                  pl.BlockSpec((k, n), lambda i, rows: (0, 0)),
                  pl.BlockSpec((1, n), lambda i, rows: (0, 0))],
        out_specs=pl.BlockSpec((TM, n), lambda i, rows: (i, 0)))
    return pl.pallas_call(scaled_matmul_kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
                          grid_spec=spec, interpret=True)(rows, a, sa, b, sb)


def _quantize(x, axis, codes):
    """Codes and scale at absmax per row (axis=1) or per column (axis=0); ``codes`` None: unquantized."""
    if codes is None:
        return x, jnp.ones(x.shape[:1] + (1,) if axis == 1 else (1,) + x.shape[1:], jnp.float32)
    top = 127.0 if codes == jnp.int8 else float(jnp.finfo(codes).max)
    scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / top
    q = x / scale
    return (jnp.round(q) if codes == jnp.int8 else q).astype(codes), scale


def layer(fmt: str | None):
    """A matmul through the kernel: fed ``fmt``'s codes and their scales, or (None) float32 and unit scales."""
    codes = None if fmt is None else CODES[fmt]

    def f(a, b):
        (qa, sa), (qb, sb) = _quantize(a, 1, codes), _quantize(b, 0, codes)
        return _call(jnp.arange(a.shape[0] // TM, dtype=jnp.int32), qa, sa, qb, sb)
    return f


def _kernel_line() -> str:
    """``tests/test_kernel_roles.py:LINE`` of the ``pl.pallas_call`` in :func:`_call`."""
    import inspect

    lines, start = inspect.getsourcelines(_call)
    (offset,) = [i for i, line in enumerate(lines) if "pl.pallas_call(" in line]
    return f"tests/test_kernel_roles.py:{start + offset}"


# -- declared roles ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(CODES))
def test_kernel_with_declared_roles_reads_quantized_should_pass(fmt):
    records = qcheck.assert_quantized(layer(fmt), A, B, kernels=ROLES)
    (r,) = records
    cast = str(np.dtype(CODES[fmt]))
    assert (r.primitive, r.opaque, r.kernel, r.kernel_roles) == ("pallas_call", True, "scaled_matmul_kernel",
                                                                 "declared")
    assert r.quantized and (r.lhs.dtype, r.rhs.dtype) == (cast, cast), qcheck.format_coverage(records)
    # The scalar-prefetch operand is neither lhs nor rhs, nor listed among the data operands.
    assert (r.lhs_shape, r.rhs_shape) == (A.shape, B.shape)
    assert len(r.operands) == 4 and not any("int32" in o for o in r.operands), r.operands
    assert (r.lhs_role, r.rhs_role) == ("activation", "activation")  # both are the call's inputs
    # The kernel computes the quantized product it is read as: within the format's error of the float64 one.
    ref = A.astype(np.float64) @ B.astype(np.float64)
    out = np.asarray(jax.jit(layer(fmt))(A, B), np.float64)
    assert 0 < np.linalg.norm(out - ref) / np.linalg.norm(ref) < 0.1


def test_kernel_with_declared_roles_on_float32_operands_should_fail():
    records = qcheck.coverage(layer(None), A, B, kernels=ROLES)
    (r,) = records
    assert not r.quantized and str(r.lhs) == str(r.rhs) == "full precision"
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer(None), A, B, kernels=ROLES)
    message = str(failure.value)
    assert message.startswith("assert_quantized: 1 of 1 matmuls reach full precision:\n  pallas_call at "
                              f"{_kernel_line()} "), message
    assert ("lhs (16, 32) float32 [full precision], rhs (32, 16) float32 [full precision]: lhs and rhs unquantized "
            "(opaque kernel scaled_matmul_kernel; roles: declared)") in message, message


def test_kernel_with_declared_roles_is_held_to_a_declaration_by_type():
    # Its body unseen, a kernel's operands are held to a declaration by the types they are cast to.
    (r,) = qcheck.assert_quantized(layer("e4m3fn"), A, B, kernels=ROLES, declared={"activations": "e4m3fn"})
    assert (r.lhs_declared, r.rhs_declared, r.findings) == ("e4m3fn", "e4m3fn", ())
    with pytest.raises(AssertionError, match=r"1 of 1 matmuls differ from the declared quantization .*\n.*\n"
                                             r"    lhs \(activation\) is cast to float8_e4m3fn; declared int8"):
        qcheck.assert_quantized(layer("e4m3fn"), A, B, kernels=ROLES, declared={"activations": "int8"})


def test_kernel_roles_counting_qarrays_read_codes_beside_their_scales():
    # qwix.pallas.pallas_call passes a QArray as its codes and scale: positions count each pair as one input.
    paired = qcheck.KernelRoles("scaled_matmul_kernel", lhs=0, rhs=1, qarrays=True)
    (by_pairs,) = qcheck.coverage(layer("int8"), A, B, kernels=paired)
    (by_position,) = qcheck.coverage(layer("int8"), A, B, kernels=ROLES)
    assert by_pairs.quantized and (by_pairs.lhs_shape, by_pairs.rhs_shape) == (A.shape, B.shape)
    assert (by_pairs.lhs, by_pairs.rhs) == (by_position.lhs, by_position.rhs)


def test_kernel_roles_that_do_not_fit_the_kernel_are_a_usage_error():
    wrong = qcheck.KernelRoles("scaled_matmul_kernel", lhs=0, rhs=4)
    with pytest.raises(ValueError, match=r"^coverage: kernels: KernelRoles\('scaled_matmul_kernel'\) at .*: rhs=4, "
                                         r"but the kernel takes 4 inputs \(as it takes them: a pallas_call's scalar-prefetch operands and grid "
                                         r"bounds left out, metadata passed as inputs counted\)$"):
        qcheck.coverage(layer("int8"), A, B, kernels=wrong)


def test_kernel_roles_naming_no_kernel_fail_as_stale():
    stale = qcheck.KernelRoles("scaled_matmul", lhs=0, rhs=2)
    with pytest.raises(AssertionError, match=r"kernels: KernelRoles\('scaled_matmul'\) names no kernel of fn \(its "
                                             r"opaque kernels: scaled_matmul_kernel\): drop it or fix its name"):
        qcheck.assert_quantized(layer("int8"), A, B, kernels=[ROLES, stale])


@pytest.mark.parametrize("kwargs, says", [
    (dict(lhs=0, rhs=0), "must be different inputs"),
    (dict(lhs=-1, rhs=1), "lhs must be an input's position"),
    (dict(lhs=0, rhs=1, lhs_scale=2, qarrays=True), "with qarrays=True"),
])
def test_kernel_roles_refuse_impossible_positions(kwargs, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        qcheck.KernelRoles("k", **kwargs)


# -- roles unknown -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [*sorted(CODES), None])
def test_kernel_without_roles_is_never_silently_passed(fmt):
    # Fed codes it is not read as quantized, fed float32 not as full precision: its roles are unknown.
    (r,) = records = qcheck.coverage(layer(fmt), A, B)
    assert r.opaque and r.roles_unknown and r.kernel == "scaled_matmul_kernel" and r.kernel_roles is None
    assert not r.quantized and str(r.lhs) == str(r.rhs) == "roles unknown"
    shown = qcheck.format_coverage(records)
    assert "pallas_call scaled_matmul_kernel" in shown and "NO (opaque, roles unknown)" in shown, shown
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer(fmt), A, B)
    message = str(failure.value)
    assert message.startswith("assert_quantized: 1 opaque kernel(s) whose roles qcheck cannot read (roles unknown): "
                              "declare which inputs are lhs, rhs and their scales (kernels=qcheck.KernelRoles("
                              "'scaled_matmul_kernel', lhs=..., rhs=...)) or spare them with a skip rule:\n"), message
    assert f"  pallas_call at {_kernel_line()} (_call), kernel scaled_matmul_kernel: data operands " in message
    # Held to a declaration, it fails the same way: no finding can be read of it.
    with pytest.raises(AssertionError, match=re.escape("roles unknown")):
        qcheck.assert_quantized(layer(fmt), A, B, declared={"activations": "int8"})


def test_kernel_without_roles_may_be_spared_by_a_skip_rule():
    rule = qcheck.skip_where(lambda r: r.kernel == "scaled_matmul_kernel", "the scaled matmul kernel")
    (r,) = qcheck.assert_quantized(layer("int8"), A, B, skip=rule)
    assert r.skipped_by == "skip_where('the scaled matmul kernel')"


# -- check_layer ---------------------------------------------------------------------------------

def _differentiable(fmt: str | None):
    """The kernel's matmul with a backward pass of plain float matmuls (Pallas kernels have none of their own),
    as a layer of ``x`` with the weight ``B``: what megablox's custom_vjp does around its kernels."""
    @jax.custom_vjp
    def matmul(a, b):
        return layer(fmt)(a, b)

    matmul.defvjp(lambda a, b: (matmul(a, b), (a, b)), lambda res, g: (g @ res[1].T, res[0].T @ g))
    w = jnp.asarray(B)
    return lambda x: matmul(x, w)


def test_check_layer_passes_a_kernel_with_declared_roles():
    figures = qcheck.check_layer(_differentiable("int8"), _differentiable(None), A, kernels=ROLES)
    (r,) = figures.coverage
    assert r.quantized and r.kernel_roles == "declared" and 0 < figures.rel_norm <= 0.22


def test_check_layer_fails_a_kernel_without_roles():
    with pytest.raises(AssertionError, match=r"(?s)^check_layer: 1 check\(s\) failed:\n  coverage: assert_quantized: "
                                             r"1 opaque kernel\(s\) whose roles qcheck cannot read \(roles unknown\)"):
        qcheck.check_layer(_differentiable("int8"), _differentiable(None), A)
    with pytest.raises(ValueError, match=r"^check_layer: kernels must be a qcheck.KernelRoles or a sequence of them"):
        qcheck.check_layer(_differentiable("int8"), _differentiable(None), A, kernels="scaled_matmul_kernel")


# -- only contractions are matmuls ---------------------------------------------------------------

def _normed_matmul(contract_scale: bool):
    """RMSNorm's scale as MaxText writes it (``...k,k->...k``, elementwise), then a quantized matmul; or, as
    the control, the same einsum with the output dropping k (``...k,k->...``): a contraction."""
    def f(x, w, s):
        y = jnp.einsum("...k,k->..." if contract_scale else "...k,k->...k", x, s)
        q = lambda v: v.astype(jnp.float8_e4m3fn).astype(jnp.float32)  # noqa: E731
        return jnp.einsum("bk,kn->bn", q(y if not contract_scale else x), q(w)) + (y.sum() if contract_scale else 0)
    return f


def test_an_elementwise_einsum_is_not_a_matmul():
    s = np.linspace(0.5, 1.5, A.shape[1], dtype=np.float32)
    records = qcheck.assert_quantized(_normed_matmul(False), A, B, s)
    assert [(r.primitive, r.lhs_shape, r.rhs_shape) for r in records] == [("dot_general", A.shape, B.shape)], (
        qcheck.format_coverage(records))


def test_an_einsum_contracting_the_same_operands_is_a_matmul():
    s = np.linspace(0.5, 1.5, A.shape[1], dtype=np.float32)
    records = qcheck.coverage(_normed_matmul(True), A, B, s)
    assert sorted(r.lhs_shape for r in records) == sorted([A.shape, A.shape]), qcheck.format_coverage(records)
    (plain,) = [r for r in records if not r.quantized]
    assert plain.rhs_shape == s.shape
    with pytest.raises(AssertionError, match=r"1 of 2 matmuls reach full precision"):
        qcheck.assert_quantized(_normed_matmul(True), A, B, s)
