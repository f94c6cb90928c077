"""tokamax's ``ragged_dot`` (with qwix) as a pinned client of qcheck.

Runs in tokamax's own environment (.ci/tokamax.sh, ``tox -e tokamax``, the tokamax
stage of .ci/run); skipped, naming how to install them, where tokamax or qwix is not
installed. Measured on tokamax 0.0.17 with qwix 0.1.8 (jax 0.12.0.1, flax 0.12.12),
on the CPU, where ``tokamax.ragged_dot``'s default implementation is ``"xla"``
(``base.RaggedDot``): its op wraps the call in ``jax.custom_vjp`` and, to capture
batched arguments, ``jax.custom_batching.custom_vmap`` (tokamax/_src/ops/op.py,
_src/batching.py), so the matmul is a ``ragged_dot_general`` two calls deep:
``custom_vjp_call`` (body in ``call_jaxpr``) -> ``custom_vmap_call`` (body in
``call``) -> ``ragged_dot_general``. A qwix ``QArray`` operand goes in as its
codes and scale and is dequantized (convert, mul) inside the innermost body.

* a user's int8 grouped matmul through ``tokamax.ragged_dot``, its codes made in
  jnp, one weight scale per expert and output column: passes ``declared`` int8
  bitwise, whether it dequantizes before the call or hands tokamax qwix QArrays;
  the plant, one weight scale shared across all experts, fails naming the site and
  "shared across axis 0" (that needs qcheck's walk to see through ``custom_vmap_call``;
  a walk that does not sees the operands quantized but cannot hold their codes);
* a known defect of qwix 0.1.8 with tokamax 0.0.17: ``qwix.quantize_model`` with
  ``QtProvider`` int8 rules quantizes the router (an ``nnx.Linear``) and leaves experts
  that call ``tokamax.ragged_dot`` float32 x float32 (qwix intercepts
  ``jax.lax.ragged_dot``; tokamax calls ``jax.lax.ragged_dot_general``); the control,
  the same module calling ``jax.lax.ragged_dot``, gets its experts quantized. Asserted
  with the versions checked, so a new tokamax or qwix makes these tests say "recheck".

* tokamax's TPU kernel (``PallasMosaicTpuRaggedDot``, Pallas Mosaic TPU) in interpret mode, reached on the
  CPU by ``implementation=[PallasMosaicTpuRaggedDot(interpret=True)]`` under an abstract TPU mesh: one
  ``pallas_call`` named ``pallas_tpu_ragged_dot_gmm`` multiplying qwix's codes, read by qcheck's table of
  kernels; per-expert weight codes hold ``declared`` int8_qwix bitwise, one weight scale shared across the
  experts fails naming the site and "shared across axis 0".

``machinery=("tokamax",)`` points each site at the user's line that calls tokamax, not
at tokamax's own ``ragged_dot_general`` (base.py, ``RaggedDot._fwd``).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import re

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck
from tests.helpers import QWIX_WARNS, import_extra

#: The versions the known defect and the traced structure were checked on.
TOKAMAX_VERSION = "0.0.17"
QWIX_VERSION = "0.1.8"
#: qcheck's int8 (absmax / 127 per slice, codes ±127), which the user's quantizer below computes: one scale per
#: index of every axis but the contraction, so per token for the activations, per expert and output column for
#: the weights.
INT8 = {"weights": "int8", "activations": "int8"}
QWIX_INT8 = {"weights": "int8_qwix", "activations": "int8_qwix"}
MACHINERY = ("tokamax",)
EXPERTS, K, N, TOKENS = 3, 32, 8, 12
GROUP_SIZES = (5, 7, 0)  # the last expert receives no token
#: Per-expert magnitudes: one scale shared across experts then loses the small experts' codes.
EXPERT_MAGNITUDES = (1.0, 10.0, 100.0)
#: The qwix-quantized MoE: embed, experts' hidden width, experts, tokens.
MOE_D, MOE_H, MOE_E, MOE_T = 32, 16, 4, 12

pytestmark = [*QWIX_WARNS]  # qwix 0.1.8 uses APIs flax 0.12 deprecates


@pytest.fixture(scope="module")
def tok():
    """tokamax and qwix, once: skipped, naming how to install them, where either is absent."""
    import_extra("tokamax")
    import_extra("qwix")
    import qwix
    import tokamax

    return type("Tokamax", (), {"tokamax": tokamax, "qwix": qwix})


def _pinned() -> None:
    installed = {d: importlib.metadata.version(d) for d in ("tokamax", "qwix")}
    if installed != {"tokamax": TOKAMAX_VERSION, "qwix": QWIX_VERSION}:
        pytest.fail(f"{installed} is installed; this was checked on tokamax {TOKAMAX_VERSION}, qwix {QWIX_VERSION}: "
                    f"recheck it, then update this test (and docs/libraries.md where it names tokamax)")


def _location(record) -> str:
    return record.location.replace(os.sep, "/")


def _line(method, needle: str) -> str:
    """``tests/test_tokamax.py:LINE`` of the one line of ``method`` holding ``needle``."""
    lines, start = inspect.getsourcelines(method)
    (offset,) = [i for i, line in enumerate(lines) if needle in line]
    return f"tests/test_tokamax.py:{start + offset}"


# -- what tokamax.ragged_dot traces to ----------------------------------------------------------------

def _operands():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(TOKENS, K)).astype(np.float32)
    w = rng.normal(size=(EXPERTS, K, N)).astype(np.float32) * np.asarray(EXPERT_MAGNITUDES, np.float32)[:, None, None]
    return x, w, np.asarray(GROUP_SIZES, np.int32)


def _body(eqn, param: str):
    inner = eqn.params[param]
    return getattr(inner, "jaxpr", inner)  # a Jaxpr on jax 0.12 (a ClosedJaxpr elsewhere)


def _avals(variables) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(v.aval.shape), str(v.aval.dtype)) for v in variables]


@pytest.mark.parametrize("operands", ["float32", "qwix QArrays"])
def test_tokamax_ragged_dot_is_a_custom_vjp_over_a_custom_vmap_over_ragged_dot_general(tok, operands):
    """tokamax 0.0.17, qwix 0.1.8, jax 0.12.0.1, CPU: the nesting, and each body's avals are its eqn's own."""
    _pinned()
    x, w, gs = _operands()
    qwix = tok.qwix

    def call(a, b, g):
        if operands == "qwix QArrays":
            a = qwix.quantize(a, jnp.int8, channelwise_axes=(0,))
            b = qwix.quantize(b, jnp.int8, channelwise_axes=(0, 2))
        return tok.tokamax.ragged_dot(a, b, g)

    closed = jax.make_jaxpr(call)(x, w, gs)
    (vjp,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "custom_vjp_call"]  # qwix's quantize before it
    assert [e.primitive.name for e in closed.jaxpr.eqns][-1] == "custom_vjp_call"
    (vmap,) = _body(vjp, "call_jaxpr").eqns
    assert vmap.primitive.name == "custom_vmap_call"
    inner = _body(vmap, "call")
    assert [e.primitive.name for e in inner.eqns] == (
        ["ragged_dot_general"] if operands == "float32" else
        ["convert_element_type", "mul", "convert_element_type", "mul", "ragged_dot_general"])
    for eqn, param in ((vjp, "call_jaxpr"), (vmap, "call")):
        body = _body(eqn, param)
        assert _avals(body.invars) == _avals(eqn.invars), param
        assert _avals(body.outvars) == _avals(eqn.outvars), param
    # custom_vmap_call hands back the operands (and the output twice) as the custom_vjp's residuals.
    assert len(vmap.outvars) == len(vmap.invars) + 2


# -- (a) a user's int8 grouped matmul through tokamax.ragged_dot -------------------------------------------

def _int8(x, axes):
    """qcheck's int8, written as a user would: absmax / 127 over ``axes``, round half to even, clip, int8."""
    scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / 127
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


