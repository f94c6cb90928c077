"""The legacy-emitter fast path: which programs take it, and the measurements that say which may."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from qcheck import _fast_jit as fj
from qcheck import cases, step
from tests.helpers import conversion_probes

needs_legacy = pytest.mark.skipif(
    not fj.legacy_emitter_options(),
    reason="this backend or jaxlib has no legacy fusion emitters (jaxlib 0.12 dropped the option)",
)

#: ml_dtypes type -> its StableHLO name, for every float type qcheck quantizes to.
FLOAT_TYPES = {
    ml_dtypes.float8_e4m3fn: "f8E4M3FN",
    ml_dtypes.float8_e5m2: "f8E5M2",
    ml_dtypes.float8_e8m0fnu: "f8E8M0FNU",
    ml_dtypes.bfloat16: "bf16",
    ml_dtypes.float8_e4m3fnuz: "f8E4M3FNUZ",
    ml_dtypes.float8_e5m2fnuz: "f8E5M2FNUZ",
    ml_dtypes.float4_e2m1fn: "f4E2M1FN",
}
#: XLA's default (MLIR) fusion emitters, named so that install() leaves the program alone.
DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
SAFE = [t for t, name in FLOAT_TYPES.items() if name in fj.LEGACY_SAFE_TYPES]
LEFT_OUT = [t for t, name in FLOAT_TYPES.items() if name not in fj.LEGACY_SAFE_TYPES]


def roundtrip_mismatches(dtype, compiler_options) -> np.ndarray:
    """Probes where jitted f32 -> ``dtype`` -> f32 differs bitwise from ml_dtypes' cast."""
    x = conversion_probes(dtype)
    got = np.asarray(jax.jit(lambda a: a.astype(dtype).astype(jnp.float32),
                             compiler_options=compiler_options)(jnp.asarray(x)))
    want = x.astype(dtype).astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    return x[~same]


@needs_legacy
@pytest.mark.parametrize("dtype", SAFE, ids=lambda t: np.dtype(t).name)
def test_legacy_emitters_convert_the_safe_types_exactly(dtype):
    bad = roundtrip_mismatches(dtype, fj.LEGACY_EMITTERS)
    assert bad.size == 0, f"legacy emitters round {np.dtype(dtype).name} wrongly at {bad[:8]}"


@needs_legacy
@pytest.mark.parametrize("dtype", LEFT_OUT, ids=lambda t: np.dtype(t).name)
def test_legacy_emitters_get_the_types_left_out_wrong(dtype):
    # Why these are not in LEGACY_SAFE_TYPES. If this fails, the installed XLA
    # converts them exactly: measure the layers and add the type.
    assert roundtrip_mismatches(dtype, fj.LEGACY_EMITTERS).size > 0
    assert roundtrip_mismatches(dtype, DEFAULT_EMITTERS).size == 0  # the default emitters get them right


def test_element_types_names_every_tensor_type():
    text = jax.jit(lambda a, b: (a.astype(jnp.float8_e4m3fnuz), b.sum())).lower(
        jnp.ones((2, 3)), jnp.ones((), jnp.int8)).as_text()
    assert {"f32", "f8E4M3FNUZ", "i8"} <= fj.element_types(text)


@pytest.mark.parametrize(("types", "safe"), [
    ("tensor<2x3xf32>, tensor<i8>, tensor<4xf8E4M3FN>", True),
    ("tensor<2x3xf32>, tensor<4xf8E4M3FNUZ>", False),
    ("tensor<16xf4E2M1FN>", False),
    ("tensor<2xf16>", False),  # never measured: not safe until it is
    ("tensor<2x3xf32, #stablehlo.bounds<?, 3>>", True),  # an encoding after the element type
    ("tensor<2xf32>, tensor<4x!quant.uniform<i8:f32, 0.5>>", False),  # unreadable: fails closed
])
def test_legacy_safe_needs_every_type_on_the_list(types, safe):
    assert fj.legacy_safe(types) is safe


def _fnuz_roundtrip(x):
    return x.astype(jnp.float8_e4m3fnuz).astype(jnp.float32)


def test_fast_jit_keeps_programs_with_unsafe_types_on_the_default_emitters():
    x = jnp.asarray(conversion_probes(ml_dtypes.float8_e4m3fnuz))
    fast = fj.FastJit(_fnuz_roundtrip)
    assert fast.compiler_options(x) == {}
    got = np.asarray(fast(x))
    want = np.asarray(x).astype(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    assert np.array_equal(got, want, equal_nan=True)


@needs_legacy
def test_fast_jit_compiles_safe_programs_with_the_legacy_emitters():
    fast = fj.FastJit(lambda n, x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32) * n, static_argnums=0)
    x = jnp.linspace(-500, 500, 64)
    assert fast.compiler_options(2.0, x) == fj.LEGACY_EMITTERS
    want = np.asarray(x).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * 2
    assert np.array_equal(fast(2.0, x), want, equal_nan=True)


