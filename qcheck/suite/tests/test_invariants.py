"""The invariant suite: every selected recipe, both models, both paths, with and without dropping.

One test per invariant of :data:`qcheck.suite.invariants.INVARIANTS` (but
``golden``, whose items are the golden files: ``test_golden_cases.py``), each
parametrized by qcheck's pytest plugin over the cases it applies to
(``@pytest.mark.qcheck_invariant``), and each running its cell as the matrix and
qcheck.testing do (:func:`qcheck.suite.cells.run_cell`): every assertion lives
in the invariant, so the three give one verdict.
"""

import pytest

from qcheck.suite import invariants
from qcheck.suite.cells import run_cell

#: The items' names, which CI logs and ``-k`` expressions know; an invariant not listed is ``test_<name>``.
_NAMES = {
    "sites": "test_call_sites_share_no_state",
    "coverage": "test_every_call_site_matmul_is_quantized",
    "exact": "test_fresh_sites_equal_cast_reference_bitwise",
    "backward": "test_fresh_sites_gradients_equal_referee_gradient_matmuls_bitwise",
    "tracks": "test_layer_tracks_unquantized_twin",
    "grads": "test_train_step_gradients_track_unquantized_twin",
    "edges": "test_layer_stays_finite_and_exact_on_edge_rows",
    "state": "test_fp8_state_moves_only_in_backward",
    "train": "test_reference_trainer_keeps_fp8_state_through_microbatches_and_the_optimizer",
    "rng": "test_rng_state_is_flat_across_depth_and_private_control_grows",
    "sharded": "test_sharded_layer_computes_the_same_function",
    "referee": "test_unquantized_layer_matches_the_float64_referee",
}


def _item(invariant: invariants.Invariant):
    @pytest.mark.qcheck_invariant(invariant.name)
    def test(qcheck_case):
        __tracebackhide__ = True
        run_cell(qcheck_case, invariant.name).raise_failure()

    test.__name__ = test.__qualname__ = _NAMES.get(invariant.name, f"test_{invariant.name}")
    test.__doc__ = f"The {invariant.name} invariant: {invariant.doc}."
    return test


for _invariant in invariants.INVARIANTS:
    if _invariant.name != "golden":
        globals()[_NAMES.get(_invariant.name, f"test_{_invariant.name}")] = _item(_invariant)


def test_dense_and_sparse_compute_the_same_function(qcheck_paths):
    __tracebackhide__ = True
    run_cell(invariants.paths_case(*qcheck_paths), invariants.PATHS).raise_failure()


def test_declared_library_refusals_and_defects_still_hold(qcheck_declared):
    """Where a recipe declares that its library refuses a case, or has a defect a check catches, assert it still does."""
    case, invariant = qcheck_declared
    verdict = run_cell(case, invariant)
    verdict.raise_failure()
    assert verdict.status in ("unsupported", "known"), verdict
