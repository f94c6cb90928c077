"""Forward exactness of call sites for every declared operand format, on probes and through the layer.

A fresh call site of a recipe that declares its operand formats (``Recipe.lhs``
/ ``rhs``; fp8-class recipes: their ``cast_dtype``) must equal, bit for bit,
the same matmul (``jnp.einsum`` or ``jax.lax.ragged_dot``, run by JAX) of its
operands quantized by :mod:`qcheck.referees` along the matmul's contraction
axes (:func:`qcheck.recipes.einsum_axes`, ``RAGGED_AXES``), never by
:mod:`qcheck.formats`.

Two ways in:

- :func:`assert_site_exact` / :func:`assert_site_ragged_exact`: a site on
  probe operands of the caller's choosing. Operands for which the reference
  equals a neighbour bitwise (the plain matmul, one operand unquantized, the
  other int8 variant, the other fp8 flavour, unscaled fp8 for current scaling,
  blocks along the wrong axes) are refused with a ValueError.
- :func:`assert_layer_sites_exact`: one jitted forward pass of the whole layer,
  every site wrapped by a recorder (:func:`capture_site_calls`), then each
  site's output against the reference of the operands it actually received. It
  sees what a probe cannot: a layer that never calls a site, calls another
  site's wrapper in its place, or calls a site that skips quantization on one
  path only. Its operands are the layer's own, so it refuses only operands
  whose reference equals the plain matmul; neighbours name a mismatch.

Named exclusions, both measured on XLA CPU (jax 0.10.2) and both other
programs of the same quantized values, so no quantization bug hides in them:

- :data:`NVFP4_DECODE_ORDERS`: XLA rewrites NVFP4's decode
  ``code · (1 / (s_enc / s_block))`` into ``code · (s_block / s_enc)`` (the
  whole case table, through the layer); the reference accepts either.
- :data:`EINSUM_LAYOUTS`: a block format's qdq moves the contraction axes last
  and back, and XLA may keep that layout for the dot, which then sums in
  another order (mxfp8 and nvfp4 ``wo`` on the dropping path); the reference
  also runs the einsum on operands laid out contraction-last, and as one
  batched dot over the flattened contraction (``jax.nn.scaled_dot_general``'s
  layout: jax_mxfp8's ``combine``, which contracts two axes, sums in that order).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from qcheck import referees
from qcheck.referees import _integer as _integer_matmul
from qcheck.referees._formats import Blocks, flush
from qcheck.referees._libraries import LIBRARY_RULES
from qcheck.recipes import MatmulAxes, Recipe, einsum_axes, get_recipe
from qcheck.recipes._axes import RAGGED_AXES

__all__ = [
    "EINSUM_LAYOUTS",
    "NVFP4_DECODE_ORDERS",
    "PARTING_BINADES",
    "SiteCall",
    "assert_layer_sites_exact",
    "assert_site_calls_exact",
    "assert_site_exact",
    "assert_site_ragged_exact",
    "capture_site_calls",
    "operand_formats",
    "probe_site_operands",
    "record_site_calls",
]

#: NVFP4 decode orders the reference accepts: qcheck's documented one, and XLA's rewrite of it.
NVFP4_DECODE_ORDERS = ("1 / (s_enc / s_block)", "s_block / s_enc")
#: Operand layouts the einsum reference runs in: as given, contraction axes last (as a block qdq leaves
#: them), and (batch, rows, flattened contraction) as one batched dot (as jax.nn.scaled_dot_general runs it).
EINSUM_LAYOUTS = ("as given", "contraction last", "flattened")

# The format a wrong-variant bug would use instead, by format.
_NEIGHBOURS = {
    "int8": ("int8_aqt", "int8_qwix"),
    "int8_aqt": ("int8", "int8_qwix"),
    "int8_qwix": ("int8", "int8_aqt"),
    "e4m3fn": ("e4m3fnuz",),
    "e4m3fnuz": ("e4m3fn",),
    "e5m2": ("e5m2fnuz",),
    "e5m2fnuz": ("e5m2",),
    "e4m3fn_current": ("e4m3fn", "e5m2_current"),
    "e5m2_current": ("e5m2", "e4m3fn_current"),
    "mxfp8": ("e4m3fn",),
    "nvfp4": (),
    # JAX's rules: the OCP / NVIDIA format they differ from is the bug a wrong rule would be.
    "mxfp8_jax": ("mxfp8", "e4m3fn"),
    "nvfp4_jax": ("nvfp4",),
}
#: Where an fp8 flavour parts from its sibling only outside the probes' magnitudes (2^-4..2^10): the binade
#: [2^lo, 2^hi) that :func:`probe_site_operands` gives some contraction fibres of an operand in that format.
#: e5m2 and e5m2fnuz share every value from 2^-14 up, their maximum (57344) too, and a saturating cast
#: never reaches e5m2's inf; a matmul's sum hides that e5m2fnuz has no -0. They part only where e5m2 is
#: subnormal: in [2^-15, 2^-14) e5m2fnuz is normal (1.25 * 2^-15 and 1.75 * 2^-15 are its own values) and
#: e5m2 keeps one bit (2^-15, 1.5 * 2^-15), so about half the values there round apart. Those are normal
#: float32 values, which XLA's CPU backend does not flush (it flushes float32 subnormals only), and XLA
#: casts them to e5m2's subnormals exactly, as ml_dtypes does (measured on jax 0.10.2 and 0.12).
#: e4m3fn and e4m3fnuz need no such binade: they part on the probes' own values above 240, e4m3fnuz's maximum.
PARTING_BINADES = {"e5m2": (-15, -14), "e5m2fnuz": (-15, -14)}
# The share of an operand's contraction fibres (at least one) the parting values fill: a whole fibre,
# so that its products are small too and the rounding of the sum keeps the flavours apart.
_PARTING_SHARE = 0.25
# Formats whose scales depend on the axes (per slice or per block).
_AXIS_FORMATS = frozenset({"int8", "int8_aqt", "int8_qwix", "mxfp8", "nvfp4", "mxfp8_jax", "nvfp4_jax"})


def operand_formats(recipe: Recipe | str) -> tuple[str, str]:
    """The (lhs, rhs) formats a fresh site of ``recipe`` quantizes to: ``lhs``/``rhs``, else ``reference.cast_dtype``'s."""
    recipe = get_recipe(recipe)
    if recipe.lhs is not None:
        return recipe.lhs, recipe.rhs
    if recipe.reference.cast_dtype is not None:
        name = recipe.reference.cast_dtype.name.removeprefix("float8_")
        return name, name
    raise ValueError(
        f"recipe {recipe.name!r} declares no operand formats (lhs=/rhs=) and no cast_dtype, "
        "so there is no exact reference for its call sites")