@needs_legacy
def test_fast_jit_leaves_programs_off_the_cpu_to_plain_jit(monkeypatch):
    # A GPU node's hardware tests hand layers GPU arrays; CPU-only options must not follow them there.
    fast = fj.FastJit(lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32))
    x = jnp.linspace(-500, 500, 64)
    assert fast.compiler_options(x) == fj.LEGACY_EMITTERS  # on the CPU, as above
    monkeypatch.setattr(fj._xla_env, "default_platform", lambda: "gpu")
    assert fj.FastJit(fast.__wrapped__).compiler_options(x) == {}


@needs_legacy
def test_a_layer_on_the_fast_path_outputs_what_the_default_emitters_do():
    # mxfp8 has the most conversions of the legacy-safe recipes (e8m0 scales, e4m3fn elements).
    case = cases.Case("mxfp8", cases.VARIANTS[0])
    graphdef, state = nnx.split(cases.layer(case))
    x = cases.layer_input(case.variant.model)
    assert step._apply.compiler_options(graphdef, state, x) == fj.LEGACY_EMITTERS
    # Asked for by name: install() would otherwise give a plain jit the legacy emitters too.
    default = jax.jit(step._apply.__wrapped__, static_argnums=0, compiler_options=DEFAULT_EMITTERS)
    assert np.array_equal(np.asarray(default(graphdef, state, x)[0]), cases.forward_output(case))


def test_an_emitter_flag_in_xla_flags_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")
    assert fj.legacy_emitter_options.__wrapped__() == {}


# -- install(): every program of qcheck's own processes --------------------------


@needs_legacy
def test_this_process_compiles_every_safe_program_with_the_legacy_emitters():
    # conftest installs it; False here means JAX moved its private hook point.
    assert fj.installed()


@pytest.mark.parametrize(("platform", "given", "types", "added"), [
    ("cpu", {}, "tensor<2xf32>, tensor<2xf8E4M3FN>", True),
    ("cpu", {}, "tensor<2xf32>, tensor<2xf8E4M3FNUZ>", False),  # an unsafe type: default emitters
    ("cpu", {"xla_cpu_use_fusion_emitters": True}, "tensor<2xf32>", False),  # the caller chose
    ("gpu", {}, "tensor<2xf32>", False),  # a CPU-only option
])
def test_options_for_adds_the_legacy_emitters_only_to_safe_cpu_programs(platform, given, types, added):
    got = fj.options_for(platform, dict(given), lambda: types)
    want = {**given, **fj.legacy_emitter_options()} if added else given
    assert got == want


def _fnuz_probes() -> tuple[np.ndarray, np.ndarray]:
    x = conversion_probes(ml_dtypes.float8_e4m3fnuz)
    return x, x.astype(ml_dtypes.float8_e4m3fnuz).astype(np.float32)


def _same(got, want) -> bool:
    return np.array_equal(np.asarray(got), want, equal_nan=True)


@needs_legacy
def test_installed_hook_reaches_eager_ops_and_plain_jit_and_keeps_unsafe_ones_off(monkeypatch):
    # The legacy emitters turn f32 -> e4m3fnuz of a negative underflow into NaN,
    # so a program that took them shows it in its bits.
    x, want = _fnuz_probes()
    jitted = lambda a: a.astype(jnp.float8_e4m3fnuz).astype(jnp.float32)  # noqa: E731
    assert _same(jax.jit(jitted)(x), want)
    assert _same(jnp.asarray(x).astype(jnp.float8_e4m3fnuz).astype(jnp.float32), want)
    # Declared safe (wrongly), the same programs now compile with the legacy emitters
    # (a new input shape each time, so nothing comes from a cache) and come out wrong ...
    monkeypatch.setattr(fj, "LEGACY_SAFE_TYPES", fj.LEGACY_SAFE_TYPES | {"f8E4M3FNUZ"})
    y, want_y = x[:-1], want[:-1]
    assert not _same(jax.jit(jitted)(y), want_y)
    assert not _same(jnp.asarray(y).astype(jnp.float8_e4m3fnuz).astype(jnp.float32), want_y)
    # ... unless the program asks for the default emitters itself.
    explicit = jax.jit(jitted, compiler_options=DEFAULT_EMITTERS)
    assert _same(explicit(x[:-2]), want[:-2])
