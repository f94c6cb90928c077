"""Every assertion qcheck offers, usable from any project.

Every assertion raises ``AssertionError`` with a message that starts with the
check's name (after its ``label``, where given) and gives the figure it
measured. Inputs that make a check meaningless (a zero reference, operands that
cannot tell the reference apart from the bug) raise ``ValueError`` instead,
with the same prefix: a check that cannot fail must not pass. A check that
measures something returns :class:`Figures`: a float equal to its main figure,
with each figure it measured by name.

The exact checks take one description of the matmul they hold a site to: an
einsum string (or :class:`Einsum`) or :class:`Ragged` with the group sizes, and
are sharp on :func:`probe_operands` (and :func:`probe_grad`, an output gradient).
:func:`check_layer` runs the layer-level checks on any layer against its
unquantized twin (its :class:`LayerFigures`).

This module offers the checks, their figures and the operands they take, and
nothing else. The parts they are made of, which qcheck's own suite calls to run
many checks in one program, are :mod:`qcheck.checks.harness`: not for users' tests.
"""

from types import ModuleType as _ModuleType

# One import line exports a name: __all__ below is what these import (tests/test_public_api.py holds each
# to be a check, a figure or an operand; a part the suite needs goes to qcheck.checks.harness).
from qcheck._coverage import assert_quantized, coverage
from qcheck.checks._amax import assert_amax_histories_follow_operands
from qcheck.checks._backward import assert_site_backward_exact
from qcheck.checks._figures import Figures
from qcheck.checks._fp8_native import assert_fp8_dtypes_native, assert_recipe_fp8_native
from qcheck.checks._fp8_state import assert_fp8_state_matches, fp8_state
from qcheck.checks._fresh import assert_fresh_cast_exact
from qcheck.checks._copy_params import copy_params_into
from qcheck.checks._layer import LayerFigures, check_layer
from qcheck.checks._layer_backward import assert_layer_sites_backward_exact
from qcheck.checks._moe_matches import assert_moe_matches_referee
from qcheck.checks._native_gemm import assert_native_matches_emulation
from qcheck.checks._probes import probe_grad, probe_operands
from qcheck.checks._programs import assert_no_recompiles
from qcheck.checks._rng_state import RngStateFigures, assert_rng_state_flat
from qcheck.checks._ragged_groups import assert_ragged_groups_independent
from qcheck.checks._format_matches import assert_format_matches_referee
from qcheck.checks._site import assert_layer_sites_exact, assert_site_exact
from qcheck.checks._tracks import assert_tracks, rel_norm
from qcheck.checks._uninitialized import assert_no_uninitialized_reads
from qcheck.recipes import Einsum, Matmul, Ragged

__all__ = sorted(name for name, value in globals().items()
                 if not name.startswith("_") and not isinstance(value, _ModuleType))


def __dir__() -> list[str]:
    return list(__all__)
