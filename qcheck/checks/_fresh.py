"""Fresh-layer fp8 casts: an op under test against the ml_dtypes cast of its operands, bitwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from jax.typing import ArrayLike

from qcheck import formats
from qcheck.checks._assertion import assertion
from qcheck.checks._bits import bits, bitwise_equal
from qcheck.checks._matmul import Einsum, Ragged, as_matmul
from qcheck.checks._probes import fp8_dtype
from qcheck.checks._tracks import count_nonfinite, rel_norm

__all__ = ["assert_fresh_cast_exact", "cast_reference"]


def cast_reference(x: ArrayLike, cast_dtype: Any) -> np.ndarray:
    """``x`` clipped to ±finfo(cast_dtype).max, rounded to ``cast_dtype`` by ml_dtypes, and returned to x's dtype.

    Computed on the host with numpy/ml_dtypes, independently of JAX and of any
    code under test.
    """
    dt = fp8_dtype(cast_dtype)
    x = np.asarray(x)
    bound = float(ml_dtypes.finfo(dt).max)
    return np.clip(x, -bound, bound).astype(dt).astype(x.dtype)


def _sibling(dt: np.dtype) -> np.dtype:
    return formats.FP8_DTYPES["float8_" + formats.FP8_SIBLINGS[dt.name.removeprefix("float8_")]]


@assertion
def assert_fresh_cast_exact(
    op: Callable[..., ArrayLike],
    matmul: str | Einsum | Ragged,
    lhs: ArrayLike,
    rhs: ArrayLike,
    *,
    cast_dtype: Any,
    label: str = "",
) -> None:
    """Assert a freshly built fp8 matmul equals the same matmul of cast operands, bitwise.

    ``matmul`` is an einsum string (``op(eqn, lhs, rhs)``, against
    ``jnp.einsum``) or :class:`~qcheck.checks.Ragged` (``op(lhs, rhs,
    group_sizes)``, against ``jax.lax.ragged_dot``). On a fresh layer the
    scales are still 1, so the op must equal the reference matmul of
    ``cast(lhs)``, ``cast(rhs)``, where ``cast`` clips to
    ±finfo(cast_dtype).max, rounds to ``cast_dtype`` (ml_dtypes, on the host)
    and returns to the compute dtype. Operands that cannot tell that reference
    from the plain matmul or from the sibling flavour's reference are refused
    with a ValueError, so the check never passes vacuously.
    """
    mm = as_matmul(matmul)
    dt = fp8_dtype(cast_dtype)
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not np.issubdtype(x.dtype, np.floating) or x.dtype.name in formats.FP8_DTYPES:
            raise TypeError(f"{name} must be a float array in the compute dtype, got {x.dtype}")
    mm.check_operands(lhs, rhs)
    sib = _sibling(dt)

    def ref(t: np.dtype) -> np.ndarray:
        return mm.reference(cast_reference(lhs, t), cast_reference(rhs, t))

    expected, sibling = ref(dt), ref(sib)
    plain = mm.reference(lhs, rhs)
    if bitwise_equal(expected, plain):
        raise ValueError(
            f"for these operands the {dt.name}-cast reference equals the unquantized "
            f"{mm.what} bitwise, so the check could not fail; use values that {dt.name} cannot "
            "represent exactly (see probe_operands)"
        )
    if bitwise_equal(expected, sibling):
        raise ValueError(
            f"for these operands the {dt.name} and {sib.name} references are "
            "bitwise equal, so a wrong fp8 flavour would pass; see probe_operands (with cast_dtype= and "
            "contract= for e5m2)"
        )
    got = mm.call(op, lhs, rhs)
    if bitwise_equal(got, expected):
        return
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(
            f"result has shape {got.shape} and dtype {got.dtype}, the {dt.name}-cast "
            f"reference has shape {expected.shape} and dtype {expected.dtype}"
        )
    mismatch = bits(got) != bits(expected)
    first = tuple(int(i) for i in np.argwhere(mismatch)[0])
    if bitwise_equal(got, plain):
        why = "it equals the unquantized result bitwise (silently unquantized?)"
    elif bitwise_equal(got, sibling):
        why = f"it equals the {sib.name}-cast reference bitwise (wrong fp8 flavour)"
    elif count_nonfinite(got) > count_nonfinite(expected):
        why = f"it has {count_nonfinite(got)} non-finite values (an unsaturated cast overflows to NaN)"
    else:
        why = f"relative norm to the reference {rel_norm(got, expected):.3g} (scale not 1? other rounding?)"
    raise AssertionError(
        f"{mm.what} differs from the {dt.name}-cast reference at "
        f"{int(mismatch.sum())} of {mismatch.size} elements, first at {first}: got "
        f"{got[first]!r}, expected {expected[first]!r}; {why}"
    )