def _wrong_axes(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    # The default-axis bug (axis=-1) where the contraction is elsewhere; else the axis before it.
    return (ndim - 1,) if axes != (ndim - 1,) else (ndim - 2,)


def _qdq(x: np.ndarray, fmt: str, axes: tuple[int, ...], order: str = NVFP4_DECODE_ORDERS[0]) -> np.ndarray:
    ftz = jax.default_backend() == "cpu"  # XLA's CPU backend flushes float32 subnormals
    if fmt != "nvfp4" or order == NVFP4_DECODE_ORDERS[0]:
        return referees.reference_qdq(x, fmt, axis=axes, ftz=ftz, xla_reciprocal=True)
    codes, scales = referees.reference_quantize(x, fmt, axis=axes, ftz=ftz)
    blocks = Blocks(codes.shape, tuple(sorted(a % x.ndim for a in axes)), 16, "nvfp4")
    c = blocks.split(codes.astype(np.float32))
    sb = scales["block"].astype(np.float32)[..., None]
    nonzero = sb > 0
    out = np.where(nonzero, c * (np.where(nonzero, sb, np.float32(1)) / scales["tensor"]), np.float32(0))
    return flush(blocks.join(out.astype(np.float32)), ftz)


def _orders(fmt: str) -> tuple[str, ...]:
    return NVFP4_DECODE_ORDERS if fmt == "nvfp4" else NVFP4_DECODE_ORDERS[:1]


@functools.partial(jax.jit, static_argnums=0)
def _einsum(eqn: str, a, b):
    return jnp.einsum(eqn, a, b)


@functools.partial(jax.jit, static_argnums=0)
def _flattened(eqn: str, a, b):
    # The einsum as JAX's scaled_dot_general runs it: each operand to (batch, rows, contraction), the
    # contraction axes flattened in axis order, one batched dot, then the output's own layout.
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
        return jnp.reshape(jnp.transpose(x, perm), shape)

    y = jax.lax.dot_general(to3(a, sa, free_a, contract_a), to3(b, sb, free_b, contract_b),
                            (((2,), (2,)), ((0,), (0,))))
    produced = batch + free_a + free_b
    y = jnp.reshape(y, [size[i] for i in produced])
    return jnp.transpose(y, [produced.index(i) for i in out])


@jax.jit
def _ragged(a, b, group_sizes):
    return jax.lax.ragged_dot(a, b, group_sizes)


class _Matmul:
    """The reference matmul of one site, in each accepted layout, run by JAX on host arrays."""

    def __init__(self, eqn: str | None, lhs_shape, rhs_shape, group_sizes=None):
        self.eqn, self.group_sizes = eqn, group_sizes
        if eqn is None:
            self.axes, self.what = RAGGED_AXES, "ragged_dot"
            return
        self.axes, self.what = einsum_axes(eqn, len(lhs_shape), len(rhs_shape)), f"einsum {eqn!r}"
        ins, out = eqn.replace(" ", "").split("->")
        self.subs, self.out = ins.split(","), out

    def __call__(self, a: np.ndarray, b: np.ndarray, layout: str = EINSUM_LAYOUTS[0]) -> np.ndarray:
        if self.eqn is None:
            return np.asarray(_ragged(jax.device_put(a), jax.device_put(b), jax.device_put(self.group_sizes)))
        if layout == EINSUM_LAYOUTS[0]:
            return np.asarray(_einsum(self.eqn, jax.device_put(a), jax.device_put(b)))
        if layout == EINSUM_LAYOUTS[2]:
            return np.asarray(_flattened(self.eqn, jax.device_put(a), jax.device_put(b)))
        (sa, a), (sb, b) = (self._last(s, x, ax) for s, x, ax in
                            ((self.subs[0], a, self.axes.lhs), (self.subs[1], b, self.axes.rhs)))
        return np.asarray(_einsum(f"{sa},{sb}->{self.out}", jax.device_put(a), jax.device_put(b)))

    @staticmethod
    def _last(sub: str, x: np.ndarray, axes: tuple[int, ...]) -> tuple[str, np.ndarray]:
        perm = [i for i in range(x.ndim) if i not in axes] + list(axes)
        return "".join(sub[i] for i in perm), np.ascontiguousarray(np.transpose(x, perm))

    def layouts(self) -> tuple[str, ...]:
        return EINSUM_LAYOUTS if self.eqn is not None else EINSUM_LAYOUTS[:1]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_bits(a), _bits(b))


