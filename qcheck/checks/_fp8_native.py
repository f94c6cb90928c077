"""Whether the fp8 types a layer multiplies are the ones its target hardware multiplies natively.

A recipe declared with the wrong e4m3 flavour everywhere (NANOO fp8 built with
e4m3fn, site and declaration alike) passes every check that follows the
declaration: ``exact``, ``backward`` and ``tracks`` compare the layer with what
it says it does. What it is *for* is independent of the formats: the hardware
it targets (``Expect.fp8_target``; :data:`qcheck.hardware.FP8_TARGETS`). Here
the types are read from the program, not the declaration: the coverage map of
a forward and a backward trace (tracing only) gives every narrowing cast on
each matmul operand's quantized chain, and each fp8 one must be native to the
target. Only the four fp8 element types with flavours count
(:data:`qcheck.formats.FP8_DTYPES`); e2m1 codes and e8m0 block scales have no
flavour to get wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from qcheck import formats
from qcheck._coverage import MatmulRecord, coverage
from qcheck.checks._assertion import assertion
from qcheck.hardware import fp8_target_dtypes

# Wide enough for every block format (NVFP4: 16, MXFP8: 32) along its last axis.
_PROBE = jax.ShapeDtypeStruct((1, 32), np.float32)


def _fp8_types(dtypes: Any) -> set[str]:
    return {str(np.dtype(d)) for d in dtypes} & set(formats.FP8_DTYPES)


def _format_fp8_dtypes(fmt: str, *, codes_only: bool = False) -> set[str]:
    """The fp8 types ``fmt`` stores codes (and scales) in, read off :func:`qcheck.formats.quantize` (shapes only)."""
    q = jax.eval_shape(lambda x: formats.quantize(x, fmt, axis=-1), _PROBE)
    return _fp8_types(leaf.dtype for leaf in jax.tree.leaves(q.codes if codes_only else q))


def declared_fp8_dtypes(recipe: Any) -> dict[str, set[str]]:
    """What ``recipe`` declares, by attribute, as the fp8 types it uses: formats (lhs/rhs/grad) and dtypes.

    ``reference.cast_dtype`` and, on fp8 recipes with flavours (``DelayedScalingFp8``,
    Flax's), ``e4m3_dtype``/``e5m2_dtype``. Attributes without fp8 types are left out.
    """
    out: dict[str, set[str]] = {}
    for arg in ("lhs", "rhs", "grad"):
        fmt = getattr(recipe, arg, None)
        if fmt is not None and (types := _format_fp8_dtypes(fmt)):
            out[arg] = types
    dtypes = {"reference.cast_dtype": getattr(getattr(recipe, "reference", None), "cast_dtype", None),
              **{arg: getattr(recipe, arg, None) for arg in ("e4m3_dtype", "e5m2_dtype")}}
    for arg, dtype in dtypes.items():
        if dtype is not None and (types := _fp8_types([dtype])):
            out[arg] = types
    return out


def declared_operand_fp8_dtypes(recipe: Any) -> set[str]:
    """The fp8 types ``recipe`` declares its matmul operands' codes in (not scales): what a trace must show.

    ``lhs``/``rhs`` codes and ``cast_dtype``. NVFP4 declares none (e2m1 codes;
    its e4m3 block scales divide, which the coverage map does not follow).
    """
    out = set()
    for arg in ("lhs", "rhs"):
        if (fmt := getattr(recipe, arg, None)) is not None:
            out |= _format_fp8_dtypes(fmt, codes_only=True)
    if (dtype := getattr(getattr(recipe, "reference", None), "cast_dtype", None)) is not None:
        out |= _fp8_types([dtype])
    return out


def _target(target: str, native: frozenset[str]) -> str:
    return f"target {target!r} (native fp8: {', '.join(sorted(native))})"


@assertion
def assert_recipe_fp8_native(recipe: Any, target: str | None = None, *, label: str = "") -> dict[str, set[str]]:
    """Assert every fp8 type ``recipe`` declares is native to ``target`` (default: ``recipe.expect.fp8_target``).

    Cheap (shapes only): it catches a declaration slip before any layer runs.
    Returns :func:`declared_fp8_dtypes`.
    """
    target = getattr(getattr(recipe, "expect", None), "fp8_target", None) if target is None else target
    if target is None:
        raise ValueError(f"recipe {getattr(recipe, 'name', recipe)!r} declares no "
                         "fp8_target; pass target=")
    native = fp8_target_dtypes(target)
    declared = declared_fp8_dtypes(recipe)
    bad = [f"{arg} {t}" for arg, types in declared.items() for t in sorted(types - native)]
    if bad:
        raise AssertionError(
            f"recipe {getattr(recipe, 'name', recipe)!r} declares fp8 types not native "
            f"to its {_target(target, native)}: {', '.join(bad)}")
    return declared


@assertion
def assert_fp8_dtypes_native(
    fn: Callable[..., Any],
    *args: Any,
    target: str,
    skip: Callable[[MatmulRecord], bool] | None = None,
    backward: bool = True,
    label: str = "",
    **kwargs: Any,
) -> list[MatmulRecord]:
    """Assert every fp8 type ``fn``'s matmul operands are cast to, forward and backward, is native to ``target``.

    ``fn`` as for :func:`qcheck.coverage` (a function of arrays or an NNX
    module); it is traced with its vjp (``coverage(..., backward=True)``), no
    compilation; ``backward=False`` traces the forward pass alone (for a layer
    that cannot take a gradient). Each operand's casts are read from the program: codes and
    scales, and an operand that arrives in an fp8 type. ``skip(record)``
    leaves matmuls out. Fails naming, per offending operand, the pass
    (forward/backward), the matmul's location and function, the operand, its
    fp8 type and the target with its native types. Returns the records.
    """
    native = fp8_target_dtypes(target)
    if skip is not None and not callable(skip):
        raise TypeError(f"skip must be a callable (record) -> bool, "
                        f"got {type(skip).__name__}")
    # Types alone: no declaration is held (that would run the program), whatever fn's library states.
    records = coverage(fn, *args, backward=backward, declared=False, **kwargs)
    lines: list[str] = []
    found = 0
    for r in records:
        if skip is not None and skip(r):
            continue
        for side, quant, casts in (("lhs", r.lhs, r.lhs_casts), ("rhs", r.rhs, r.rhs_casts)):
            seen = _fp8_types(set(casts) | ({quant.dtype} if quant.kind == "cast" else set()))
            found += bool(seen)
            for dtype in sorted(seen - native):
                line = (f"  {'backward' if r.backward else 'forward'}: {r.primitive} at {r.location} "
                        f"({r.function}): {side} cast to {dtype}")
                if line not in lines:
                    lines.append(line)
    if lines:
        raise AssertionError(
            f"{len(lines)} operand casts to fp8 types not native to "
            f"{_target(target, native)}:\n" + "\n".join(lines))
    if not found:
        # Nothing to hold to the target: a check that saw nothing must not pass.
        raise ValueError(
            f"none of the {len(records)} matmuls takes an operand cast to an fp8 type "
            f"({', '.join(formats.FP8_DTYPES)}); nothing to check against target {target!r}")
    return records
