"""One compiled program per case for the per-site checks, read by both ``exact`` and ``backward``.

The suite is compile-bound, and the per-site checks were its largest share of
programs: a forward program per site for ``exact``'s probes, a ``jax.vjp``
program per site for ``backward``'s, and a recorded forward pass of the layer.
Here one jitted program runs them all for a layer — every site on its forward
probes, every site's vjp on its backward probes, the layer's forward pass
with each site's operands recorded (:func:`qcheck.checks._site.record_site_calls`),
and one backward pass of the layer with each site's gradients recorded
(:func:`qcheck.checks._layer_backward.record_site_grads`)
— and the checks read its results. Each site runs exactly as it does alone
(the same merge of its fresh state, the same call), so the references stay
what they were: numpy referees and plain JAX matmuls of their quantized
operands, computed apart from this program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qcheck import checks
from qcheck.checks import _backward
from qcheck.checks import _layer_backward
from qcheck.checks import _site as _site_exact
from qcheck.layers.moe import MoE
from qcheck.recipes import Recipe, einsum_axes
from qcheck.recipes._axes import RAGGED_AXES
from qcheck.suite.cases import BATCH, SEQ

__all__ = ["Probe", "SiteRuns", "backward_probes", "exact_probes", "probe_group_sizes", "run_sites"]


def probe_group_sizes(rows: int, groups: int, seed: int) -> np.ndarray:
    """Uneven group sizes summing to ``rows``, with the last group empty."""
    rng = np.random.default_rng(seed)
    return np.bincount(rng.integers(0, groups - 1, rows), minlength=groups).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Probe:
    """The operands one site is run on: einsum ``eqn`` (None: ragged_dot with ``group_sizes``), and ``g`` for a vjp."""

    site: str
    eqn: str | None
    lhs: np.ndarray
    rhs: np.ndarray
    group_sizes: np.ndarray | None
    g: np.ndarray | None = None

    def arrays(self) -> tuple:
        return self.lhs, self.rhs, self.group_sizes, self.g


@dataclasses.dataclass(frozen=True)
class SiteRuns:
    """What the program computed: each site's output on its forward probe, its (dgrad, wgrad), the recorded calls
    of the layer's forward pass and of its backward pass."""

    forward: dict[str, np.ndarray]
    grads: dict[str, tuple[np.ndarray, np.ndarray]]
    calls: list[_site_exact.SiteCall] | None
    key: jax.Array
    grad_calls: list[_layer_backward.SiteGradCall] | None = None


def _axes(spec):
    if spec.eqn is None:
        return RAGGED_AXES
    return einsum_axes(spec.eqn, len(spec.lhs_shape), len(spec.rhs_shape))


def exact_probes(layer: MoE, recipe: Recipe) -> list[Probe]:
    """Each site's probe for ``exact``: operands that tell the reference from every neighbouring bug."""
    lhs_fmt, rhs_fmt = _site_exact.operand_formats(recipe)
    out = []
    for i, (name, spec) in enumerate(layer.site_specs(BATCH, SEQ).items()):
        lhs, rhs = _site_exact.probe_site_operands(i, spec.lhs_shape, spec.rhs_shape, _axes(spec),
                                                   lhs_format=lhs_fmt, rhs_format=rhs_fmt,
                                                   spread="mxfp8_jax" in (lhs_fmt, rhs_fmt))
        sizes = None if spec.eqn is not None else probe_group_sizes(lhs.shape[0], rhs.shape[0], i)
        out.append(Probe(name, spec.eqn, lhs, rhs, sizes))
    return out


