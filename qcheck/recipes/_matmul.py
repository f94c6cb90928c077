"""One description of the matmul a call site computes: an einsum, or a grouped ``ragged_dot``.

A layer's site specs, the suite's probes, the calls recorded in a forward or
backward pass and every exact check (fresh fp8 casts, call sites forward and
backward) carry one value: :class:`Einsum` or :class:`Ragged` with the group
sizes. It knows what they need of the matmul: its contraction axes, how to run
it on a call site (``site(eqn, lhs, rhs)`` or ``site.ragged_dot(lhs, rhs,
group_sizes)``) and to call an op under test, and the reference matmul run by
JAX on host arrays (forward, in each layout the reference accepts, and the two
gradient matmuls), each program compiled once per shape, and the forward einsum
summed by numpy in each order of partial sums the reference accepts. Both are
pytrees: an einsum's equation is static, a ragged_dot's group sizes are data,
so a traced program records them as it runs and hands them back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from qcheck.recipes._axes import RAGGED_AXES, MatmulAxes, einsum_axes
from qcheck import referees

#: Operand layouts the einsum reference runs in: as given, contraction axes last (as a block qdq leaves
#: them), and (batch, rows, flattened contraction) as one batched dot (as jax.nn.scaled_dot_general runs it).
EINSUM_LAYOUTS = ("as given", "contraction last", "flattened")
#: Sum orders the einsum reference also runs in, by numpy: the (flattened) contraction summed into k
#: interleaved float32 partial sums (element i into sum i mod k, each in order), then those added in order.
#: XLA:CPU's dot may sum so, k and whether it does depending on the CPU, the layout and the threading, as
#: measured on an AVX-512 AMD EPYC (jax 0.12): jax_mxfp8's ``wo`` sums in 2, while jnp.einsum of the same
#: operands sums in order with one intra-op thread and in 2 with more.
EINSUM_PARTIAL_SUMS = tuple(f"{k} interleaved partial sums" for k in (1, 2, 4, 8, 16))
# numpy sums these one contraction index at a time: beyond this many multiply-adds (the wo site whose
# order needed them has 262,144) a failing check does not try the orders.
_PARTIAL_SUMS_MAX_WORK = 1 << 24


@functools.partial(jax.jit, static_argnums=0)
def _einsum(eqn: str, a, b):
    return jnp.einsum(eqn, a, b)


def _batched(xp, eqn: str, a, b, dot):
    """``dot`` of each operand as (batch, rows, contraction), the contraction axes flattened in axis order
    (as JAX's scaled_dot_general lays the einsum out), back in the output's own layout; ``xp``: jnp or np."""
    ins, out = eqn.replace(" ", "").split("->")
    sa, sb = ins.split(",")
    batch = [i for i in sa if i in sb and i in out]
    contract_a = [i for i in sa if i in sb and i not in out]
    contract_b = [i for i in sb if i in sa and i not in out]
    free_a, free_b = [i for i in sa if i not in sb], [i for i in sb if i not in sa]
    size = dict(zip(sa, a.shape)) | dict(zip(sb, b.shape))

    def to3(x, sub, free, contract):
        perm = [sub.index(i) for i in batch + free + contract]
        shape = [int(np.prod([size[i] for i in g])) for g in (batch, free, contract)]
        return xp.reshape(xp.transpose(x, perm), shape)

    y = dot(to3(a, sa, free_a, contract_a), to3(b, sb, free_b, contract_b))
    produced = batch + free_a + free_b
    y = xp.reshape(y, [size[i] for i in produced])
    return xp.transpose(y, [produced.index(i) for i in out])


@functools.partial(jax.jit, static_argnums=0)
def _flattened(eqn: str, a, b):
    return _batched(jnp, eqn, a, b, lambda x, y: jax.lax.dot_general(x, y, (((2,), (2,)), ((0,), (0,)))))


def _partial_sums(eqn: str, a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """The einsum in float32, its contraction summed into ``k`` interleaved partial sums (EINSUM_PARTIAL_SUMS).

    Each product is rounded to float32 before it is added (a fused multiply-add
    rounds once; the two agree wherever the products are exact, as those of
    fp8 and block-format values are).
    """
    def dot(x, y):  # (batch, rows, contraction) x (batch, cols, contraction) -> (batch, rows, cols)
        total = np.zeros((x.shape[0], x.shape[1], y.shape[1]), np.float32)
        for lane in range(k):  # each partial sum in order, then added to the total in order
            part = np.zeros_like(total)
            for i in range(lane, x.shape[2], k):
                part += x[:, :, None, i] * y[:, None, :, i]
            total = part if lane == 0 else total + part
        return total

    return np.ascontiguousarray(_batched(np, eqn, a.astype(np.float32), b.astype(np.float32), dot))


@functools.partial(jax.jit, static_argnums=0)
def _einsum_grad_matmuls(eqn: str, lhs, rhs, g_dgrad, g_wgrad):
    _, vjp = jax.vjp(functools.partial(jnp.einsum, eqn), lhs, rhs)
    return vjp(g_dgrad)[0], vjp(g_wgrad)[1]


@jax.jit
def _ragged_grad_matmuls(lhs, rhs, group_sizes, g_dgrad, g_wgrad):
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes), lhs, rhs)
    return vjp(g_dgrad)[0], vjp(g_wgrad)[1]


def _host(x: jax.Array) -> np.ndarray:
    return np.asarray(x)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["eqn"])
@dataclasses.dataclass(frozen=True)
class Einsum:
    """A two-operand einsum, e.g. ``Einsum("BSM,EMH->BSEH")``; the op under test is called ``op(eqn, lhs, rhs)``."""

    eqn: str

    def __post_init__(self) -> None:
        eqn = self.eqn
        if not isinstance(eqn, str):
            raise ValueError(f"matmul must be an einsum string such as 'ij,jk->ik', got {type(eqn).__name__}")
        ins, arrow, out = eqn.replace(" ", "").partition("->")
        subs = ins.split(",")
        if not arrow or len(subs) != 2 or not all(s.isalpha() for s in subs) or not (out.isalpha() or out == ""):
            raise ValueError(f"matmul must be a two-operand einsum with an explicit output such as 'ij,jk->ik', "
                             f"got {eqn!r}")

    @property
    def what(self) -> str:
        return f"einsum {self.eqn!r}"

    @property
    def subscripts(self) -> tuple[str, str, str]:
        """(lhs, rhs, output) subscripts."""
        ins, out = self.eqn.replace(" ", "").split("->")
        lhs, rhs = ins.split(",")
        return lhs, rhs, out

    #: Its weight has no groups to calibrate across.
    shared_rhs_axes = None

    def axes(self, lhs_ndim: int, rhs_ndim: int) -> MatmulAxes:
        return einsum_axes(self.eqn, lhs_ndim, rhs_ndim)

    def run(self, site: Any, lhs: jax.Array, rhs: jax.Array, **kwargs: Any) -> jax.Array:
        """``site(eqn, lhs, rhs, **kwargs)``: a call site's einsum, traced in the caller's program."""
        return site(self.eqn, lhs, rhs, **kwargs)

    def site_call(self, lhs: Any, rhs: Any) -> tuple[str, tuple]:
        """(the call site's method, its arguments) for operands ``lhs`` and ``rhs``."""
        return "__call__", (self.eqn, lhs, rhs)

    def regrouped(self, seed: int) -> Einsum:
        """The same matmul on a probe: an einsum has no groups to draw."""
        return self

    def integer(self, lhs_codes, lhs_scales, rhs_codes, rhs_scales, *, order: str, ftz: bool) -> np.ndarray:
        """The integer-mode reference (:func:`qcheck.referees.integer_einsum`) of codes and scales."""
        axes = self.axes(lhs_codes.ndim, rhs_codes.ndim)
        return referees.integer_einsum(self.eqn, lhs_codes, lhs_scales, rhs_codes, rhs_scales, axes, order=order,
                                       ftz=ftz)

    def check_operands(self, lhs: np.ndarray, rhs: np.ndarray) -> None:
        """A one-line ValueError where the operands do not fit the einsum (rank, or a shared axis's size)."""
        sa, sb, _ = self.subscripts
        for name, x, sub in (("lhs", lhs, sa), ("rhs", rhs, sb)):
            if x.ndim != len(sub):
                raise ValueError(f"{name} has shape {x.shape}, but einsum {self.eqn!r} gives it {len(sub)} axes")
        size = dict(zip(sa, lhs.shape))
        for i, n in zip(sb, rhs.shape):
            if size.setdefault(i, n) != n:
                raise ValueError(f"einsum {self.eqn!r}: axis {i!r} has size {size[i]} in lhs {lhs.shape} and {n} "
                                 f"in rhs {rhs.shape}")

    def out_shape(self, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]) -> tuple[int, ...]:
        sa, sb, out = self.subscripts
        size = dict(zip(sa, lhs_shape)) | dict(zip(sb, rhs_shape))
        return tuple(size[i] for i in out)

    def call(self, op: Callable[..., ArrayLike], lhs: ArrayLike, rhs: ArrayLike) -> np.ndarray:
        """The op under test on device copies of the operands, back on the host."""
        # device_put, not jnp.asarray: on jax 0.10 asarray of a host array compiles a
        # program per shape to stage it, and the checks run on a dozen shapes per layer.
        return np.asarray(op(self.eqn, jax.device_put(lhs), jax.device_put(rhs)))

    def reference(self, a: np.ndarray, b: np.ndarray, layout: str = EINSUM_LAYOUTS[0]) -> np.ndarray:
        """``jnp.einsum`` of host operands, in one of :data:`EINSUM_LAYOUTS`, or numpy's in one of
        :data:`EINSUM_PARTIAL_SUMS`."""
        if layout in EINSUM_PARTIAL_SUMS:
            return _partial_sums(self.eqn, a, b, int(layout.split()[0]))
        if layout == EINSUM_LAYOUTS[0]:
            # jnp.einsum itself (a jitted function): the program an eager einsum of the same shapes uses too.
            return _host(jnp.einsum(self.eqn, jax.device_put(a), jax.device_put(b)))
        if layout == EINSUM_LAYOUTS[2]:
            return _host(_flattened(self.eqn, jax.device_put(a), jax.device_put(b)))
        sa, sb, out = self.subscripts
        axes = self.axes(a.ndim, b.ndim)
        (sa, a), (sb, b) = (_contraction_last(s, x, ax) for s, x, ax in ((sa, a, axes.lhs), (sb, b, axes.rhs)))
        return _host(_einsum(f"{sa},{sb}->{out}", jax.device_put(a), jax.device_put(b)))

    def layouts(self, lhs_shape: tuple[int, ...] = (), rhs_shape: tuple[int, ...] = ()) -> tuple[str, ...]:
        """The layouts, and for a matmul of these shapes small enough the sum orders, the reference runs in."""
        if not lhs_shape or not rhs_shape:
            return EINSUM_LAYOUTS
        contraction = self.axes(len(lhs_shape), len(rhs_shape)).lhs
        work = int(np.prod(self.out_shape(lhs_shape, rhs_shape))) * int(np.prod([lhs_shape[i] for i in contraction]))
        return EINSUM_LAYOUTS + (EINSUM_PARTIAL_SUMS if work <= _PARTIAL_SUMS_MAX_WORK else ())

    def grad_matmuls(self, a: np.ndarray, b: np.ndarray, g_dgrad: np.ndarray, g_wgrad: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """(DGRAD of ``g_dgrad``, WGRAD of ``g_wgrad``): ``jax.vjp`` of ``jnp.einsum`` in float32."""
        d, w = _einsum_grad_matmuls(self.eqn, *map(jax.device_put, (a, b, g_dgrad, g_wgrad)))
        return _host(d), _host(w)


def _contraction_last(sub: str, x: np.ndarray, axes: tuple[int, ...]) -> tuple[str, np.ndarray]:
    perm = [i for i in range(x.ndim) if i not in axes] + list(axes)
    return "".join(sub[i] for i in perm), np.ascontiguousarray(np.transpose(x, perm))


def uneven_group_sizes(rows: int, groups: int, seed: int) -> np.ndarray:
    """Uneven group sizes summing to ``rows``, with the last group empty."""
    rng = np.random.default_rng(seed)
    return np.bincount(rng.integers(0, groups - 1, rows), minlength=groups).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Ragged:
    """A grouped matmul ``ragged_dot(lhs[m, k], rhs[g, k, n], group_sizes[g])``; the op under test is called
    ``op(lhs, rhs, group_sizes)``. ``group_sizes`` are non-negative integers, one per group of ``rhs``, and
    sum to ``lhs``'s rows."""

    group_sizes: Any

    def __post_init__(self) -> None:
        sizes = np.asarray(self.group_sizes)
        if sizes.ndim != 1 or sizes.size == 0 or not np.issubdtype(sizes.dtype, np.integer) or np.any(sizes < 0):
            raise ValueError(f"group_sizes must be a non-empty 1-D array of non-negative integers, got "
                             f"{sizes.dtype}{list(sizes.shape)} {sizes.tolist()}")
        object.__setattr__(self, "group_sizes", tuple(int(n) for n in sizes))  # hashable, compares by value

    @classmethod
    def recorded(cls, group_sizes: Any) -> Ragged:
        """The grouped matmul a traced program runs with these (traced) group sizes; they are checked where they
        reach the host (:func:`as_matmul`)."""
        out = object.__new__(cls)
        object.__setattr__(out, "group_sizes", group_sizes)
        return out

    @property
    def what(self) -> str:
        return "ragged_dot"

    @functools.cached_property
    def _sizes(self) -> jax.Array:
        if isinstance(self.group_sizes, jax.Array):
            return self.group_sizes
        return jax.device_put(np.asarray(self.group_sizes, np.int32))

    #: A weight calibrated over its groups and contraction: one scale shared by every expert (AQT, qwix).
    shared_rhs_axes = (0, 1)

    def axes(self, lhs_ndim: int = 2, rhs_ndim: int = 3) -> MatmulAxes:
        return RAGGED_AXES

    def run(self, site: Any, lhs: jax.Array, rhs: jax.Array, **kwargs: Any) -> jax.Array:
        """``site.ragged_dot(lhs, rhs, group_sizes, **kwargs)``: a call site's grouped matmul, traced in the
        caller's program."""
        return site.ragged_dot(lhs, rhs, self._sizes, **kwargs)

    def site_call(self, lhs: Any, rhs: Any) -> tuple[str, tuple]:
        """(the call site's method, its arguments) for operands ``lhs`` and ``rhs``."""
        return "ragged_dot", (lhs, rhs, self._sizes)

    def regrouped(self, seed: int) -> Ragged:
        """The same rows and groups on a probe: uneven group sizes drawn from ``seed``, the last group empty."""
        return Ragged(uneven_group_sizes(sum(self.group_sizes), len(self.group_sizes), seed))

    def integer(self, lhs_codes, lhs_scales, rhs_codes, rhs_scales, *, order: str, ftz: bool) -> np.ndarray:
        """The integer-mode reference (:func:`qcheck.referees.integer_ragged_dot`) of codes and scales."""
        return referees.integer_ragged_dot(lhs_codes, lhs_scales, rhs_codes, rhs_scales,
                                           np.asarray(self.group_sizes, np.int32), order=order, ftz=ftz)

    def check_operands(self, lhs: np.ndarray, rhs: np.ndarray) -> None:
        """A one-line ValueError where the operands do not fit ``ragged_dot`` with these group sizes."""
        if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
            raise ValueError(f"ragged_dot takes lhs [m, k] and rhs [g, k, n], got shapes {lhs.shape} and {rhs.shape}")
        if len(self.group_sizes) != rhs.shape[0]:
            raise ValueError(f"group_sizes has {len(self.group_sizes)} groups, rhs {rhs.shape} has {rhs.shape[0]}")
        if sum(self.group_sizes) != lhs.shape[0]:
            raise ValueError(f"group_sizes sum to {sum(self.group_sizes)}, lhs {lhs.shape} has {lhs.shape[0]} rows "
                             "(rows in no group would be checked against zeros)")

    def out_shape(self, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (lhs_shape[0], rhs_shape[-1])

    def call(self, op: Callable[..., ArrayLike], lhs: ArrayLike, rhs: ArrayLike) -> np.ndarray:
        return np.asarray(op(jax.device_put(lhs), jax.device_put(rhs), self._sizes))

    def reference(self, a: np.ndarray, b: np.ndarray, layout: str = EINSUM_LAYOUTS[0]) -> np.ndarray:
        """``jax.lax.ragged_dot`` of host operands (one layout: as given)."""
        # jax.lax.ragged_dot itself: the program an eager ragged_dot of the same shapes uses too.
        return _host(jax.lax.ragged_dot(jax.device_put(a), jax.device_put(b), self._sizes))

    def layouts(self, lhs_shape: tuple[int, ...] = (), rhs_shape: tuple[int, ...] = ()) -> tuple[str, ...]:
        return EINSUM_LAYOUTS[:1]

    def grad_matmuls(self, a: np.ndarray, b: np.ndarray, g_dgrad: np.ndarray, g_wgrad: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """(DGRAD of ``g_dgrad``, WGRAD of ``g_wgrad``): ``jax.vjp`` of ``jax.lax.ragged_dot`` in float32."""
        a, b, gd, gw = map(jax.device_put, (a, b, g_dgrad, g_wgrad))
        d, w = _ragged_grad_matmuls(a, b, self._sizes, gd, gw)
        return _host(d), _host(w)


def _ragged_children(r: Ragged) -> tuple[tuple[Any], None]:
    sizes = r.group_sizes
    return (sizes if isinstance(sizes, jax.Array) else np.asarray(sizes, np.int32),), None


jax.tree_util.register_pytree_node(Ragged, _ragged_children, lambda _, children: Ragged.recorded(children[0]))

#: What an exact check's ``matmul`` argument describes.
Matmul = Union[Einsum, Ragged]


def as_matmul(matmul: str | Einsum | Ragged) -> Einsum | Ragged:
    """``matmul`` as a description: an einsum string becomes :class:`Einsum`; anything else is a ValueError."""
    if isinstance(matmul, Ragged) and not isinstance(matmul.group_sizes, tuple):  # sizes a program handed back
        return Ragged(np.asarray(matmul.group_sizes))
    if isinstance(matmul, (Einsum, Ragged)):
        return matmul
    if isinstance(matmul, str):
        return Einsum(matmul)
    raise ValueError(f"matmul must be an einsum string, qcheck.checks.Einsum(eqn) or "
                     f"qcheck.checks.Ragged(group_sizes), got {type(matmul).__name__}")

