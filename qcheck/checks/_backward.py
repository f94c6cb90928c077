"""Backward exactness of a fresh call site: both gradients, bitwise, against numpy-quantized output gradients.

The forward exact check cannot see a recipe that quantizes the output gradient
``g`` wrongly: the forward pass is the same. Here a fresh site (fp8 scales 1) is
differentiated once, jitted, and each gradient is held bit for bit to the same
gradient matmul (``jax.vjp`` of ``jnp.einsum`` / ``jax.lax.ragged_dot`` in
float32, the contraction the site itself runs) of operands and ``g`` quantized
by :mod:`qcheck.referees`, never by :mod:`qcheck.formats`:

- fp8-class recipes (``recipe.reference.cast_dtype`` set): ``g`` cast, saturating at
  scale 1, to the e5m2 flavour of the recipe's e4m3 flavour (e4m3fn -> e5m2,
  e4m3fnuz -> e5m2fnuz), for both gradients;
- declarative recipes with ``grad=``: ``g`` quantized along the axes each
  gradient matmul contracts (DGRAD with rhs, WGRAD with lhs), separately;
  :class:`~qcheck.recipes.NVFP4` rounds DGRAD's copy stochastically with the
  site's salted key, and the referee gets the uniforms that key draws;
- recipes without ``grad=``: ``g`` unquantized (straight through the operand
  quantizers) against the quantized operands, or against the operands as
  received where the recipe says so (``grad_operands="original"``, qwix's QAT).

Each expectation comes with its neighbours — the bugs it exists for (``g``
unquantized, in the e4m3 flavour, in the sibling fnuz/non-fnuz flavour,
blocked along the other gradient's axes, rounded to nearest; the operands
unquantized). Inputs for which the expectation equals a neighbour bitwise are
refused with a ValueError; a site that matches a neighbour is told so.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.typing import ArrayLike

from qcheck import referees
from qcheck.layers.bridge import QuantSite
from qcheck.recipes import NVFP4, MatmulAxes, Recipe, einsum_axes
from qcheck.recipes._axes import RAGGED_AXES

__all__ = [
    "assert_site_backward_exact",
    "assert_site_ragged_backward_exact",
    "check_einsum_grads",
    "check_ragged_grads",
    "grad_operands",
    "probe_grad",
    "probe_nvfp4",
    "site_dgrad_key",
    "site_grads",
]

# The gradient flavour that goes with each forward e4m3 flavour: same family.
_E5M2_OF = {"e4m3fn": "e5m2", "e4m3fnuz": "e5m2fnuz"}
# Each fp8 flavour's sibling, the one a wrong-flavour bug casts to instead.
_SIBLING = {"e4m3fn": "e4m3fnuz", "e4m3fnuz": "e4m3fn", "e5m2": "e5m2fnuz", "e5m2fnuz": "e5m2"}
# Formats whose quantization depends on the axes (per-slice or per-block scales);
# the fp8 and current-scaling formats scale the whole tensor alike along any axis.
_AXIS_FORMATS = frozenset({"int8", "nvfp4", "mxfp8"})


def probe_grad(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """An output gradient that makes the backward checks sharp, float32.

    Magnitudes are log-uniform over [2^-17, 2^-1] with random signs: small
    gradients are where fp8 flavours part — e4m3 flushes most of them to zero
    (2^-9 is e4m3fn's smallest subnormal), e5m2 and e5m2fnuz differ only below
    2^-14, where e5m2 is subnormal and e5m2fnuz is not. Every value is a normal
    float32, so no backend's flushing of float32 subnormals can matter.
    """
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-17.0, -1.0, size=shape))
    return (mag * rng.choice(np.array([-1.0, 1.0]), size=shape)).astype(np.float32)


def probe_nvfp4(seed: int, shape: tuple[int, ...], *axis_sets: tuple[int, ...]) -> np.ndarray:
    """A float32 array whose NVFP4 blocks along each of ``axis_sets`` decode exactly, in any order.

    XLA may reorder NVFP4's decode ``code / (s_enc / s_block)`` under jit (up to
    2 ulps, :data:`qcheck.checks._referee.NVFP4_JIT_DECODE_ULPS`), which no
    bitwise reference survives. Here the tensor amax is 6 and every block's amax
    is 6 · 2^-j (j in 0..3) along every axis set given, so each block's encode
    scale is 2^j: every decode order is exact. One element per block (where the
    flat indices over the axis sets sum to a multiple of 16) carries that amax;
    the others are log-uniform below the smaller amax of their blocks, so blocks
    along different axes differ and a wrong-axes quantization shows.
    """
    rng = np.random.default_rng(seed)
    ndim = len(shape)
    sets = [tuple(sorted({a % ndim for a in axes})) for axes in axis_sets]
    if not sets:
        raise ValueError("probe_nvfp4: give at least one axis set")
    idx = np.indices(shape)
    flat = [np.ravel_multi_index([idx[a] for a in axes], [shape[a] for a in axes]) for axes in sets]
    planted = sum(flat) % _NVFP4_BLOCK == 0
    amax = np.where(planted, 6.0 * np.exp2(-rng.integers(0, 4, shape)), 0.0)
    amax[np.unravel_index(np.argmax(planted), shape)] = 6.0  # the tensor amax, 6 exactly
    ceiling = np.min([_block_max(amax, axes) for axes in sets], axis=0)
    mag = np.where(planted, amax, ceiling * np.exp2(rng.uniform(-8.0, -0.01, shape)))
    return (mag * rng.choice(np.array([-1.0, 1.0]), size=shape)).astype(np.float32)


_NVFP4_BLOCK = 16


def _block_max(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Each element's block maximum, blocks of 16 along the flattened ``axes``."""
    rest = [a for a in range(x.ndim) if a not in axes]
    perm = (*rest, *axes)
    moved = np.transpose(x, perm)
    blocks = moved.reshape(*moved.shape[: len(rest)], -1, _NVFP4_BLOCK)
    top = np.broadcast_to(blocks.max(axis=-1, keepdims=True), blocks.shape)
    return np.transpose(top.reshape(moved.shape), np.argsort(perm))


