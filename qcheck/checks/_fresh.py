"""Fresh-layer fp8 casts: an op under test against the ml_dtypes cast of its operands, bitwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from jax.typing import ArrayLike

from qcheck import formats
from qcheck.checks._assertion import assertion
from qcheck.checks._bits import bitwise_equal
from qcheck.checks._mismatch import mismatch, refuse_known_bugs
from qcheck.recipes import Einsum, Matmul, Ragged, as_matmul
from qcheck.checks._probes import fp8_dtype
from qcheck.checks._tracks import count_nonfinite, rel_norm


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
    return formats.get_format(formats.cast_format(dt).siblings[0]).element


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
    mm, lhs, rhs = _fresh_inputs(matmul, lhs, rhs)
    dt = fp8_dtype(cast_dtype)
    judge_fresh_cast(mm, lhs, rhs, mm.call(op, lhs, rhs), cast_dtype=dt)


def _fresh_inputs(matmul, lhs: ArrayLike, rhs: ArrayLike) -> tuple[Matmul, np.ndarray, np.ndarray]:
    mm = as_matmul(matmul)
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not np.issubdtype(x.dtype, np.floating) or x.dtype.name in formats.FP8_DTYPES:
            raise TypeError(f"{name} must be a float array in the compute dtype, got {x.dtype}")
    mm.check_operands(lhs, rhs)
    return mm, lhs, rhs


def judge_fresh_cast(matmul: Matmul, lhs: ArrayLike, rhs: ArrayLike, got: ArrayLike, *, cast_dtype: Any) -> None:
    """:func:`assert_fresh_cast_exact`'s judgement of ``got``, what the op computed on these operands elsewhere."""
    __tracebackhide__ = True
    mm, lhs, rhs = _fresh_inputs(matmul, lhs, rhs)
    dt = fp8_dtype(cast_dtype)
    sib = _sibling(dt)

    def ref(t: np.dtype) -> np.ndarray:
        return mm.reference(cast_reference(lhs, t), cast_reference(rhs, t))

    expected = ref(dt)
    # The sibling's advice holds for both: values the cast cannot represent, parted from the sibling flavour.
    bugs = refuse_known_bugs(
        mm.what, expected, ((f"the unquantized {mm.what}", mm.reference(lhs, rhs)),
                            (f"the {sib.name}-cast reference", ref(sib))),
        reference=f"the {dt.name}-cast reference",
        advice=f"use values that {dt.name} cannot represent exactly and its sibling flavour rounds otherwise (see "
               "probe_operands, with cast_dtype= and contract= for e5m2)")
    got = np.asarray(got)
    if bitwise_equal(got, expected):
        return
    hints = {f"the unquantized {mm.what}": "silently unquantized?", f"the {sib.name}-cast reference": "wrong fp8 flavour"}

    def otherwise() -> str:
        if count_nonfinite(got) > count_nonfinite(expected):
            return f"it has {count_nonfinite(got)} non-finite values (an unsaturated cast overflows to NaN)"
        return f"relative norm to the reference {rel_norm(got, expected):.3g} (scale not 1? other rounding?)"

    raise mismatch(mm.what, got, expected, reference=f"the {dt.name}-cast reference", bugs=bugs, hints=hints,
                   otherwise=otherwise)
