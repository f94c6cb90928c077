"""The reference of a matmul that multiplies integer codes and scales the result: numpy only.

A library such as AQT (``DequantMode.OUTPUT``, ``dg_accumulator_dtype=int32``:
aqt/jax/v2/aqt_dot_general.py ``_qtensor_dot_general`` and
``QTensor.dequant``) does not multiply dequantized float32 operands. It runs
``dot_general`` on the int8 codes with an int32 accumulator, converts the sum
to float32, then multiplies it by the scale of the ``dot_general``'s lhs and
after that by the scale of its rhs, each transposed to the output. The float32
matmul of dequantized operands rounds elsewhere (1 ulp, relative 7.9e-8 on
qcheck's probes), so such a recipe declares ``matmul="integer"`` and its exact
reference is built here: the integer matmul in int64 (exact), the conversion,
then the two float32 products in the library's order.

Which einsum operand ``dot_general`` gets as its lhs is JAX's choice, not the
library's: ``jnp.einsum`` passes ``(rhs, lhs)`` when that order needs no
transpose of the result (jax/_src/numpy/einsum.py), and AQT's ``AqtEinsum``
swaps its config to follow. :func:`dot_general_lhs` reads that choice from
the traced einsum, which runs no library code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qcheck.referees._formats import flush

#: How a recipe's sites multiply quantized operands: "float" (the float32 matmul
#: of dequantized operands) or "integer" (codes in integer arithmetic, scales after).
MATMUL_MODES = ("float", "integer")
#: Which operand's scale multiplies the converted integer sum first.
SCALE_ORDERS = ("dot_general lhs first", "dot_general rhs first")

_F32 = np.float32


@functools.cache
def dot_general_lhs(eqn: str, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]) -> str:
    """``"lhs"`` or ``"rhs"``: the einsum operand ``jnp.einsum(eqn, lhs, rhs)`` passes to ``dot_general`` first."""
    a, b = (jax.ShapeDtypeStruct(s, np.float32) for s in (lhs_shape, rhs_shape))
    jaxpr = jax.make_jaxpr(lambda x, y: jnp.einsum(eqn, x, y))(a, b)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    if len(dots) != 1:
        raise ValueError(f"einsum {eqn!r} lowers to {len(dots)} dot_general calls, not one")
    first = dots[0].invars[0]
    x, y = jaxpr.jaxpr.invars
    if first is x:
        return "lhs"
    if first is y:
        return "rhs"
    raise ValueError(f"einsum {eqn!r}: dot_general's first operand is neither einsum operand (a transpose in between)")


def _scaled(acc: np.ndarray, first: np.ndarray, second: np.ndarray, ftz: bool) -> np.ndarray:
    # QTensor.dequant: qvalue.astype(float32), then `ret *= s` per scale, in list order.
    out = flush(acc.astype(_F32), ftz)
    out = flush((out * first).astype(_F32), ftz)
    return flush((out * second).astype(_F32), ftz)


def _to_output(sub: str, scale: np.ndarray, axes: tuple[int, ...], out: str) -> np.ndarray:
    """``scale`` (keepdims over the contraction ``axes`` of operand ``sub``) laid out to broadcast over ``out``."""
    s = np.squeeze(scale, axis=axes)
    kept = [c for i, c in enumerate(sub) if i not in axes]
    order = [c for c in out if c in kept]
    s = np.transpose(s, [kept.index(c) for c in order])
    return s.reshape([s.shape[order.index(c)] if c in kept else 1 for c in out])


def integer_einsum(
    eqn: str,
    lhs_codes: np.ndarray,
    lhs_scale: np.ndarray,
    rhs_codes: np.ndarray,
    rhs_scale: np.ndarray,
    axes,
    *,
    order: str = SCALE_ORDERS[0],
    ftz: bool = False,
) -> np.ndarray:
    """``einsum(eqn)`` of integer codes, exact, then float32 times each operand's scale in ``order``.

    ``lhs_scale``/``rhs_scale`` have the operand's rank with size 1 along its
    contraction axes (``axes``, a :class:`qcheck.recipes.MatmulAxes`).
    """
    ins, out = eqn.replace(" ", "").split("->")
    sa, sb = ins.split(",")
    acc = np.einsum(eqn, lhs_codes.astype(np.int64), rhs_codes.astype(np.int64))
    sl, sr = _to_output(sa, lhs_scale, axes.lhs, out), _to_output(sb, rhs_scale, axes.rhs, out)
    first = dot_general_lhs(eqn, lhs_codes.shape, rhs_codes.shape)
    if order == SCALE_ORDERS[1]:
        first = "rhs" if first == "lhs" else "lhs"
    return _scaled(acc, *((sl, sr) if first == "lhs" else (sr, sl)), ftz)


def integer_ragged_dot(
    lhs_codes: np.ndarray,
    lhs_scale: np.ndarray,
    rhs_codes: np.ndarray,
    rhs_scale: np.ndarray,
    group_sizes: np.ndarray,
    *,
    order: str = SCALE_ORDERS[0],
    ftz: bool = False,
) -> np.ndarray:
    """``ragged_dot(lhs[m, k], rhs[g, k, n], group_sizes)`` of integer codes, then the scales in ``order``.

    Every row against its own group's weights, as ``mk,gkn->mgn`` keeps it
    (``dot_general`` lhs: the rows); rows past ``sum(group_sizes)`` are 0.
    ``rhs_scale`` is ``[g, 1, n]`` (per group and column) or ``[1, 1, n]``.
    """
    m, n = lhs_codes.shape[0], rhs_codes.shape[2]
    group = np.repeat(np.arange(len(group_sizes)), np.asarray(group_sizes))
    rows = len(group)
    acc = np.zeros((m, n), np.int64)
    acc[:rows] = np.einsum("mk,mkn->mn", lhs_codes[:rows].astype(np.int64), rhs_codes[group].astype(np.int64))
    sr = np.ones((m, n), _F32)
    sr[:rows] = np.broadcast_to(rhs_scale, (rhs_codes.shape[0], 1, n))[group, 0, :]
    sl = np.broadcast_to(lhs_scale, (m, 1)).astype(_F32)
    out = _scaled(acc, *((sl, sr) if order == SCALE_ORDERS[0] else (sr, sl)), ftz)
    out[rows:] = 0
    return out
