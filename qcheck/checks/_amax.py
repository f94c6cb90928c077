"""Delayed-scaling fp8 state must record each operand's own amax, not the other operand's.

Flax-style fp8 einsums keep ``input_amax_history`` (the lhs) and
``kernel_amax_history`` (the rhs) and bind them positionally inside the
einsum's dot_general. ``jnp.einsum`` may call its dot_general with the
operands swapped (it does for ``BSEH,EHM->BSEM``), and a module that does not
notice files the weight's amax as the activation's: from the second step on,
each operand is scaled by the other's range. The forward pass of a fresh layer
is unaffected, so only a check after a backward pass sees it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from qcheck.checks._assertion import assertion
from qcheck.checks._figures import Figures
from qcheck.layers.bridge import Fp8Meta

_SIDES = {"input_amax_history": "lhs", "kernel_amax_history": "rhs"}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _grad_meta(graphdef, eqn: str, meta, rest, lhs, rhs):
    # Fp8 state is returned through its gradient (Flax's OVERWRITE_WITH_GRADIENT).
    return jax.grad(lambda m: jnp.sum(nnx.merge(graphdef, m, rest, copy=True)(eqn, lhs, rhs)))(meta)


@assertion
def assert_amax_histories_follow_operands(
    site: nnx.Module, eqn: str, lhs: ArrayLike, rhs: ArrayLike, *, label: str = ""
) -> Figures:
    """Assert that one backward pass of ``site(eqn, lhs, rhs)`` records max|lhs| and max|rhs| where they belong.

    ``site`` is an NNX module holding fp8 state (:class:`qcheck.layers.bridge.Fp8Meta`
    variables named ``*input_amax_history`` and ``*kernel_amax_history``, newest
    entry first, as Flax keeps them). Amax is a max of absolute values, so the
    comparison is exact. Operands with equal amax are refused (a swap could not
    show). Returns the newest entries by variable path (:class:`~qcheck.checks.Figures`, whose
    value is the largest of them).
    """
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    want = {"lhs": float(np.max(np.abs(lhs))), "rhs": float(np.max(np.abs(rhs)))}
    if want["lhs"] == want["rhs"]:
        raise ValueError(f"lhs and rhs both have amax {want['lhs']}, so a swap could not show; "
                         "give operands of different ranges")
    graphdef, meta, rest = nnx.split(site, Fp8Meta, ...)
    new = _grad_meta(graphdef, eqn, meta, rest, jax.device_put(lhs), jax.device_put(rhs))
    got: dict[str, tuple[str, float]] = {}
    for path, v in nnx.to_flat_state(new):
        name = str(path[-1])
        if name in _SIDES:
            got[".".join(map(str, path))] = (_SIDES[name], float(np.asarray(v.get_value()).reshape(-1)[0]))
    if {side for side, _ in got.values()} != set(_SIDES.values()):
        raise ValueError(f"the site has no fp8 amax histories named {' and '.join(_SIDES)} "
                         f"(found {sorted(got) or 'none'})")
    for path, (side, value) in got.items():
        if value != want[side]:
            other = "rhs" if side == "lhs" else "lhs"
            why = (f"the {other}'s amax: fp8 state filed under the other operand" if value == want[other]
                   else "neither operand's amax")
            raise AssertionError(
                f"{eqn!r}: after one backward pass {path} holds {value:g} ({lhs.dtype} "
                f"operands), the {side} amax is {want[side]:g}; that is {why}")
    newest = {path: value for path, (_, value) in got.items()}
    return Figures(max(newest.values()), newest)