class GroupedInt8(nnx.Module):
    """Int8 experts: activations per token, weights over ``weight_axes`` (contraction alone: per expert and
    output column; with the expert axis too: one scale shared by every expert), multiplied by tokamax."""

    def __init__(self, w, weight_axes: tuple[int, ...], operands: str):
        self.w = nnx.Param(jnp.asarray(w))
        self.weight_axes = weight_axes
        self.operands = operands

    def __call__(self, x, group_sizes):
        import qwix
        import tokamax

        x_codes, x_scale = _int8(x, (1,))
        w_codes, w_scale = _int8(self.w[...], self.weight_axes)
        if self.operands == "qwix QArrays":  # tokamax dequantizes them itself
            lhs, rhs = qwix.QArray(x_codes, x_scale, qtype=jnp.int8), qwix.QArray(w_codes, w_scale, qtype=jnp.int8)
        else:
            lhs, rhs = x_codes.astype(jnp.float32) * x_scale, w_codes.astype(jnp.float32) * w_scale
        return tokamax.ragged_dot(lhs, rhs, group_sizes)


OPERANDS = ["dequantized", "qwix QArrays"]
PER_EXPERT, SHARED = (1,), (0, 1)


def _grouped(weight_axes, operands):
    x, w, gs = _operands()
    return GroupedInt8(w, weight_axes, operands), x, gs


