"""Fresh-layer fp8 casts: an op under test against the ml_dtypes cast of its operands, bitwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import ArrayLike

from qcheck.checks._tracks import count_nonfinite, rel_norm

_FP8 = {np.dtype(t).name: np.dtype(t) for t in (
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz)}
# The flavour a wrong-flavour bug would use instead: each fp8 type's sibling.
_SIBLING = {
    "float8_e4m3fn": "float8_e4m3fnuz",
    "float8_e4m3fnuz": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2fnuz",
    "float8_e5m2fnuz": "float8_e5m2",
}



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
    elif count_nonfinite(got) > count_nonfinite(expected):
        why = f"it has {count_nonfinite(got)} non-finite values (an unsaturated cast overflows to NaN)"
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
    from qcheck.checks._site import PARTING_BINADES, _parting

    fmt = _fp8_dtype(cast_dtype).name.removeprefix("float8_")
    if fmt not in PARTING_BINADES:
        return out
    if contract is None or len(contract) != len(shapes):
        raise ValueError(
            f"probe_operands: cast_dtype float8_{fmt} parts from its sibling only in whole contraction fibres "
            f"below 2^-14, so give contract=, one tuple of contraction axes per shape ({len(shapes)}), "
            f"got {contract!r}")
    return [_parting(x, axes, fmt, (seed, i)) for i, (x, axes) in enumerate(zip(out, contract))]
