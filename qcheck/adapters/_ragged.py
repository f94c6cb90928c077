"""A grouped matmul built from any two-operand einsum, for libraries that only quantize einsums."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Einsum = Callable[[str, jax.Array, jax.Array], jax.Array]


def ragged_dot_from_einsum(
    einsum: Einsum, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs[m, k], rhs[g, k, n], group_sizes)`` computed with ``einsum``.

    Every row is multiplied against every group in one einsum call, so the
    library quantizes the whole weight (its amax covers all experts, as it
    would on the dense path), then each row keeps its own group's product.
    Rows past ``sum(group_sizes)`` come out zero, as ragged_dot's do. Costs
    ``g`` times the FLOPs of ragged_dot: meant for the tiny layers of qcheck.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            "ragged_dot_from_einsum expects lhs [m, k], rhs [g, k, n], group_sizes [g]; got shapes "
            f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}"
        )
    m, g = lhs.shape[0], rhs.shape[0]
    ends = jnp.cumsum(group_sizes)
    # The group of each row; g (one past the last) for rows past the end.
    row_group = jnp.searchsorted(ends, jnp.arange(m, dtype=ends.dtype), side="right")
    every = einsum("mk,gkn->mgn", lhs, rhs)
    own = jnp.take_along_axis(every, jnp.minimum(row_group, g - 1)[:, None, None], axis=1)[:, 0]
    # where, not a one-hot product: 0 * inf would put NaN in rows that should be 0.
    return jnp.where((row_group < g)[:, None], own, jnp.zeros_like(own))