def _float32(x: ArrayLike, what: str, check: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise TypeError(f"{check}: {what} must be a float32 array, got dtype {a.dtype}")
    return a


def _neighbours(mm: _Matmul, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt) -> Iterator[tuple[str, np.ndarray]]:
    """(description, result) of each bug the reference must tell apart, computed lazily."""
    yield "the unquantized matmul", mm(lhs, rhs)
    yield "lhs unquantized", mm(lhs, q_rhs)
    yield "rhs unquantized", mm(q_lhs, rhs)
    for side, x, fmt, axes in (("lhs", lhs, lhs_fmt, mm.axes.lhs), ("rhs", rhs, rhs_fmt, mm.axes.rhs)):
        def with_(q):
            return mm(q, q_rhs) if side == "lhs" else mm(q_lhs, q)
        for other in _NEIGHBOURS[fmt]:
            yield f"{side} in {other} instead of {fmt}", with_(_qdq(x, other, axes))
        if fmt in _AXIS_FORMATS:
            wrong = _wrong_axes(axes, x.ndim)
            try:
                q = _qdq(x, fmt, wrong)
            except ValueError:  # the wrong axes cannot hold whole blocks: that bug could not run here
                continue
            yield f"{side} in {fmt} along the wrong axes {wrong} (contraction: {axes})", with_(q)
    if lhs_fmt == rhs_fmt:  # the wrong flavour throughout, as a recipe that declares one and runs another has it
        for other in _NEIGHBOURS[lhs_fmt]:
            yield (f"both operands in {other} instead of {lhs_fmt}",
                   mm(_qdq(lhs, other, mm.axes.lhs), _qdq(rhs, other, mm.axes.rhs)))
    # Per-slice formats only: a block format's blocks lie within one group's contraction either way.
    if mm.eqn is None and rhs_fmt in _INTEGER_FORMATS:
        yield _SHARED, mm(q_lhs, _qdq(rhs, rhs_fmt, _SHARED_AXES))


# A ragged weight calibrated over its groups and contraction: one scale shared by every expert (AQT, qwix).
_SHARED_AXES = (0, 1)
_SHARED = "rhs with one weight scale shared across groups (calibrated over groups and contraction)"
_INTEGER_FORMATS = frozenset({"int8", "int8_aqt", "int8_qwix"})


def _library_neighbours(mm: _Matmul, lhs, rhs, lhs_fmt: str, rhs_fmt: str) -> Iterator[tuple[str, np.ndarray]]:
    """What a library computes under the declared formats' names (qcheck.referees._libraries), on both operands.

    Names for a failure only: the reference need not tell them apart on every
    operand (qwix's MXFP8 equals OCP's on blocks whose amax significand is at
    most 1.75), so they never refuse operands.
    """
    ftz = jax.default_backend() == "cpu"
    for (dl, ql), (dr, qr) in itertools.product(LIBRARY_RULES.get(lhs_fmt, ()), LIBRARY_RULES.get(rhs_fmt, ())):
        desc = f"both operands in {dl}" if dl == dr else f"lhs in {dl}, rhs in {dr}"
        yield desc, mm(ql(lhs, mm.axes.lhs, ftz), qr(rhs, mm.axes.rhs, ftz))


def _integer_reference(mm: _Matmul, lhs, rhs, lhs_fmt: str, rhs_fmt: str, order: str, rhs_axes=None) -> np.ndarray:
    """The integer-mode reference: referee codes multiplied exactly, then the scales in ``order``."""
    ftz = jax.default_backend() == "cpu"
    rhs_axes = mm.axes.rhs if rhs_axes is None else rhs_axes
    (cl, sl), (cr, sr) = ((c, s["slice"]) for c, s in (
        referees.reference_quantize(lhs, lhs_fmt, axis=mm.axes.lhs, ftz=ftz, xla_reciprocal=True),
        referees.reference_quantize(rhs, rhs_fmt, axis=rhs_axes, ftz=ftz, xla_reciprocal=True)))
    if mm.eqn is None:
        return _integer_matmul.integer_ragged_dot(cl, sl, cr, sr, mm.group_sizes, order=order, ftz=ftz)
    return _integer_matmul.integer_einsum(mm.eqn, cl, sl, cr, sr, mm.axes, order=order, ftz=ftz)


def _integer_neighbours(mm: _Matmul, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt) -> Iterator[tuple[str, np.ndarray]]:
    """The integer-mode bugs: the float matmul a library might run instead, the scales in the other order."""
    yield "the float32 matmul of the dequantized operands (matmul='float')", mm(q_lhs, q_rhs)
    yield (f"the scales applied in the other order ({_integer_matmul.SCALE_ORDERS[1]})",
           _integer_reference(mm, lhs, rhs, lhs_fmt, rhs_fmt, _integer_matmul.SCALE_ORDERS[1]))
    if mm.eqn is None:
        yield _SHARED + ", in integer arithmetic", _integer_reference(
            mm, lhs, rhs, lhs_fmt, rhs_fmt, _integer_matmul.SCALE_ORDERS[0], rhs_axes=_SHARED_AXES)


def _check(check: str, site: str, mm: _Matmul, lhs, rhs, got, lhs_fmt: str, rhs_fmt: str, *, strict: bool,
           matmul: str = "float") -> None:
    __tracebackhide__ = True
    integer = matmul == "integer"
    prefix = f"{check}: site {site!r} {mm.what} ({lhs_fmt} x {rhs_fmt}{', integer matmul' if integer else ''})"
    q = {(o1, o2): (_qdq(lhs, lhs_fmt, mm.axes.lhs, o1), _qdq(rhs, rhs_fmt, mm.axes.rhs, o2))
         for o1, o2 in itertools.product(_orders(lhs_fmt), _orders(rhs_fmt))}
    q_lhs, q_rhs = q[(NVFP4_DECODE_ORDERS[0], NVFP4_DECODE_ORDERS[0])]
    if integer:
        want = _integer_reference(mm, lhs, rhs, lhs_fmt, rhs_fmt, _integer_matmul.SCALE_ORDERS[0])
        bugs = itertools.chain(_neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt),
                               _integer_neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt))
    else:
        want = mm(q_lhs, q_rhs)
        bugs = _neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt)
    if not strict:  # the layer's own operands: only the bug every path can have must be tellable
        bugs = itertools.islice(bugs, 1)
    known = {}
    for desc, bug in bugs:
        if _equal(bug, want):
            raise ValueError(f"{prefix}: for these operands the reference equals {desc} bitwise, so that bug "
                             "would pass; use probe_site_operands (with lhs_format= and rhs_format=)")
        known[desc] = bug
    if integer and _equal(got, want):
        return
    candidates = ((a, b, layout) for (a, b) in q.values() for layout in mm.layouts())
    if not integer and any(_equal(got, mm(a, b, layout)) for a, b, layout in candidates):
        return
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{prefix}: result is {got.dtype}{list(got.shape)}, the reference "
                             f"{want.dtype}{list(want.shape)}")
    off = _bits(got) != _bits(want)
    first = tuple(int(i) for i in np.argwhere(off)[0])
    if not strict:  # now it failed, name the bug if it is a known one
        known.update(_neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt))
        if integer:
            known.update(_integer_neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt))
    matched = [desc for desc, bug in known.items() if _equal(got, bug)]
    if not matched and not integer:
        matched = [desc for desc, bug in _library_neighbours(mm, lhs, rhs, lhs_fmt, rhs_fmt) if _equal(got, bug)]
    why = f"it equals {matched[0]} bitwise" if matched else (
        f"it matches no known bug; relative norm to the reference "
        f"{float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)):.3g}")
    raise AssertionError(
        f"{prefix}: differs from the referee-quantized reference at {int(off.sum())} of {off.size} elements, "
        f"first at {first}: got {got[first]!r}, expected {want[first]!r}; {why}")


