"""Backward exactness through the layer: each site's gradients as the layer's own backward pass computes them.

``backward`` on probes differentiates each site alone. A layer can still get
its gradients elsewhere: a straight-through trick around a quantized call
(``stop_gradient(site(x, w)) + plain - stop_gradient(plain)``), a custom_vjp
that skips the site's backward on one path, a rewrite that differentiates
another matmul. Here one backward pass of the whole layer is recorded: every
site call gets zero-valued taps added to its operands and its output, passed
in as inputs, so the gradient of the layer with respect to each tap is exactly
what that call received (``g`` at its output) and gave back (the cotangents of
its operands: DGRAD and WGRAD), and the layer's gradient of the weight named
like the site must be that WGRAD, bitwise. Each pair is then held bit for bit to the
referee's gradient matmuls of the operands the call consumed and the ``g`` it
received (:mod:`qcheck.checks._backward`'s expectations), never to the site run again.

A stochastic gradient format's DGRAD (NVFP4's) rounds with bits the layer draws from the site's
own stream, which this record does not see: recipes whose ``grad`` format's record says ``stochastic``
are held on probes only (:func:`qcheck.checks._backward.assert_site_backward_exact`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from qcheck import formats
from qcheck.checks._assertion import assertion
from qcheck.checks._backward import (assert_grad_equal, backend_qdq, expectations, grad_bugs, grad_operand_formats,
                                     grad_operands, other_form_grads)
from qcheck.checks._bits import bits, bitwise_equal
from qcheck.checks._probes import probe_grad
from qcheck.checks._site import record_site_calls
from qcheck.recipes import Einsum, Matmul, Ragged, Recipe, as_matmul, get_recipe


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["matmul", "lhs", "rhs", "g", "dgrad", "wgrad", "weight_grad"],
                   meta_fields=["site"])
@dataclasses.dataclass(frozen=True)
class SiteGradCall:
    """One site call in a backward pass of the layer: its matmul, operands, the ``g`` it received, the gradients
    it gave."""

    site: str
    matmul: Matmul
    lhs: jax.Array
    rhs: jax.Array
    g: jax.Array
    dgrad: jax.Array
    wgrad: jax.Array
    #: The layer's gradient of the parameter named like the site (its weight), if it has one.
    weight_grad: jax.Array | None


def through_layer_applies(recipe: Recipe) -> bool:
    """Whether the layer's own backward can be held to the referee: not where DGRAD draws from the site's stream."""
    return recipe.grad is None or not formats.get_format(recipe.grad).stochastic


class _Tap:
    """Stands in for one site: adds its taps to the operands and the output, and logs what the site consumed."""

    def __init__(self, site, name: str, taps: dict, log: dict):
        self.site, self.name, self.taps, self.log = site, name, taps, log

    def _operands(self, lhs, rhs):
        t_lhs, t_rhs, _ = self.taps[self.name]
        # The barrier makes the logged operands the very buffers the site consumes.
        return jax.lax.optimization_barrier((lhs + t_lhs, rhs + t_rhs))

    def __call__(self, eqn, lhs, rhs, **kwargs):
        return self._tap(Einsum(eqn), lhs, rhs, kwargs)

    def ragged_dot(self, lhs, rhs, group_sizes, **kwargs):
        return self._tap(Ragged.recorded(group_sizes), lhs, rhs, kwargs)

    def _tap(self, mm: Matmul, lhs, rhs, kwargs):
        lhs, rhs = self._operands(lhs, rhs)
        self.log.setdefault(self.name, []).append((mm, lhs, rhs))
        return mm.run(self.site, lhs, rhs, **kwargs) + self.taps[self.name][2]


def record_site_grads(layer: nnx.Module, x: jax.Array, g: jax.Array) -> list[SiteGradCall]:
    """Each site call of one backward pass of ``layer(x)`` with output gradient ``g``, traced in the caller's program.

    ``layer`` must be a copy the caller owns (it is changed), holding its call
    sites in ``layer.sites``; every site must be called once (the forward
    capture, :func:`qcheck.checks._site.judge_site_calls`, says which is not).
    """
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    names = tuple(layer.sites.keys())

    def run(taps, params):
        copy = nnx.merge(graphdef, params, rest, copy=True)
        log: dict = {}
        copy.sites = {n: _Tap(copy.sites[n], n, taps, log) for n in names}  # as record_site_calls does
        return copy(x), log

    shapes = _call_shapes(nnx.graphdef(layer), nnx.state(layer), x, names)
    taps = {n: tuple(jnp.zeros(s, jnp.float32) for s in shapes[n]) for n in shapes}
    _, vjp, log = jax.vjp(run, taps, params, has_aux=True)
    tap_grads, param_grads = vjp(g)
    weights = {path[0]: v.get_value() for path, v in nnx.to_flat_state(param_grads) if len(path) == 1}
    calls = []
    for name, entries in log.items():
        (mm, lhs, rhs), = entries  # one call per site, as every tap is one input
        dgrad, wgrad, g_site = tap_grads[name]
        calls.append(SiteGradCall(name, mm, lhs, rhs, g_site, dgrad, wgrad, weights.get(name)))
    return calls


def _call_shapes(graphdef, state, x, names: Sequence[str]) -> dict[str, tuple]:
    out = jax.eval_shape(lambda s: record_site_calls(nnx.merge(graphdef, s, copy=True), x)[1], state)
    shapes = {}
    for call in out:
        if call.site in shapes:
            raise AssertionError(f"record_site_grads: site {call.site!r} is called more than once in one forward "
                                 "pass; another call site uses its wrapper")
        shapes[call.site] = (call.lhs.shape, call.rhs.shape, call.out.shape)
    if missing := [n for n in names if n not in shapes]:
        raise AssertionError(f"record_site_grads: sites {missing} are never called in the forward pass")
    return shapes


@functools.partial(jax.jit, static_argnums=0)
def _record(graphdef, state, x, g):
    return record_site_grads(nnx.merge(graphdef, state, copy=True), x, g)


@assertion
def assert_layer_sites_backward_exact(layer: nnx.Module, x: ArrayLike, recipe: Recipe | str, *,
                                      g: ArrayLike | None = None, label: str = "") -> None:
    """Every site's gradients in one backward pass of a fresh ``layer(x)`` equal the referee's, bitwise.

    One jitted program (:func:`record_site_grads`); ``g`` is the layer output's
    gradient (default :func:`qcheck.checks._probes.probe_grad`, whose small values
    part the gradient flavours). See :func:`judge_site_grad_calls`.
    """
    recipe = get_recipe(recipe)
    graphdef, state = nnx.split(layer)
    if g is None:
        g = probe_grad(7, tuple(jax.eval_shape(lambda: layer(x)).shape))
    calls = _record(graphdef, state, x, jax.device_put(np.asarray(g, np.float32)))
    judge_site_grad_calls(calls, recipe)


def judge_site_grad_calls(calls: Sequence[SiteGradCall], recipe: Recipe | str) -> None:
    """:func:`assert_layer_sites_backward_exact`'s judgement of calls already recorded (by
    :func:`record_site_grads` in some program): each call's DGRAD and WGRAD equal the gradient matmuls of its
    referee-quantized operands and ``g``.

    The operands and ``g`` are the layer's own, so nothing is refused: a
    mismatch is named, with the known bug it equals where it equals one
    (``g`` unquantized, in the other flavour, along the other gradient's axes;
    the operands unquantized).
    """
    __tracebackhide__ = True
    recipe = get_recipe(recipe)
    if not through_layer_applies(recipe):
        raise ValueError(f"recipe {recipe.name!r} rounds DGRAD stochastically from the site's own stream, "
                         "which a layer's backward pass does not expose; hold it on probes")
    lhs_fmt, rhs_fmt = grad_operand_formats(recipe)
    for call in calls:
        lhs, rhs, g = (np.asarray(a) for a in (call.lhs, call.rhs, call.g))
        mm = as_matmul(call.matmul)
        axes = mm.axes(lhs.ndim, rhs.ndim)
        q_lhs, q_rhs = backend_qdq(lhs, lhs_fmt, axes.lhs), backend_qdq(rhs, rhs_fmt, axes.rhs)
        dgrad, wgrad = expectations(recipe, axes, g, None, None)
        (a, b), other, (other_a, other_b) = grad_operands(recipe, lhs, rhs, q_lhs, q_rhs)
        want = mm.grad_matmuls(a, b, dgrad.g, wgrad.g)
        got = (np.asarray(call.dgrad), np.asarray(call.wgrad))
        if call.weight_grad is not None and not bitwise_equal(w := np.asarray(call.weight_grad), got[1]):
            off = int(np.sum(bits(w) != bits(got[1]))) if w.shape == got[1].shape else w.size
            raise AssertionError(
                f"the layer's gradient of its parameter {call.site!r} is not the gradient its site "
                f"gave (they differ at {off} of {w.size} elements; the site's is {'all zeros' if not got[1].any() else 'nonzero'}): "
                "the layer takes that weight's gradient from elsewhere (a straight-through path around the site?)")
        for i, (which, exp) in enumerate((("dgrad", dgrad), ("wgrad", wgrad))):
            if bitwise_equal(got[i], want[i]) or any(
                    bitwise_equal(got[i], w) for w in other_form_grads(recipe, mm, lhs, rhs, (dgrad.g, wgrad.g), i)):
                continue
            bugs = dict(grad_bugs(mm, i, exp, (a, b), (dgrad.g, wgrad.g), other, (other_a, other_b)))
            assert_grad_equal(f"site {call.site!r} {mm.what} {which} in the layer's backward ({exp.what})",
                              got[i], want[i], bugs)
