"""Whether a layer's gradients failed because its own gradient casts flushed them to zero.

A delayed-scaling fp8 layer casts each site's output gradient to e5m2 at a
scale its amax history sets; a fresh layer's history is empty and its scale 1,
so gradients below e5m2's smallest subnormal (2^-16) become 0 and the weights'
gradients vanish. That is what the layer computes at its first step, and a
failed gradient bound is the right verdict; the failure then says why: the
fraction of zero gradient codes, their format and scale, and the way out.

The evidence is the layer's own backward pass, walked with values
(coverage's walk with the gradient role declared), under the same output
cotangent as check_layer's step: the output ``v`` replaced by
``v * stop_gradient(2 v)`` and seeded with ones gives the cotangent ``2 v``
of the step's sum of squares. It is one more program, compiled only where
gradients already failed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from qcheck._coverage import as_declaration, prepare
from qcheck.checks._layer_forms import select_output

#: A site is named as flushing where at least this fraction of its nonzero gradients became zero codes.
FLUSHED = 0.25


def _cotangent(out: Any, output: Any) -> list[jax.Array]:
    leaves = [v.astype(jnp.float32) for _, v in select_output(out, output)]
    return [v * jax.lax.stop_gradient(2 * v) for v in leaves]


class _Probe(nnx.Module):
    """An NNX probe with the step's cotangent: the module under its class's name, as check_layer's own scopes."""

    def __init__(self, module: nnx.Module, output: Any):
        self.called = type(module).__name__
        self.output = output
        setattr(self, self.called, module)

    def __call__(self, x: jax.Array) -> list[jax.Array]:
        return _cotangent(getattr(self, self.called)(x), self.output)


def _probe(probe: Any, output: Any) -> Any:
    if isinstance(probe, nnx.Module):
        return _Probe(probe, output)
    return lambda x: _cotangent(probe(x), output)


def flushed_gradients(probe: Any, x: jax.Array, output: Any, machinery: tuple[str, ...], kernels: Any
                      ) -> list[str]:
    """Each backward site whose gradient codes are mostly 0 where their input is not, as a failure line."""
    walk = prepare(_probe(probe, output), (x,), {}, errors=False, backward=True, machinery=machinery,
                   declaration=as_declaration({"grads": "e5m2"}),  # any: its quantizers are read, not judged
                   entry="check_layer", what="layer", kernels=kernels, warm=False)
    _, quantizers = jax.jit(walk.evaluate)(walk.leaves)
    sites = {q: walk.walker.records[i] for i, _, q, _ in walk.walker.operands}
    lines = []
    for q, (x_q, codes, divisor) in enumerate(quantizers):
        codes = np.asarray(codes)
        if not codes.dtype.name.startswith(("float8", "float4")):  # a narrow float's codes: what can flush
            continue
        nonzero = np.asarray(x_q) != 0
        zero = nonzero & (codes.astype(np.float32) == 0)
        n = int(np.count_nonzero(nonzero))
        if not n or int(np.count_nonzero(zero)) < FLUSHED * n:
            continue
        scale = "none" if divisor is None else f"{float(np.max(np.asarray(divisor))):g}"
        tiny = float(ml_dtypes.finfo(codes.dtype).smallest_subnormal)
        amax = float(np.max(np.abs(np.asarray(x_q, np.float32))))
        r = sites.get(q)
        # The site as check_layer's other lines name it (a call= probe's wrapper is named _Called).
        where = (r.scope or r.location).removeprefix("_Called/") if r is not None else f"quantizer {q}"
        lines.append(
            f"flushed: {np.count_nonzero(zero)} of {n} nonzero output gradients ({np.count_nonzero(zero) / n:.1%}) "
            f"at {where} became 0 codes of {codes.dtype.name} at scale {scale} (their largest magnitude "
            f"{amax:.3g}; {codes.dtype.name}'s smallest subnormal {tiny:.3g} times the scale): a fresh delayed scale "
            f"of 1 does this; warm the scale with a training step before checking (qcheck.train(layer, x)), or "
            f"scale the loss up")
    return lines
