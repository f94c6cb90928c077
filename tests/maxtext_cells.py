"""MaxText 0.2.5's real ``RoutedMoE``, tiny (Mixtral-like) and on one CPU device.

The cells tests/test_maxtext.py and docs/checking-your-layer.md check: every
MaxText quantization recipe qcheck covers (``QUANTIZATIONS``), on the dense
and the sparse path (``sparse_matmul`` False/True, megablox off, so the sparse
path is MaxText's own ``jax.lax.ragged_dot``), each with its unquantized twin
(``quantization=""``) holding the layer's weights (:func:`cell`); and the DeepSeek
block's unquantized ``RoutedAndSharedMoE`` (:func:`routed_and_shared`).

Needs MaxText's environment (.ci/maxtext.sh): ``JAX_PLATFORMS=cpu``,
``DECOUPLE_GCLOUD=TRUE`` and ``MAXTEXT_ASSETS_ROOT`` set before maxtext is imported.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from maxtext.layers import moe

#: The MaxText version these cells and their known defects were checked on.
MAXTEXT_VERSION = "0.2.5"
#: MaxText's ``quantization`` values qcheck checks; "" is the unquantized twin.
QUANTIZATIONS = ("int8", "fp8", "nanoo_fp8")
EMB, MLP, EXPERTS, TOP_K = 32, 64, 4, 2
#: (batch, sequence, emb): 16 tokens, 32 routed rows.
X_SHAPE = (2, 8, EMB)
#: What .ci/maxtext.sh sets before MaxText is imported: the wheel otherwise looks
#: for its assets in a source tree and for Google Cloud clients it does not ship.
ENVIRONMENT = ("JAX_PLATFORMS", "DECOUPLE_GCLOUD", "MAXTEXT_ASSETS_ROOT")
#: With megablox: every ``*_tile_*`` key of MaxText's config (forward, dlhs, drhs; the eval ones too) shrunk
#: to the tiny block's (batch_seq, embed_dim, mlp_dim), so the Pallas kernels tile 32 routed rows (padded
#: to 64), an embedding of 32 and an MLP of 64 (its defaults, 512/1024/1024, do not divide them).
MEGABLOX_TILES = {"batch_seq": 64, "embed_dim": EMB, "mlp_dim": MLP}


def _megablox_tiles() -> dict[str, int]:
    return {f"{prefix}{w}_tile_{kind}_{dim}": size for w in ("wi", "wo") for kind in ("fwd", "dlhs", "drhs")
            for prefix in ("", "eval_") if prefix == "" or kind == "fwd" for dim, size in MEGABLOX_TILES.items()}


@functools.cache
def config(quantization: str = "", sparse_matmul: bool = False, megablox: bool = False, **overrides):
    """MaxText's config for a tiny Mixtral-like MoE (float32 throughout, dropless; megablox off unless asked,
    and then on the sparse path, its Pallas kernels interpreted on CPU, with tiles the block's size).

    ``overrides``: further config keys, over these (a ``capacity_factor``, a DeepSeek block's keys)."""
    import maxtext
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    return pyconfig.initialize(
        [None, base], run_name="qcheck", enable_checkpointing=False, **{
            "base_emb_dim": EMB, "base_mlp_dim": MLP, "base_moe_mlp_dim": MLP, "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K, "sparse_matmul": sparse_matmul or megablox, "megablox": megablox,
            "capacity_factor": -1.0, **(_megablox_tiles() if megablox else {}),
            "quantization": quantization, "dtype": "float32", "weight_dtype": "float32",
            # One device: AQT's range finding unsharded. MaxText's default (-1) takes jax.local_device_count(),
            # eight in qcheck's test processes, and AQT's int8 backward then asserts 8 divides a contraction of 2.
            "quantization_local_shard_count": 1, **overrides},
    )


def build(quantization: str = "", sparse_matmul: bool = False, seed: int = 0, quant=None,
          megablox: bool = False, **overrides) -> moe.RoutedMoE:
    """``RoutedMoE`` as MaxText's Mixtral decoder layer builds it (models/mixtral.py).

    ``quant``: the quantization object the block gets in place of the one its config
    makes (a user's own, or a planted bug), while ``config.quantization`` still declares.
    ``overrides``: further config keys (:func:`config`).
    """
    import jax
    from flax import nnx
    from maxtext.layers import initializers, moe, quantizations

    cfg = config(quantization, sparse_matmul, megablox, **overrides)
    # One device, every MaxText mesh axis of size 1: the block as on one accelerator (qcheck's test
    # processes have eight host devices, which MaxText's own mesh would shard the tiny batch over).
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape([1] * len(cfg.mesh_axes)), cfg.mesh_axes)
    return moe.RoutedMoE(
        config=cfg, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, mesh=mesh,
        kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"), kernel_axes=("embed", None),
        intermediate_dim=cfg.moe_mlp_dim, dtype=cfg.dtype, weight_dtype=cfg.weight_dtype,
        quant=quant or quantizations.configure_quantization(cfg), rngs=nnx.Rngs(seed),
    )


