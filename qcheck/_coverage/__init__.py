"""Which matmuls of a program are quantized, and how: a walk over its jaxpr, and the rules that spare some.

Its public names are offered as ``qcheck.*`` and ``qcheck.checks.*``.
"""

from __future__ import annotations

from qcheck._versions import require_supported

require_supported()  # the walk reads jaxpr internals that older JAX lacks

from qcheck._coverage._records import (BLOCK_SCALED, MATMUL_PRIMITIVES, VALUE_PRESERVING, MatmulRecord,
                                       OperandQuant, call_body)
from qcheck._coverage._declaration import Hold, judge_stored, judged_once, mixed_formats
from qcheck._coverage._kernels import as_kernel_roles
from qcheck._coverage._map import (CoverageMap, Prepared, after_first_call, assert_quantized, coverage,
                                   format_coverage, graph_paths, judged_runs, machinery_tuple, prepare,
                                   quantized_records, warmed_up)
from qcheck._coverage._readers import read_declaration, read_stored, resolve_declaration
from qcheck._coverage._scopes import machinery_prefixes, user_frames
from qcheck._coverage._skips import Skip, SkipArg, as_skips, skip_at, skip_functions, skip_modules, skip_where
from qcheck._coverage._values import debug_info_type
from qcheck._coverage._weights import Weights, unmarked, weights
from qcheck.libraries import Declaration, KernelRoles, Stored, as_declaration

__all__ = [
    "BLOCK_SCALED",
    "CoverageMap",
    "Declaration",
    "Hold",
    "KernelRoles",
    "MATMUL_PRIMITIVES",
    "VALUE_PRESERVING",
    "Weights",
    "MatmulRecord",
    "OperandQuant",
    "Prepared",
    "Skip",
    "SkipArg",
    "Stored",
    "after_first_call",
    "as_declaration",
    "as_kernel_roles",
    "as_skips",
    "assert_quantized",
    "call_body",
    "coverage",
    "debug_info_type",
    "format_coverage",
    "graph_paths",
    "judge_stored",
    "judged_once",
    "judged_runs",
    "machinery_prefixes",
    "machinery_tuple",
    "mixed_formats",
    "prepare",
    "quantized_records",
    "read_declaration",
    "read_stored",
    "resolve_declaration",
    "skip_at",
    "skip_functions",
    "skip_modules",
    "skip_where",
    "unmarked",
    "user_frames",
    "warmed_up",
    "weights",
]
