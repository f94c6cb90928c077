"""Forward exactness of call sites for every declared operand format, on probes and through the layer.

A fresh call site of a recipe that declares its operand formats (``Recipe.lhs``
/ ``rhs``; fp8-class recipes: their ``cast_dtype``) must equal, bit for bit,
the same matmul (``jnp.einsum`` or ``jax.lax.ragged_dot``, run by JAX) of its
operands quantized by :mod:`qcheck.referees` along the matmul's contraction
axes (:func:`qcheck.recipes.einsum_axes`, ``RAGGED_AXES``), never by
:mod:`qcheck.formats`.

Two ways in:

- :func:`assert_site_exact`: a site's einsum or ragged_dot on probe operands
  of the caller's choosing. Operands for which the reference equals a
  neighbour bitwise (the plain matmul, one operand unquantized, the other
  int8 variant, the other fp8 flavour, unscaled fp8 for current scaling,
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
- :data:`EINSUM_PARTIAL_SUMS`: XLA:CPU's dot may sum the contraction
  into a few interleaved partial sums, as many as the CPU, the layout and
  the intra-op threads give it (jax_mxfp8 ``wo`` on an AVX-512 AMD EPYC, jax
  0.12: two); for matmuls of up to 2^24 multiply-adds the reference also
  sums in 1, 2, 4, 8 and 16, in numpy.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping

import jax
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from qcheck import formats, referees
from qcheck.checks._assertion import assertion
from qcheck.checks._bits import as_float32, bitwise_equal
from qcheck.checks._mismatch import mismatch, refuse_known_bugs
from qcheck.checks._probes import log_uniform, part_fibres, probe_nvfp4
from qcheck.checks._tracks import count_nonfinite
from qcheck.recipes import Einsum, Matmul, MatmulAxes, Ragged, Recipe, as_matmul, get_recipe
from qcheck.referees import LIBRARY_RULES, MATMUL_MODES, SCALE_ORDERS, Blocks, flush

#: NVFP4 decode orders the reference accepts: qcheck's documented one, and XLA's rewrite of it.
NVFP4_DECODE_ORDERS = ("1 / (s_enc / s_block)", "s_block / s_enc")

#: The formats a wrong-variant bug would use instead, by format (the probes must tell each apart): each
#: record's siblings.
NEIGHBOURS = {f.name: f.siblings for f in formats.FORMATS}


def operand_formats(recipe: Recipe | str) -> tuple[str, str]:
    """The (lhs, rhs) formats a fresh site of ``recipe`` quantizes to: ``lhs``/``rhs``, else its ``cast_dtype``."""
    recipe = get_recipe(recipe)
    if recipe.lhs is not None:
        return recipe.lhs, recipe.rhs
    if recipe.reference.cast_dtype is not None:
        name = formats.cast_format(recipe.reference.cast_dtype, where=f"recipe {recipe.name!r}").name
        return name, name
    raise ValueError(
        f"recipe {recipe.name!r} declares no operand formats (lhs=/rhs=) and no cast_dtype, "
        "so there is no exact reference for its call sites")


def _wrong_axes(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    # The default-axis bug (axis=-1) where the contraction is elsewhere; else the axis before it.
    return (ndim - 1,) if axes != (ndim - 1,) else (ndim - 2,)


def _qdq(x: np.ndarray, fmt: str, axes: tuple[int, ...], order: str = NVFP4_DECODE_ORDERS[0],
         form: str = "all by reciprocal") -> np.ndarray:
    ftz = jax.default_backend() == "cpu"  # XLA's CPU backend flushes float32 subnormals
    if order == NVFP4_DECODE_ORDERS[0]:
        return referees.reference_qdq(x, fmt, axis=axes, ftz=ftz, xla_reciprocal=form)
    # XLA's order (only for a format whose record allows decode_ulps): the block scale over the tensor scale.
    codes, scales = referees.reference_quantize(x, fmt, axis=axes, ftz=ftz)
    blocks = Blocks(codes.shape, tuple(sorted(a % x.ndim for a in axes)), formats.get_format(fmt).block, fmt)
    c = blocks.split(codes.astype(np.float32))
    sb = scales["block"].astype(np.float32)[..., None]
    nonzero = sb > 0
    out = np.where(nonzero, c * (np.where(nonzero, sb, np.float32(1)) / scales["tensor"]), np.float32(0))
    return flush(blocks.join(out.astype(np.float32)), ftz)


def _qdq_in(x: np.ndarray, fmt: str, axes: tuple[int, ...], *, form: str) -> np.ndarray:
    return _qdq(x, fmt, axes, form=form)


def forms_of(*fmts: str) -> tuple[str, ...]:
    """The referee forms every one of ``fmts`` admits (their records' ``forms``), in the first's order: one
    program computes its divisions one way, so a site's operands are held in one form together."""
    return tuple(f for f in formats.get_format(fmts[0]).forms
                 if all(f in formats.get_format(other).forms for other in fmts[1:]))


def _orders(fmt: str) -> tuple[str, ...]:
    # A format whose record says XLA may reorder its decode (nvfp4) is held to either order.
    return NVFP4_DECODE_ORDERS if formats.get_format(fmt).decode_ulps else NVFP4_DECODE_ORDERS[:1]


def _neighbours(mm: Matmul, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt, form: str = "all by reciprocal"
                ) -> Iterator[tuple[str, np.ndarray]]:
    """(description, result) of each bug the reference must tell apart, its divisions in ``form``, computed
    lazily."""
    _qdq = functools.partial(_qdq_in, form=form)
    yield "the unquantized matmul", mm.reference(lhs, rhs)
    yield "lhs unquantized", mm.reference(lhs, q_rhs)
    yield "rhs unquantized", mm.reference(q_lhs, rhs)
    for side, x, fmt, axes in (("lhs", lhs, lhs_fmt, mm.axes(lhs.ndim, rhs.ndim).lhs), ("rhs", rhs, rhs_fmt, mm.axes(lhs.ndim, rhs.ndim).rhs)):
        def with_(q):
            return mm.reference(q, q_rhs) if side == "lhs" else mm.reference(q_lhs, q)
        for other in formats.get_format(fmt).siblings:
            yield f"{side} in {other} instead of {fmt}", with_(_qdq(x, other, axes))
        if formats.get_format(fmt).per_axis:
            wrong = _wrong_axes(axes, x.ndim)
            try:
                q = _qdq(x, fmt, wrong)
            except ValueError:  # the wrong axes cannot hold whole blocks: that bug could not run here
                continue
            yield f"{side} in {fmt} along the wrong axes {wrong} (contraction: {axes})", with_(q)
    if lhs_fmt == rhs_fmt:  # the wrong flavour throughout, as a recipe that declares one and runs another has it
        for other in formats.get_format(lhs_fmt).siblings:
            yield (f"both operands in {other} instead of {lhs_fmt}",
                   mm.reference(_qdq(lhs, other, mm.axes(lhs.ndim, rhs.ndim).lhs), _qdq(rhs, other, mm.axes(lhs.ndim, rhs.ndim).rhs)))
    # Per-slice formats only: a block format's blocks lie within one group's contraction either way.
    if mm.shared_rhs_axes is not None and _integer(rhs_fmt):
        yield _SHARED, mm.reference(q_lhs, _qdq(rhs, rhs_fmt, mm.shared_rhs_axes))


_SHARED = "rhs with one weight scale shared across groups (calibrated over groups and contraction)"
# The integer reference multiplies the integer sum by each operand's scale: a format whose stored scale divides
# (int8_keras: Keras divides the sum by the product of its encode scales) is not that arithmetic, nor is one whose
# codes carry a zero point (int8_qwix_minmax: the sum needs a correction term).
def _integer(fmt: str) -> bool:
    record = formats.get_format(fmt)
    return record.kind == "int" and not record.divides and "zero_point" not in record.scales


def _library_neighbours(mm: Matmul, lhs, rhs, lhs_fmt: str, rhs_fmt: str) -> Iterator[tuple[str, np.ndarray]]:
    """What a library computes under the declared formats' names (``qcheck.referees.LIBRARY_RULES``), on both operands.

    Names for a failure only: the reference need not tell them apart on every
    operand (qwix's MXFP8 equals OCP's on blocks whose amax significand is at
    most 1.75), so they never refuse operands.
    """
    ftz = jax.default_backend() == "cpu"
    for (dl, ql), (dr, qr) in itertools.product(LIBRARY_RULES.get(lhs_fmt, ()), LIBRARY_RULES.get(rhs_fmt, ())):
        desc = f"both operands in {dl}" if dl == dr else f"lhs in {dl}, rhs in {dr}"
        yield desc, mm.reference(ql(lhs, mm.axes(lhs.ndim, rhs.ndim).lhs, ftz), qr(rhs, mm.axes(lhs.ndim, rhs.ndim).rhs, ftz))


def _integer_reference(mm: Matmul, lhs, rhs, lhs_fmt: str, rhs_fmt: str, order: str, rhs_axes=None,
                       form: str = "all by reciprocal") -> np.ndarray:
    """The integer-mode reference: referee codes (in ``form``) multiplied exactly, then the scales in ``order``."""
    ftz = jax.default_backend() == "cpu"
    rhs_axes = mm.axes(lhs.ndim, rhs.ndim).rhs if rhs_axes is None else rhs_axes
    (cl, sl), (cr, sr) = ((c, s["slice"]) for c, s in (
        referees.reference_quantize(lhs, lhs_fmt, axis=mm.axes(lhs.ndim, rhs.ndim).lhs, ftz=ftz, xla_reciprocal=form),
        referees.reference_quantize(rhs, rhs_fmt, axis=rhs_axes, ftz=ftz, xla_reciprocal=form)))
    return mm.integer(cl, sl, cr, sr, order=order, ftz=ftz)


def _integer_neighbours(mm: Matmul, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt, form: str = "all by reciprocal"
                        ) -> Iterator[tuple[str, np.ndarray]]:
    """The integer-mode bugs: the float matmul a library might run instead, the scales in the other order."""
    yield "the float32 matmul of the dequantized operands (arithmetic='float')", mm.reference(q_lhs, q_rhs)
    yield (f"the scales applied in the other order ({SCALE_ORDERS[1]})",
           _integer_reference(mm, lhs, rhs, lhs_fmt, rhs_fmt, SCALE_ORDERS[1], form=form))
    if mm.shared_rhs_axes is not None:
        yield _SHARED + ", in integer arithmetic", _integer_reference(
            mm, lhs, rhs, lhs_fmt, rhs_fmt, SCALE_ORDERS[0], rhs_axes=mm.shared_rhs_axes, form=form)


def _check(site: str, mm: Matmul, lhs, rhs, got, lhs_fmt: str, rhs_fmt: str, *, strict: bool,
           arithmetic: str = "float", refuse: bool = True) -> None:
    __tracebackhide__ = True
    integer = arithmetic == "integer"
    prefix = f"site {site!r} {mm.what} ({lhs_fmt} x {rhs_fmt}{', integer matmul' if integer else ''})"
    axes = mm.axes(lhs.ndim, rhs.ndim)
    forms = forms_of(lhs_fmt, rhs_fmt)
    q_lhs, q_rhs = _qdq(lhs, lhs_fmt, axes.lhs, form=forms[0]), _qdq(rhs, rhs_fmt, axes.rhs, form=forms[0])

    def operands():  # every admissible (form, decode order) pair's operands, lazily: the first usually matches
        for form, o1, o2 in itertools.product(forms, _orders(lhs_fmt), _orders(rhs_fmt)):
            a, b = _qdq(lhs, lhs_fmt, axes.lhs, o1, form), _qdq(rhs, rhs_fmt, axes.rhs, o2, form)
            # A form whose referee makes NaN of finite operands (a flushed scale divided by) holds nothing.
            if referees.keeps_finite(lhs, a) and referees.keeps_finite(rhs, b):
                yield a, b

    if integer:
        want = _integer_reference(mm, lhs, rhs, lhs_fmt, rhs_fmt, SCALE_ORDERS[0], form=forms[0])
        bugs = itertools.chain(_neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt),
                               _integer_neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt))
    else:
        want = mm.reference(q_lhs, q_rhs)
        bugs = _neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt)
    if not strict:  # the layer's own operands: only the bug every path can have must be tellable
        bugs = itertools.islice(bugs, 1)
    if refuse:
        known = refuse_known_bugs(prefix, want, bugs, advice="use probe_site_operands (with lhs_format= and "
                                                             "rhs_format=)")
    else:  # held to the reference all the same: a bug it equals here is another check's to catch
        known = {desc: bug for desc, bug in bugs if not bitwise_equal(bug, want)}
    if integer and any(bitwise_equal(got, want if form == forms[0] else
                                     _integer_reference(mm, lhs, rhs, lhs_fmt, rhs_fmt, SCALE_ORDERS[0], form=form))
                       for form in forms):
        return
    candidates = ((a, b, layout) for (a, b) in operands() for layout in mm.layouts(lhs.shape, rhs.shape))
    if not integer and any(bitwise_equal(got, mm.reference(a, b, layout)) for a, b, layout in candidates):
        return
    if not strict and got.shape == want.shape:  # now it failed, name the bug if it is a known one
        known.update(_neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt, forms[0]))
        if integer:
            known.update(_integer_neighbours(mm, lhs, rhs, q_lhs, q_rhs, lhs_fmt, rhs_fmt, forms[0]))
    if got.shape == want.shape and not any(bitwise_equal(got, bug) for bug in known.values()):
        # A bug computed in another admissible form is the same bug: name it so, where none is named already.
        for form in forms[1:]:
            ql, qr = _qdq(lhs, lhs_fmt, axes.lhs, form=form), _qdq(rhs, rhs_fmt, axes.rhs, form=form)
            others = itertools.chain(_neighbours(mm, lhs, rhs, ql, qr, lhs_fmt, rhs_fmt, form),
                                     _integer_neighbours(mm, lhs, rhs, ql, qr, lhs_fmt, rhs_fmt, form) if integer
                                     else ())
            for desc, bug in others:
                if desc in known and not bitwise_equal(got, known[desc]) and bitwise_equal(got, bug):
                    known[desc] = bug

    def otherwise() -> str:
        if not integer and (lib := next((desc for desc, bug in _library_neighbours(mm, lhs, rhs, lhs_fmt, rhs_fmt)
                                         if bitwise_equal(got, bug)), None)):
            return f"it equals {lib} bitwise"
        if count_nonfinite(got) > count_nonfinite(want):
            return (f"it has {count_nonfinite(got)} non-finite values where the reference has "
                    f"{count_nonfinite(want) or 'none'} (a cast without saturation overflows to NaN)")
        return (f"it matches no known bug; relative norm to the reference "
                f"{float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)):.3g}")

    raise mismatch(f"{prefix}:", got, want, reference="the referee-quantized reference", bugs=known,
                   otherwise=otherwise)


