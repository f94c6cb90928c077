"""Tests that need hardware this CPU host may lack; they skip with a reason, or fail under --require-hardware.

On an fp8 GPU the fp8 einsums must run the native fp8 GEMM, and on Blackwell
the block formats the native block-scaled dot: each test reads the compiled
program for that kernel, then holds its result to a float64 emulation of the
same codes within ``qcheck.checks.harness.NATIVE_GEMM_TOL`` (see there for why that bound).
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from qcheck import build_moe, checks, formats, get_recipe, hardware, native, recipe_names
from qcheck.checks import harness
from qcheck.layers import step
from qcheck.suite import cases
from tests.helpers import NATIVE_EQN, documented_scaled_matmul, native_operands, unquantized_product

# The forward flavours: cuBLASLt has no fp8 GEMM with both operands e5m2 (e5m2
# gradients meet e4m3 operands in a backward pass, not each other).
FP8_DTYPES = ["float8_e4m3fn", "float8_e4m3fnuz"]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8", "nanoo_fp8", "nvfp4"])
def test_quantized_layer_tracks_its_twin_on_the_gpu(recipe):
    gpu = jax.devices("gpu")[0]
    with jax.default_device(gpu):
        x = jax.device_put(cases.layer_input("mixtral"), gpu)
        quantized, _ = step.apply(build_moe("mixtral", recipe), x)
        reference, _ = step.apply(build_moe("mixtral", "none"), x)
    assert quantized.devices() == {gpu}
    checks.assert_tracks(quantized, reference, max_rel_norm=get_recipe(recipe).expect.max_rel_norm)


def _needs_native(dtype: str) -> None:
    # The fp8_gpu marker has already skipped hosts with no fp8 GPU at all; this
    # one has one, but its vendor multiplies only one family of fp8 types.
    if dtype not in hardware.fp8_gemm_dtypes():
        pytest.skip(f"this GPU has no native {dtype} GEMM (it has {', '.join(sorted(hardware.fp8_gemm_dtypes()))})")


def _run_native(fn, *args, label: str):
    """Compile ``fn`` for the GPU, assert XLA gave it a native low-precision GEMM, and run it."""
    gpu = jax.devices("gpu")[0]
    args = [jax.device_put(a, gpu) for a in args]
    compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text()
    dots = [line.strip()[:160] for line in text.splitlines() if "dot(" in line or "custom-call(" in line]
    assert native.native_gemm_calls(text), (
        f"{label}: XLA compiled no native low-precision GEMM (targets {', '.join(native.NATIVE_GEMM_TARGETS)} "
        f"or an fp8 Triton GEMM); its dots and calls: {dots}")
    return np.asarray(compiled(*args))


@pytest.mark.fp8_gpu
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_fp8_einsum_runs_the_native_gemm_and_matches_the_emulation(dtype):
    _needs_native(dtype)
    lhs, rhs = native_operands()
    out = _run_native(functools.partial(native.fp8_einsum, NATIVE_EQN, dtype=dtype), lhs, rhs, label=dtype)
    checks.assert_native_matches_emulation(out, native.emulate_fp8_einsum(NATIVE_EQN, lhs, rhs, dtype=dtype),
                                           unquantized_product(lhs, rhs), label=dtype)


@pytest.mark.fp8_gpu
@pytest.mark.parametrize("recipe", [r for r in recipe_names() if get_recipe(r).reference.cast_dtype is not None])
def test_fresh_fp8_call_site_runs_the_native_gemm_and_matches_the_emulation(recipe):
    # The recipe's own quantized einsum, not a stand-in: XLA must see through its
    # qdq (cast to fp8, back to float32 times the scale) to the fp8 operands.
    dtype = get_recipe(recipe).reference.cast_dtype.name
    _needs_native(dtype)
    with jax.default_device(jax.devices("gpu")[0]):
        graphdef, state = nnx.split(build_moe("mixtral", recipe).get_einsum("wi_0"))
    lhs, rhs = native_operands()
    out = _run_native(lambda s, a, b: nnx.merge(graphdef, s, copy=True)(NATIVE_EQN, a, b), state, lhs, rhs,
                      label=f"{recipe} site 'wi_0'")
    checks.assert_native_matches_emulation(out, native.emulate_fp8_einsum(NATIVE_EQN, lhs, rhs, dtype=dtype),
                                           unquantized_product(lhs, rhs), label=f"{recipe} site 'wi_0'")


@pytest.mark.blackwell
@pytest.mark.parametrize("fmt", native.BLOCK_SCALED_FORMATS)
def test_block_scaled_matmul_runs_the_native_dot_and_matches_the_emulation(fmt):
    lhs, rhs = native_operands()
    out = _run_native(functools.partial(native.block_scaled_matmul, fmt=fmt), lhs, rhs, label=fmt)
    checks.assert_native_matches_emulation(out, native.emulate_block_scaled_matmul(lhs, rhs, fmt),
                                           unquantized_product(lhs, rhs), label=fmt)


# -- the tests above on a CPU standing in for the GPU ----------------------------
# They run nowhere else here, so a slip in them would first show on a GPU node.
# The CPU upcasts fp8 before its dot, so the native-kernel check must fail there;
# with a kernel pretended into the compiled program, everything after it must pass.

NATIVE_TESTS = [
    (test_fp8_einsum_runs_the_native_gemm_and_matches_the_emulation, "float8_e4m3fn"),
    (test_fp8_einsum_runs_the_native_gemm_and_matches_the_emulation, "float8_e4m3fnuz"),
    *((test_fresh_fp8_call_site_runs_the_native_gemm_and_matches_the_emulation, r)
      for r in recipe_names() if get_recipe(r).reference.cast_dtype is not None),
    *((test_block_scaled_matmul_runs_the_native_dot_and_matches_the_emulation, f) for f in native.BLOCK_SCALED_FORMATS),
]


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: devices("cpu" if backend == "gpu" else backend))
    monkeypatch.setattr(hardware, "fp8_gemm_dtypes", lambda: frozenset(formats.FP8_DTYPES))
    monkeypatch.setattr(jax.nn, "scaled_matmul", documented_scaled_matmul)  # it has no CPU lowering


@pytest.mark.parametrize("test, arg", NATIVE_TESTS, ids=lambda x: getattr(x, "__name__", x))
def test_on_a_gpu_that_upcasts_the_native_tests_fail(cpu_as_gpu, test, arg):
    with pytest.raises(AssertionError, match="XLA compiled no native low-precision GEMM"):
        test(arg)


def _recording(monkeypatch, name: str) -> list[float]:
    """Wrap ``checks.<name>`` so the figures it returns are kept: proof the test really compared something."""
    figures: list[float] = []
    check = getattr(checks, name)
    monkeypatch.setattr(checks, name, lambda *a, **k: figures.append(check(*a, **k)) or figures[-1])
    return figures


@pytest.mark.parametrize("test, arg", NATIVE_TESTS, ids=lambda x: getattr(x, "__name__", x))
def test_with_a_native_kernel_the_native_tests_pass(cpu_as_gpu, monkeypatch, test, arg):
    monkeypatch.setattr(native, "native_gemm_calls", lambda text: ["pretended native GEMM"])
    figures = _recording(monkeypatch, "assert_native_matches_emulation")
    test(arg)
    assert len(figures) == 1 and 0 <= figures[0] <= harness.NATIVE_GEMM_TOL, figures


def test_the_layer_test_runs_on_the_stand_in(cpu_as_gpu, monkeypatch):
    figures = _recording(monkeypatch, "assert_tracks")
    test_quantized_layer_tracks_its_twin_on_the_gpu("fp8")
    assert len(figures) == 1 and 0 < figures[0] <= get_recipe("fp8").expect.max_rel_norm, figures
