"""qwix (pip ``qwix``): why a quantized qcheck layer cannot go to ``qwix.quantize_model``, and the ways that work.

qwix quantizes a model by intercepting ``jnp.einsum``, ``jax.lax.dot_general``
and ``jax.lax.ragged_dot`` while it runs, and tells weights from activations by
finding the operand among the calling module's own params. Two facts (qwix
0.1.8, flax 0.12.8 and 0.12.12) shape how qcheck runs it:

- ``qwix.quantize_model`` walks an NNX model's modules and cannot place the
  Linen variables of an ``nnx.bridge.ToNNX`` in a collection ("Cannot infer
  collection name from value"); every call site of a quantized qcheck layer is
  a ``QuantSite``, a ToNNX. The ``none`` layer's sites are plain NNX modules,
  which qwix walks: :class:`qcheck.adapters.QwixRecipe` quantizes them.
- qcheck's call sites receive the weight as an argument; qwix treats a weight
  it cannot find among the calling module's params as an activation, so a
  weight-only rule leaves that matmul unquantized (a silent fallback that
  ``qcheck.checks.assert_tracks`` reports). ``QwixRecipe`` accepts only rules
  that quantize weights and activations alike, for which that makes no difference.

A user's own model is checked by quantizing it with qwix and holding it to its
unquantized twin with qcheck's checks (docs/libraries.md).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

try:
    import qwix
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("qcheck.adapters' qwix support needs qwix: pip install 'qcheck[qwix]'") from e


def _bridged(model: nnx.Module) -> list[str]:
    return ["/".join(map(str, path)) or "<model>" for path, m in nnx.iter_modules(model)
            if isinstance(m, nnx.bridge.ToNNX)]


def qwix_quantize_model(model: nnx.Module, provider: Any, *model_inputs: Any, **model_inputs_kwargs: Any) -> nnx.Module:
    """``qwix.quantize_model`` for an NNX model, refusing up front what qwix cannot walk.

    A model holding ``nnx.bridge.ToNNX`` modules (every quantized qcheck layer) raises a
    TypeError that names them, says why and what to do instead, where qwix would
    fail deep inside its walk with "Cannot infer collection name from value".
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}")
    if bridged := _bridged(model):
        raise TypeError(
            f"qwix_quantize_model: model {type(model).__name__} holds nnx.bridge.ToNNX modules at "
            f"{', '.join(bridged[:4])}{' ...' if len(bridged) > 4 else ''} ({len(bridged)} in all). "
            "qwix.quantize_model (qwix 0.1.8) cannot place a bridged Linen module's variables in an NNX "
            "collection, and a quantized qcheck layer's call sites (QuantSite) are such modules. Build the "
            "`none` layer (plain NNX call sites) and quantize it with qcheck.adapters.QwixRecipe, or quantize "
            "your own model, whose "
            "matmuls are jnp.einsum / jax.lax.dot_general / jax.lax.ragged_dot on its own nnx.Param weights, and "
            "check it against its unquantized twin with qcheck.checks.assert_tracks, "
            "qcheck.checks.assert_ragged_groups_independent and qcheck.coverage (see docs/libraries.md)")
    return qwix.quantize_model(model, provider, *model_inputs, **model_inputs_kwargs)