@pytest.mark.parametrize("operands", OPERANDS)
def test_int8_grouped_matmul_with_a_scale_per_expert_passes_declared_int8_should_pass(tok, operands):
    """tokamax 0.0.17, qwix 0.1.8, jax 0.12.0.1: the control. Codes per expert and output column are int8's."""
    layer, x, gs = _grouped(PER_EXPERT, operands)
    (site,) = qcheck.assert_quantized(layer, x, gs, declared=INT8, machinery=MACHINERY)
    assert site.primitive == "ragged_dot_general" and site.quantized and site.findings == ()
    assert (site.lhs_role, site.rhs_role) == ("activation", "weight")
    assert _location(site).endswith(_line(GroupedInt8.__call__, "tokamax.ragged_dot(")), _location(site)


@pytest.mark.parametrize("operands", OPERANDS)
def test_int8_grouped_matmul_with_one_weight_scale_shared_across_experts_fails_declared_int8(tok, operands):
    """tokamax 0.0.17, qwix 0.1.8, jax 0.12.0.1: the plant. One weight scale for every expert fails, at the site."""
    layer, x, gs = _grouped(SHARED, operands)
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer, x, gs, declared=INT8, machinery=MACHINERY)
    message = str(failure.value).replace(os.sep, "/")
    assert "1 of 1 matmuls differ from the declared quantization (weights int8, activations int8" in message, message
    site = rf"ragged_dot_general at \S*{re.escape(_line(GroupedInt8.__call__, 'tokamax.ragged_dot('))} "
    assert re.search(site + r"\(GroupedInt8\.__call__\)", message), message
    assert "rhs (weight): codes are not int8's:" in message, message
    assert "they match one scale shared across axis 0 (size 3)" in message, message
    assert "lhs (activation)" not in message, message  # the activations are per token, as declared


@pytest.mark.parametrize("operands", OPERANDS)
def test_shared_weight_scale_is_quantized_somehow_so_only_the_declaration_catches_it(tok, operands):
    """Control of the plant: undeclared, assert_quantized passes it (its operands are int8 codes, dequantized)."""
    layer, x, gs = _grouped(SHARED, operands)
    (site,) = qcheck.assert_quantized(layer, x, gs, machinery=MACHINERY)
    assert site.lhs.dtype == site.rhs.dtype == "int8", qcheck.format_coverage([site])


def test_without_machinery_the_site_is_tokamaxs_own_ragged_dot_general(tok):
    """tokamax 0.0.17: qcheck's MACHINERY does not list tokamax, so a site is located inside it unless named."""
    layer, x, gs = _grouped(PER_EXPERT, "dequantized")
    (site,) = qcheck.coverage(layer, x, gs)
    assert "tokamax/_src/ops/ragged_dot/base.py:" in _location(site) and site.function == "RaggedDot._fwd", site


# -- (b) qwix.quantize_model on a module whose experts call tokamax.ragged_dot ---------------------------

class TopOneMoE(nnx.Module):
    """A router (``nnx.Linear``) and experts multiplied by ``ragged_dot`` (tokamax's, or jax.lax's), top-1."""

    def __init__(self, ragged_dot, rngs: nnx.Rngs):
        self.router = nnx.Linear(MOE_D, MOE_E, use_bias=False, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (MOE_E, MOE_D, MOE_H)) / MOE_D ** 0.5)
        self.ragged_dot = ragged_dot

    def __call__(self, x):
        logits = self.router(x)
        expert = jnp.argmax(logits, axis=-1)
        gate = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
        order = jnp.argsort(expert)
        group_sizes = jnp.bincount(expert, length=MOE_E).astype(jnp.int32)
        y = self.ragged_dot(x[order], self.w[...], group_sizes)
        return jnp.zeros_like(y).at[order].set(y) * gate[:, None]


