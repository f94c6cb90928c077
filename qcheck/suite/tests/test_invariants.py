"""The invariant suite: every selected recipe, both models, both paths, with and without dropping.

Each test is parametrized by qcheck's pytest plugin over the cases its
invariant applies to (``@pytest.mark.qcheck_invariant``).
"""

import pytest

from qcheck.suite import invariants


@pytest.mark.qcheck_invariant("coverage")
def test_every_call_site_matmul_is_quantized(qcheck_case):
    assert invariants.check_coverage(qcheck_case) > 0


@pytest.mark.qcheck_invariant("exact")
def test_fresh_sites_equal_cast_reference_bitwise(qcheck_case):
    invariants.check_exact(qcheck_case)


@pytest.mark.qcheck_invariant("backward")
def test_fresh_sites_gradients_equal_referee_gradient_matmuls_bitwise(qcheck_case):
    invariants.check_backward(qcheck_case)


@pytest.mark.qcheck_invariant("tracks")
def test_layer_tracks_unquantized_twin(qcheck_case):
    figure = invariants.check_tracks(qcheck_case)
    assert figure > 0


@pytest.mark.qcheck_invariant("state")
def test_fp8_state_moves_only_in_backward(qcheck_case):
    invariants.check_state(qcheck_case)


@pytest.mark.qcheck_invariant("train")
def test_reference_trainer_keeps_fp8_state_through_microbatches_and_the_optimizer(qcheck_case):
    invariants.check_train(qcheck_case)


def test_dense_and_sparse_compute_the_same_function(qcheck_paths):
    model, dropping = qcheck_paths
    assert invariants.check_paths_agree(model, dropping) <= invariants.PATHS_ATOL * 10


@pytest.mark.qcheck_invariant("sites")
def test_call_sites_share_no_state(qcheck_case):
    invariants.check_sites(qcheck_case)


@pytest.mark.qcheck_invariant("rng")
def test_rng_state_is_flat_across_depth_and_private_control_grows(qcheck_case):
    flat = invariants.check_rng(qcheck_case)
    # Flat, and no more than the unquantized stack carries: the caller's one stream (tests/test_rng.py: the control).
    twin = invariants.rng_entry_params(qcheck_case.variant.model, "none", depths=(1,))[1].get("u32", 0)
    invariants.assert_rng_state_matches_twin(flat, twin, qcheck_case.id)


@pytest.mark.qcheck_invariant("sharded")
def test_sharded_layer_computes_the_same_function(qcheck_case):
    assert invariants.check_sharded(qcheck_case) <= invariants.SHARDED_ATOL


@pytest.mark.qcheck_invariant("referee")
def test_unquantized_layer_matches_the_float64_referee(qcheck_case):
    assert invariants.check_referee(qcheck_case) <= qcheck_case.variant.referee_tolerance[0]


@pytest.mark.qcheck_invariant("grads")
def test_train_step_gradients_track_unquantized_twin(qcheck_case):
    assert invariants.check_grads(qcheck_case) > 0


def test_declared_library_refusals_and_defects_still_hold(qcheck_declared):
    """Where a recipe declares that its library refuses a case, or has a defect a check catches, assert it still does."""
    from qcheck.suite import _declared

    case, invariant = qcheck_declared
    note = _declared.check_declared(case, invariant)
    assert note.startswith(("not supported by ", "known defect of ")), note