def site_dgrad_key(key: jax.Array, site_name: str) -> jax.Array:
    """The key an NVFP4 site called with ``rngs=key`` rounds its DGRAD copy of ``g`` with.

    Linen's first ``make_rng("params")`` of a top-level module, folded with
    crc32(``"{site_name}/dgrad"``) as NVFP4 documents (TransformerEngine's
    per-quantizer salt); written out here, not taken from the recipe.
    """
    base = _MakeRng().apply({}, rngs={"params": key})
    return jax.random.fold_in(base, zlib.crc32(f"{site_name}/dgrad".encode()) & 0x7FFFFFFF)


def _uniforms(key: jax.Array, shape: tuple[int, ...], axes: tuple[int, ...]) -> np.ndarray:
    """:func:`qcheck.checks._referee.nvfp4_uniforms`, drawn flat: one program per size, not per layout.

    JAX's uniforms depend on the flat index alone (tests/test_backward.py checks the two agree).
    """
    n = int(np.prod(shape))
    u = np.asarray(_flat_uniform(key, n))
    ndim = len(shape)
    axes = tuple(sorted({a % ndim for a in axes}))
    perm = (*[a for a in range(ndim) if a not in axes], *axes)
    return np.transpose(u.reshape(tuple(shape[a] for a in perm)), np.argsort(perm))


@functools.partial(jax.jit, static_argnums=1)
def _flat_uniform(key: jax.Array, n: int) -> jax.Array:
    return jax.random.uniform(key, (n,), jnp.float32)


class _MakeRng(nn.Module):
    @nn.compact
    def __call__(self):
        return self.make_rng("params")


# -- the programs: one per kind of site (its graph definition) and shapes ---------------