EXPERTS_LINE = lambda: _line(TopOneMoE.__call__, "= self.ragged_dot(")  # noqa: E731


@pytest.fixture(scope="module")
def moe_x():
    return np.random.default_rng(1).normal(size=(MOE_T, MOE_D)).astype(np.float32)


@pytest.fixture(scope="module")
def qwix_moe(tok, moe_x):
    """``qwix.quantize_model`` with int8 rules (weights and activations) on each module, built once."""
    qwix, built = tok.qwix, {}

    def get(which: str):
        if which not in built:
            ragged_dot = tok.tokamax.ragged_dot if which == "tokamax" else jax.lax.ragged_dot
            rules = qwix.QtProvider([qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8)])
            built[which] = qwix.quantize_model(TopOneMoE(ragged_dot, nnx.Rngs(0)), rules, moe_x)
        return built[which]

    return get


def _sites(records):
    (router,) = [r for r in records if r.primitive == "dot_general"]
    (experts,) = [r for r in records if r.primitive == "ragged_dot_general"]
    return router, experts


def test_qwix_quantize_model_leaves_tokamax_experts_in_full_precision(qwix_moe, moe_x):
    """qwix 0.1.8 with tokamax 0.0.17 (jax 0.12.0.1, flax 0.12.12): a known defect. ``QtProvider`` intercepts
    ``jax.lax.ragged_dot`` (qwix/_src/providers/qt.py, ``get_intercept_map``); tokamax's ``RaggedDot._fwd`` calls
    ``jax.lax.ragged_dot_general``, so the experts stay float32 x float32 and only the router is quantized."""
    _pinned()
    # declared=False: coverage alone (the declaration read off the model is the next tests').
    records = qcheck.coverage(qwix_moe("tokamax"), moe_x, machinery=MACHINERY, declared=False)
    router, experts = _sites(records)
    assert router.quantized and router.lhs.dtype == router.rhs.dtype == "int8", qcheck.format_coverage(records)
    assert router.scope == "router"
    assert not experts.quantized and experts.lhs.kind == experts.rhs.kind == "full", qcheck.format_coverage(records)
    assert _location(experts).endswith(EXPERTS_LINE()), _location(experts)
    table = qcheck.format_coverage(records)
    (row,) = [line for line in table.splitlines() if line.startswith("ragged_dot_general")]
    assert "float32 full precision" in row and row.split()[-2] == "NO", table

    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(qwix_moe("tokamax"), moe_x, machinery=MACHINERY, declared=False)
    message = str(failure.value).replace(os.sep, "/")
    assert "assert_quantized: 1 of 2 matmuls reach full precision:" in message, message
    assert re.search(rf"ragged_dot_general at \S*{re.escape(EXPERTS_LINE())} \(TopOneMoE\.__call__\)", message), message
    assert "lhs and rhs unquantized" in message, message
    assert _line(TopOneMoE.__call__, "self.router(x)") not in message, message  # the router is not named


def test_qwix_quantize_model_tokamax_experts_fail_declared_int8_qwix_where_the_router_passes(qwix_moe, moe_x):
    """qwix 0.1.8 with tokamax 0.0.17: the same defect, declared: the router holds qwix's int8 codes bitwise."""
    _pinned()
    router, experts = _sites(qcheck.coverage(qwix_moe("tokamax"), moe_x, machinery=MACHINERY, declared=QWIX_INT8))
    assert router.findings == (), router.findings
    assert experts.findings == ("lhs (activation) reaches the matmul in full precision; declared int8_qwix",
                                "rhs (weight) reaches the matmul in full precision; declared int8_qwix")


