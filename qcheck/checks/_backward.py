"""Backward exactness of a fresh call site: both gradients, bitwise, against numpy-quantized output gradients.

The forward exact check cannot see a recipe that quantizes the output gradient
``g`` wrongly: the forward pass is the same. Here a fresh site (fp8 scales 1) is
differentiated once, jitted, and each gradient is held bit for bit to the same
gradient matmul (``jax.vjp`` of ``jnp.einsum`` / ``jax.lax.ragged_dot`` in
float32, the contraction the site itself runs) of operands and ``g`` quantized
by :mod:`qcheck.referees`, never by :mod:`qcheck.formats`:

- fp8-class recipes (``recipe.reference.cast_dtype`` set): ``g`` cast, saturating at
  scale 1, to the gradient flavour of the recipe's cast format (its record's ``grad``:
  e4m3fn -> e5m2, e4m3fnuz -> e5m2fnuz), for both gradients;
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
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.typing import ArrayLike

from qcheck import formats, referees
from qcheck.checks._assertion import assertion
from qcheck.checks._bits import as_float32, bits, bitwise_equal
from qcheck.checks._figures import Figures
from qcheck.checks._mismatch import mismatch, refuse_known_bugs
from qcheck.layers.bridge import QuantSite
from qcheck.recipes import NVFP4, Einsum, Matmul, MatmulAxes, Ragged, Recipe, as_matmul

def site_dgrad_key(key: jax.Array, site_name: str) -> jax.Array:
    """The key an NVFP4 site called with ``rngs=key`` rounds its DGRAD copy of ``g`` with.

    Linen's first ``make_rng("params")`` of a top-level module, folded with
    crc32(``"{site_name}/dgrad"``) as NVFP4 documents (TransformerEngine's
    per-quantizer salt); written out here, not taken from the recipe.
    """
    base = _MakeRng().apply({}, rngs={"params": key})
    return jax.random.fold_in(base, zlib.crc32(f"{site_name}/dgrad".encode()) & 0x7FFFFFFF)


def flat_uniforms(key: jax.Array, shape: tuple[int, ...], axes: tuple[int, ...]) -> np.ndarray:
    """:func:`qcheck.checks._format_matches.nvfp4_uniforms`, drawn flat: one program per size, not per layout.

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


