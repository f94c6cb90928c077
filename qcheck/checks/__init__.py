"""Every assertion qcheck offers, usable from any project.

Every assertion raises ``AssertionError`` with a message that starts with the
check's name and gives the figure it measured. Inputs that make a check
meaningless (a zero reference, operands that cannot tell the reference apart
from the bug) raise ``ValueError`` instead: a check that cannot fail must not
pass.
"""

from __future__ import annotations

from qcheck._coverage import assert_quantized, coverage
from qcheck.checks._amax import assert_amax_histories_follow_operands
from qcheck.checks._backward import assert_site_backward_exact, assert_site_ragged_backward_exact
from qcheck.checks._fp8_native import assert_fp8_dtypes_native, assert_recipe_fp8_native
from qcheck.checks._fp8_state import assert_fp8_state_matches, fp8_state
from qcheck.checks._fresh import assert_fresh_cast_exact, assert_fresh_ragged_cast_exact, cast_reference, probe_operands
from qcheck.checks._native_gemm import NATIVE_GEMM_TOL, assert_native_matches_emulation
from qcheck.checks._programs import assert_no_recompiles, entry_params, lowered_entry_params
from qcheck.checks._ragged_groups import assert_ragged_groups_independent
from qcheck.checks._referee import assert_format_matches_referee
from qcheck.checks._tracks import assert_tracks, rel_norm

__all__ = [
    "NATIVE_GEMM_TOL",
    "assert_amax_histories_follow_operands",
    "assert_fp8_dtypes_native",
    "assert_fp8_state_matches",
    "assert_format_matches_referee",
    "assert_fresh_cast_exact",
    "assert_fresh_ragged_cast_exact",
    "assert_native_matches_emulation",
    "assert_no_recompiles",
    "assert_quantized",
    "assert_ragged_groups_independent",
    "assert_recipe_fp8_native",
    "assert_site_backward_exact",
    "assert_site_ragged_backward_exact",
    "assert_tracks",
    "cast_reference",
    "coverage",
    "entry_params",
    "fp8_state",
    "lowered_entry_params",
    "probe_operands",
    "rel_norm",
]