def assert_site_exact(
    einsum: Callable[[str, ArrayLike, ArrayLike], ArrayLike],
    eqn: str,
    lhs: ArrayLike,
    rhs: ArrayLike,
    *,
    lhs_format: str,
    rhs_format: str,
    site: str = "",
    matmul: str = "float",
) -> None:
    """Assert ``einsum(eqn, lhs, rhs)`` equals the einsum of referee-quantized operands, bitwise.

    ``lhs``/``rhs`` (float32) are quantized in ``lhs_format``/``rhs_format``
    along the einsum's contraction axes. Operands that cannot tell the reference
    from a neighbouring bug are refused with a ValueError (see
    :func:`probe_site_operands`). ``site`` names the call site in messages.
    ``matmul="integer"`` (int8 formats): the reference multiplies the codes
    exactly and applies the scales after (:mod:`qcheck.referees._integer`).
    """
    __tracebackhide__ = True
    check = "assert_site_exact"
    lhs, rhs = _float32(lhs, "lhs", check), _float32(rhs, "rhs", check)
    _check_formats(check, lhs_format, rhs_format, matmul=matmul)
    mm = _Matmul(eqn, lhs.shape, rhs.shape)
    got = np.asarray(einsum(eqn, jax.device_put(lhs), jax.device_put(rhs)))
    _check(check, site, mm, lhs, rhs, got, lhs_format, rhs_format, strict=True, matmul=matmul)


