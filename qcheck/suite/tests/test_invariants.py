"""The invariant suite: every selected recipe, both models, both paths, with and without dropping.

Each test is parametrized by qcheck's pytest plugin over the cases its
invariant applies to (``@pytest.mark.qcheck_invariant``), and runs its cell as
the matrix and qcheck.testing do (:func:`qcheck.suite._cells.run_cell`): every
assertion lives in the invariant, so the three give one verdict.
"""

import pytest

from qcheck.suite import invariants
from qcheck.suite._cells import run_cell


def _run(case, invariant: str) -> None:
    __tracebackhide__ = True
    run_cell(case, invariant).raise_failure()


@pytest.mark.qcheck_invariant("coverage")
def test_every_call_site_matmul_is_quantized(qcheck_case):
    _run(qcheck_case, "coverage")


@pytest.mark.qcheck_invariant("exact")
def test_fresh_sites_equal_cast_reference_bitwise(qcheck_case):
    _run(qcheck_case, "exact")


@pytest.mark.qcheck_invariant("backward")
def test_fresh_sites_gradients_equal_referee_gradient_matmuls_bitwise(qcheck_case):
    _run(qcheck_case, "backward")


@pytest.mark.qcheck_invariant("tracks")
def test_layer_tracks_unquantized_twin(qcheck_case):
    _run(qcheck_case, "tracks")


@pytest.mark.qcheck_invariant("state")
def test_fp8_state_moves_only_in_backward(qcheck_case):
    _run(qcheck_case, "state")


@pytest.mark.qcheck_invariant("train")
def test_reference_trainer_keeps_fp8_state_through_microbatches_and_the_optimizer(qcheck_case):
    _run(qcheck_case, "train")


def test_dense_and_sparse_compute_the_same_function(qcheck_paths):
    invariants.run_paths(*qcheck_paths)


@pytest.mark.qcheck_invariant("sites")
def test_call_sites_share_no_state(qcheck_case):
    _run(qcheck_case, "sites")


@pytest.mark.qcheck_invariant("rng")
def test_rng_state_is_flat_across_depth_and_private_control_grows(qcheck_case):
    _run(qcheck_case, "rng")


@pytest.mark.qcheck_invariant("sharded")
def test_sharded_layer_computes_the_same_function(qcheck_case):
    _run(qcheck_case, "sharded")


@pytest.mark.qcheck_invariant("referee")
def test_unquantized_layer_matches_the_float64_referee(qcheck_case):
    _run(qcheck_case, "referee")


@pytest.mark.qcheck_invariant("grads")
def test_train_step_gradients_track_unquantized_twin(qcheck_case):
    _run(qcheck_case, "grads")


def test_declared_library_refusals_and_defects_still_hold(qcheck_declared):
    """Where a recipe declares that its library refuses a case, or has a defect a check catches, assert it still does."""
    case, invariant = qcheck_declared
    verdict = run_cell(case, invariant)
    verdict.raise_failure()
    assert verdict.status in ("unsupported", "known"), verdict
