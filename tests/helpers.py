"""Helpers shared by several test modules."""

import contextlib
import functools
import io
import os
import importlib.util

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck import formats
from qcheck.layers import step as qcheck_step
from qcheck.layers.bridge import QuantSite
from qcheck.layers.moe import UNQUANTIZED_BY_DESIGN
from qcheck.recipes import NVFP4, DelayedScalingFp8
from qcheck.recipes._fp8 import DelayedScalingFp8Site
from qcheck.recipes._nvfp4 import NVFP4Site, quantizer_key
from qcheck.recipes._sites import fake_quant_matmul

EQN = "bd,de->be"

#: The optional extras qcheck's tests use: extra -> (the module a test imports, how to install it).
#: A test needing one skips, naming it, where it is missing: `pip install -e '.[test]'` alone passes.
EXTRAS = {
    "aqt": ("aqt.jax.v2", "pip install 'qcheck-jax[aqt]'"),
    "qwix": ("qwix", "pip install 'qcheck-jax[qwix]'"),
    # Equinox is no extra of qcheck's: qcheck checks Equinox modules without depending on it.
    "equinox": ("equinox", "pip install equinox, or run them in the Levanter environment: .ci/levanter.sh env VENV"),
    # MaxText is no extra of qcheck's: it lives in its own environment (tox, a stage of .ci/run).
    "maxtext": ("maxtext", "pip install maxtext==0.2.5 in its own environment: .ci/maxtext.sh env VENV (docs/checking-your-layer.md)"),
    # Levanter neither: it pins jax<0.12 and a stack of its own.
    "levanter": ("levanter", "pip install marin-levanter==0.2.227.dev40316220070 in its own environment: .ci/levanter.sh env VENV (tox -e levanter)"),
    # gemma 4.0.1 neither: `pip install gemma` does not resolve (kauldron's dependencies); .ci/gemma.sh installs it.
    "gemma": ("gemma", "gemma 4.0.1 in its own environment: .ci/gemma.sh env VENV (`pip install gemma` alone does not resolve; tox -e gemma)"),
    # tokamax 0.0.17 neither: a pinned client with qwix 0.1.8 (it resolves jax 0.12.0.1), in its own environment.
    "tokamax": ("tokamax", "tokamax 0.0.17 with qwix 0.1.8 in its own environment: .ci/tokamax.sh env VENV (tox -e tokamax)"),
    # EasyDeL 0.3.0 neither: a pinned client on its own jax 0.9.2 and flax 0.12.3, in its own environment.
    "easydel": ("easydel", "easydel 0.3.0 in its own environment: .ci/easydel.sh env VENV (tox -e easydel)"),
    # Keras 3.15.1 neither: a pinned client on its JAX backend (KERAS_BACKEND=jax), in its own environment.
    "keras": ("keras", "keras 3.15.1 on its JAX backend in its own environment: .ci/keras.sh env VENV, its tests run "
                       "with KERAS_BACKEND=jax by .ci/keras.sh run (tox -e keras)"),
}


def _extra(extra: str) -> tuple[str, str]:
    if extra not in EXTRAS:
        raise ValueError(f"extra: unknown extra {extra!r}; known: {', '.join(sorted(EXTRAS))}")
    return EXTRAS[extra]


def extra_skip_reason(extra: str) -> str:
    """Why a test needing ``extra`` skips: the extra's name and how to install it."""
    return f"needs the {extra} extra: {_extra(extra)[1]}"


def extra_missing(extra: str) -> bool:
    """Whether ``extra``'s module cannot be found (its parent packages are imported to look)."""
    module = _extra(extra)[0]
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a parent package of a dotted name is missing
        return True


def requires_extra(*extras: str) -> pytest.MarkDecorator:
    """A skip mark for a test, class or module (``pytestmark``) that needs every one of ``extras``."""
    missing = [e for e in extras if extra_missing(e)]
    return pytest.mark.skipif(bool(missing), reason="; ".join(map(extra_skip_reason, missing)) or "")