def assert_site_ragged_exact(
    ragged_dot: Callable[[ArrayLike, ArrayLike, ArrayLike], ArrayLike],
    lhs: ArrayLike,
    rhs: ArrayLike,
    group_sizes: ArrayLike,
    *,
    lhs_format: str,
    rhs_format: str,
    site: str = "",
    matmul: str = "float",
) -> None:
    """:func:`assert_site_exact` for a grouped matmul ``ragged_dot(lhs[m, k], rhs[g, k, n], group_sizes)``."""
    __tracebackhide__ = True
    check = "assert_site_ragged_exact"
    lhs, rhs = _float32(lhs, "lhs", check), _float32(rhs, "rhs", check)
    _check_formats(check, lhs_format, rhs_format, matmul=matmul)
    gs = np.asarray(group_sizes, np.int32)
    mm = _Matmul(None, lhs.shape, rhs.shape, gs)
    got = np.asarray(ragged_dot(jax.device_put(lhs), jax.device_put(rhs), jax.device_put(gs)))
    _check(check, site, mm, lhs, rhs, got, lhs_format, rhs_format, strict=True, matmul=matmul)


def _check_formats(check: str, *fmts: str, matmul: str = "float") -> None:
    for fmt in fmts:
        if fmt not in _NEIGHBOURS:
            raise ValueError(f"{check}: unknown format {fmt!r}; valid formats: {', '.join(_NEIGHBOURS)}")
    if matmul not in _integer_matmul.MATMUL_MODES:
        raise ValueError(f"{check}: unknown matmul {matmul!r}; valid: {', '.join(_integer_matmul.MATMUL_MODES)}")
    if matmul == "integer" and (bad := [f for f in fmts if f not in _INTEGER_FORMATS]):
        raise ValueError(f"{check}: matmul='integer' needs integer formats ({', '.join(sorted(_INTEGER_FORMATS))}), "
                         f"got {', '.join(bad)}")