@assertion
def assert_site_exact(
    op: Callable[..., ArrayLike],
    matmul: str | Einsum | Ragged,
    lhs: ArrayLike,
    rhs: ArrayLike,
    *,
    lhs_format: str,
    rhs_format: str,
    site: str = "",
    arithmetic: str = "float",
    label: str = "",
) -> None:
    """Assert a call site's matmul equals the same matmul of referee-quantized operands, bitwise.

    ``matmul`` is an einsum string (``op(eqn, lhs, rhs)``, against
    ``jnp.einsum``) or :class:`~qcheck.checks.Ragged` (``op(lhs, rhs,
    group_sizes)``, against ``jax.lax.ragged_dot``). ``lhs``/``rhs`` (float32)
    are quantized in ``lhs_format``/``rhs_format`` along the matmul's
    contraction axes. Operands that cannot tell the reference from a
    neighbouring bug are refused with a ValueError (see
    :func:`probe_site_operands`). ``site`` names the call site in messages.
    ``arithmetic="integer"`` (int8 formats): the reference multiplies the codes
    exactly and applies the scales after (:func:`qcheck.referees.integer_einsum`).
    """
    mm, lhs, rhs = _site_inputs(matmul, lhs, rhs, lhs_format, rhs_format, arithmetic)
    judge_site_exact(mm, lhs, rhs, mm.call(op, lhs, rhs), lhs_format=lhs_format, rhs_format=rhs_format, site=site,
                     arithmetic=arithmetic)


