"""Reusable numerical assertions for quantized code, usable from any project.

Every assertion raises ``AssertionError`` with a message that starts with the
check's name and gives the figure it measured. Inputs that make a check
meaningless (a zero reference, operands that cannot tell the reference apart
from the bug) raise ``ValueError`` instead: a check that cannot fail must not
pass.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import ArrayLike

__all__ = [
    "assert_amax_histories_follow_operands",
    "assert_fp8_dtypes_native",
    "assert_fp8_state_matches",
    "assert_format_matches_referee",
    "assert_fresh_cast_exact",
    "assert_fresh_ragged_cast_exact",
    "assert_native_matches_emulation",
    "assert_no_recompiles",
    "assert_site_backward_exact",
    "assert_site_ragged_backward_exact",
    "assert_quantized",
    "assert_ragged_groups_independent",
    "assert_recipe_fp8_native",
    "assert_tracks",
    "cast_reference",
    "coverage",
    "entry_params",
    "fp8_state",
    "lowered_entry_params",
    "probe_operands",
    "rel_norm",
]

_FP8 = {np.dtype(t).name: np.dtype(t) for t in (
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz)}
# The flavour a wrong-flavour bug would use instead: each fp8 type's sibling.
_SIBLING = {
    "float8_e4m3fn": "float8_e4m3fnuz",
    "float8_e4m3fnuz": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2fnuz",
    "float8_e5m2fnuz": "float8_e5m2",
}


def _np(x: ArrayLike, what: str) -> np.ndarray:
    try:
        return np.asarray(x)
    except Exception as e:  # a tracer, say
        raise TypeError(f"{what} must be a concrete array, got {type(x).__name__}") from e


def rel_norm(actual: ArrayLike, reference: ArrayLike) -> float:
    """‖actual − reference‖₂ / ‖reference‖₂, computed in float32."""
    a = _np(actual, "actual").astype(np.float32)
    r = _np(reference, "reference").astype(np.float32)
    if a.shape != r.shape:
        raise ValueError(f"rel_norm: actual has shape {a.shape}, reference has shape {r.shape}")
    denom = np.linalg.norm(r.ravel())
    if denom == 0:
        raise ValueError("rel_norm: the reference is all zeros, so a relative norm is undefined")
    return float(np.linalg.norm((a - r).ravel()) / denom)


def _count_nonfinite(x: np.ndarray) -> int:
    return int(x.size - np.count_nonzero(np.isfinite(x.astype(np.float32))))


def assert_tracks(actual: ArrayLike, reference: ArrayLike, *, max_rel_norm: float = 0.22) -> float:
    """Assert a quantized result stays near its unquantized reference without equalling it.

    Passes only when the shapes are equal (no broadcasting), both are finite,
    ``rel_norm(actual, reference) <= max_rel_norm``, and the two are not bitwise
    equal: a quantized path that silently fell back to full precision fails.
    Returns the measured relative norm.
    """
    __tracebackhide__ = True
    a, r = _np(actual, "actual"), _np(reference, "reference")
    if a.shape != r.shape:
        raise AssertionError(
            f"assert_tracks: actual has shape {a.shape} but reference has shape {r.shape} "
            "(no broadcasting)"
        )
    for what, x in (("actual", a), ("reference", r)):
        if (n := _count_nonfinite(x)) > 0:
            raise AssertionError(f"assert_tracks: {what} has {n} non-finite values out of {x.size}")
    if not np.any(r):
        raise ValueError("assert_tracks: the reference is all zeros; a relative bound cannot judge it")
    if a.dtype == r.dtype and a.tobytes() == r.tobytes():
        raise AssertionError(
            "assert_tracks: actual is bitwise equal to the unquantized reference — "
            "the quantized path was not taken (silent fallback?)"
        )
    figure = rel_norm(a, r)
    if not figure <= max_rel_norm:
        raise AssertionError(
            f"assert_tracks: relative norm {figure:.4f} exceeds the bound {max_rel_norm}"
        )
    return figure


#: Bound on rel_norm(native, emulated) for a native low-precision GEMM. The
#: products of two fp8 (or e2m1 × e4m3 block-scaled) codes are exact in float32,
#: so the two differ only in how the sums are accumulated: in float32 in another
#: order, or, on Hopper's fp8 tensor cores, with about 14 mantissa bits kept.
#: For the probes' K = 128 that is typically below 1e-3; 2^-8 leaves room, and
#: stays well under what quantizing costs (e4m3: about 3%), which the control
#: in assert_native_matches_emulation holds the probes to.
NATIVE_GEMM_TOL = 2.0**-8


def assert_native_matches_emulation(
    native: ArrayLike,
    emulated: ArrayLike,
    unquantized: ArrayLike,
    *,
    tol: float = NATIVE_GEMM_TOL,
    label: str = "",
) -> float:
    """Assert a native low-precision GEMM's result matches the emulation of the same codes within ``tol``.

    ``emulated`` is the same product computed from the same codes on the host
    (``qcheck.native.emulate_*``), ``unquantized`` the product of the original
    operands. The control: the operands must set ``unquantized`` more than
    4·``tol`` apart from ``emulated`` (else a ValueError), so a native path that
    silently multiplied in full precision cannot pass. Returns
    rel_norm(native, emulated).
    """
    __tracebackhide__ = True
    where = f"{label}: " if label else ""
    n, e, u = (_np(x, w).astype(np.float64) for x, w in
               ((native, "native"), (emulated, "emulated"), (unquantized, "unquantized")))
    if not n.shape == e.shape == u.shape:
        raise AssertionError(f"{where}native has shape {n.shape}, emulated {e.shape}, unquantized {u.shape}")
    if (bad := _count_nonfinite(n)) > 0:
        raise AssertionError(f"{where}native has {bad} non-finite values out of {n.size}")
    if not (gap := rel_norm(u, e)) > 4 * tol:
        raise ValueError(f"{where}the operands cannot tell quantized from unquantized: the unquantized product "
                         f"is {gap:.3g} from the emulation, not more than 4 × {tol:.3g}")
    figure = rel_norm(n, e)
    if figure <= tol:
        return figure
    if rel_norm(n, u) <= tol:
        why = "it matches the unquantized product instead (the GEMM did not quantize?)"
    else:
        why = "another format, scale or rounding?"
    raise AssertionError(f"{where}native differs from the emulation by relative norm {figure:.3g} > {tol:.3g}; {why}")


def _fp8_dtype(cast_dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(cast_dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in _FP8:
        raise ValueError(
            f"cast_dtype must be an fp8 type ({', '.join(_FP8)}), got {cast_dtype!r}"
        )
    return dt


def cast_reference(x: ArrayLike, cast_dtype: Any) -> np.ndarray:
    """``x`` clipped to ±finfo(cast_dtype).max, rounded to ``cast_dtype`` by ml_dtypes, and returned to x's dtype.

    Computed on the host with numpy/ml_dtypes, independently of JAX and of any
    code under test.
    """
    dt = _fp8_dtype(cast_dtype)
    x = np.asarray(x)
    bound = float(ml_dtypes.finfo(dt).max)
    return np.clip(x, -bound, bound).astype(dt).astype(x.dtype)


def _bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _assert_cast_exact(
    check: str,
    what: str,
    reference_op: Callable[[ArrayLike, ArrayLike], ArrayLike],
    op_under_test: Callable[[ArrayLike, ArrayLike], ArrayLike],
    lhs: ArrayLike,
    rhs: ArrayLike,
    cast_dtype: Any,
) -> None:
    __tracebackhide__ = True
    dt = _fp8_dtype(cast_dtype)
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not np.issubdtype(x.dtype, np.floating) or x.dtype.name in _FP8:
            raise TypeError(f"{check}: {name} must be a float array in the compute dtype, got {x.dtype}")

    def ref(t: np.dtype) -> np.ndarray:
        return np.asarray(reference_op(cast_reference(lhs, t), cast_reference(rhs, t)))

    expected, sibling = ref(dt), ref(_FP8[_SIBLING[dt.name]])
    plain = np.asarray(reference_op(lhs, rhs))
    if _bitwise_equal(expected, plain):
        raise ValueError(
            f"{check}: for these operands the {dt.name}-cast reference equals the unquantized "
            f"{what} bitwise, so the check could not fail; use values that {dt.name} cannot "
            "represent exactly (see probe_operands)"
        )
    if _bitwise_equal(expected, sibling):
        raise ValueError(
            f"{check}: for these operands the {dt.name} and {_SIBLING[dt.name]} references are "
            "bitwise equal, so a wrong fp8 flavour would pass; see probe_operands (with cast_dtype= and "
            "contract= for e5m2)"
        )
    got = np.asarray(op_under_test(lhs, rhs))
    if _bitwise_equal(got, expected):
        return
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(
            f"{check}: result has shape {got.shape} and dtype {got.dtype}, the {dt.name}-cast "
            f"reference has shape {expected.shape} and dtype {expected.dtype}"
        )
    diff = got.view(np.uint8).reshape(*got.shape, -1) != expected.view(np.uint8).reshape(*expected.shape, -1)
    mismatch = np.any(diff, axis=-1)
    first = tuple(int(i) for i in np.argwhere(mismatch)[0])
    if _bitwise_equal(got, plain):
        why = "it equals the unquantized result bitwise (silently unquantized?)"
    elif _bitwise_equal(got, sibling):
        why = f"it equals the {_SIBLING[dt.name]}-cast reference bitwise (wrong fp8 flavour)"
    elif _count_nonfinite(got) > _count_nonfinite(expected):
        why = f"it has {_count_nonfinite(got)} non-finite values (an unsaturated cast overflows to NaN)"
    else:
        why = f"relative norm to the reference {rel_norm(got, expected):.3g} (scale not 1? other rounding?)"
    raise AssertionError(
        f"{check}: {what} differs from the {dt.name}-cast reference at "
        f"{int(mismatch.sum())} of {mismatch.size} elements, first at {first}: got "
        f"{got[first]!r}, expected {expected[first]!r}; {why}"
    )


def assert_fresh_cast_exact(
    einsum: Callable[[str, ArrayLike, ArrayLike], ArrayLike],
    eqn: str,
    lhs: ArrayLike,
    rhs: ArrayLike,
    *,
    cast_dtype: Any,
) -> None:
    """Assert a freshly built fp8 einsum equals the einsum of cast operands, bitwise.

    On a fresh layer the scales are still 1, so ``einsum(eqn, lhs, rhs)`` must
    equal ``jnp.einsum(eqn, cast(lhs), cast(rhs))`` where ``cast`` clips to
    ±finfo(cast_dtype).max, rounds to ``cast_dtype`` (ml_dtypes, on the host) and
    returns to the compute dtype. Operands that cannot tell that reference from
    the plain einsum or from the sibling flavour's reference are refused with a
    ValueError, so the check never passes vacuously.
    """
    __tracebackhide__ = True
    # device_put, not jnp.asarray: on jax 0.10 asarray of a host array compiles a
    # program per shape to stage it, and the checks run on a dozen shapes per layer.
    _assert_cast_exact(
        "assert_fresh_cast_exact",
        f"einsum {eqn!r}",
        lambda a, b: jnp.einsum(eqn, jax.device_put(a), jax.device_put(b)),
        lambda a, b: einsum(eqn, jax.device_put(a), jax.device_put(b)),
        lhs,
        rhs,
        cast_dtype,
    )


def assert_fresh_ragged_cast_exact(
    ragged_dot: Callable[[ArrayLike, ArrayLike, ArrayLike], ArrayLike],
    lhs: ArrayLike,
    rhs: ArrayLike,
    group_sizes: ArrayLike,
    *,
    cast_dtype: Any,
) -> None:
    """:func:`assert_fresh_cast_exact` for a grouped matmul against ``jax.lax.ragged_dot``."""
    __tracebackhide__ = True
    gs = jax.device_put(np.asarray(group_sizes, np.int32))
    _assert_cast_exact(
        "assert_fresh_ragged_cast_exact",
        "ragged_dot",
        lambda a, b: jax.lax.ragged_dot(jax.device_put(a), jax.device_put(b), gs),
        lambda a, b: ragged_dot(jax.device_put(a), jax.device_put(b), gs),
        lhs,
        rhs,
        cast_dtype,
    )


def probe_operands(
    seed: int,
    *shapes: tuple[int, ...],
    dtype: Any = np.float32,
    cast_dtype: Any = None,
    contract: tuple[tuple[int, ...], ...] | None = None,
) -> list[np.ndarray]:
    """Operands that make the fp8 exact checks sharp.

    Magnitudes are log-uniform over [2^-4, 2^10] with random signs: most values
    are not representable in any fp8 flavour (so quantization shows), some lie
    above every e4m3 maximum (so a missing clip, or e4m3fnuz's 240 for
    e4m3fn's 448, shows), and none is subnormal in any fp8 flavour (so the
    reference never leans on how a backend casts to fp8 subnormals). e5m2 and
    e5m2fnuz round alike on all of them: for ``cast_dtype`` float8_e5m2 or
    float8_e5m2fnuz give ``contract``, each operand's contraction axes, and a
    quarter of each operand's contraction fibres come from [2^-15, 2^-14)
    instead, where e5m2 is subnormal and e5m2fnuz is not, and the two round
    apart (XLA's CPU backend casts those exactly, as ml_dtypes does).
    """
    rng = np.random.default_rng(seed)
    out = []
    for shape in shapes:
        mag = np.exp2(rng.uniform(-4.0, 10.0, size=shape))
        sign = rng.choice(np.array([-1.0, 1.0]), size=shape)
        out.append((mag * sign).astype(dtype))
    if cast_dtype is None:
        return out
    from qcheck._site_exact import PARTING_BINADES, _parting

    fmt = _fp8_dtype(cast_dtype).name.removeprefix("float8_")
    if fmt not in PARTING_BINADES:
        return out
    if contract is None or len(contract) != len(shapes):
        raise ValueError(
            f"probe_operands: cast_dtype float8_{fmt} parts from its sibling only in whole contraction fibres "
            f"below 2^-14, so give contract=, one tuple of contraction axes per shape ({len(shapes)}), "
            f"got {contract!r}")
    return [_parting(x, axes, fmt, (seed, i)) for i, (x, axes) in enumerate(zip(out, contract))]


_HLO_PARAM = re.compile(r"=\s*([a-z][a-z0-9]*)\[[^\]]*\](?:\{[^}]*\})?\s+parameter\(\d+\)")
_MLIR_TENSOR = re.compile(r"tensor<(?:[0-9?]+x)*([a-z][a-z0-9]*)>")


def _main_inputs(lowered: jax.stages.Lowered) -> str:
    """The input types of the lowered module's entry function, e.g. ``(tensor<2xui32>, tensor<4x8xf32>)``.

    Read off the function's type rather than the printed module, which for a
    train step is a hundred thousand characters.
    """
    for op in lowered.compiler_ir().body.operations:
        attributes = op.operation.attributes
        if "sym_name" in attributes and str(attributes["sym_name"]) == '"main"':
            return str(attributes["function_type"]).split(" -> ")[0]
    raise ValueError("the lowered module has no entry function @main")


def _hlo_type(mlir: str) -> str:
    """StableHLO element type -> HLO's name for it (ui32 -> u32, i32 -> s32, i1 -> pred)."""
    if mlir == "i1":
        return "pred"
    if mlir.startswith("ui"):
        return "u" + mlir[2:]
    if mlir.startswith("i"):
        return "s" + mlir[1:]
    return mlir


def entry_params(fn: Callable[..., Any], *args: Any, compile: bool = True) -> dict[str, int]:
    """Parameters of the entry computation of ``jax.jit(fn)`` compiled for ``args``, by HLO element type.

    Returns e.g. ``{'f32': 12, 'u32': 2, 'total': 14}``. A raw or typed PRNG key
    lowers to ``u32``. Arguments JAX prunes as unused are not counted, as in an
    ``--xla_dump_to`` dump of the real step. ``compile=False`` reads the same
    signature off the lowered module without running XLA — much cheaper for
    deep unrolled steps; the suite checks that both agree.
    """
    return lowered_entry_params(jax.jit(fn).lower(*args), compile=compile)


def lowered_entry_params(lowered: jax.stages.Lowered, *, compile: bool = False) -> dict[str, int]:
    """:func:`entry_params` of an already lowered program (read off StableHLO unless ``compile``)."""
    if compile:
        hlo = lowered.compile().as_text()
        entry = hlo[hlo.index("\nENTRY"):]
        types = _HLO_PARAM.findall(entry[: entry.index("\n}")])
    else:
        types = [_hlo_type(t) for t in _MLIR_TENSOR.findall(_main_inputs(lowered))]
    counts = Counter(types)
    return {**dict(sorted(counts.items())), "total": sum(counts.values())}


def assert_no_recompiles(fn: Callable[[], Any], *, warmup: Callable[[], Any] | None = None,
                         label: str = "") -> None:
    """Run ``warmup`` (default: ``fn``), then ``fn``; that run must request no XLA compilation.

    ``fn`` should do what a test run does (build, jit, run). A run after the
    warm-up that compiles means a program is not cached where it should be: a
    ``jax.jit`` made anew on every call, a static argument that does not compare
    equal, a shape that changes. The message names each function and its
    argument types.
    """
    __tracebackhide__ = True
    from qcheck._compiles import counting_compilations

    (warmup or fn)()
    with counting_compilations() as counts:
        fn()
    if counts:
        lines = "\n  ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
        raise AssertionError(
            f"assert_no_recompiles{': ' + label if label else ''}: the second run compiled "
            f"{sum(counts.values())} programs again:\n  {lines}"
        )


# Checks with a module of their own, offered here beside the others.
from qcheck._coverage import assert_quantized, coverage  # noqa: E402
from qcheck._referee_checks import assert_format_matches_referee  # noqa: E402
from qcheck._backward import assert_site_backward_exact, assert_site_ragged_backward_exact  # noqa: E402
from qcheck._fp8_amax import assert_amax_histories_follow_operands  # noqa: E402
from qcheck._ragged_groups import assert_ragged_groups_independent  # noqa: E402
from qcheck._fp8_native import assert_fp8_dtypes_native, assert_recipe_fp8_native  # noqa: E402
from qcheck._fp8_state import assert_fp8_state_matches, fp8_state  # noqa: E402
