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
"""

from __future__ import annotations

from qcheck._coverage import assert_quantized, coverage
from qcheck.checks._amax import assert_amax_histories_follow_operands
from qcheck.checks._backward import assert_site_backward_exact
from qcheck.checks._figures import Figures
from qcheck.checks._fp8_native import assert_fp8_dtypes_native, assert_recipe_fp8_native
from qcheck.checks._fp8_state import assert_fp8_state_matches, fp8_state
from qcheck.checks._fresh import assert_fresh_cast_exact, cast_reference
from qcheck.checks._layer import LayerFigures, check_layer
from qcheck.recipes._matmul import Einsum, Matmul, Ragged
from qcheck.checks._moe_referee import assert_moe_matches_referee
from qcheck.checks._native_gemm import NATIVE_GEMM_TOL, assert_native_matches_emulation
from qcheck.checks._probes import probe_operands
from qcheck.checks._programs import assert_no_recompiles, entry_params, lowered_entry_params
from qcheck.checks._ragged_groups import assert_ragged_groups_independent
from qcheck.checks._referee import assert_format_matches_referee
from qcheck.checks._site import assert_layer_sites_exact, assert_site_exact
from qcheck.checks._tracks import assert_tracks, rel_norm
from qcheck.checks._uninitialized import assert_no_uninitialized_reads

__all__ = [
    "Einsum",
    "Figures",
    "LayerFigures",
    "Matmul",
    "NATIVE_GEMM_TOL",
    "Ragged",
    "assert_amax_histories_follow_operands",
    "assert_fp8_dtypes_native",
    "assert_fp8_state_matches",
    "assert_format_matches_referee",
    "assert_fresh_cast_exact",
    "assert_layer_sites_exact",
    "assert_moe_matches_referee",
    "assert_native_matches_emulation",
    "assert_no_uninitialized_reads",
    "assert_no_recompiles",
    "assert_quantized",
    "assert_ragged_groups_independent",
    "assert_recipe_fp8_native",
    "assert_site_backward_exact",
    "assert_site_exact",
    "assert_tracks",
    "cast_reference",
    "check_layer",
    "coverage",
    "entry_params",
    "fp8_state",
    "lowered_entry_params",
    "probe_operands",
    "rel_norm",
]