def cell(quantization: str, sparse_matmul: bool, megablox: bool = False) -> tuple[moe.RoutedMoE, moe.RoutedMoE]:
    """(layer, twin): the quantized block and the unquantized one, with the layer's weights.

    The same seed is not enough: MaxText's quantizers draw from the block's
    ``nnx.Rngs`` before the router and experts do, so the twin's weights would
    differ; ``copy_params_into`` copies the layer's ``nnx.Param`` leaves over.
    """
    import qcheck

    layer = build(quantization, sparse_matmul, megablox=megablox)
    return layer, qcheck.copy_params_into(layer, build("", sparse_matmul, megablox=megablox))


def inputs(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=X_SHAPE).astype(np.float32)


#: The qwix path's tiny model: a 1-layer Mixtral (4 query heads of 8, 2 KV heads), the block's dims above.
QWIX_LAYERS, QWIX_HEADS, QWIX_KV_HEADS, QWIX_HEAD_DIM, QWIX_VOCAB, QWIX_SEQUENCE = 1, 4, 2, 8, 128, 8


def qwix_model(quantization: str, layers: int = QWIX_LAYERS, qwix: bool = True):
    """(forward, inputs, model): a whole tiny Mixtral as MaxText builds it with ``use_qwix_quantization=True``.

    ``model_creation_utils.from_config`` -> ``create_model`` -> ``quantizations.maybe_quantize_model``, which
    hands the model to ``qwix.quantize_model`` with MaxText's rules (MaxText's own path, on one device).
    ``forward``: an NNX module holding ``model`` that calls it with ``enable_dropout=False`` (a static
    argument ``coverage`` would otherwise trace) and rank promotion allowed (MaxText's RoPE needs it);
    ``inputs``: (tokens, positions, segment ids). Built once per process (about 12 s on CPU).
    ``layers``: its decoder layers (unrolled); ``qwix=False``: MaxText's other path for ``quantization``
    (AQT's, for ``"int8"``).
    """
    return _qwix_model(quantization, layers, qwix)  # one cache entry however the arguments are spelled


@functools.cache
def _qwix_model(quantization: str, layers: int, qwix: bool):
    import warnings

    import jax
    import maxtext
    from flax import nnx
    from maxtext.configs import pyconfig

    with warnings.catch_warnings():
        # model_creation_utils imports transformers, and through it sympy, whose mpmath import is deprecated.
        warnings.simplefilter("ignore", DeprecationWarning)
        from maxtext.utils import maxtext_utils_nnx, model_creation_utils

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    cfg = pyconfig.initialize(
        [None, base], run_name="qcheck", enable_checkpointing=False, decoder_block="mixtral",
        base_num_decoder_layers=layers, base_emb_dim=EMB, base_num_query_heads=QWIX_HEADS,
        base_num_kv_heads=QWIX_KV_HEADS, head_dim=QWIX_HEAD_DIM, base_mlp_dim=MLP, base_moe_mlp_dim=MLP,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, vocab_size=QWIX_VOCAB, max_target_length=QWIX_SEQUENCE,
        per_device_batch_size=1, mlp_activations=["silu", "linear"], logits_via_embedding=False,
        sparse_matmul=False, megablox=False, capacity_factor=-1.0, scan_layers=False, attention="dot_product",
        enable_dropout=False, dtype="float32", weight_dtype="float32",
        quantization=quantization, use_qwix_quantization=qwix, quantization_local_shard_count=1,
    )
    # MaxText's rotary embedding broadcasts ranks (embeddings.py:295), which qcheck's test settings refuse.
    with jax.numpy_rank_promotion("allow"):
        model = model_creation_utils.from_config(cfg, jax.devices()[:1], rngs=maxtext_utils_nnx.create_nnx_rngs(cfg))

    class Forward(nnx.Module):
        def __init__(self, model):
            self.model = model

        def __call__(self, tokens, positions, segments):
            with jax.numpy_rank_promotion("allow"):
                return self.model(tokens, positions, segments, enable_dropout=False)

    shape = (cfg.micro_batch_size_to_train_on, cfg.max_target_length)
    tokens = (np.arange(np.prod(shape)) % QWIX_VOCAB).reshape(shape).astype(np.int32)
    positions = np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy()
    return Forward(model), (tokens, positions, np.ones(shape, np.int32)), model


