"""The ``sharded`` invariant: a layer on the ("data", "expert") mesh computes what it computes on one device.

Comparing outputs alone is blind to a twin that never reached the mesh: a
layer built without its mesh, run on an input placed on it, is the
single-device layer again (bitwise, 0.0), so a bug that exists only on a mesh
goes unseen. The check therefore builds the twin itself, from a function of
the mesh, and first verifies that its expert weights really are split over
"expert" across every device of the mesh, naming the first weight that is not.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qcheck.checks.harness import assertion
from qcheck.layers import step
from qcheck.layers.moe import MoE

#: The sharded layer against the single-device one: float32 rounding, as dense == sparse.
SHARDED_RTOL, SHARDED_ATOL = 1e-5, 1e-6

#: The layer's weights with a leading expert axis, which a layer on a mesh splits over "expert"
#: (``per_expert_scale``: Gemma only). The router's ``gate`` is replicated by design.
EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo", "per_expert_scale")


def _describe(sharding) -> str:
    if isinstance(sharding, NamedSharding):
        shape = " x ".join(f"{n}={s}" for n, s in sharding.mesh.shape.items())
        return f"NamedSharding({sharding.spec}) on a mesh {shape}"
    return f"{type(sharding).__name__} on {len(sharding.device_set)} device(s)"


@assertion
def assert_layer_sharded(layer: MoE, mesh: Mesh, *, label: str = "") -> None:
    """Every expert weight of ``layer`` is split over ``mesh``'s "expert" axis, across all its devices.

    Read off the arrays themselves, not the layer's intent: each weight's
    sharding must be a ``NamedSharding`` on ``mesh``, held by all
    ``mesh.size`` devices, and its shards must cut the leading (expert) axis
    into ``mesh.shape["expert"]`` distinct blocks.
    """
    __tracebackhide__ = True
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    blocks = mesh.shape["expert"]
    names = [n for n in EXPERT_WEIGHTS if hasattr(layer, n)]
    if not names:
        raise AssertionError(f"the layer has none of the expert weights {EXPERT_WEIGHTS}")
    for name in names:
        w = getattr(layer, name)[...]
        sharding = getattr(w, "sharding", None)
        prefix = f"the sharded twin is not sharded: weight {name!r} ({w.dtype}{list(w.shape)})"
        if not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
            where = "a host array" if sharding is None else _describe(sharding)
            if isinstance(sharding, NamedSharding):
                where += " of other devices"
            raise AssertionError(f"{prefix} is {where}, not on the {blocks}-way 'expert' mesh of "
                                 f"{mesh.size} devices (built without its mesh?)")
        starts = {shard.index[0].start or 0 for shard in w.addressable_shards}
        devices = len(sharding.device_set)
        if len(starts) != blocks or devices != mesh.size:
            raise AssertionError(
                f"{prefix} is {_describe(sharding)}: its shards hold {len(starts)} distinct block(s) of its "
                f"{w.shape[0]} experts on {devices} devices, expected {blocks} blocks on {mesh.size}")


@assertion
def assert_sharded_matches(single: np.ndarray, sharded: np.ndarray, *, label: str = "") -> float:
    """The layer on the mesh computes what it computes on one device, to float32 rounding.

    The mesh splits tokens and experts, never a contraction, and the dense
    combine gathers the experts before summing them, so on jax 0.10.2 every case
    is bitwise equal. jax 0.12's XLA fuses Gemma's router differently inside the
    sharded program (a few ulps: up to 6e-7 on outputs of order 1), so the check
    allows float32 rounding and returns the largest difference. A sharding bug
    that changes the function (experts reassembled in the wrong order, a scale
    from one shard's amax) is orders of magnitude beyond it.
    """
    __tracebackhide__ = True
    if single.shape != sharded.shape or single.dtype != sharded.dtype:
        raise AssertionError(f"sharded output is {sharded.shape} {sharded.dtype}, "
                             f"single-device {single.shape} {single.dtype}")
    worst = float(np.max(np.abs(single.astype(np.float64) - sharded)))
    if not np.allclose(sharded, single, rtol=SHARDED_RTOL, atol=SHARDED_ATOL):
        differ = ~np.isclose(sharded, single, rtol=SHARDED_RTOL, atol=SHARDED_ATOL)
        raise AssertionError(
            f"the sharded layer differs from the single-device one at {int(differ.sum())} of "
            f"{differ.size} values, by up to {worst:.3g} (rtol {SHARDED_RTOL}, atol {SHARDED_ATOL})")
    return worst


@assertion
def assert_layer_sharded_matches(
    build_sharded: Callable[[Mesh], MoE], single: np.ndarray, x: jax.Array, *, mesh: Mesh, label: str = ""
) -> float:
    """``build_sharded(mesh)`` is really split over ``mesh`` and, on ``x`` split over "data", outputs ``single``.

    ``single`` is the same layer's single-device output on ``x``. Returns the
    largest difference (:func:`assert_sharded_matches`).
    """
    __tracebackhide__ = True
    if isinstance(build_sharded, MoE) or not callable(build_sharded):
        raise TypeError(f"build_sharded must be a function of the mesh returning the layer, "
                        f"got {type(build_sharded).__name__}")
    layer = build_sharded(mesh)
    assert_layer_sharded(layer, mesh, label=label)
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    return assert_sharded_matches(single, np.asarray(step.apply(layer, placed)[0]), label=label)
