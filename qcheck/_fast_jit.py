"""``jax.jit`` that compiles qcheck's layer programs with XLA CPU's legacy fusion emitters where that is exact.

Compiling is most of the suite's time. On jaxlib 0.10, XLA CPU's legacy
fusion emitters (``xla_cpu_use_fusion_emitters=False``) compile qcheck's
layers about twice as fast as the default MLIR emitters, and give the same
forward outputs bit for bit — except that they convert wrongly to some
low-precision types (measured on jaxlib 0.10.2, pinned by
``tests/test_fast_jit.py``):

- f32 -> f8E4M3FNUZ / f8E5M2FNUZ: a negative value that underflows to zero
  becomes 0x80, which is NaN in those formats (NANOO fp8 layers output NaN);
- f32 -> f4E2M1FN: values next to a rounding midpoint round the wrong way
  (-3.4999998 -> -4 instead of -3).

A program takes the legacy emitters only if every element type in it is one
whose conversions the tests check bitwise against ml_dtypes
(:data:`LEGACY_SAFE_TYPES`). ``formats.qdq`` keeps e2m1 out of NVFP4 layers
(``formats.round_e2m1``), so they qualify; NANOO fp8 layers do not. Any other
program, on any other backend or jaxlib (0.12 has no such option), or when the
user's ``XLA_FLAGS`` name the option, compiles exactly as ``jax.jit`` would.

:class:`FastJit` does this for qcheck's layer programs in any process.
qcheck's own processes (the suite, the CLI, the matrix workers) also call
:func:`install`, which applies the same rule to every program they compile:
eager ops, references, the tests' own programs, more than half of the suite's
compile time.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qcheck import _mlir_context, _xla_env

__all__ = ["LEGACY_EMITTERS", "LEGACY_SAFE_TYPES", "FastJit", "fast_jit", "install", "installed",
           "legacy_emitter_options", "legacy_safe", "options_for"]

LEGACY_EMITTERS: dict[str, Any] = {"xla_cpu_use_fusion_emitters": False}

#: StableHLO element types whose conversions the legacy emitters get bitwise right.
LEGACY_SAFE_TYPES = frozenset({
    "i1", "i8", "i32", "i64", "ui8", "ui32", "ui64",
    "f32", "bf16", "f8E4M3FN", "f8E5M2", "f8E8M0FNU",
})

_TENSOR = re.compile(r"tensor<")
_ELEMENT_TYPE = re.compile(r"tensor<(?:[0-9?]+x)*([A-Za-z][A-Za-z0-9]*)[,>]")


def element_types(stablehlo: str) -> set[str]:
    """The element types of every tensor named in a StableHLO module's text."""
    return set(_ELEMENT_TYPE.findall(stablehlo))


def legacy_safe(stablehlo: str) -> bool:
    """Whether a program may compile with the legacy emitters: it holds only :data:`LEGACY_SAFE_TYPES`.

    Fails closed: a tensor type this cannot read (a quantized or nested element
    type) makes the program unsafe rather than unexamined.
    """
    if len(_ELEMENT_TYPE.findall(stablehlo)) != len(_TENSOR.findall(stablehlo)):
        return False
    return element_types(stablehlo) <= LEGACY_SAFE_TYPES


@functools.cache
def legacy_emitter_options() -> dict[str, Any]:
    """:data:`LEGACY_EMITTERS` where the default backend takes them, else ``{}``.

    Empty off CPU, when ``XLA_FLAGS`` already names the option (the user's
    choice then applies to every program), or when this jaxlib does not know
    it. Asked once per process, with a one-op program.
    """
    if _xla_env.default_platform() != "cpu" or any(k in os.environ.get("XLA_FLAGS", "") for k in LEGACY_EMITTERS):
        return {}
    try:
        jax.jit(lambda x: x + 1).lower(jnp.float32(0)).compile(compiler_options=LEGACY_EMITTERS)
    except Exception:  # noqa: BLE001 - jaxlib 0.12: "No such compile option"
        return {}
    return dict(LEGACY_EMITTERS)


def _runs_on_cpu(args: tuple) -> bool:
    """Whether a jitted call on ``args`` runs on the CPU: no array is on another device, nor is the default device.

    On a GPU node qcheck's own computations default to the CPU, but the hardware
    tests hand layers arrays on the GPU, where the CPU-only options do not apply.
    """
    devices = {d for x in jax.tree.leaves(args) if isinstance(x, jax.Array) for d in x.sharding.device_set}
    return _xla_env.default_platform() == "cpu" and all(d.platform == "cpu" for d in devices)


