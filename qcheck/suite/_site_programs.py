"""One compiled program per case for the per-site checks, read by both ``exact`` and ``backward``.

The suite is compile-bound, and the per-site checks were its largest share of
programs: a forward program per site for ``exact``'s probes, a ``jax.vjp``
program per site for ``backward``'s, and a recorded forward pass of the layer.
Here one jitted program runs them all for a layer — every site on its forward
probes, every site's vjp on its backward probes, the layer's forward pass
with each site's operands recorded (:func:`qcheck.checks.harness.record_site_calls`),
and one backward pass of the layer with each site's gradients recorded
(:func:`qcheck.checks.harness.record_site_grads`)
— and the checks judge its results (each check's judgement of computed
values, under the check's name). Each site runs exactly as it does alone
(the same merge of its fresh state, the same call), so the references stay
what they were: numpy referees and plain JAX matmuls of their quantized
operands, computed apart from this program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from qcheck import checks, formats
from qcheck.checks import harness
from qcheck.layers.moe import MoE
from qcheck.recipes import Matmul, Recipe
from qcheck.suite.cases import BATCH, SEQ

@dataclasses.dataclass(frozen=True)
class Probe:
    """The operands one site is run on: its matmul (a ragged_dot with the probe's group sizes), and ``g`` for a vjp."""

    site: str
    matmul: Matmul
    lhs: np.ndarray
    rhs: np.ndarray
    g: np.ndarray | None = None

    def arrays(self) -> tuple:
        return self.matmul, self.lhs, self.rhs, self.g


@dataclasses.dataclass(frozen=True)
class SiteRuns:
    """What the program computed: each site's output on its forward probe, its (dgrad, wgrad), the recorded calls
    of the layer's forward pass and of its backward pass."""

    forward: dict[str, np.ndarray]
    grads: dict[str, tuple[np.ndarray, np.ndarray]]
    calls: list[harness.SiteCall] | None
    key: jax.Array
    grad_calls: list[harness.SiteGradCall] | None = None


def exact_probes(layer: MoE, recipe: Recipe) -> list[Probe]:
    """Each site's probe for ``exact``: operands that tell the reference from every neighbouring bug."""
    lhs_fmt, rhs_fmt = harness.operand_formats(recipe)
    out = []
    for i, (name, spec) in enumerate(layer.site_specs(BATCH, SEQ).items()):
        axes = spec.matmul.axes(len(spec.lhs_shape), len(spec.rhs_shape))
        lhs, rhs = harness.probe_site_operands(i, spec.lhs_shape, spec.rhs_shape, axes,
                                              lhs_format=lhs_fmt, rhs_format=rhs_fmt,
                                              spread=any(formats.get_format(f).probe_spread for f in (lhs_fmt, rhs_fmt)))
        out.append(Probe(name, spec.matmul.regrouped(i), lhs, rhs))
    return out


def backward_probes(layer: MoE, recipe: Recipe) -> list[Probe]:
    """Each site's probe for ``backward``: operands and an output gradient on which every known bug shows."""
    try:
        formats_in = harness.operand_formats(recipe)
    except ValueError:  # no declared operand formats: the probes' own magnitudes
        formats_in = None
    out = []
    for i, (name, spec) in enumerate(layer.site_specs(BATCH, SEQ).items()):
        axes = spec.matmul.axes(len(spec.lhs_shape), len(spec.rhs_shape))
        out_shape = spec.matmul.out_shape(spec.lhs_shape, spec.rhs_shape)
        # A gradient format XLA may decode in another order (nvfp4): probes that decode exactly in every order.
        if recipe.grad is not None and formats.get_format(recipe.grad).decode_ulps:
            lhs = harness.probe_nvfp4(i, spec.lhs_shape, axes.lhs)
            rhs = harness.probe_nvfp4(i + 100, spec.rhs_shape, axes.rhs)
            g = harness.probe_nvfp4(i + 200, out_shape, axes.dgrad, axes.wgrad)
        else:  # never subnormal in a cast operand format (e3m4 is subnormal below 2^-2)
            lhs, rhs = checks.probe_operands(i, spec.lhs_shape, spec.rhs_shape, normal_in=formats_in)
            g = checks.probe_grad(i, out_shape)
        out.append(Probe(name, spec.matmul.regrouped(i), lhs, rhs, g))
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _program(graphdef, forward: tuple, backward: tuple, capture: bool, state, x, fwd_in, bwd_in, key, layer_g):
    def fresh():  # every part sees the fresh layer, as each did in a program of its own
        return nnx.merge(graphdef, state, copy=True)

    outs = {}
    for name, (mm, lhs, rhs, _) in zip(forward, fwd_in):
        outs[name] = mm.run(fresh().sites[name], lhs, rhs)
    grads = {name: harness.site_grads(fresh().sites[name], mm, lhs, rhs, g, key)
             for name, (mm, lhs, rhs, g) in zip(backward, bwd_in)}
    calls = harness.record_site_calls(fresh(), x)[1] if capture else None
    grad_calls = None if layer_g is None else harness.record_site_grads(fresh(), x, layer_g)
    return outs, grads, calls, grad_calls


def run_sites(layer: MoE, *, forward: list[Probe] = (), backward: list[Probe] = (), x: jax.Array | None = None,
              capture: bool | None = None, layer_g: np.ndarray | None = None, key: jax.Array | None = None) -> SiteRuns:
    """Run ``layer``'s sites on their probes in one jitted program.

    Given ``x``: also the layer's forward pass with each site call recorded
    (unless ``capture`` is False), and with ``layer_g`` one backward pass of it
    with each site's gradients recorded (:func:`qcheck.checks.harness.record_site_grads`).
    """
    key = jax.random.key(0) if key is None else key
    capture = x is not None if capture is None else capture
    graphdef, state = nnx.split(layer)
    outs, grads, calls, grad_calls = _program(
        graphdef, tuple(p.site for p in forward), tuple(p.site for p in backward),
        capture, state, x, tuple(p.arrays() for p in forward), tuple(p.arrays() for p in backward), key,
        None if layer_g is None else jax.device_put(layer_g))
    return SiteRuns({k: np.asarray(v) for k, v in outs.items()},
                    {k: (np.asarray(d), np.asarray(w)) for k, (d, w) in grads.items()}, calls, key, grad_calls)
