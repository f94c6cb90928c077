"""What a call site actually feeds its matmul: traced, not recomputed from the recipe's declaration.

The golden cases record a site's quantized operands on one canonical einsum.
Asking :mod:`qcheck.formats` what the declared ``lhs``/``rhs`` formats would
give records the declaration, not the site: a plug-in whose site quantizes
otherwise (or declares nothing) would be pinned to the wrong codes. Here the
site runs on the operands under a small jaxpr interpreter that follows the
values through nested calls (jit, custom_jvp/custom_vjp) and keeps, for each
operand of the first matmul it reaches:

* the floating-point operand the matmul received, bit for bit;
* every narrow-typed value (8 bits or fewer: int8 codes, fp8 codes or block
  scales, e8m0 scales) the site computed on the way to it, in trace order.

The interpreter runs under one ``jax.jit``, so a case costs one small program.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx

from jax.extend.core import Jaxpr

from qcheck._coverage import BLOCK_SCALED, MATMUL_PRIMITIVES, call_body

# The coverage map's tables: the primitives whose operands count as "what the site fed its matmul" (a block-scaled
# one records each side's scales among the narrow values it was computed from), and the calls whose inner jaxpr
# takes the call's operands one for one, followed so a value computed inside a custom_vjp's forward is seen.
# Anything else (loops, conds, a call whose body is no jaxpr) is evaluated as a whole.


def _narrow(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind != "b" and dtype.itemsize <= 1


class _Found(Exception):
    def __init__(self, operands):
        self.operands = operands


def _inner(eqn) -> tuple[Jaxpr, list] | None:
    return call_body(eqn)


def _run(jaxpr: Jaxpr, consts, args, origins):
    """Evaluate ``jaxpr``; ``origins`` holds, per input, the narrow values it was computed from.

    Raises :class:`_Found` at the first matmul, carrying its operands and their origins.
    """
    env: dict[Any, tuple[Any, tuple]] = {}

    def read(v):
        return (v.val, ()) if hasattr(v, "val") and not hasattr(v, "count") else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = (c, ())
    for v, a, o in zip(jaxpr.invars, args, origins):
        env[v] = (a, o)
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        vals = [x for x, _ in ins]
        came_from = tuple(o for _, os in ins for o in os)
        if eqn.primitive.name in BLOCK_SCALED:
            raise _Found([(x, o + os + (sc,)) for (x, o), (sc, os) in zip(ins[:2], ins[2:4])])
        if eqn.primitive.name in MATMUL_PRIMITIVES:
            raise _Found(ins[:2])
        inner = _inner(eqn)
        if inner is not None:
            outs = _run(*inner, vals, [o for _, o in ins])
        else:
            out = eqn.primitive.bind(*vals, **eqn.params)
            outs = out if eqn.primitive.multiple_results else [out]
            outs = [(x, came_from) for x in outs]
            if eqn.primitive.name == "convert_element_type" and _narrow(eqn.outvars[0].aval.dtype):
                outs = [(outs[0][0], came_from + (outs[0][0],))]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _dedupe(values: tuple) -> list:
    seen, out = set(), []
    for x in values:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _capture(graphdef, eqn: str, state, lhs, rhs):
    # One program per kind of site and shape, cached on the graph definition as the steps are.
    fn = lambda st, a, b: nnx.merge(graphdef, st, copy=True)(eqn, a, b)  # noqa: E731
    closed = jax.make_jaxpr(fn)(state, lhs, rhs)
    flat = jax.tree.leaves((state, lhs, rhs))
    try:
        _run(closed.jaxpr, closed.consts, flat, [()] * len(flat))
    except _Found as found:
        return [(x, _dedupe(o)) for x, o in found.operands]
    return None


def site_operands(site: nnx.Module, eqn: str, lhs, rhs) -> dict[str, np.ndarray]:
    """``{"lhs": ..., "rhs": ..., "lhs.<dtype>": ..., ...}``: what ``site(eqn, lhs, rhs)`` fed its matmul.

    ``lhs``/``rhs``: the operands the matmul received. ``<side>.<dtype>`` (with
    ``.<i>`` from the second value of a dtype on): the narrow values they were
    computed from, in trace order. The site is not changed (its state is
    copied in). A site that reaches no matmul is a ValueError.
    """
    graphdef, state = nnx.split(site)
    got = _capture(graphdef, eqn, state, lhs, rhs)
    if got is None:
        raise ValueError(f"site_operands: {type(site).__name__}({eqn!r}) reached no matmul "
                         f"(looked for {', '.join(sorted(MATMUL_PRIMITIVES))})")
    out: dict[str, np.ndarray] = {}
    for side, (operand, narrow) in zip(("lhs", "rhs"), got):
        out[side] = np.asarray(operand)
        counts: dict[str, int] = {}
        for x in narrow:
            name = np.dtype(x.dtype).name
            n = counts[name] = counts.get(name, -1) + 1
            out[f"{side}.{name}" + (f".{n}" if n else "")] = np.asarray(x)
    return out
