"""Tests that need hardware this CPU host may lack; they skip with a reason, or fail under --require-hardware."""

import jax
import pytest

from qcheck import build_moe, cases, checks, get_recipe, step


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8", "nanoo_fp8", "nvfp4"])
def test_quantized_layer_tracks_its_twin_on_the_gpu(recipe):
    gpu = jax.devices("gpu")[0]
    with jax.default_device(gpu):
        x = jax.device_put(cases.layer_input("mixtral"), gpu)
        quantized, _ = step.apply(build_moe("mixtral", recipe), x)
        reference, _ = step.apply(build_moe("mixtral", "none"), x)
    assert quantized.devices() == {gpu}
    checks.assert_tracks(quantized, reference, max_rel_norm=get_recipe(recipe).max_rel_norm)