def _site_inputs(matmul, lhs, rhs, lhs_format: str, rhs_format: str, arithmetic: str):
    mm = as_matmul(matmul)
    lhs, rhs = as_float32(lhs, "lhs"), as_float32(rhs, "rhs")
    mm.check_operands(lhs, rhs)
    _check_formats(lhs_format, rhs_format, arithmetic=arithmetic)
    return mm, lhs, rhs


def judge_site_exact(matmul: Matmul, lhs: ArrayLike, rhs: ArrayLike, got: ArrayLike, *, lhs_format: str,
                     rhs_format: str, site: str = "", arithmetic: str = "float") -> None:
    """:func:`assert_site_exact`'s judgement of ``got``, what the site computed on these operands elsewhere."""
    __tracebackhide__ = True
    mm, lhs, rhs = _site_inputs(matmul, lhs, rhs, lhs_format, rhs_format, arithmetic)
    _check(site, mm, lhs, rhs, np.asarray(got), lhs_format, rhs_format, strict=True, arithmetic=arithmetic)


def _check_formats(*fmts: str, arithmetic: str = "float") -> None:
    for fmt in fmts:
        formats.get_format(fmt)
    if arithmetic not in MATMUL_MODES:
        raise ValueError(f"unknown arithmetic {arithmetic!r}; valid: {', '.join(MATMUL_MODES)}")
    if arithmetic == "integer" and (bad := [f for f in fmts if not _integer(f)]):
        integer = sorted(f for f in formats.format_names() if _integer(f))
        raise ValueError(f"arithmetic='integer' needs integer formats ({', '.join(integer)}), "
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
    ``nvfp4`` (or an nvfp4 format) :func:`~qcheck.checks._probes.probe_nvfp4` along
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
        if fmt is not None:
            formats.get_format(fmt, where="probe_site_operands")
    # A format XLA may decode in another order (its record's decode_ulps: nvfp4) needs probes that decode
    # exactly in every order.
    nvfp4 = nvfp4 or any(f is not None and formats.get_format(f).decode_ulps for f in (lhs_format, rhs_format))
    if not nvfp4:
        lhs, rhs = log_uniform(seed, (lhs_shape, rhs_shape),
                               [None if f is None else formats.get_format(f) for f in (lhs_format, rhs_format)])
        if spread:
            rng = np.random.default_rng(seed + 1000)
            lhs, rhs = (x * np.exp2(sum(rng.integers(-6, 7, n).reshape([-1 if d == a else 1 for d in range(x.ndim)])
                                        for a, n in enumerate(x.shape))).astype(np.float32) for x in (lhs, rhs))
    else:
        def probe(s, shape, ax):
            wrong = _wrong_axes(ax, len(shape))
            try:
                referees.reference_quantize(np.zeros(shape, np.float32), "nvfp4", axis=wrong)
            except ValueError:
                return probe_nvfp4(s, shape, ax)
            return probe_nvfp4(s, shape, ax, wrong)

        lhs, rhs = probe(seed, lhs_shape, axes.lhs), probe(seed + 100, rhs_shape, axes.rhs)
    return (part_fibres(lhs, axes.lhs, lhs_format, (seed, 0)), part_fibres(rhs, axes.rhs, rhs_format, (seed, 1)))


# -- through the layer -------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["matmul", "lhs", "rhs", "out"],
                   meta_fields=["site"])
