"""Every assertion qcheck offers, usable from any project.

Every assertion raises ``AssertionError`` with a message that starts with the
check's name (after its ``label``, where given) and gives the figure it
measured. Inputs that make a check meaningless (a zero reference, operands that
cannot tell the reference apart from the bug) raise ``ValueError`` instead,
with the same prefix: a check that cannot fail must not pass. A check that
measures something returns :class:`Figures`: a float equal to its main figure,
with each figure it measured by name.

The exact checks take one description of the matmul they hold a site to: an
einsum string (or :class:`Einsum`) or :class:`Ragged` with the group sizes.
:func:`check_layer` runs the layer-level checks on any layer against its
unquantized twin.

Besides the assertions, the parts they are made of, for a harness that runs
many checks in one program: each exact check's judgement (``judge_*``, a pure
verdict over values computed elsewhere, raised as the check by
:func:`judged_as`), the recorders of a layer's site calls
(:func:`record_site_calls`, :func:`record_site_grads`), the probes that
make the checks sharp, and the edge rows where quantizers break
(:data:`EDGE_ROWS`, :func:`format_edge_rows`).
"""

from __future__ import annotations

from qcheck._coverage import assert_quantized, coverage
from qcheck.checks._amax import assert_amax_histories_follow_operands
from qcheck.checks._assertion import assertion, judged_as
from qcheck.checks._backward import assert_site_backward_exact, judge_site_backward, site_grads
from qcheck.checks._edges import EDGE_ROWS, format_edge_rows
from qcheck.checks._figures import Figures
from qcheck.checks._fp8_native import assert_fp8_dtypes_native, assert_recipe_fp8_native, declared_operand_fp8_dtypes
from qcheck.checks._fp8_state import assert_fp8_state_matches, fp8_state, history_rolls
from qcheck.checks._fresh import assert_fresh_cast_exact, cast_reference, judge_fresh_cast
from qcheck.checks._layer import LayerFigures, check_layer, copy_params_into
from qcheck.checks._layer_backward import (SiteGradCall, assert_layer_sites_backward_exact, judge_site_grad_calls,
                                           record_site_grads, through_layer_applies)
from qcheck.checks._moe_referee import assert_moe_matches_referee, compare_with_referee, module_params, referee_weights
from qcheck.checks._native_gemm import NATIVE_GEMM_TOL, assert_native_matches_emulation
from qcheck.checks._probes import probe_grad, probe_nvfp4, probe_operands
from qcheck.checks._programs import assert_no_recompiles, entry_params, lowered_entry_params
from qcheck.checks._ragged_groups import assert_ragged_groups_independent
from qcheck.checks._referee import assert_format_matches_referee
from qcheck.checks._site import (SiteCall, assert_layer_sites_exact, assert_site_exact, judge_site_calls,
                                 judge_site_exact, operand_formats, probe_site_operands, record_site_calls)
from qcheck.checks._tracks import assert_tracks, rel_norm
from qcheck.checks._uninitialized import assert_no_uninitialized_reads
from qcheck.recipes import Einsum, Matmul, Ragged

__all__ = [
    "EDGE_ROWS",
    "Einsum",
    "Figures",
    "LayerFigures",
    "Matmul",
    "NATIVE_GEMM_TOL",
    "Ragged",
    "SiteCall",
    "SiteGradCall",
    "assert_amax_histories_follow_operands",
    "assert_format_matches_referee",
    "assert_fp8_dtypes_native",
    "assert_fp8_state_matches",
    "assert_fresh_cast_exact",
    "assert_layer_sites_backward_exact",
    "assert_layer_sites_exact",
    "assert_moe_matches_referee",
    "assert_native_matches_emulation",
    "assert_no_recompiles",
    "assert_no_uninitialized_reads",
    "assert_quantized",
    "assert_ragged_groups_independent",
    "assert_recipe_fp8_native",
    "assert_site_backward_exact",
    "assert_site_exact",
    "assert_tracks",
    "assertion",
    "cast_reference",
    "check_layer",
    "compare_with_referee",
    "copy_params_into",
    "coverage",
    "declared_operand_fp8_dtypes",
    "entry_params",
    "format_edge_rows",
    "fp8_state",
    "history_rolls",
    "judge_fresh_cast",
    "judge_site_backward",
    "judge_site_calls",
    "judge_site_exact",
    "judge_site_grad_calls",
    "judged_as",
    "lowered_entry_params",
    "module_params",
    "operand_formats",
    "probe_grad",
    "probe_nvfp4",
    "probe_operands",
    "probe_site_operands",
    "record_site_calls",
    "record_site_grads",
    "referee_weights",
    "rel_norm",
    "site_grads",
    "through_layer_applies",
]
