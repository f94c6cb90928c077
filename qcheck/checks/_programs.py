"""What a compiled program takes as parameters, and whether a second run compiles again."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

from qcheck.checks._assertion import assertion
from qcheck.checks._compiles import counting_compilations

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


@assertion
def assert_no_recompiles(fn: Callable[[], Any], *, warmup: Callable[[], Any] | None = None,
                         label: str = "") -> None:
    """Run ``warmup`` (default: ``fn``), then ``fn``; that run must request no XLA compilation.

    ``fn`` should do what a test run does (build, jit, run). A run after the
    warm-up that compiles means a program is not cached where it should be: a
    ``jax.jit`` made anew on every call, a static argument that does not compare
    equal, a shape that changes. The message names each function and its
    argument types.
    """
    (warmup or fn)()
    with counting_compilations() as counts:
        fn()
    if counts:
        lines = "\n  ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
        raise AssertionError(
            "the second run compiled "
            f"{sum(counts.values())} programs again:\n  {lines}"
        )
