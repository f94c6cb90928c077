"""A layer that needs a mesh (``shard_map`` inside) is checked under the mesh its caller entered.

Without one, the error says that a mesh is needed. The sharded matmul's
operands are marked varying over the manual axes inside the body
(``pvary``): that moves values, so a quantized weight stays quantized there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import qcheck

X = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(8, 8)
BOUNDS = {"max_rel_norm": 0.5, "max_grad_rel_norm": 1.0}


def _fp8(v: jax.Array) -> jax.Array:
    # Saturating, as a cast to e4m3fn must be, and straight through (check_layer's edge rows hold a value of 1e5
    # to it: a cast's own transpose would cast the gradient to e4m3fn too, unsaturated).
    q = jnp.clip(v, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return v + jax.lax.stop_gradient(q - v)


class RowSharded(nnx.Module):
    """Tokens split over "data" by a shard_map that takes the context's mesh; the weight replicated."""

    def __init__(self, quantized: bool):
        self.w = nnx.Param(jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8))
        self.quantized = quantized

    def __call__(self, x):
        def body(x, w):
            if self.quantized:
                x, w = _fp8(x), _fp8(w)
            return x @ w

        return jax.shard_map(body, in_specs=(P("data"), P()), out_specs=P("data"))(x, self.w[...])


@pytest.fixture
def mesh():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (qcheck's test processes force 8 host devices)")
    with jax.set_mesh(jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))) as entered:
        yield entered


def test_check_layer_runs_under_the_callers_mesh_should_pass(mesh):
    figures = qcheck.check_layer(RowSharded(True), RowSharded(False), X, **BOUNDS)
    (record,) = figures.coverage
    assert record.lhs.dtype == record.rhs.dtype == "float8_e4m3fn", record


def test_check_layer_under_the_callers_mesh_should_fail_on_an_unquantized_shard(mesh):
    with pytest.raises(AssertionError, match=r"(?s)1 of 1 matmuls reach full precision:.*lhs and rhs unquantized"):
        qcheck.check_layer(RowSharded(False), RowSharded(False), X, **BOUNDS)


def test_a_quantized_weight_stays_quantized_through_shard_map_s_varying_cast(mesh):
    (record,) = qcheck.coverage(RowSharded(True), X, errors=True)
    assert record.quantized and record.rhs.dtype == "float8_e4m3fn", record


def test_without_a_mesh_the_error_says_one_is_needed():
    with pytest.raises(qcheck.UserCodeError, match=r"^check_layer: layer could not be traced and run on \w+: "
                       r"ValueError: .*\(no mesh is entered and the code needs one: call qcheck inside "
                       r"`with jax.set_mesh\(mesh\):`\)$"):
        qcheck.check_layer(RowSharded(True), RowSharded(False), X, **BOUNDS)
    with pytest.raises(qcheck.UserCodeError, match=r"^coverage: fn could not .*no mesh is entered"):
        qcheck.coverage(RowSharded(True), X)
