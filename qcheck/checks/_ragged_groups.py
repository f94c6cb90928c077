"""Expert isolation of a grouped matmul: one expert's weights must not move another expert's rows.

Per-expert quantization gives every group of ``ragged_dot`` its own weight
scale. A library that calibrates the weight over the expert axis too shares one
scale across experts, so a single expert with large weights coarsens every
other expert's grid (AQT v2's and qwix's ragged_dot do, see docs/libraries.md).
The dense path usually keeps per-expert scales, so the two paths of one model
then quantize differently and only the sparse one, which accelerators take, is
affected.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.typing import ArrayLike

from qcheck.checks._assertion import assertion
from qcheck.checks._figures import Figures

@assertion
def assert_ragged_groups_independent(
    ragged_dot: Callable[[ArrayLike, ArrayLike, ArrayLike], ArrayLike],
    lhs: ArrayLike,
    rhs: ArrayLike,
    group_sizes: ArrayLike,
    *,
    group: int = 0,
    factor: float = 1000.0,
    label: str = "",
) -> Figures:
    """Assert that scaling group ``group``'s weights leaves every other group's rows bitwise unchanged.

    ``ragged_dot(lhs[m, k], rhs[g, k, n], group_sizes[g])`` is called twice, the
    second time with ``rhs[group] * factor``. Rows of the other groups see the
    same operands both times, so with per-group scales their results are
    bitwise equal; a scale shared across groups rescales their grid and moves
    them. A per-tensor recipe (one scale for the whole weight, such as
    qcheck's ``fp8_current``) fails it by design. Returns the number of rows compared
    (:class:`~qcheck.checks.Figures`: ``rows``). Group sizes that leave
    ``group`` or every other group empty are refused (the check could not fail).
    """
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    sizes = np.asarray(group_sizes)
    if lhs.ndim != 2 or rhs.ndim != 3 or sizes.shape != rhs.shape[:1]:
        raise ValueError(f"expects lhs [m, k], rhs [g, k, n], group_sizes [g]; got shapes "
                         f"{lhs.shape}, {rhs.shape}, {sizes.shape}")
    if not 0 <= group < rhs.shape[0]:
        raise ValueError(f"group must lie in [0, {rhs.shape[0]}), got {group}")
    if factor == 1.0 or not np.isfinite(factor):
        raise ValueError(f"factor must be finite and not 1, got {factor}")
    ends = np.cumsum(sizes)
    starts = ends - sizes
    if ends[-1] > lhs.shape[0]:
        raise ValueError(f"group_sizes sum to {ends[-1]}, more than lhs's {lhs.shape[0]} rows")
    own = np.zeros(lhs.shape[0], bool)
    own[starts[group]:ends[group]] = True
    others = np.zeros(lhs.shape[0], bool)
    others[:ends[-1]] = ~own[:ends[-1]]
    if not own.any() or not others.any():
        raise ValueError(f"group_sizes {sizes.tolist()} leave group {group} or every other group "
                         "empty, so the check could not fail")
    scaled = rhs.copy()
    scaled[group] *= np.asarray(factor, rhs.dtype)
    gs = jax.device_put(sizes.astype(np.int32))

    def run(w: np.ndarray) -> np.ndarray:
        return np.asarray(ragged_dot(jax.device_put(lhs), jax.device_put(w), gs))

    base, moved = run(rhs), run(scaled)
    a, b = base[others], moved[others]
    changed = np.any(a.view(np.uint8).reshape(len(a), -1) != b.view(np.uint8).reshape(len(b), -1), axis=1)
    if changed.any():
        worst = float(np.max(np.abs(a.astype(np.float64) - b)))
        raise AssertionError(
            f"scaling group {group}'s weights by {factor:g} changed {int(changed.sum())} of "
            f"{len(a)} rows of other groups ({base.dtype}), by up to {worst:.3g}: one weight scale shared "
            "across groups (experts)")
    return Figures(len(a), rows=int(len(a)))
