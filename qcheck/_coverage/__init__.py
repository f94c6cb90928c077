"""Which matmuls of a program are quantized, and how: a walk over its jaxpr, and the rules that spare some.

Its public names are offered as ``qcheck.*`` and ``qcheck.checks.*``.
"""

from __future__ import annotations

from qcheck._versions import require_supported

require_supported()  # the walk reads jaxpr internals that older JAX lacks

from qcheck._coverage._records import (BLOCK_SCALED, CALLS, MATMUL_PRIMITIVES, VALUE_PRESERVING, MatmulRecord,
                                       OperandQuant)
from qcheck._coverage._kernels import KernelRoles
from qcheck._coverage._map import assert_quantized, coverage, format_coverage, warmed_up
from qcheck._coverage._scopes import MACHINERY
from qcheck._coverage._skips import Skip, SkipArg, as_skips, skip_at, skip_functions, skip_modules, skip_where

__all__ = [
    "BLOCK_SCALED",
    "CALLS",
    "KernelRoles",
    "MACHINERY",
    "MATMUL_PRIMITIVES",
    "VALUE_PRESERVING",
    "MatmulRecord",
    "OperandQuant",
    "Skip",
    "SkipArg",
    "as_skips",
    "assert_quantized",
    "coverage",
    "format_coverage",
    "skip_at",
    "skip_functions",
    "skip_modules",
    "skip_where",
    "warmed_up",
]