def import_extra(extra: str, module: str | None = None):
    """Import ``module`` (default: the extra's own) inside a test, or skip it naming ``extra``."""
    return pytest.importorskip(module or _extra(extra)[0], reason=extra_skip_reason(extra))


def keras_on_jax(run: str):
    """Keras on its JAX backend, for a module-scoped fixture to yield from: skipped, naming how to install or run
    it (``run``), where it is absent or on another backend; its tests run with rank promotion allowed (Dense adds
    its bias (units,) to (batch, units) by rank broadcasting, which the suite's conftest refuses)."""
    if extra_missing("keras"):
        import_extra("keras")  # skips, naming how to install it
    backend = os.environ.get("KERAS_BACKEND")
    try:  # Keras imports its backend when first imported: its default, TensorFlow, is not in Keras's environment
        import keras
    except ImportError as error:
        pytest.skip(f"Keras is installed but does not import on its backend (KERAS_BACKEND={backend!r}, else "
                    f"keras.json's): {error}: {run}")
    if keras.backend.backend() != "jax":
        pytest.skip(f"Keras's backend is {keras.backend.backend()}, not jax: {run}")
    with jax.numpy_rank_promotion("allow"):
        yield keras


def conversion_probes(dtype) -> np.ndarray:
    """Every finite value of ``dtype``, its rounding midpoints and their float32 neighbours, both signs, and underflow."""
    if dtype == ml_dtypes.bfloat16:
        grid = np.random.default_rng(0).normal(size=4096).astype(dtype)
    else:
        grid = np.arange(2 ** (ml_dtypes.finfo(dtype).bits), dtype=np.uint8).view(dtype)
    grid = np.unique(grid.astype(np.float32)[np.isfinite(grid.astype(np.float32))])
    mids = (grid[1:] + grid[:-1]) / 2
    near = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    tiny = np.array([1e-30, 1e-9, float(ml_dtypes.finfo(dtype).smallest_subnormal) / 3], np.float32)
    values = np.concatenate([grid, near, tiny, -grid, -near, -tiny, [0.0, -0.0]]).astype(np.float32)
    return np.abs(values) if dtype == ml_dtypes.float8_e8m0fnu else values  # e8m0 has no sign


