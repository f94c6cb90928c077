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
``v * stop_gradient(2 s v)`` and seeded with ones gives the cotangent ``2 s v``
of the step's loss, ``s`` times the sum of squares. It is one more program, compiled only where
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
from qcheck.checks._layer_programs import LOSS_SCALE

#: A site is named as flushing where at least this fraction of its nonzero gradients became zero codes.
FLUSHED = 0.25


def _cotangent(out: Any, output: Any) -> list[jax.Array]:
    leaves = [v.astype(jnp.float32) for _, v in select_output(out, output)]
    return [v * jax.lax.stop_gradient(2 * LOSS_SCALE * v) for v in leaves]


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
    found: dict[str, dict[str, Any]] = {}  # by code type: what flushed, over every quantizer of that type
    for q, (x_q, codes, divisor) in enumerate(quantizers):
        codes = np.asarray(codes)
        if not codes.dtype.name.startswith(("float8", "float4")):  # a narrow float's codes: what can flush
            continue
        x_q = np.asarray(x_q, np.float32)
        scale = np.float32(1) if divisor is None else np.asarray(divisor, np.float32)
        scaled = x_q * scale if divisor is not None and walk.walker.multiplied[q] else x_q / scale
        tiny = float(ml_dtypes.finfo(codes.dtype).smallest_subnormal)
        nonzero = x_q != 0
        # Flushed: a zero code of a nonzero input that, scaled, is below the format's smallest subnormal (a zero
        # code of a larger one is no flush).
        zero = int(np.count_nonzero(nonzero & (codes.astype(np.float32) == 0) & (np.abs(scaled) < tiny)))
        n = int(np.count_nonzero(nonzero))
        if not n or zero < FLUSHED * n:
            continue
        # The site as check_layer's other lines name it (a call= probe's wrapper is named _Called).
        r = sites.get(q)
        at = found.setdefault(codes.dtype.name, {"zero": 0, "n": 0, "sites": [], "scales": set(), "amax": 0.0,
                                                 "tiny": tiny})
        at["zero"] += zero
        at["n"] += n
        at["sites"].append((r.scope or r.location).removeprefix("_Called/") if r is not None else None)
        at["scales"].update(np.unique(np.ravel(scale)).tolist())
        at["amax"] = max(at["amax"], float(np.max(np.abs(x_q))))
    lines = []
    for dtype, at in found.items():
        named = [s for s in at["sites"] if s is not None]
        where = (", ".join(named[:3]) + (f" and {len(at['sites']) - 3} more" if len(at["sites"]) > 3 else "")
                 if named else f"{len(at['sites'])} gradient cast(s)")
        low, high = min(at["scales"]), max(at["scales"])
        scale = f"{low:g}" if low == high else f"{low:g} to {high:g}"
        # The way out where it is a delayed scale not yet moved; otherwise the cast itself is the question.
        way = ("a fresh delayed scale of 1 does this; warm the scale with a training step before checking "
               "(qcheck.train(layer, x)), or scale the loss up" if scale == "1" else
               f"the gradients are not scaled into {dtype}'s range before this cast")
        lines.append(
            f"flushed: {at['zero']} of {at['n']} nonzero gradient values ({at['zero'] / at['n']:.1%}) at {where} "
            f"became 0 codes of {dtype} at scale {scale} (their largest magnitude {at['amax']:.3g}; {dtype}'s "
            f"smallest subnormal {at['tiny']:.3g} times the scale): {way}")
    return lines