def site_grads(site, eqn: str | None, lhs, rhs, group_sizes, g, key) -> tuple[jax.Array, jax.Array]:
    """The site's (dgrad, wgrad) for output gradient ``g``, traced in the caller's program (``eqn`` None: ragged_dot).

    A :class:`~qcheck.QuantSite` draws from ``key``; an interception recipe's
    site (a plain module a library rewrote) takes no streams.
    """
    kw = {"rngs": key} if isinstance(site, QuantSite) else {}
    if eqn is None:
        _, vjp = jax.vjp(lambda a, b: site.ragged_dot(a, b, group_sizes, **kw), lhs, rhs)
    else:
        _, vjp = jax.vjp(lambda a, b: site(eqn, a, b, **kw), lhs, rhs)
    return vjp(g)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _einsum_site_grads(graphdef, eqn: str, state, lhs, rhs, g, key):
    return site_grads(nnx.merge(graphdef, state, copy=True), eqn, lhs, rhs, None, g, key)


@functools.partial(jax.jit, static_argnums=0)
def _ragged_site_grads(graphdef, state, lhs, rhs, group_sizes, g, key):
    return site_grads(nnx.merge(graphdef, state, copy=True), None, lhs, rhs, group_sizes, g, key)


@functools.partial(jax.jit, static_argnums=0)
def _einsum_grad_matmuls(eqn: str, lhs, rhs, g_dgrad, g_wgrad):
    _, vjp = jax.vjp(functools.partial(jnp.einsum, eqn), lhs, rhs)
    return vjp(g_dgrad)[0], vjp(g_wgrad)[1]


@jax.jit
def _ragged_grad_matmuls(lhs, rhs, group_sizes, g_dgrad, g_wgrad):
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes), lhs, rhs)
    return vjp(g_dgrad)[0], vjp(g_wgrad)[1]


# -- what each gradient's copy of g should be --------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Expectation:
    """Each gradient's expected quantized ``g`` and the neighbours (bugs) it must differ from."""

    what: str  # e.g. "g in e5m2 (saturating, scale 1)"
    g: np.ndarray
    neighbours: dict[str, np.ndarray]  # description -> that bug's g


def _qdq(x: np.ndarray, fmt: str, axis=-1, uniforms=None) -> np.ndarray:
    return referees.reference_qdq(
        x, fmt, axis=axis, uniforms=uniforms, ftz=jax.default_backend() == "cpu", xla_reciprocal=True
    )


def _fp8_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name.removeprefix("float8_")


def _operand_formats(recipe: Recipe) -> tuple[str, str]:
    if recipe.reference.cast_dtype is not None:
        fmt = _fp8_name(recipe.reference.cast_dtype)
        if fmt not in _E5M2_OF:
            raise ValueError(
                f"recipe {recipe.name!r}: cast_dtype {recipe.reference.cast_dtype} has no e5m2 gradient flavour; "
                f"fp8-class recipes cast to one of {', '.join('float8_' + k for k in _E5M2_OF)}"
            )
        return fmt, fmt
    if recipe.lhs is None:
        raise ValueError(
            f"recipe {recipe.name!r} declares no operand formats (lhs=/rhs=) and no cast_dtype, "
            "so there is no reference for its gradients"
        )
    return recipe.lhs, recipe.rhs