def probe_site_operands(
    seed: int,
    lhs_shape: tuple[int, ...],
    rhs_shape: tuple[int, ...],
    axes: MatmulAxes,
    *,
    nvfp4: bool = False,
    lhs_format: str | None = None,
    rhs_format: str | None = None,
    spread: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Probe operands that make :func:`assert_site_exact` sharp for the matmul with contraction ``axes``.

    :func:`qcheck.checks.probe_operands` (log-uniform over 2^-4..2^10), or with
    ``nvfp4`` (or an nvfp4 format) :func:`qcheck.checks._backward.probe_nvfp4` along
    the contraction axes and the wrong axes, whose blocks decode exactly in any
    order. An operand whose format (``lhs_format``/``rhs_format``, as the
    check will be given them) parts from its sibling flavour only at smaller
    magnitudes (:data:`PARTING_BINADES`: e5m2 and e5m2fnuz) has a quarter of
    its contraction fibres filled from that binade instead, so the check can
    tell the two apart; without the formats it gets the plain probes.
    ``spread`` scales the log-uniform probes by 2^r, r an integer in [-6, 6]
    drawn per index of every axis, so block amaxes differ along any axes (a
    power-of-two scale rounded up, as ``mxfp8_jax``'s, otherwise comes out the
    same for every block of values that all reach about 2^10).
    """
    for fmt in (lhs_format, rhs_format):
        if fmt is not None and fmt not in _NEIGHBOURS:
            raise ValueError(f"probe_site_operands: unknown format {fmt!r}; valid formats: {', '.join(_NEIGHBOURS)}")
    nvfp4 = nvfp4 or "nvfp4" in (lhs_format, rhs_format)
    if not nvfp4:
        from qcheck.checks._fresh import probe_operands

        lhs, rhs = probe_operands(seed, lhs_shape, rhs_shape)
        if spread:
            rng = np.random.default_rng(seed + 1000)
            lhs, rhs = (x * np.exp2(sum(rng.integers(-6, 7, n).reshape([-1 if d == a else 1 for d in range(x.ndim)])
                                        for a, n in enumerate(x.shape))).astype(np.float32) for x in (lhs, rhs))
    else:
        from qcheck.checks._backward import probe_nvfp4

        def probe(s, shape, ax):
            wrong = _wrong_axes(ax, len(shape))
            try:
                referees.reference_quantize(np.zeros(shape, np.float32), "nvfp4", axis=wrong)
            except ValueError:
                return probe_nvfp4(s, shape, ax)
            return probe_nvfp4(s, shape, ax, wrong)

        lhs, rhs = probe(seed, lhs_shape, axes.lhs), probe(seed + 100, rhs_shape, axes.rhs)
    return (_parting(lhs, axes.lhs, lhs_format, (seed, 0)), _parting(rhs, axes.rhs, rhs_format, (seed, 1)))


def _parting(x: np.ndarray, axes: tuple[int, ...], fmt: str | None, seed: tuple[int, int]) -> np.ndarray:
    """``x`` with some of its contraction fibres drawn log-uniform from ``fmt``'s parting binade, if it has one."""
    if fmt not in PARTING_BINADES:
        return x
    lo, hi = PARTING_BINADES[fmt]
    rng = np.random.default_rng(seed)  # a stream of its own: the rest of the probe stays what it was
    axes = tuple(a % x.ndim for a in axes)
    fibres = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    pick = rng.random(fibres) < _PARTING_SHARE
    pick.flat[0] = True  # at least one
    small = np.exp2(rng.uniform(lo, hi, size=x.shape)) * rng.choice(np.array([-1.0, 1.0]), size=x.shape)
    return np.where(pick, small, x).astype(x.dtype)


# -- through the layer -------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["lhs", "rhs", "group_sizes", "out"],
                   meta_fields=["site", "eqn"])
