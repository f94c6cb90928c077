"""Which axes of a matmul's operands and output gradient are contracted."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MatmulAxes:
    """Contraction axes of a two-operand matmul, forward and backward.

    ``lhs``/``rhs``: the operands' contracted axes. ``dgrad``/``wgrad``: the
    axes of the output gradient contracted to form the lhs and rhs gradients.
    """

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    dgrad: tuple[int, ...]
    wgrad: tuple[int, ...]


#: ragged_dot(lhs[m, k], rhs[g, k, n]) -> [m, n].
RAGGED_AXES = MatmulAxes(lhs=(1,), rhs=(1,), dgrad=(1,), wgrad=(0,))


def einsum_axes(eqn: str, lhs_ndim: int, rhs_ndim: int) -> MatmulAxes:
    """The :class:`MatmulAxes` of an explicit two-operand einsum ``eqn``."""
    if "->" not in eqn or "..." in eqn:
        raise ValueError(f"einsum equation must be explicit ('ab,bc->ac') without '...', got {eqn!r}")
    inputs, out = eqn.replace(" ", "").split("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        raise ValueError(f"einsum equation must have two operands, got {eqn!r}")
    lhs, rhs = parts
    if (len(lhs), len(rhs)) != (lhs_ndim, rhs_ndim):
        raise ValueError(
            f"einsum {eqn!r} expects operands of rank {len(lhs)} and {len(rhs)}, "
            f"got rank {lhs_ndim} and {rhs_ndim}"
        )
    contracted = [c for c in lhs if c in rhs and c not in out]
    return MatmulAxes(
        lhs=tuple(lhs.index(c) for c in contracted),
        rhs=tuple(rhs.index(c) for c in contracted),
        dgrad=tuple(i for i, c in enumerate(out) if c in rhs and c not in lhs),
        wgrad=tuple(i for i, c in enumerate(out) if c in lhs and c not in rhs),
    )