#: The scanned decoder: two Mixtral decoder layers (the qwix model's attention dims), stacked and applied
#: by MaxText's own ``nnx_scan.create_scanned_layers`` / ``apply_scanned_layers``.
SCANNED_LAYERS = 2


@functools.cache
def scanned_config(quantization: str = ""):
    """MaxText's config for the scanned decoder layers (float32, dropless, megablox off, ``scan_layers``)."""
    import maxtext
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    return pyconfig.initialize(
        [None, base], run_name="qcheck", enable_checkpointing=False, decoder_block="mixtral",
        base_num_decoder_layers=SCANNED_LAYERS, base_emb_dim=EMB, base_num_query_heads=QWIX_HEADS,
        base_num_kv_heads=QWIX_KV_HEADS, head_dim=QWIX_HEAD_DIM, base_mlp_dim=MLP, base_moe_mlp_dim=MLP,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, vocab_size=QWIX_VOCAB, max_target_length=X_SHAPE[1],
        per_device_batch_size=1, mlp_activations=["silu", "linear"], sparse_matmul=False, megablox=False,
        capacity_factor=-1.0, scan_layers=True, attention="dot_product", enable_dropout=False, dtype="float32",
        weight_dtype="float32", quantization=quantization, quantization_local_shard_count=1,
    )


def scanned(quantization: str = "", seed: int = 0):
    """Two ``MixtralDecoderLayer``s stacked by ``nnx_scan.create_scanned_layers``; called on hidden states
    ``[1, sequence, emb]`` it runs them by ``nnx_scan.apply_scanned_layers`` (a ``jax.lax.scan`` whose body
    ``nnx.merge``s each layer from its slice of the stacked state), positions and segments fixed."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from maxtext.layers import nnx_scan, quantizations
    from maxtext.models import mixtral

    cfg = scanned_config(quantization)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape([1] * len(cfg.mesh_axes)), cfg.mesh_axes)
    quant = quantizations.configure_quantization(cfg)

    class ScannedDecoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.layers = nnx_scan.create_scanned_layers(
                lambda rngs: mixtral.MixtralDecoderLayer(config=cfg, mesh=mesh, model_mode="train", quant=quant,
                                                         rngs=rngs),
                length=SCANNED_LAYERS, param_scan_axis=cfg.param_scan_axis, metadata_axis_name="layers", rngs=rngs)

        def __call__(self, x):
            batch, length = x.shape[:2]
            segments = jnp.ones((batch, length), jnp.int32)
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

            def apply(layer, carry):
                # MaxText's rotary embedding broadcasts ranks (embeddings.py:295), which qcheck's tests refuse.
                with jax.numpy_rank_promotion("allow"):
                    return layer(carry, segments, positions, True, "train")[0]

            return nnx_scan.apply_scanned_layers(self.layers, x, length=SCANNED_LAYERS,
                                                 param_scan_axis=cfg.param_scan_axis, apply_fn=apply)

    with jax.numpy_rank_promotion("allow"):
        return ScannedDecoder(nnx.Rngs(seed))


def scanned_inputs(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(1, *X_SHAPE[1:])).astype(np.float32)


#: A DeepSeek-V2-style block (models/deepseek.py): two shared experts beside the routed ones, the router's
#: softmax over all experts (``routed_score_func``), the chosen k taken as they are, times a routed scaling
#: factor (DeepSeek-V2 236B's is 16; any value other than 1 shows it is applied).
DEEPSEEK = {"decoder_block": "deepseek", "shared_experts": 2, "routed_score_func": "softmax",
            "routed_scaling_factor": 2.5}


def routed_and_shared(sparse_matmul: bool = False, megablox: bool = False, seed: int = 0) -> moe.RoutedAndSharedMoE:
    """MaxText's unquantized ``RoutedAndSharedMoE`` as its DeepSeek decoder layer builds it (models/deepseek.py),
    with :data:`DEEPSEEK`'s keys over the tiny block's config: the routed experts are a ``RoutedMoE``
    (``MoeBlock_0``), the shared ones one ``MlpBlock`` of ``shared_experts`` times the experts' width."""
    import jax
    from flax import nnx
    from maxtext.layers import initializers, moe, quantizations

    cfg = config("", sparse_matmul, megablox, **DEEPSEEK)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape([1] * len(cfg.mesh_axes)), cfg.mesh_axes)
    return moe.RoutedAndSharedMoE(
        config=cfg, mesh=mesh, kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
        kernel_axes=("embed", None), dtype=cfg.dtype, weight_dtype=cfg.weight_dtype,
        quant=quantizations.configure_quantization(cfg), rngs=nnx.Rngs(seed),
    )