@dataclasses.dataclass(frozen=True)
class SiteCall:
    """One call of a site in a forward pass: its name, einsum ``eqn`` (None: ragged_dot), operands and output."""

    site: str
    eqn: str | None
    lhs: jax.Array
    rhs: jax.Array
    group_sizes: jax.Array | None
    out: jax.Array


class _Recorder:
    """Stands in for one site: calls it and logs what it received and returned.

    The barrier makes the logged operands the very buffers the site consumes
    (else XLA may recompute an activation inside the site's fusion, an ulp away).
    """

    def __init__(self, site, name: str, log: list[SiteCall]):
        self.site, self.name, self.log = site, name, log

    def __call__(self, eqn, lhs, rhs, **kwargs):
        lhs, rhs = jax.lax.optimization_barrier((lhs, rhs))
        out = self.site(eqn, lhs, rhs, **kwargs)
        self.log.append(SiteCall(self.name, eqn, lhs, rhs, None, out))
        return out

    def ragged_dot(self, lhs, rhs, group_sizes, **kwargs):
        lhs, rhs = jax.lax.optimization_barrier((lhs, rhs))
        out = self.site.ragged_dot(lhs, rhs, group_sizes, **kwargs)
        self.log.append(SiteCall(self.name, None, lhs, rhs, group_sizes, out))
        return out