class FastJit:
    """``jax.jit(fun, static_argnums=...)``, compiled with :func:`legacy_emitter_options` where :func:`legacy_safe`.

    Each distinct program is lowered once (by the plain jit, so ``lower`` and
    calls share its caches) and compiled once; a program that is not legacy-safe
    runs through the plain jit unchanged.
    """

    def __init__(self, fun: Callable, *, static_argnums: int | tuple[int, ...] = ()) -> None:
        self._static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self._jit = jax.jit(fun, static_argnums=self._static)
        self._compiled: dict[Any, Any] = {}  # program key -> Compiled, or None for the plain jit
        functools.update_wrapper(self, fun)

    def lower(self, *args) -> jax.stages.Lowered:
        return self._jit.lower(*args)

    def _key(self, args: tuple):
        dynamic = [a for i, a in enumerate(args) if i not in self._static]
        leaves, tree = jax.tree.flatten(dynamic)
        static = tuple(args[i] for i in self._static)
        return static, tree, tuple((jax.typeof(x), getattr(x, "sharding", None)) for x in leaves)

    def compiler_options(self, *args) -> dict[str, Any]:
        """The compiler options the program for ``args`` compiles with (``{}``: jax's defaults)."""
        return self._choose(args)[1]

    def _choose(self, args: tuple):
        key = self._key(args)
        if key not in self._compiled:
            options = legacy_emitter_options()
            if options and _runs_on_cpu(args) and legacy_safe((lowered := self._jit.lower(*args)).as_text()):
                self._compiled[key] = (lowered.compile(compiler_options=options), options)
            else:
                self._compiled[key] = (None, {})
        return self._compiled[key]

    def __call__(self, *args):
        if not legacy_emitter_options():
            return self._jit(*args)
        compiled, _ = self._choose(args)
        if compiled is None:
            return self._jit(*args)
        return compiled(*[a for i, a in enumerate(args) if i not in self._static])


def fast_jit(*, static_argnums: int | tuple[int, ...] = ()) -> Callable[[Callable], FastJit]:
    """Decorator form of :class:`FastJit`."""
    return functools.partial(FastJit, static_argnums=static_argnums)


def options_for(platform: str, compiler_options: dict[str, Any], module_text: Callable[[], str]) -> dict[str, Any]:
    """The options a program compiles with under :func:`install`: the caller's, plus the legacy emitters where safe.

    Only CPU programs holding nothing but :data:`LEGACY_SAFE_TYPES` gain them,
    and never when the caller already chose a value for the option.
    ``module_text`` gives the program's StableHLO, read only if needed.
    """
    legacy = legacy_emitter_options()
    if not legacy or platform != "cpu" or any(k in compiler_options for k in legacy):
        return compiler_options
    if not legacy_safe(module_text()):
        return compiler_options
    return {**compiler_options, **legacy}


# The one place JAX (0.10) builds a program's compile options from jit's
# ``compiler_options``, for jitted functions, eager ops and ``Lowered.compile``
# alike. Private, so install() checks the signature and otherwise does nothing.
_HOOK_PARAMS = ("computation", "tuple_args", "allow_prop_to_inputs", "allow_prop_to_outputs", "backend",
                "np_dev", "compiler_options")
_INSTALLED = "_qcheck_legacy_emitters"


def installed() -> bool:
    """Whether this process compiles every legacy-safe CPU program with the legacy emitters (:func:`install`)."""
    from jax._src.interpreters import pxla

    return getattr(pxla.create_compile_options, _INSTALLED, False)


def install() -> bool:
    """Compile every legacy-safe CPU program of this process with the legacy emitters, not only :class:`FastJit`'s.

    For qcheck's own processes only: it changes how the whole process
    compiles (never what a program with an unsafe type computes). Returns
    whether it is in place; False where this jaxlib has no legacy emitters
    (nothing to gain) or JAX's private hook point has changed. Lowering gets
    the same treatment whatever the emitters: :mod:`qcheck._mlir_context`.
    """
    _mlir_context.install()
    if not legacy_emitter_options():
        return False
    try:
        from jax._src.interpreters import pxla

        original = pxla.create_compile_options
        if getattr(original, _INSTALLED, False):
            return True
        if tuple(inspect.signature(original).parameters) != _HOOK_PARAMS:
            return False
    except (ImportError, AttributeError, TypeError, ValueError):
        return False

    @functools.wraps(original)
    def create_compile_options(computation, tuple_args, allow_prop_to_inputs, allow_prop_to_outputs, backend,
                               np_dev, compiler_options):
        if compiler_options is not None:
            # Types are all that is read: constants' values (which can be large) are elided.
            text = functools.partial(computation.operation.get_asm, large_elements_limit=16)
            compiler_options = options_for(backend.platform, compiler_options, text)
        return original(computation, tuple_args, allow_prop_to_inputs, allow_prop_to_outputs, backend, np_dev,
                        compiler_options)

    setattr(create_compile_options, _INSTALLED, True)
    pxla.create_compile_options = create_compile_options
    return True