def test_qwix_quantize_model_tokamax_experts_fail_the_read_declaration_should_fail(qwix_moe, moe_x):
    """qwix 0.1.8 with tokamax 0.0.17: the same defect through the declaration read off the model (the qwix
    reader: its QtProvider's int8 rule on every module), by default and with declared=True: the router holds
    int8_qwix bitwise, the experts' site is named, full precision where the rule declares int8_qwix."""
    _pinned()
    read = ("read from the fn: qwix QtProvider rules on 2 module(s) (module_path='.*': weights int8_qwix, "
            "activations int8_qwix)")
    router, experts = _sites(qcheck.coverage(qwix_moe("tokamax"), moe_x, machinery=MACHINERY))
    assert router.findings == () and router.lhs_hold.bitwise and router.rhs_hold.bitwise, router.findings
    assert experts.findings == ("lhs (activation) reaches the matmul in full precision; declared int8_qwix",
                                "rhs (weight) reaches the matmul in full precision; declared int8_qwix")
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(qwix_moe("tokamax"), moe_x, machinery=MACHINERY, declared=True)
    message = str(failure.value).replace(os.sep, "/")
    assert re.search(rf"ragged_dot_general at \S*{re.escape(EXPERTS_LINE())} \(TopOneMoE\.__call__\)", message), message
    assert "rhs (weight) reaches the matmul in full precision; declared int8_qwix" in message, message
    assert message.endswith(f"declared: {read}"), message


def test_qwix_quantize_model_quantizes_jax_lax_ragged_dot_experts_should_pass(qwix_moe, moe_x):
    """qwix 0.1.8 (jax 0.12.0.1): the control. The same module calling ``jax.lax.ragged_dot``: both sites int8
    (coverage alone, declared=False: the declaration read off the model fails on qwix's own defect, next test)."""
    records = qcheck.assert_quantized(qwix_moe("lax"), moe_x, machinery=MACHINERY, declared=False)
    router, experts = _sites(records)
    assert router.quantized and experts.quantized, qcheck.format_coverage(records)
    assert experts.lhs.dtype == experts.rhs.dtype == "int8", qcheck.format_coverage(records)
    assert _location(experts).endswith(EXPERTS_LINE()), _location(experts)


def test_qwix_lax_ragged_dot_experts_share_one_weight_scale_across_experts(qwix_moe, moe_x):
    """qwix 0.1.8: quantized, but with qwix's own ragged_dot defect (docs/libraries.md): one weight scale per
    output column across all experts, where int8_qwix keeps one per expert and output column."""
    _pinned()
    for declared in (QWIX_INT8, None):  # by hand, and read off the model's qwix rule (the default)
        with pytest.raises(AssertionError) as failure:
            qcheck.assert_quantized(qwix_moe("lax"), moe_x, machinery=MACHINERY, declared=declared)
        message = str(failure.value)
        assert "1 of 2 matmuls differ from the declared quantization" in message, message
        assert "rhs (weight): codes are not int8_qwix's:" in message, message
        assert f"they match one scale shared across axis 0 (size {MOE_E})" in message, message


# -- (c) tokamax's TPU kernel (Pallas Mosaic TPU), interpreted on the CPU ----------------------------------

#: tokamax's TPU ragged_dot takes its operands' non-expert axes >= 128 (pallas_mosaic_tpu.py, ``_fwd``).
TPU_M, TPU_K, TPU_N = 128, 128, 128
TPU_GROUP_SIZES = (40, 88, 0)
GMM = "pallas_tpu_ragged_dot_gmm"