@dataclasses.dataclass(frozen=True)
class SiteCall:
    """One call of a site in a forward pass: its name, its matmul (an einsum, or a ragged_dot with the group sizes
    it received), operands and output."""

    site: str
    matmul: Matmul
    lhs: jax.Array
    rhs: jax.Array
    out: jax.Array


class _Recorder:
    """Stands in for one site: calls it and logs what it received and returned.

    The barrier makes the logged operands the very buffers the site consumes
    (else XLA may recompute an activation inside the site's fusion, an ulp away).
    """

    def __init__(self, site, name: str, log: list[SiteCall]):
        self.site, self.name, self.log = site, name, log

    def __call__(self, eqn, lhs, rhs, **kwargs):
        return self._record(Einsum(eqn), lhs, rhs, kwargs)

    def ragged_dot(self, lhs, rhs, group_sizes, **kwargs):
        return self._record(Ragged.recorded(group_sizes), lhs, rhs, kwargs)

    def _record(self, mm: Matmul, lhs, rhs, kwargs):
        lhs, rhs = jax.lax.optimization_barrier((lhs, rhs))
        out = mm.run(self.site, lhs, rhs, **kwargs)
        self.log.append(SiteCall(self.name, mm, lhs, rhs, out))
        return out


def record_site_calls(layer: nnx.Module, x: jax.Array) -> tuple[jax.Array, list[SiteCall]]:
    """``layer(x)`` and its site calls, traced inside the caller's program; ``layer`` must be a copy it owns."""
    log: list[SiteCall] = []
    # The layer reads its sites through `self.sites`; this copy's reads go to the recorders. A plain NNX
    # attribute assignment: the copy was made in this trace, and the recorders hold no arrays of their own.
    layer.sites = {n: _Recorder(layer.sites[n], n, log) for n in layer.sites.keys()}
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


