"""qcheck.native on the CPU: the emulations, the native-kernel finder and the comparison, each with its failing twin.

The native kernels themselves run only on GPUs (tests/test_hardware.py); here
``jax.nn.scaled_matmul``, which has no CPU lowering, is replaced by its
documented definition, so what qcheck adds around it (scales, shapes) is tested.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qcheck import checks, formats, native
from tests.helpers import NATIVE_EQN, documented_scaled_matmul, native_operands, unquantized_product

@functools.cache
def fp8_einsum_jit(dtype: str):
    return jax.jit(functools.partial(native.fp8_einsum, NATIVE_EQN, dtype=dtype))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_fp8_einsum_matches_its_emulation_and_not_the_unquantized_product(dtype):
    lhs, rhs = native_operands()
    emulated = native.emulate_fp8_einsum(NATIVE_EQN, lhs, rhs, dtype=dtype)
    figure = checks.assert_native_matches_emulation(fp8_einsum_jit(dtype)(lhs, rhs), emulated,
                                                    unquantized_product(lhs, rhs), label=dtype)
    assert figure < 1e-6  # float32 sums on the CPU against float64 ones


def test_a_gemm_that_did_not_quantize_fails():
    lhs, rhs = native_operands()
    with pytest.raises(AssertionError, match="matches the unquantized product instead"):
        checks.assert_native_matches_emulation(
            jnp.einsum(NATIVE_EQN, lhs, rhs), native.emulate_fp8_einsum(NATIVE_EQN, lhs, rhs, dtype="float8_e4m3fn"),
            unquantized_product(lhs, rhs), label="e4m3fn")


def test_a_gemm_in_the_wrong_fp8_flavour_fails():
    lhs, rhs = native_operands()
    with pytest.raises(AssertionError, match=r"e4m3fn: assert_native_matches_emulation: native differs from the "
                                             r"emulation by relative norm"):
        checks.assert_native_matches_emulation(
            fp8_einsum_jit("float8_e4m3fnuz")(lhs, rhs),
            native.emulate_fp8_einsum(NATIVE_EQN, lhs, rhs, dtype="float8_e4m3fn"),
            unquantized_product(lhs, rhs), label="e4m3fn")


def test_operands_that_quantization_barely_moves_are_refused():
    lhs, rhs = (np.round(x / 150) for x in native_operands())  # small integers: exact in e4m3
    with pytest.raises(ValueError, match="cannot tell quantized from unquantized"):
        checks.assert_native_matches_emulation(
            fp8_einsum_jit("float8_e4m3fn")(lhs, rhs),
            native.emulate_fp8_einsum(NATIVE_EQN, lhs, rhs, dtype="float8_e4m3fn"),
            unquantized_product(lhs, rhs))


def test_nonfinite_native_results_fail():
    lhs, rhs = native_operands()
    emulated = native.emulate_fp8_einsum(NATIVE_EQN, lhs, rhs, dtype="float8_e4m3fn")
    with pytest.raises(AssertionError, match="native has 1 non-finite values"):
        checks.assert_native_matches_emulation(np.where(np.arange(emulated.size).reshape(emulated.shape) == 5,
                                                        np.nan, emulated), emulated, unquantized_product(lhs, rhs))


@pytest.mark.parametrize("fmt", native.BLOCK_SCALED_FORMATS)
def test_block_scaled_matmul_matches_its_emulation(fmt):
    lhs, rhs = native_operands()
    got = jax.jit(functools.partial(native.block_scaled_matmul, fmt=fmt, matmul=documented_scaled_matmul))(lhs, rhs)
    checks.assert_native_matches_emulation(got, native.emulate_block_scaled_matmul(lhs, rhs, fmt),
                                           unquantized_product(lhs, rhs), label=fmt)


def test_nvfp4_without_its_tensor_scales_fails():
    lhs, rhs = native_operands()

    @jax.jit
    def forgot_the_tensor_scales(lhs, rhs):
        ql, qr = formats.quantize(lhs, "nvfp4"), formats.quantize(rhs, "nvfp4")
        return documented_scaled_matmul(ql.codes[None], qr.codes[None], ql.scales["block"][None],
                                        qr.scales["block"][None])[0]

    forgot = forgot_the_tensor_scales(lhs, rhs)
    with pytest.raises(AssertionError, match="nvfp4: assert_native_matches_emulation: native differs from the emulation"):
        checks.assert_native_matches_emulation(forgot, native.emulate_block_scaled_matmul(lhs, rhs, "nvfp4"),
                                               unquantized_product(lhs, rhs), label="nvfp4")


def test_the_cpu_upcasts_fp8_so_no_native_gemm_is_found():
    lhs, rhs = native_operands()
    assert native.native_gemm_calls(fp8_einsum_jit("float8_e4m3fn").lower(lhs, rhs).compile().as_text()) == []


# Shaped like XLA GPU's optimized HLO (compiled.as_text()), trimmed to what the finder reads.
GPU_HLO = """\
HloModule jit_fp8_einsum, entry_computation_layout={(f32[128,128]{1,0}, f32[48,128]{1,0})->f32[64,48]{1,0}}

%triton_gemm_dot (parameter_0: f8e4m3fn[64,128], parameter_1: f8e4m3fn[48,128]) -> f32[64,48] {
  %parameter_0 = f8e4m3fn[64,128]{1,0} parameter(0)
  %parameter_1 = f8e4m3fn[48,128]{1,0} parameter(1)
  ROOT %dot = f32[64,48]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%triton_gemm_f32 (parameter_0: f32[128,128], parameter_1: f32[48,128]) -> f32[64,48] {
  %parameter_0 = f32[128,128]{1,0} parameter(0)
  %parameter_1 = f32[48,128]{1,0} parameter(1)
  ROOT %dot = f32[64,48]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %main (a: f32[128,128], b: f32[48,128]) -> f32[64,48] {
  %cublas = (f32[64,48]{1,0}, s8[0]{0}) custom-call(%a8, %b8, %one, %one), custom_call_target="__cublas$lt$matmul$f8"
  %triton_fp8 = f32[64,48]{1,0} fusion(%a8, %b8), kind=kCustom, calls=%triton_gemm_dot, {TRITON}
  %triton_f32 = f32[64,48]{1,0} fusion(%a, %b), kind=kCustom, calls=%triton_gemm_f32, {TRITON}
  ROOT %gemm = (f32[64,48]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
}
""".replace("{TRITON}", 'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}')


def test_native_gemm_calls_finds_fp8_cublaslt_and_triton_gemms_only():
    found = native.native_gemm_calls(GPU_HLO)
    assert [line.split(" = ")[0] for line in found] == ["%cublas", "%triton_fp8"]


def test_bad_arguments_are_named():
    lhs, rhs = native_operands()
    with pytest.raises(ValueError, match="unknown block-scaled format 'fp4'; valid block-scaled formats: mxfp8, nvfp4"):
        native.block_scaled_matmul(lhs, rhs, "fp4")
    with pytest.raises(ValueError, match=r"rhs must be 2-D \[rows, K\]"):
        native.emulate_block_scaled_matmul(lhs, rhs[0], "mxfp8")
    with pytest.raises(ValueError, match="must share the contraction axis K"):
        native.block_scaled_matmul(lhs, rhs[:, :64], "mxfp8")
    with pytest.raises(ValueError, match="dtype must be an fp8 type"):
        native.fp8_einsum(NATIVE_EQN, lhs, rhs, dtype=ml_dtypes.bfloat16)
