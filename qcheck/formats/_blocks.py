"""The contraction axes a format quantizes along, and the blocks a block format cuts them into."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import Array


def normalize_axis(axis: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """``axis`` as sorted, distinct, non-negative axes of an array of rank ``ndim``."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for an array of rank {ndim}")
        out.append(a % ndim)
    return tuple(sorted(set(out)))


def to_blocks(x: Array, axes: tuple[int, ...], block: int, fmt: str) -> tuple[Array, Callable[[Array], Array]]:
    """Move ``axes`` last and flatten them into blocks: ``[..., n_blocks, block]``, plus the inverse."""
    rest = [a for a in range(x.ndim) if a not in axes]
    moved = jnp.transpose(x, (*rest, *axes))
    lead = moved.shape[: len(rest)]
    k = math.prod(moved.shape[len(rest):])
    if k % block:
        where = (f"axis {axes[0]} has {k} elements" if len(axes) == 1 else
                 f"axes {axes} have {' x '.join(str(x.shape[a]) for a in axes)} = {k} elements")
        raise ValueError(
            f"{fmt} needs whole blocks of {block} along the contraction axis, but {where}, "
            f"which is not a multiple of {block}"
        )
    blocks = moved.reshape(*lead, k // block, block)

    def restore(y: Array) -> Array:
        return jnp.transpose(y.reshape(moved.shape), np.argsort((*rest, *axes)))

    return blocks, restore