@assertion
def assert_layer_sites_exact(layer: nnx.Module, x: ArrayLike, recipe: Recipe | str, *, label: str = "") -> None:
    """Every site of a fresh ``layer`` is called once in ``layer(x)`` and equals the reference of its own operands.

    One jitted forward pass records each site's operands and output
    (:func:`capture_site_calls`); on the host each output is held bit for bit
    to the matmul of its operands quantized by the referee in the recipe's
    formats (:func:`operand_formats`). Fails naming the site when a site is
    never called, called more than once (another site's wrapper used in its
    place), or computes anything else (a path that skips quantization).
    """
    operand_formats(recipe)  # a recipe without formats fails before anything compiles
    _, calls = capture_site_calls(layer, x)
    judge_site_calls(tuple(layer.sites.keys()), calls, recipe)


def judge_site_calls(sites: tuple[str, ...], calls: list[SiteCall], recipe: Recipe | str, *,
                     refuse: bool = True) -> None:
    """:func:`assert_layer_sites_exact`'s judgement of calls already captured (by :func:`record_site_calls` in
    some program). ``sites`` names every site the layer holds, so one that was never called fails.

    ``refuse=False``: where the operands make the reference equal the unquantized matmul (an edge input, whose
    all-zero operand a site receives), hold each call to the reference all the same rather than refuse; an
    unquantized site is then the plain input's to catch.
    """
    __tracebackhide__ = True
    lhs_fmt, rhs_fmt = operand_formats(recipe)
    arithmetic = get_recipe(recipe).reference.matmul
    _check_formats(lhs_fmt, rhs_fmt, arithmetic=arithmetic)
    counts = {name: 0 for name in sites}
    for call in calls:
        counts[call.site] += 1
    tally = ", ".join(f"{n} x{c}" for n, c in counts.items())
    for name in (n for n, c in counts.items() if c == 0):  # the site whose call went elsewhere comes first
        raise AssertionError(f"site {name!r} was never called in the forward pass (calls: "
                             f"{tally}); the layer skips it or calls another site in its place")
    for name, n in counts.items():
        if n > 1:
            raise AssertionError(f"site {name!r} was called {n} times in one forward pass (calls: "
                                 f"{tally}); another call site uses its wrapper")
    for call in calls:
        lhs, rhs, out = (np.asarray(a) for a in (call.lhs, call.rhs, call.out))
        _check(call.site, as_matmul(call.matmul), lhs, rhs, out, lhs_fmt, rhs_fmt, strict=False,
               arithmetic=arithmetic, refuse=refuse)
