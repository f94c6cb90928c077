"""The ``sharded`` invariant's control: its twin must really be split over the mesh before outputs are compared."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import qcheck
from qcheck.layers.moe import MESH_AXES
from qcheck.suite import cases, invariants

MIXTRAL = cases.Case("none", cases.Variant("mixtral", "dense", False))


@pytest.mark.parametrize("model, recipe", [("mixtral", "int8"), ("gemma", "none")])
def test_assert_layer_sharded_should_pass_on_a_layer_built_on_the_mesh(model, recipe):
    invariants.assert_layer_sharded(qcheck.build_moe(model, recipe, mesh=cases.mesh()), cases.mesh(), label="ok")


def test_assert_layer_sharded_should_fail_on_a_layer_built_without_its_mesh():
    with pytest.raises(AssertionError, match=r"^bug: assert_layer_sharded: the sharded twin is not sharded: "
                       r"weight 'wi_0' "
                       r"\(float32\[8, 32, 64\]\) is SingleDeviceSharding on 1 device\(s\), not on the 4-way "
                       r"'expert' mesh of 8 devices \(built without its mesh\?\)"):
        invariants.assert_layer_sharded(qcheck.build_moe("mixtral", "none"), cases.mesh(), label="bug")


def test_assert_layer_sharded_should_fail_on_a_replicated_expert_weight():
    mesh = cases.mesh()
    layer = qcheck.build_moe("gemma", "none", mesh=mesh)
    layer.per_expert_scale.set_value(jax.device_put(layer.per_expert_scale[...], NamedSharding(mesh, P())))
    with pytest.raises(AssertionError, match=r"^bug: assert_layer_sharded: the sharded twin is not sharded: weight "
                       r"'per_expert_scale' \(float32\[16\]\) is NamedSharding\(P\(\)\) on a mesh data=2 x expert=4: "
                       r"its shards hold 1 distinct block\(s\) of its 16 experts on 8 "
                       r"devices, expected 4 blocks on 8"):
        invariants.assert_layer_sharded(layer, mesh, label="bug")


def test_assert_layer_sharded_should_fail_on_a_layer_on_another_mesh():
    other = Mesh(np.array(jax.devices("cpu")[:8][::-1]).reshape(2, 4), MESH_AXES)
    with pytest.raises(AssertionError, match=r"^bug: assert_layer_sharded: .*weight 'wi_0' .* on a mesh "
                       r"data=2 x expert=4 of other devices"):
        invariants.assert_layer_sharded(qcheck.build_moe("mixtral", "none", mesh=other), cases.mesh(), label="bug")


def test_assert_layer_sharded_names_its_bad_arguments():
    with pytest.raises(TypeError, match="^bug: assert_layer_sharded: mesh must be a jax.sharding.Mesh, got tuple"):
        invariants.assert_layer_sharded(qcheck.build_moe("mixtral", "none"), (2, 4), label="bug")
    with pytest.raises(TypeError, match="^bug: assert_layer_sharded_matches: build_sharded must be a function of "
                       "the mesh returning the layer, got MoE"):
        invariants.assert_layer_sharded_matches(qcheck.build_moe("mixtral", "none"), None, None, mesh=cases.mesh(),
                                                label="bug")


def test_assert_layer_sharded_matches_should_pass_on_the_case_layer():
    worst = invariants.assert_layer_sharded_matches(
        lambda mesh: cases.sharded_layer(MIXTRAL, mesh), cases.layer_output(MIXTRAL),
        cases.layer_input("mixtral"), mesh=cases.mesh(), label="ok")
    assert worst <= invariants.SHARDED_ATOL