def backward_probes(layer: MoE, recipe: Recipe) -> list[Probe]:
    """Each site's probe for ``backward``: operands and an output gradient on which every known bug shows."""
    out = []
    for i, (name, spec) in enumerate(layer.site_specs(BATCH, SEQ).items()):
        axes = _axes(spec)
        if spec.eqn is not None:
            shape = jax.eval_shape(functools.partial(jnp.einsum, spec.eqn),
                                   *(jax.ShapeDtypeStruct(s, np.float32) for s in (spec.lhs_shape, spec.rhs_shape)))
            out_shape = tuple(shape.shape)
        else:
            out_shape = (spec.lhs_shape[0], spec.rhs_shape[-1])
        if recipe.grad == "nvfp4":  # probes on which NVFP4 decodes exactly in any order XLA picks
            lhs = _backward.probe_nvfp4(i, spec.lhs_shape, axes.lhs)
            rhs = _backward.probe_nvfp4(i + 100, spec.rhs_shape, axes.rhs)
            g = _backward.probe_nvfp4(i + 200, out_shape, axes.dgrad, axes.wgrad)
        else:
            lhs, rhs = checks.probe_operands(i, spec.lhs_shape, spec.rhs_shape)
            g = _backward.probe_grad(i, out_shape)
        sizes = None if spec.eqn is not None else probe_group_sizes(lhs.shape[0], rhs.shape[0], i)
        out.append(Probe(name, spec.eqn, lhs, rhs, sizes, g))
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _program(graphdef, forward: tuple, backward: tuple, capture: bool, state, x, fwd_in, bwd_in, key, layer_g):
    def fresh():  # every part sees the fresh layer, as each did in a program of its own
        return nnx.merge(graphdef, state, copy=True)

    outs = {}
    for name, eqn in forward:
        lhs, rhs, sizes, _ = fwd_in[name]
        site = fresh().sites[name]
        outs[name] = site(eqn, lhs, rhs) if eqn is not None else site.ragged_dot(lhs, rhs, sizes)
    grads = {name: _backward.site_grads(fresh().sites[name], eqn, *bwd_in[name][:3], bwd_in[name][3], key)
             for name, eqn in backward}
    calls = _site_exact.record_site_calls(fresh(), x)[1] if capture else None
    grad_calls = None if layer_g is None else _layer_backward.record_site_grads(fresh(), x, layer_g)
    return outs, grads, calls, grad_calls


def run_sites(layer: MoE, *, forward: list[Probe] = (), backward: list[Probe] = (), x: jax.Array | None = None,
              capture: bool | None = None, layer_g: np.ndarray | None = None, key: jax.Array | None = None) -> SiteRuns:
    """Run ``layer``'s sites on their probes in one jitted program.

    Given ``x``: also the layer's forward pass with each site call recorded
    (unless ``capture`` is False), and with ``layer_g`` one backward pass of it
    with each site's gradients recorded (:func:`qcheck.checks._layer_backward.record_site_grads`).
    """
    key = jax.random.key(0) if key is None else key
    capture = x is not None if capture is None else capture
    graphdef, state = nnx.split(layer)
    outs, grads, calls, grad_calls = _program(
        graphdef, tuple((p.site, p.eqn) for p in forward), tuple((p.site, p.eqn) for p in backward),
        capture, state, x, {p.site: p.arrays() for p in forward}, {p.site: p.arrays() for p in backward}, key,
        None if layer_g is None else jax.device_put(layer_g))
    return SiteRuns({k: np.asarray(v) for k, v in outs.items()},
                    {k: (np.asarray(d), np.asarray(w)) for k, (d, w) in grads.items()}, calls, key, grad_calls)


def replay(result, probe: Probe, *arrays: np.ndarray):
    """A stand-in for the site that returns what the program computed, after checking it is asked the same operands."""

    def call(*args):
        given = [np.asarray(a) for a in [a for a in args if not isinstance(a, str)][: len(arrays)]]
        if len(given) != len(arrays) or not all(
                g.shape == a.shape and np.array_equal(np.ascontiguousarray(g).view(np.uint8),
                                                      np.ascontiguousarray(a).view(np.uint8))
                for g, a in zip(given, arrays)):
            raise RuntimeError(f"site {probe.site!r} was asked other operands than the program ran it on")
        return result

    return call