def site_grads(site: nnx.Module, matmul: Matmul, lhs: ArrayLike, rhs: ArrayLike, g: ArrayLike,
               key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The site's (dgrad, wgrad) of ``matmul`` for output gradient ``g``, traced in the caller's program.

    A :class:`~qcheck.QuantSite` draws from ``key``; an interception recipe's
    site (a plain module a library rewrote) takes no streams.
    """
    kw = {"rngs": key} if isinstance(site, QuantSite) else {}
    _, vjp = jax.vjp(lambda a, b: matmul.run(site, a, b, **kw), lhs, rhs)
    return vjp(g)


@functools.partial(jax.jit, static_argnums=0)
def _site_grads(graphdef, state, matmul: Matmul, lhs, rhs, g, key):
    return site_grads(nnx.merge(graphdef, state, copy=True), matmul, lhs, rhs, g, key)


# -- what each gradient's copy of g should be --------------------------------------------


@dataclasses.dataclass(frozen=True)
class Expectation:
    """Each gradient's expected quantized ``g`` and the neighbours (bugs) it must differ from."""

    what: str  # e.g. "g in e5m2 (saturating, scale 1)"
    g: np.ndarray
    neighbours: dict[str, np.ndarray]  # description -> that bug's g


def backend_qdq(x: np.ndarray, fmt: str, axis=-1, uniforms=None, form: str = "all by reciprocal") -> np.ndarray:
    return referees.reference_qdq(
        x, fmt, axis=axis, uniforms=uniforms, ftz=jax.default_backend() == "cpu", xla_reciprocal=form
    )


def other_form_grads(recipe: Recipe, mm: Matmul, lhs: np.ndarray, rhs: np.ndarray, gs, i: int
                     ) -> Iterator[np.ndarray]:
    """Gradient ``i`` of the operands quantized in each other form both operand formats admit (the first form is
    the reference's own), lazily: XLA may compute a quantizer's divisions in any of them, one per program."""
    lhs_fmt, rhs_fmt = grad_operand_formats(recipe)
    forms = [f for f in formats.get_format(lhs_fmt).forms if f in formats.get_format(rhs_fmt).forms]
    axes = mm.axes(lhs.ndim, rhs.ndim)
    for form in forms[1:]:
        q = backend_qdq(lhs, lhs_fmt, axes.lhs, form=form), backend_qdq(rhs, rhs_fmt, axes.rhs, form=form)
        if not (referees.keeps_finite(lhs, q[0]) and referees.keeps_finite(rhs, q[1])):
            continue  # the referee made NaN of finite operands in this form: it holds nothing
        (a, b), _, _ = grad_operands(recipe, lhs, rhs, *q)
        yield mm.grad_matmuls(a, b, *gs)[i]


def grad_operand_formats(recipe: Recipe) -> tuple[str, str]:
    if recipe.reference.cast_dtype is not None:
        record = formats.cast_format(recipe.reference.cast_dtype, where=f"recipe {recipe.name!r}")
        if record.grad is None:
            with_grad = [f.element.name for f in map(formats.get_format, formats.format_names()) if f.grad]
            raise ValueError(
                f"recipe {recipe.name!r}: cast_dtype {recipe.reference.cast_dtype} has no e5m2 gradient flavour "
                f"(its format's record names no grad); fp8-class recipes cast to one of {', '.join(with_grad)}"
            )
        return record.name, record.name
    if recipe.lhs is None:
        raise ValueError(
            f"recipe {recipe.name!r} declares no operand formats (lhs=/rhs=) and no cast_dtype, "
            "so there is no reference for its gradients"
        )
    return recipe.lhs, recipe.rhs


def expectations(
    recipe: Recipe,
    axes: MatmulAxes,
    g: np.ndarray,
    dgrad_key: jax.Array | None,
    unsalted_key: jax.Array | None,
) -> tuple[Expectation, Expectation]:
    lhs_fmt, _ = grad_operand_formats(recipe)
    if recipe.reference.cast_dtype is not None:
        forward = formats.get_format(lhs_fmt)
        e5 = formats.get_format(forward.grad)
        sib = formats.get_format(e5.siblings[0])
        exp = Expectation(
            f"g in {e5.element.name}",
            backend_qdq(g, e5.name),
            {
                "unquantized g": g,
                f"g in {forward.element.name} (the forward flavour)": backend_qdq(g, lhs_fmt),
                f"g in {sib.element.name} (the other fnuz flavour)": backend_qdq(g, sib.name),
            },
        )
        return exp, exp
    if recipe.grad is None:
        on = " to the original operands" if recipe.reference.grad_operands == "original" else ""
        exp = Expectation(f"g unquantized (straight through{on})", g, {})
        return exp, exp
    fmt = recipe.grad
    out = []
    for which, own, other, other_name in (
        ("dgrad", axes.dgrad, axes.wgrad, "wgrad"),
        ("wgrad", axes.wgrad, axes.dgrad, "dgrad"),
    ):
        u = None if which == "wgrad" or dgrad_key is None else flat_uniforms(dgrad_key, g.shape, own)
        rounding = ", stochastic" if u is not None else ""
        neighbours = {"unquantized g": g}
        if formats.get_format(fmt).per_axis:
            # A wrong-axes bug still rounds stochastically, drawing the same key for its own blocks.
            wrong_u = None if u is None else flat_uniforms(dgrad_key, g.shape, other)
            neighbours[f"g in {fmt} along the {other_name} axes {other}"] = backend_qdq(g, fmt, other, wrong_u)
        if u is not None:
            neighbours[f"g in {fmt} along {own}, rounded to nearest"] = backend_qdq(g, fmt, own)
            neighbours[f"g in {fmt} along {own}, rounded with the unsalted key"] = backend_qdq(
                g, fmt, own, flat_uniforms(unsalted_key, g.shape, own))
        if lhs_fmt != fmt:
            neighbours[f"g in {lhs_fmt} (the operands' format)"] = backend_qdq(g, lhs_fmt, own)
        record = formats.get_format(fmt)
        if record.kind == "cast":  # probe_grad reaches below 2^-14, where even e5m2 and e5m2fnuz part
            neighbours[f"g in {record.siblings[0]} instead of {fmt}"] = backend_qdq(g, record.siblings[0], own)
        out.append(Expectation(f"g in {fmt} along axes {own}{rounding}", backend_qdq(g, fmt, own, u), neighbours))
    return out[0], out[1]


def grad_operands(recipe: Recipe, lhs: np.ndarray, rhs: np.ndarray, q_lhs: np.ndarray, q_rhs: np.ndarray
                  ) -> tuple[tuple[np.ndarray, np.ndarray], str, tuple[np.ndarray, np.ndarray]]:
    """``(operands, other's description, other operands)``: what the gradient matmuls take, and the bug of
    taking the other ones (``recipe.reference.grad_operands``)."""
    if recipe.reference.grad_operands == "original":
        return (lhs, rhs), "the quantized operands (straight through the quantizers)", (q_lhs, q_rhs)
    return (q_lhs, q_rhs), "unquantized operands", (lhs, rhs)


def _require_exact_decode(what: str, x: np.ndarray, fmt: str, axes: tuple[int, ...]) -> None:
    # XLA may compute a block-scaled decode in another order under jit (its record's decode_ulps: nvfp4's);
    # only power-of-two encode scales make every order exact, and a bitwise reference fair.
    _, scales = referees.reference_quantize(x, fmt, axis=axes, ftz=jax.default_backend() == "cpu")
    block = scales["block"].astype(np.float32)
    ratio = (scales["tensor"] / block[block > 0]).astype(np.float32)
    if ratio.size == 0 or np.any(np.frexp(ratio)[0] != 0.5):
        raise ValueError(
            f"{what} has {fmt} blocks along axes {axes} whose encode scale is not a power of two, "
            f"so XLA's reordering of the decode (up to {formats.get_format(fmt).decode_ulps} ulps) would move bits; "
            "use probe_nvfp4 with the axes of every quantization of it"
        )


# -- the check ----------------------------------------------------------------------------


def _reference(name: str, recipe: Recipe, mm: Matmul, lhs: np.ndarray, rhs: np.ndarray, g: np.ndarray,
               key: jax.Array) -> Callable[[tuple[np.ndarray, np.ndarray]], Figures]:
    """The judge of a site's (dgrad, wgrad): the reference and its known bugs, computed (and the inputs refused
    where they cannot tell them apart) before the site runs."""
    __tracebackhide__ = True
    axes = mm.axes(lhs.ndim, rhs.ndim)
    lhs_fmt, rhs_fmt = grad_operand_formats(recipe)
    dgrad_key = unsalted = None
    if isinstance(recipe, NVFP4):
        dgrad_key, unsalted = site_dgrad_key(key, name), _MakeRng().apply({}, rngs={"params": key})
    try:
        q_lhs, q_rhs = backend_qdq(lhs, lhs_fmt, axes.lhs), backend_qdq(rhs, rhs_fmt, axes.rhs)
        dgrad, wgrad = expectations(recipe, axes, g, dgrad_key, unsalted)
    except ValueError as e:  # a shape the format cannot block (e.g. mxfp8 WGRAD over 16 tokens)
        raise ValueError(f"site {name!r}: the referee cannot quantize for this site: {e}") from e
    for what, x, fmt, ax in (("lhs", lhs, lhs_fmt, axes.lhs), ("rhs", rhs, rhs_fmt, axes.rhs),
                             ("g (dgrad)", g, recipe.grad, axes.dgrad), ("g (wgrad)", g, recipe.grad, axes.wgrad)):
        if fmt is not None and formats.get_format(fmt).decode_ulps and recipe.reference.cast_dtype is None:
            _require_exact_decode(what, x, fmt, ax)

    (a, b), other, (other_a, other_b) = grad_operands(recipe, lhs, rhs, q_lhs, q_rhs)
    want = mm.grad_matmuls(a, b, dgrad.g, wgrad.g)
    verdicts = []
    for i, (which, exp) in enumerate((("dgrad", dgrad), ("wgrad", wgrad))):
        prefix = f"site {name!r} {which} ({exp.what})"
        bugs = refuse_known_bugs(prefix, want[i], grad_bugs(mm, i, exp, (a, b), (dgrad.g, wgrad.g), other,
                                                           (other_a, other_b)),
                                 operands="these operands and g", advice="use probe_operands and probe_grad")
        verdicts.append((which, prefix, want[i], bugs))

    def judge(got: tuple[np.ndarray, np.ndarray]) -> Figures:
        __tracebackhide__ = True
        margins: dict[str, int] = {}
        for i, (which, prefix, want_i, bugs) in enumerate(verdicts):
            if not bitwise_equal(np.asarray(got[i]), want_i) and any(
                    bitwise_equal(np.asarray(got[i]), w)
                    for w in other_form_grads(recipe, mm, lhs, rhs, (dgrad.g, wgrad.g), i)):
                continue
            assert_grad_equal(prefix, np.asarray(got[i]), want_i, bugs)
            margins[which] = min(int(np.sum(bits(b) != bits(want_i))) for b in bugs.values())
        return Figures(min(margins.values()), margins)

    return judge


def grad_bugs(mm: Matmul, i: int, exp: Expectation, operands, gs, other: str, other_operands
              ) -> Iterator[tuple[str, np.ndarray]]:
    """(description, gradient ``i``) of each bug that gradient must tell apart, as it would come out: each
    neighbour of its ``g`` (``exp``), and the gradient matmuls of the other operands (``other``)."""
    for desc, bug_g in exp.neighbours.items():
        yield f"the gradient with {desc}", mm.grad_matmuls(*operands, *((bug_g, gs[1]) if i == 0 else (gs[0], bug_g)))[i]
    yield f"the gradient with {other}", mm.grad_matmuls(*other_operands, *gs)[i]


def assert_grad_equal(what: str, got: np.ndarray, want: np.ndarray, bugs: dict[str, np.ndarray]) -> None:
    """``got`` equals ``want`` bitwise, else an AssertionError about gradient ``what`` naming the bug it equals."""
    __tracebackhide__ = True
    if bitwise_equal(got, want):
        return

    def otherwise() -> str:
        zeros = int(np.count_nonzero(got == 0)) - int(np.count_nonzero(want == 0))
        return f"{zeros} more zeros than the reference" if zeros > 0 else "it matches none of the known bugs"

    raise mismatch(f"{what}:", got, want, result="gradient", bugs=bugs, otherwise=otherwise)


@assertion
def assert_site_backward_exact(
    site: QuantSite,
    matmul: str | Einsum | Ragged,
    lhs: ArrayLike,
    rhs: ArrayLike,
    g: ArrayLike,
    *,
    recipe: Recipe,
    key: jax.Array | None = None,
    label: str = "",
) -> Figures:
    """Assert a fresh site's gradients equal the gradient matmuls of referee-quantized ``g``, bitwise.

    ``site`` is a fresh :class:`~qcheck.QuantSite` of ``recipe`` (fp8 scales
    still 1); ``matmul`` an einsum string (the site is called ``site(eqn, lhs,
    rhs)``) or :class:`~qcheck.checks.Ragged` (``site.ragged_dot(lhs, rhs,
    group_sizes)``); ``g`` the output gradient (float32, the matmul's output
    shape). The site runs once under ``jax.jit(jax.vjp)``, called with
    ``rngs=key`` (default ``jax.random.key(0)``) so a stochastic recipe's bits
    are known. See the module docstring for what each recipe's gradients must
    equal. A ValueError refuses inputs that cannot tell the reference from a
    known bug.

    Returns, for ``"dgrad"`` and ``"wgrad"``, how many elements the nearest known
    bug's gradient differs from the reference in: the margin the check had
    (:class:`~qcheck.checks.Figures`, whose value is the smaller margin).
    """
    mm, lhs, rhs, g = _backward_inputs(matmul, lhs, rhs, g)
    _check_site(site, recipe)
    key = jax.random.key(0) if key is None else key
    judge = _reference(site.site_name, recipe, mm, lhs, rhs, g, key)
    graphdef, state = nnx.split(site)
    return judge(_site_grads(graphdef, state, mm, *map(jax.device_put, (lhs, rhs, g)), key))


def _backward_inputs(matmul, lhs, rhs, g):
    mm = as_matmul(matmul)
    lhs, rhs, g = (as_float32(x, w) for x, w in ((lhs, "lhs"), (rhs, "rhs"), (g, "g")))
    mm.check_operands(lhs, rhs)
    if g.shape != (out := mm.out_shape(lhs.shape, rhs.shape)):
        raise ValueError(f"g has shape {g.shape}, the matmul's output has shape {out}")
    return mm, lhs, rhs, g


def _check_site(site, recipe) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a qcheck.Recipe, got {type(recipe).__name__}")
    if not isinstance(site, nnx.Module) or not hasattr(site, "site_name"):
        raise TypeError(f"site must be a qcheck call site (a QuantSite, or an interception recipe's site), "
                        f"got {type(site).__name__}")
    grad_operand_formats(recipe)  # a recipe without a reference fails before anything compiles


def judge_site_backward(site: str, matmul: Matmul, lhs: ArrayLike, rhs: ArrayLike, g: ArrayLike,
                        got: tuple[ArrayLike, ArrayLike], *, recipe: Recipe, key: jax.Array) -> Figures:
    """:func:`assert_site_backward_exact`'s judgement of ``got``, the (dgrad, wgrad) site ``site`` (its
    ``site_name``) gave elsewhere, called with ``rngs=key``."""
    __tracebackhide__ = True
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a qcheck.Recipe, got {type(recipe).__name__}")
    mm, lhs, rhs, g = _backward_inputs(matmul, lhs, rhs, g)
    return _reference(site, recipe, mm, lhs, rhs, g, key)(got)