def _expectations(
    recipe: Recipe,
    axes: MatmulAxes,
    g: np.ndarray,
    dgrad_key: jax.Array | None,
    unsalted_key: jax.Array | None,
) -> tuple[_Expectation, _Expectation]:
    lhs_fmt, _ = _operand_formats(recipe)
    if recipe.reference.cast_dtype is not None:
        e5 = _E5M2_OF[lhs_fmt]
        sib = _SIBLING[e5]
        exp = _Expectation(
            f"g in float8_{e5}",
            _qdq(g, e5),
            {
                "unquantized g": g,
                f"g in float8_{lhs_fmt} (the forward flavour)": _qdq(g, lhs_fmt),
                f"g in float8_{sib} (the other fnuz flavour)": _qdq(g, sib),
            },
        )
        return exp, exp
    if recipe.grad is None:
        on = " to the original operands" if recipe.reference.grad_operands == "original" else ""
        exp = _Expectation(f"g unquantized (straight through{on})", g, {})
        return exp, exp
    fmt = recipe.grad
    out = []
    for which, own, other, other_name in (
        ("dgrad", axes.dgrad, axes.wgrad, "wgrad"),
        ("wgrad", axes.wgrad, axes.dgrad, "dgrad"),
    ):
        u = None if which == "wgrad" or dgrad_key is None else _uniforms(dgrad_key, g.shape, own)
        rounding = ", stochastic" if u is not None else ""
        neighbours = {"unquantized g": g}
        if fmt in _AXIS_FORMATS:
            # A wrong-axes bug still rounds stochastically, drawing the same key for its own blocks.
            wrong_u = None if u is None else _uniforms(dgrad_key, g.shape, other)
            neighbours[f"g in {fmt} along the {other_name} axes {other}"] = _qdq(g, fmt, other, wrong_u)
        if u is not None:
            neighbours[f"g in {fmt} along {own}, rounded to nearest"] = _qdq(g, fmt, own)
            neighbours[f"g in {fmt} along {own}, rounded with the unsalted key"] = _qdq(
                g, fmt, own, _uniforms(unsalted_key, g.shape, own))
        if lhs_fmt != fmt:
            neighbours[f"g in {lhs_fmt} (the operands' format)"] = _qdq(g, lhs_fmt, own)
        if fmt in _SIBLING:  # probe_grad reaches below 2^-14, where even e5m2 and e5m2fnuz part
            neighbours[f"g in {_SIBLING[fmt]} instead of {fmt}"] = _qdq(g, _SIBLING[fmt], own)
        out.append(_Expectation(f"g in {fmt} along axes {own}{rounding}", _qdq(g, fmt, own, u), neighbours))
    return out[0], out[1]


def grad_operands(recipe: Recipe, lhs: np.ndarray, rhs: np.ndarray, q_lhs: np.ndarray, q_rhs: np.ndarray
                  ) -> tuple[tuple[np.ndarray, np.ndarray], str, tuple[np.ndarray, np.ndarray]]:
    """``(operands, other's description, other operands)``: what the gradient matmuls take, and the bug of
    taking the other ones (``recipe.reference.grad_operands``)."""
    if recipe.reference.grad_operands == "original":
        return (lhs, rhs), "the quantized operands (straight through the quantizers)", (q_lhs, q_rhs)
    return (q_lhs, q_rhs), "unquantized operands", (lhs, rhs)


def _require_exact_nvfp4_decode(check: str, what: str, x: np.ndarray, axes: tuple[int, ...]) -> None:
    # XLA may compute NVFP4's decode in another order under jit (NVFP4_JIT_DECODE_ULPS);
    # only power-of-two encode scales make every order exact, and a bitwise reference fair.
    _, scales = referees.reference_quantize(x, "nvfp4", axis=axes, ftz=jax.default_backend() == "cpu")
    block = scales["block"].astype(np.float32)
    ratio = (scales["tensor"] / block[block > 0]).astype(np.float32)
    if ratio.size == 0 or np.any(np.frexp(ratio)[0] != 0.5):
        raise ValueError(
            f"{check}: {what} has NVFP4 blocks along axes {axes} whose encode scale is not a power of two, "
            "so XLA's reordering of the decode (up to NVFP4_JIT_DECODE_ULPS) would move bits; "
            "use probe_nvfp4 with the axes of every quantization of it"
        )


# -- the check ----------------------------------------------------------------------------


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_bits(a), _bits(b))


