"""A native low-precision GEMM against the host emulation of the same codes."""

from __future__ import annotations

import numpy as np
from jax.typing import ArrayLike

from qcheck.checks._assertion import assertion
from qcheck.checks._figures import Figures
from qcheck.checks._tracks import count_nonfinite, concrete, rel_norm

#: Bound on rel_norm(native, emulated) for a native low-precision GEMM. The
#: products of two fp8 (or e2m1 × e4m3 block-scaled) codes are exact in float32,
#: so the two differ only in how the sums are accumulated: in float32 in another
#: order, or, on Hopper's fp8 tensor cores, with about 14 mantissa bits kept.
#: For the probes' K = 128 that is typically below 1e-3; 2^-8 leaves room, and
#: stays well under what quantizing costs (e4m3: about 3%), which the control
#: in assert_native_matches_emulation holds the probes to.
NATIVE_GEMM_TOL = 2.0**-8


@assertion
def assert_native_matches_emulation(
    native: ArrayLike,
    emulated: ArrayLike,
    unquantized: ArrayLike,
    *,
    tol: float = NATIVE_GEMM_TOL,
    label: str = "",
) -> Figures:
    """Assert a native low-precision GEMM's result matches the emulation of the same codes within ``tol``.

    ``emulated`` is the same product computed from the same codes on the host
    (``qcheck.native.emulate_*``), ``unquantized`` the product of the original
    operands. The control: the operands must set ``unquantized`` more than
    4·``tol`` apart from ``emulated`` (else a ValueError), so a native path that
    silently multiplied in full precision cannot pass. Returns
    rel_norm(native, emulated) (:class:`~qcheck.checks.Figures`: ``rel_norm``, and ``gap``, the
    unquantized product's distance from the emulation).
    """
    n, e, u = (concrete(x, w).astype(np.float64) for x, w in
               ((native, "native"), (emulated, "emulated"), (unquantized, "unquantized")))
    if not n.shape == e.shape == u.shape:
        raise AssertionError(f"native has shape {n.shape}, emulated {e.shape}, unquantized {u.shape}")
    if (bad := count_nonfinite(n)) > 0:
        raise AssertionError(f"native has {bad} non-finite values out of {n.size}")
    if not (gap := rel_norm(u, e)) > 4 * tol:
        raise ValueError(f"the operands cannot tell quantized from unquantized: the unquantized product "
                         f"is {gap:.3g} from the emulation, not more than 4 × {tol:.3g}")
    figure = rel_norm(n, e)
    if figure <= tol:
        return Figures(figure, rel_norm=figure, gap=gap)
    if rel_norm(n, u) <= tol:
        why = "it matches the unquantized product instead (the GEMM did not quantize?)"
    else:
        why = "another format, scale or rounding?"
    raise AssertionError(f"native differs from the emulation by relative norm {figure:.3g} > {tol:.3g}; {why}")
