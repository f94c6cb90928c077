"""The parts qcheck's checks are made of: qcheck's own interface onto them, not a user's.

A user's test calls :mod:`qcheck.checks` (every ``assert_*``, :func:`~qcheck.checks.check_layer`, their
figures and the operands they take). This module is for qcheck's invariant suite (``qcheck/suite``), which
runs many checks in one compiled program per case, and for qcheck's other modules and tests; its names may
change with the suite, without notice or deprecation.

What it holds:

- each exact check's judgement (``judge_*``): a pure verdict over values computed elsewhere, raised under the
  check's name and ``label`` by :func:`judged_as`; :func:`assertion` is the wrapper that gives every check
  its message prefix;
- the recorders of a layer's site calls (:func:`record_site_calls`, :func:`record_site_grads`, the records
  :class:`SiteCall` and :class:`SiteGradCall`) and a fresh site's gradients (:func:`site_grads`);
- the probes the suite builds per matmul (:func:`probe_site_operands`, :func:`probe_nvfp4`) and each
  recipe's operand formats (:func:`operand_formats`);
- the edge rows where quantizers break (:data:`EDGE_ROWS`, :func:`format_edge_rows`);
- the MoE referee's parts (:func:`module_params`, :func:`referee_weights`, :func:`compare_with_referee`),
  the fp8 state's history roll (:func:`history_rolls`), a recipe's declared fp8 dtypes
  (:func:`declared_operand_fp8_dtypes`), a program's entry parameters (:func:`entry_params`,
  :func:`lowered_entry_params`) and the RNG state entering a step (:func:`step_rng_state`, its record
  :class:`StepRngState`, judged by :func:`judge_rng_state_flat`), the fresh cast's reference
  (:func:`cast_reference`, which :mod:`qcheck.native`'s emulation shares) and the native GEMM's bound
  (:data:`NATIVE_GEMM_TOL`).
"""

from __future__ import annotations

from qcheck.checks._assertion import assertion, judged_as
from qcheck.checks._backward import judge_site_backward, site_grads
from qcheck.checks._edges import EDGE_ROWS, format_edge_rows
from qcheck.checks._fp8_native import declared_operand_fp8_dtypes
from qcheck.checks._fp8_state import history_rolls
from qcheck.checks._fresh import cast_reference, judge_fresh_cast
from qcheck.checks._layer_backward import SiteGradCall, judge_site_grad_calls, record_site_grads, through_layer_applies
from qcheck.checks._moe_matches import compare_with_referee, module_params, referee_weights
from qcheck.checks._native_gemm import NATIVE_GEMM_TOL
from qcheck.checks._probes import probe_nvfp4
from qcheck.checks._programs import entry_params, lowered_entry_params
from qcheck.checks._rng_state import StepRngState, judge_rng_state_flat, step_rng_state
from qcheck.checks._site import (SiteCall, judge_site_calls, judge_site_exact, operand_formats, probe_site_operands,
                                 record_site_calls)

__all__ = [
    "EDGE_ROWS",
    "NATIVE_GEMM_TOL",
    "SiteCall",
    "SiteGradCall",
    "StepRngState",
    "assertion",
    "cast_reference",
    "compare_with_referee",
    "declared_operand_fp8_dtypes",
    "entry_params",
    "format_edge_rows",
    "history_rolls",
    "judge_fresh_cast",
    "judge_rng_state_flat",
    "judge_site_backward",
    "judge_site_calls",
    "judge_site_exact",
    "judge_site_grad_calls",
    "judged_as",
    "lowered_entry_params",
    "module_params",
    "operand_formats",
    "probe_nvfp4",
    "probe_site_operands",
    "record_site_calls",
    "record_site_grads",
    "referee_weights",
    "site_grads",
    "step_rng_state",
    "through_layer_applies",
]