@functools.cache
def nvfp4_dgrad(site_name: str, seed: int) -> np.ndarray:
    """The lhs gradient through one NVFP4 site, whose stream starts from ``seed``."""
    site = QuantSite(qcheck.get_recipe("nvfp4"), site_name, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(site)
    lhs, rhs = (jax.random.normal(jax.random.key(i), s) for i, s in ((1, (16, 32)), (2, (32, 16))))

    def loss(a):
        return jnp.sum(nnx.merge(graphdef, state, copy=True)(EQN, a, rhs) * jnp.linspace(0.1, 1.0, 16)[None, :])

    return np.asarray(jax.jit(jax.grad(loss))(lhs))


#: Arguments for a pytest run inside this one (pytester.inline_run), as a user's project
#: runs qcheck's suite. The outer session has imported qcheck's plugin already, so the inner
#: one cannot assertion-rewrite it (with an editable install that warning is an error under
#: the project's filterwarnings); and the suite's modules lie inside this checkout, whose
#: root conftest the inner run must not load as if it were the user's.
INNER = ("-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning", "--noconftest")


#: The native-GEMM probes' einsum: lhs [M, K] against rhs [N, K], K last on both
#: as jax.nn.scaled_matmul wants it.
NATIVE_EQN = "mk,nk->mn"


@functools.cache
def native_operands(m: int = 128, n: int = 128, k: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Operands for the native-GEMM checks.

    Sides are multiples of 128 (cuBLASLt's and cuDNN's tile shapes); values
    reach about ±700, so e4m3fn (448) and e4m3fnuz (240) both saturate somewhere.
    """
    rng = np.random.default_rng(7)
    return (rng.standard_normal((m, k)).astype(np.float32) * 150,
            rng.standard_normal((n, k)).astype(np.float32) * 150)


def unquantized_product(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return np.einsum(NATIVE_EQN, lhs.astype(np.float64), rhs.astype(np.float64))


def documented_scaled_matmul(a, b, a_scales, b_scales, preferred_element_type=jnp.float32):
    """``jax.nn.scaled_matmul`` as its docstring defines it: scales repeated over their blocks, then BMK,BNK->BMN."""
    a = a.astype(jnp.float32) * jnp.repeat(a_scales.astype(jnp.float32), a.shape[-1] // a_scales.shape[-1], axis=-1)
    b = b.astype(jnp.float32) * jnp.repeat(b_scales.astype(jnp.float32), b.shape[-1] // b_scales.shape[-1], axis=-1)
    return jnp.einsum("BMK,BNK->BMN", a, b, preferred_element_type=preferred_element_type)


def assert_quantizers_draw_their_own_bits(dgrad=nvfp4_dgrad) -> None:
    """Two SHARED nvfp4 quantizers at one stream state (``dgrad(site, seed)``) draw different rounding bits."""
    if np.array_equal(dgrad("wi_0", 5), dgrad("wi_1", 5)):
        raise AssertionError("quantizers 'wi_0' and 'wi_1' drew the same stochastic-rounding bits at one stream "
                             "state: their keys are not salted per quantizer")


# qwix 0.1.8 walks NNX models with APIs flax 0.12 deprecates (m.iter_modules(), Param.value).
QWIX_WARNS = [
    pytest.mark.filterwarnings(r"ignore:The 'm\.iter_modules\(\)' method is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(r"ignore:'\.value' access is now deprecated:DeprecationWarning"),
]


# -- planted layers and recipes shared by test_layer_check, test_backward and test_catalogue -----------------

#: The input check_layer's tests feed qcheck's Mixtral layer.
CHECK_LAYER_X = np.random.default_rng(0).normal(size=(2, 32, 32)).astype(np.float32)


#: qcheck's layer keeps its router and its combine einsum unquantized, by design: the skip rule saying so.
MOE_FULL_PRECISION = qcheck.skip_functions(*UNQUANTIZED_BY_DESIGN)


@nnx.jit
def module_train_step(module: nnx.Module, x: jax.Array):
    """A user's train step on an NNX module, jitted as they run it: the module in (its state, each variable once,
    however many modules share it), the loss, the gradients and the state after the step out (qcheck's own train
    step, over the module's split)."""
    graphdef, params, meta, rest = qcheck_step.split_for_step(module)
    return qcheck_step.train_step_fn(graphdef)(params, meta, rest, x)


def decoder_at(recipe: str, apply_rngs: str | None = None):
    """``build(n)`` for ``assert_rng_state_flat``: qcheck's unrolled Mixtral decoder at n layers under ``recipe``
    (``apply_rngs="private"``: every site keeps its own fork, the seed's bug)."""
    return lambda n: qcheck.build_decoder("mixtral", recipe, layers=n, seed=0, apply_rngs=apply_rngs)


@functools.cache
def sparse_moe(recipe: str, seed: int = 0) -> qcheck.MoE:
    """qcheck's sparse Mixtral layer under ``recipe``, built once per (recipe, seed)."""
    return qcheck.build_moe("mixtral", recipe, path="sparse", seed=seed)


@jax.custom_vjp
def _nan_backward(y):
    return y


_nan_backward.defvjp(lambda y: (y, None), lambda _, g: (jnp.full_like(g, jnp.nan),))


class NaNBackwardMoE(qcheck.MoE):
    """A layer whose forward pass is fine and whose every gradient is NaN."""

    def __call__(self, x):
        return _nan_backward(super().__call__(x))


def unpermute_into_empty(rows: jax.Array, order: jax.Array, per_seq: int, written: int) -> jax.Array:
    """``rows`` (sorted by expert) back in token order, copied into a ``jax.lax.empty`` buffer (maxtext#4905's shape).

    Only each sequence's first ``written`` of its ``per_seq`` rows are copied:
    with ``written < per_seq`` its last rows stay unwritten, zeros on CPU.
    """
    buffer = jax.lax.empty(rows.shape, rows.dtype)
    to = jnp.where(order % per_seq < written, order, rows.shape[0])  # past the end: dropped
    return buffer.at[to].set(rows, mode="drop")


class UnpermuteIntoEmpty(qcheck.MoE):
    """qcheck's sparse path unpermuting into ``jax.lax.empty``, leaving each sequence's last ``unwritten`` rows."""

    unwritten = 1
    unpermute = staticmethod(unpermute_into_empty)

    def _sparse(self, x, weights, idx):
        wi_0, wi_1, wo = self._weights()
        s = self.sites
        b, sq, m = x.shape
        k, e = self.config.top_k, self.config.num_experts
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        xs = x.reshape(b * sq, m)[order // k]
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        h = self._act(s["wi_0"].ragged_dot(xs, wi_0, sizes), s["wi_1"].ragged_dot(xs, wi_1, sizes))
        out = self.unpermute(s["wo"].ragged_dot(h, wo, sizes), order, sq * k, (sq - self.unwritten) * k)
        y = self.combine("TKM,TK->TM", out.reshape(b * sq, k, m), weights.reshape(b * sq, k))
        return y.reshape(b, sq, m)


def unpermute_moe(recipe: str, *, unwritten: int = 1, nested_jit: bool = False) -> qcheck.MoE:
    """:class:`UnpermuteIntoEmpty`'s sparse Mixtral layer under ``recipe`` (seed 0).

    ``nested_jit``: its unpermute is a ``jax.jit`` function of its own.
    """
    cls = type("UnpermuteIntoEmpty", (UnpermuteIntoEmpty,), {
        "unwritten": unwritten,
        "unpermute": staticmethod(jax.jit(unpermute_into_empty, static_argnums=(2, 3)) if nested_jit
                                  else unpermute_into_empty)})
    return cls(qcheck.MODELS["mixtral"], qcheck.get_recipe(recipe), path="sparse", rngs=nnx.Rngs(0))


class _SkipGradSite(DelayedScalingFp8Site):
    def quantize_output(self, y):
        return y  # the output gradient is never quantized


class SkipGradFp8(DelayedScalingFp8):
    """fp8 whose output gradient is never quantized."""

    def site_module(self, name):
        return _SkipGradSite(amax_history_length=self.amax_history_length,
                             e4m3_dtype=self.e4m3_dtype, e5m2_dtype=self.e5m2_dtype)


class _WrongAxesNVFP4Site(NVFP4Site):
    def matmul(self, op, lhs, rhs, axes):
        key = quantizer_key(self.make_rng("params"), f"{self.quantizer}/dgrad")
        return fake_quant_matmul(
            op, lhs, rhs, key,
            q_lhs=lambda x: formats.qdq(x, "nvfp4", axis=axes.lhs),
            q_rhs=lambda x: formats.qdq(x, "nvfp4", axis=axes.rhs),
            q_dgrad=lambda g, k: formats.qdq(g, "nvfp4", axis=axes.wgrad, rng=k),  # the bug: WGRAD's axes
            q_wgrad=lambda g: formats.qdq(g, "nvfp4", axis=axes.wgrad),
        )


class WrongAxesNVFP4(NVFP4):
    """nvfp4 blocking the input gradient's copy of g along the weight gradient's axes."""

    def site_module(self, name):
        return _WrongAxesNVFP4Site(quantizer=name)


class Terminal(io.StringIO):
    """A stderr that is a terminal: where long commands show their progress (qcheck.suite.progress)."""

    def isatty(self) -> bool:
        return True


# -- a user's library, installed through its entry point --------------------------------------------------------

#: Distributions installed for the tests (a dist-info with an entry_points.txt beside their packages): qcheck_userlib.
PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins")


@contextlib.contextmanager
def installed(*paths: str):
    """The distributions under ``paths`` installed for the ``with`` block: on ``sys.path``, their entry points
    load at qcheck's next use, and whatever they register is gone after (``qcheck.libraries.registered``)."""
    import importlib
    import sys

    from qcheck import libraries

    with libraries.registered():
        sys.path[:0] = paths
        importlib.invalidate_caches()
        try:
            yield
        finally:
            for path in paths:
                sys.path.remove(path)