def record_site_calls(layer: nnx.Module, x: jax.Array) -> tuple[jax.Array, list[SiteCall]]:
    """``layer(x)`` and its site calls, traced inside the caller's program; ``layer`` must be a copy it owns."""
    log: list[SiteCall] = []
    # The layer reads its sites through `self.sites`; this copy's reads go to the recorders.
    object.__setattr__(layer, "sites", {n: _Recorder(layer.sites[n], n, log) for n in layer.sites.keys()})
    return layer(x), log


@functools.partial(jax.jit, static_argnums=0)
def _capture(graphdef, state, x):
    return record_site_calls(nnx.merge(graphdef, state, copy=True), x)


def capture_site_calls(layer: nnx.Module, x: ArrayLike) -> tuple[jax.Array, list[SiteCall]]:
    """The output of ``layer(x)`` and every site call it made, in call order, from one jitted forward pass.

    ``layer`` holds its call sites in ``layer.sites`` (name -> site) and reads
    them from there; ``layer`` itself is not changed. One program per layer
    structure and input shape.
    """
    if not isinstance(getattr(layer, "sites", None), Mapping) and not hasattr(getattr(layer, "sites", None), "keys"):
        raise TypeError(f"layer must hold its call sites in layer.sites, got {type(layer).__name__}")
    graphdef, state = nnx.split(layer)
    return _capture(graphdef, state, x)


def assert_layer_sites_exact(layer: nnx.Module, x: ArrayLike, recipe: Recipe | str, *, label: str = "") -> None:
    """Every site of a fresh ``layer`` is called once in ``layer(x)`` and equals the reference of its own operands.

    One jitted forward pass records each site's operands and output
    (:func:`capture_site_calls`); on the host each output is held bit for bit
    to the matmul of its operands quantized by the referee in the recipe's
    formats (:func:`operand_formats`). Fails naming the site when a site is
    never called, called more than once (another site's wrapper used in its
    place), or computes anything else (a path that skips quantization).
    """
    __tracebackhide__ = True
    operand_formats(recipe)  # a recipe without formats fails before anything compiles
    _, calls = capture_site_calls(layer, x)
    assert_site_calls_exact(tuple(layer.sites.keys()), calls, recipe, label=label)


def assert_site_calls_exact(
    sites: tuple[str, ...], calls: list[SiteCall], recipe: Recipe | str, *, label: str = ""
) -> None:
    """:func:`assert_layer_sites_exact` on calls already captured (by :func:`record_site_calls` in some program).

    ``sites`` names every site the layer holds, so one that was never called fails.
    """
    __tracebackhide__ = True
    check = "assert_layer_sites_exact"
    where = f"{label}: " if label else ""
    lhs_fmt, rhs_fmt = operand_formats(recipe)
    matmul = get_recipe(recipe).reference.matmul
    _check_formats(check, lhs_fmt, rhs_fmt, matmul=matmul)
    counts = {name: 0 for name in sites}
    for call in calls:
        counts[call.site] += 1
    tally = ", ".join(f"{n} x{c}" for n, c in counts.items())
    for name in (n for n, c in counts.items() if c == 0):  # the site whose call went elsewhere comes first
        raise AssertionError(f"{where}{check}: site {name!r} was never called in the forward pass (calls: "
                             f"{tally}); the layer skips it or calls another site in its place")
    for name, n in counts.items():
        if n > 1:
            raise AssertionError(f"{where}{check}: site {name!r} was called {n} times in one forward pass (calls: "
                                 f"{tally}); another call site uses its wrapper")
    for call in calls:
        lhs, rhs, out = (np.asarray(a) for a in (call.lhs, call.rhs, call.out))
        gs = None if call.group_sizes is None else np.asarray(call.group_sizes)
        mm = _Matmul(call.eqn, lhs.shape, rhs.shape, gs)
        try:
            _check(check, call.site, mm, lhs, rhs, out, lhs_fmt, rhs_fmt, strict=False, matmul=matmul)
        except AssertionError as e:
            raise AssertionError(f"{where}{e}") from None