def _tpu(tok):
    """tokamax's ``PallasMosaicTpuRaggedDot`` in interpret mode, and the abstract TPU mesh it is traced under.

    The op asks ``pltpu.get_tpu_info()`` for the chip while it traces, which on the CPU raises "Unsupported TPU
    device kind: cpu ... wrap your code in a `jax.sharding.use_abstract_mesh` context manager"; an abstract mesh
    naming a TPU v5 lite answers it. Passed as ``implementation=[op]``, tokamax bypasses its device check."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu

    device = jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu")
    mesh = jax.sharding.AbstractMesh((), (), (), abstract_device=device)
    return [pallas_mosaic_tpu.PallasMosaicTpuRaggedDot(interpret=True)], mesh


def _tpu_operands():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(TPU_M, TPU_K)).astype(np.float32)
    w = rng.normal(size=(EXPERTS, TPU_K, TPU_N)).astype(np.float32)
    w *= np.asarray(EXPERT_MAGNITUDES, np.float32)[:, None, None]
    return x, w, np.asarray(TPU_GROUP_SIZES, np.int32)


class TpuKernelInt8(nnx.Module):
    """Experts multiplied by tokamax's TPU kernel: activations per token and weights over ``weight_axes``
    quantized with ``qwix.quantize`` (kept: per expert and output column; ``(2,)``: one scale shared by every
    expert), or (None) float32, handed to tokamax as QArrays."""

    def __init__(self, w, weight_axes: tuple[int, ...] | None, implementation, mesh):
        self.w = nnx.Param(jnp.asarray(w))
        self.weight_axes = weight_axes
        self.implementation, self.mesh = implementation, mesh

    def __call__(self, x, group_sizes):
        import qwix
        import tokamax

        with jax.sharding.use_abstract_mesh(self.mesh):
            lhs, rhs = x, self.w[...]
            if self.weight_axes is not None:
                lhs = qwix.quantize(lhs, jnp.int8, channelwise_axes=(0,))
                rhs = qwix.quantize(rhs, jnp.int8, channelwise_axes=self.weight_axes)
            return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=self.implementation)


PER_EXPERT_QWIX, SHARED_QWIX = (0, 2), (2,)
TPU_SITE = lambda: _line(TpuKernelInt8.__call__, "tokamax.ragged_dot(")  # noqa: E731


def _tpu_layer(tok, weight_axes):
    implementation, mesh = _tpu(tok)
    x, w, gs = _tpu_operands()
    return TpuKernelInt8(w, weight_axes, implementation, mesh), x, gs


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                body = getattr(sub, "jaxpr", sub)
                if isinstance(body, jcore.Jaxpr):
                    yield from _pallas_calls(body)


def test_tpu_kernel_is_one_pallas_call_whose_inputs_are_five_int32_then_two_qarrays(tok):
    """tokamax 0.0.17, qwix 0.1.8, jax 0.12.0.1: what qcheck's table row reads. The pallas_call named
    ``pallas_tpu_ragged_dot_gmm`` has no scalar prefetch of its own (``custom_buffered_pallas_call`` passes
    its prefetch as SMEM inputs): 9 inputs, 5 int32 metadata, then lhs codes and scale, rhs codes and scale,
    each scale repeated to tile; traced in ``pallas_mosaic_tpu_kernel.gmm``, with four xprof metadata keys."""
    _pinned()
    layer, x, gs = _tpu_layer(tok, PER_EXPERT_QWIX)
    (eqn,) = _pallas_calls(jax.make_jaxpr(lambda a, g: layer(a, g))(x, gs).jaxpr)
    gm = eqn.params["grid_mapping"]
    assert (eqn.params["name"], gm.num_index_operands, gm.num_dynamic_grid_bounds, gm.num_inputs) == (GMM, 0, 0, 9)
    assert _avals(eqn.invars) == [((1,), "int32"), ((EXPERTS + 1,), "int32"), ((EXPERTS,), "int32"),
                                  ((EXPERTS,), "int32"), ((1,), "int32"),
                                  ((TPU_M, TPU_K), "int8"), ((TPU_M, TPU_K), "float32"),
                                  ((EXPERTS, TPU_K, TPU_N), "int8"), ((EXPERTS, 8, TPU_N), "float32")]
    names = eqn.params["jaxpr"].debug_info.arg_names[5:9]
    assert names == ("args_refs[3].qvalue", "args_refs[3].scale", "args_refs[4].qvalue", "args_refs[4].scale")
    frames = {(code.co_filename.replace(os.sep, "/").split("/tokamax/_src/")[-1], code.co_qualname)
              for code, _ in zip(*eqn.source_info.traceback.raw_frames()) if "/tokamax/" in code.co_filename}
    assert ("ops/ragged_dot/pallas_mosaic_tpu_kernel.py", "gmm") in frames, frames
    keys = set(json.loads(eqn.params["metadata"]["xprof_metadata"]))
    assert keys == {"prefer_element_type", "tiling", "transpose_rhs", "input_buffer_count"}


def test_tpu_kernel_with_a_weight_scale_per_expert_holds_declared_int8_qwix_bitwise_should_pass(tok):
    """tokamax 0.0.17, qwix 0.1.8: the control. Read by qcheck's table (not roles unknown), the kernel's code
    inputs are held to int8_qwix's codes of qwix.quantize's inputs, bitwise, activations and weights."""
    layer, x, gs = _tpu_layer(tok, PER_EXPERT_QWIX)
    records = qcheck.assert_quantized(layer, x, gs, declared=QWIX_INT8, machinery=MACHINERY)
    (site,) = records
    assert (site.primitive, site.opaque, site.kernel, site.kernel_roles) == ("pallas_call", True, GMM, "tokamax")
    assert site.quantized and site.lhs.dtype == site.rhs.dtype == "int8" and site.findings == ()
    assert (site.lhs_shape, site.rhs_shape) == ((TPU_M, TPU_K), (EXPERTS, TPU_K, TPU_N))
    assert (site.lhs_role, site.rhs_role) == ("activation", "weight")
    assert site.lhs_hold.strength == site.rhs_hold.strength == "bitwise", (site.lhs_hold, site.rhs_hold)
    assert "roles unknown" not in qcheck.format_coverage(records)
    assert _location(site).endswith(TPU_SITE()), _location(site)


def test_tpu_kernel_with_one_weight_scale_shared_across_experts_fails_declared_int8_qwix(tok):
    """tokamax 0.0.17, qwix 0.1.8: the plant. The weight quantized by qwix with one scale per output column
    for every expert: the kernel multiplies those codes, and the declaration fails at the site."""
    layer, x, gs = _tpu_layer(tok, SHARED_QWIX)
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer, x, gs, declared=QWIX_INT8, machinery=MACHINERY)
    message = str(failure.value).replace(os.sep, "/")
    assert "1 of 1 matmuls differ from the declared quantization" in message, message
    assert re.search(rf"pallas_call at \S*{re.escape(TPU_SITE())} \(TpuKernelInt8\.__call__\)", message), message
    assert "rhs (weight): codes are not int8_qwix's:" in message, message
    assert f"they match one scale shared across axis 0 (size {EXPERTS})" in message, message
    assert "lhs (activation)" not in message, message
    # Undeclared it passes: int8 codes both sides; only the declaration catches the shared scale.
    (site,) = qcheck.assert_quantized(layer, x, gs, machinery=MACHINERY)
    assert site.quantized and site.kernel_roles == "tokamax"


def test_tpu_kernel_on_float32_operands_reads_full_precision_not_roles_unknown(tok):
    """tokamax 0.0.17: fed arrays, the kernel takes 7 inputs; counted as QArrays its lhs and rhs are still 5
    and 6, read full precision, and assert_quantized fails on them as on any full-precision matmul."""
    layer, x, gs = _tpu_layer(tok, None)
    (site,) = qcheck.coverage(layer, x, gs, machinery=MACHINERY)
    assert (site.kernel, site.kernel_roles, site.quantized) == (GMM, "tokamax", False)
    assert str(site.lhs) == str(site.rhs) == "full precision"
    with pytest.raises(AssertionError, match=r"1 of 1 matmuls reach full precision"):
        qcheck.assert_quantized(layer, x, gs, machinery=MACHINERY)


def test_tpu_kernel_transposed_for_the_backward_pass_is_not_read_by_the_forward_row(tok):
    """tokamax 0.0.17: its dlhs kernel (``transpose_rhs=True``, rhs [g, n, k]) has the forward's frames and
    metadata keys; named ``pallas_tpu_ragged_dot_gmm_transpose_rhs``, qcheck's table leaves its roles unknown
    rather than read it with the forward's contracting axes."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu

    implementation, mesh = _tpu(tok)
    x, w, gs = _tpu_operands()

    def dlhs(a, b, g):  # a [m, n], b [g, k, n]: contract n
        with jax.sharding.use_abstract_mesh(mesh):
            a = tok.qwix.quantize(a, jnp.int8, channelwise_axes=(0,))
            b = tok.qwix.quantize(b, jnp.int8, channelwise_axes=(0, 1))
            return tok.tokamax.ragged_dot_general(
                a, b, g, pallas_mosaic_tpu.DLHS_RAGGED_DOT_DIM_NUMS, implementation=implementation)

    (site,) = qcheck.coverage(dlhs, x, w, gs, machinery=MACHINERY)
    assert (site.kernel, site.kernel_roles, site.roles_unknown) == (GMM + "_transpose_rhs", None, True)
