"""Native low-precision GEMMs, and float64 numpy emulations of the same codes to hold them to.

A quantized layer on CPU only *emulates* fp8 and NVFP4: XLA upcasts the codes to
float32 before its dot. On an fp8 GPU XLA's GEMM rewriter hands an einsum of
fp8 operands to cuBLASLt (``__cublas$lt$matmul$f8``, hipBLASLt on ROCm under
the same name), and on Blackwell ``jax.nn.scaled_matmul`` runs cuDNN's
block-scaled dot (``__cudnn$blockScaledDot``). The hardware-marked tests run
these, prove from the compiled program that the native kernel ran
(:func:`native_gemm_calls`), and compare the result with :func:`emulate_fp8_einsum`
or :func:`emulate_block_scaled_matmul` (``checks.assert_native_matches_emulation``).
The emulations take the same codes and do the arithmetic in float64 numpy
(ml_dtypes for the casts), so they share no arithmetic with the path under test.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from qcheck import formats
from qcheck._choices import require_choice
from qcheck.checks.harness import cast_reference

__all__ = [
    "BLOCK_SCALED_FORMATS",
    "NATIVE_GEMM_TARGETS",
    "block_scaled_matmul",
    "emulate_block_scaled_matmul",
    "emulate_fp8_einsum",
    "fp8_einsum",
    "native_gemm_calls",
]

#: Custom-call targets of XLA GPU's native low-precision GEMMs.
NATIVE_GEMM_TARGETS = ("__cublas$lt$matmul$f8", "__cublas$lt$matmul$mx", "__cudnn$blockScaledDot")
#: Block formats ``jax.nn.scaled_matmul`` takes natively on Blackwell.
BLOCK_SCALED_FORMATS = ("mxfp8", "nvfp4")


def _fp8(dtype: np.dtype | type | str) -> np.dtype:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in formats.FP8_DTYPES:
        raise ValueError(f"dtype must be an fp8 type, one of {', '.join(formats.FP8_DTYPES)}; got {name!r}")
    return formats.FP8_DTYPES[name]


def fp8_einsum(eqn: str, lhs: ArrayLike, rhs: ArrayLike, *, dtype: np.dtype | type | str) -> Array:
    """``eqn`` on ``lhs`` and ``rhs`` saturated and cast to the fp8 ``dtype``, accumulated in float32.

    The operands reach the dot as fp8 (``preferred_element_type`` keeps the
    accumulator float32), which is what lets an fp8 GPU run its native GEMM.
    """
    t = _fp8(dtype)
    return jnp.einsum(eqn, formats.saturating_cast(lhs, t), formats.saturating_cast(rhs, t),
                      preferred_element_type=jnp.float32)


def emulate_fp8_einsum(eqn: str, lhs: ArrayLike, rhs: ArrayLike, *, dtype: np.dtype | type | str) -> np.ndarray:
    """:func:`fp8_einsum` in float64 numpy: operands clipped and cast by ml_dtypes, products and sums exact-ish."""
    t = _fp8(dtype)
    return np.einsum(eqn, *(cast_reference(np.asarray(x, np.float32), t).astype(np.float64) for x in (lhs, rhs)))


def _check_matmul_operands(lhs: ArrayLike, rhs: ArrayLike) -> None:
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if np.ndim(x) != 2:
            raise ValueError(f"{name} must be 2-D [rows, K] (K, the contraction axis, last); got shape {np.shape(x)}")
    if np.shape(lhs)[1] != np.shape(rhs)[1]:
        raise ValueError(f"lhs and rhs must share the contraction axis K (last): got lhs {np.shape(lhs)}, "
                         f"rhs {np.shape(rhs)}")


# One program per format and shape, not dozens of eager ops.
_quantize_last_axis = jax.jit(lambda x, fmt: formats.quantize(x, fmt, axis=-1), static_argnums=1)


def _check_block_format(fmt: str) -> None:
    require_choice("block-scaled format", fmt, BLOCK_SCALED_FORMATS)


def block_scaled_matmul(
    lhs: ArrayLike,
    rhs: ArrayLike,
    fmt: str,
    *,
    matmul: Callable[..., Array] | None = None,
) -> Array:
    """``lhs [M, K] @ rhs [N, K]ᵀ`` with both quantized in ``fmt`` along K, through ``jax.nn.scaled_matmul``.

    The codes and block scales go to ``matmul`` (default ``jax.nn.scaled_matmul``,
    which has no CPU lowering: on Blackwell it is cuDNN's block-scaled dot);
    NVFP4's per-tensor scales are divided out of its float32 result.
    """
    _check_block_format(fmt)
    _check_matmul_operands(lhs, rhs)
    ql, qr = formats.quantize(lhs, fmt, axis=-1), formats.quantize(rhs, fmt, axis=-1)
    run = jax.nn.scaled_matmul if matmul is None else matmul
    out = run(ql.codes[None], qr.codes[None], ql.scales["block"][None], qr.scales["block"][None],
              preferred_element_type=jnp.float32)[0]
    if "tensor" in formats.get_format(fmt).scales:  # nvfp4's encode scale per tensor: x ≈ codes · block / tensor
        out = out / (ql.scales["tensor"] * qr.scales["tensor"])
    return out


def emulate_block_scaled_matmul(lhs: ArrayLike, rhs: ArrayLike, fmt: str) -> np.ndarray:
    """:func:`block_scaled_matmul` in float64 numpy, from the same codes and scales (``formats.quantize``)."""
    _check_block_format(fmt)
    _check_matmul_operands(lhs, rhs)

    def decode(x: ArrayLike) -> np.ndarray:
        q = _quantize_last_axis(jnp.asarray(x), fmt)
        codes = np.asarray(q.codes).astype(np.float64)
        block = np.asarray(q.scales["block"]).astype(np.float64)
        block = np.repeat(block, codes.shape[-1] // block.shape[-1], axis=-1)
        tensor = float(np.asarray(q.scales["tensor"])) if "tensor" in q.scales else 1.0
        return codes * block / tensor

    return decode(lhs) @ decode(rhs).T


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_LOW_PRECISION = re.compile(r"= (?:f8e\w+|f4e2m1fn)\[[^=]*parameter\(")


def native_gemm_calls(compiled_text: str) -> list[str]:
    """The instructions of a compiled program (``compiled.as_text()``) that run a native low-precision GEMM.

    Those are calls of :data:`NATIVE_GEMM_TARGETS`, and Triton GEMM fusions
    (XLA GPU may give a small fp8 dot to Triton instead of cuBLASLt) whose fused
    computation takes fp8 or fp4 parameters. A program that upcast its codes
    before the dot has none.
    """
    bodies: dict[str, list[str]] = {}
    current: list[str] = []
    for line in compiled_text.splitlines():
        if m := _COMPUTATION.match(line.strip()):
            current = bodies.setdefault(m.group(1), [])
        else:
            current.append(line.strip())
    found = []
    for line in (x for body in bodies.values() for x in body):
        if "custom_call_target=" in line and any(f'"{t}"' in line for t in NATIVE_GEMM_TARGETS):
            found.append(line)
        elif "__triton_gemm" in line and (m := _CALLS.search(line)) and any(
                _LOW_PRECISION.search(x) for x in bodies.get(m.group(1), ())):
            found.append(line)
    return found