def _float32(x: ArrayLike, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise TypeError(f"{what} must be a float32 array, got dtype {a.dtype}")
    return a


def _check(
    check: str,
    site: QuantSite,
    recipe: Recipe,
    axes: MatmulAxes,
    lhs: np.ndarray,
    rhs: np.ndarray,
    g: np.ndarray,
    key: jax.Array,
    site_grads,
    grad_matmuls,
) -> dict[str, int]:
    __tracebackhide__ = True
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{check}: recipe must be a qcheck.Recipe, got {type(recipe).__name__}")
    if not isinstance(site, nnx.Module) or not hasattr(site, "site_name"):
        raise TypeError(f"{check}: site must be a qcheck call site (a QuantSite, or an interception recipe's site), "
                        f"got {type(site).__name__}")
    name = site.site_name
    lhs_fmt, rhs_fmt = _operand_formats(recipe)
    dgrad_key = unsalted = None
    if isinstance(recipe, NVFP4):
        dgrad_key, unsalted = site_dgrad_key(key, name), _MakeRng().apply({}, rngs={"params": key})
    try:
        q_lhs, q_rhs = _qdq(lhs, lhs_fmt, axes.lhs), _qdq(rhs, rhs_fmt, axes.rhs)
        dgrad, wgrad = _expectations(recipe, axes, g, dgrad_key, unsalted)
    except ValueError as e:  # a shape the format cannot block (e.g. mxfp8 WGRAD over 16 tokens)
        raise ValueError(f"{check}: site {name!r}: the referee cannot quantize for this site: {e}") from e
    for what, x, fmt, ax in (("lhs", lhs, lhs_fmt, axes.lhs), ("rhs", rhs, rhs_fmt, axes.rhs),
                             ("g (dgrad)", g, recipe.grad, axes.dgrad), ("g (wgrad)", g, recipe.grad, axes.wgrad)):
        if fmt == "nvfp4" and recipe.reference.cast_dtype is None:
            _require_exact_nvfp4_decode(check, what, x, ax)

    def grads(a, b, gd, gw) -> tuple[np.ndarray, np.ndarray]:
        d, w = grad_matmuls(jax.device_put(a), jax.device_put(b), jax.device_put(gd), jax.device_put(gw))
        return np.asarray(d), np.asarray(w)

    (a, b), other, (other_a, other_b) = grad_operands(recipe, lhs, rhs, q_lhs, q_rhs)
    want = grads(a, b, dgrad.g, wgrad.g)
    got = tuple(np.asarray(x) for x in site_grads(jax.device_put(lhs), jax.device_put(rhs), jax.device_put(g), key))
    margins: dict[str, int] = {}
    for i, (which, exp) in enumerate((("dgrad", dgrad), ("wgrad", wgrad))):
        prefix = f"{check}: site {name!r} {which} ({exp.what})"
        # The bugs this gradient must tell apart, as that gradient would come out.
        bugs: dict[str, np.ndarray] = {}
        for desc, bug_g in exp.neighbours.items():
            gd, gw = (bug_g, wgrad.g) if i == 0 else (dgrad.g, bug_g)
            bugs[desc] = grads(a, b, gd, gw)[i]
        bugs[other] = grads(other_a, other_b, dgrad.g, wgrad.g)[i]
        for desc, bug in bugs.items():
            if _equal(bug, want[i]):
                raise ValueError(
                    f"{prefix}: for these operands and g the reference equals the gradient with {desc} "
                    "bitwise, so that bug would pass; use probe_operands and probe_grad"
                )
        _assert_equal(prefix, got[i], want[i], bugs)
        margins[which] = min(int(np.sum(_bits(b) != _bits(want[i]))) for b in bugs.values())
    return margins


def _assert_equal(prefix: str, got: np.ndarray, want: np.ndarray, bugs: dict[str, np.ndarray]) -> None:
    __tracebackhide__ = True
    if _equal(got, want):
        return
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(
            f"{prefix}: gradient is {got.dtype}{list(got.shape)}, the reference {want.dtype}{list(want.shape)}"
        )
    off = _bits(got) != _bits(want)
    first = tuple(int(j) for j in np.argwhere(off)[0])
    matched = [desc for desc, bug in bugs.items() if _equal(got, bug)]
    if matched:
        why = f"it equals the gradient with {matched[0]} bitwise"
    else:
        zeros = int(np.count_nonzero(got == 0)) - int(np.count_nonzero(want == 0))
        why = f"{zeros} more zeros than the reference" if zeros > 0 else "it matches none of the known bugs"
    raise AssertionError(
        f"{prefix}: differs from the reference at {int(off.sum())} of {off.size} elements, first at "
        f"{first}: got {got[first]!r}, expected {want[first]!r}; {why}"
    )


def assert_site_backward_exact(
    site: QuantSite,
    eqn: str,
    lhs: ArrayLike,
    rhs: ArrayLike,
    g: ArrayLike,
    *,
    recipe: Recipe,
    key: jax.Array | None = None,
) -> dict[str, int]:
    """Assert a fresh site's einsum gradients equal the gradient matmuls of referee-quantized ``g``, bitwise.

    ``site`` is a fresh :class:`~qcheck.QuantSite` of ``recipe`` (fp8 scales
    still 1); ``g`` the output gradient (float32, the einsum's output shape).
    The site runs once under ``jax.jit(jax.vjp)``, called with ``rngs=key``
    (default ``jax.random.key(0)``) so a stochastic recipe's bits are known.
    See the module docstring for what each recipe's gradients must equal. A
    ValueError refuses inputs that cannot tell the reference from a known bug.

    Returns, for ``"dgrad"`` and ``"wgrad"``, how many elements the nearest known
    bug's gradient differs from the reference in: the margin the check had.
    """
    __tracebackhide__ = True
    graphdef, state = nnx.split(site)
    return check_einsum_grads(site, eqn, lhs, rhs, g, recipe=recipe, key=key, site_grads=(
        lambda a, b, gg, k: _einsum_site_grads(graphdef, eqn, state, a, b, gg, k)))


def check_einsum_grads(site: QuantSite, eqn: str, lhs: ArrayLike, rhs: ArrayLike, g: ArrayLike, *,
                       recipe: Recipe, key: jax.Array | None, site_grads) -> dict[str, int]:
    """:func:`assert_site_backward_exact` with the site's gradients from ``site_grads(lhs, rhs, g, key)``.

    For a caller that ran the site inside a larger program of its own (:func:`site_grads`).
    """
    __tracebackhide__ = True
    lhs, rhs, g = (_float32(x, w) for x, w in ((lhs, "lhs"), (rhs, "rhs"), (g, "g")))
    axes = einsum_axes(eqn, lhs.ndim, rhs.ndim)
    _check_g_shape("assert_site_backward_exact", g, jax.eval_shape(functools.partial(jnp.einsum, eqn), lhs, rhs))
    key = jax.random.key(0) if key is None else key
    return _check(
        "assert_site_backward_exact", site, recipe, axes, lhs, rhs, g, key, site_grads,
        lambda a, b, gd, gw: _einsum_grad_matmuls(eqn, a, b, gd, gw),
    )


def assert_site_ragged_backward_exact(
    site: QuantSite,
    lhs: ArrayLike,
    rhs: ArrayLike,
    group_sizes: ArrayLike,
    g: ArrayLike,
    *,
    recipe: Recipe,
    key: jax.Array | None = None,
) -> dict[str, int]:
    """:func:`assert_site_backward_exact` for a sparse site's ``ragged_dot(lhs[m, k], rhs[e, k, n], group_sizes)``."""
    __tracebackhide__ = True
    graphdef, state = nnx.split(site)
    gs = jax.device_put(np.asarray(group_sizes, np.int32))
    return check_ragged_grads(site, lhs, rhs, group_sizes, g, recipe=recipe, key=key, site_grads=(
        lambda a, b, gg, k: _ragged_site_grads(graphdef, state, a, b, gs, gg, k)))


def check_ragged_grads(site: QuantSite, lhs: ArrayLike, rhs: ArrayLike, group_sizes: ArrayLike, g: ArrayLike, *,
                       recipe: Recipe, key: jax.Array | None, site_grads) -> dict[str, int]:
    """:func:`assert_site_ragged_backward_exact` with the site's gradients from ``site_grads(lhs, rhs, g, key)``."""
    __tracebackhide__ = True
    lhs, rhs, g = (_float32(x, w) for x, w in ((lhs, "lhs"), (rhs, "rhs"), (g, "g")))
    gs = jax.device_put(np.asarray(group_sizes, np.int32))
    _check_g_shape("assert_site_ragged_backward_exact", g,
                   jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[-1]), np.float32))
    key = jax.random.key(0) if key is None else key
    return _check(
        "assert_site_ragged_backward_exact", site, recipe, RAGGED_AXES, lhs, rhs, g, key, site_grads,
        lambda a, b, gd, gw: _ragged_grad_matmuls(a, b, gs, gd, gw),
    )


def _check_g_shape(check: str, g: np.ndarray, out: jax.ShapeDtypeStruct) -> None:
    if g.shape != tuple(out.shape):
        raise ValueError(f"{check}: g has shape {g.shape}, the matmul's output has shape {tuple(out.shape)}")
