"""The unquantized twin given the layer's weights: every parameter copied across at the same path."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from qcheck.checks._layer_forms import (equinox_of, equinox_param_leaves, equinox_split, keras_of, named_array_type,
                                        path_name)


def copy_params_into(layer: Any, reference: Any) -> Any:
    """Copy every ``nnx.Param`` of ``layer`` into ``reference`` at the same path; return ``reference``.

    ``reference`` is the unquantized twin the user built with their own
    constructor. Only parameters travel: quantization state (fp8 scales and amax
    histories, ``qcheck.layers.bridge.Fp8Meta``), RNG streams and any other non-Param
    leaf stay as each module has them, and the layer may have such leaves the
    reference lacks. Every Param path of either module must exist in the other
    with the same shape and dtype, else a ``ValueError`` names the first that
    does not (in sorted path order) and lists both modules' Param paths.

    Two Equinox modules: the parameters are those :func:`check_layer`
    compares (inexact-array leaves by path, not haliax's quantization state),
    and, Equinox modules being immutable, a copy of ``reference`` holding
    them is returned.
    """
    kinds = []
    for name, m in (("layer", layer), ("reference", reference)):
        kinds.append("nnx" if isinstance(m, nnx.Module) else "equinox" if equinox_of(m) is not None else None)
        if kinds[-1] is None:
            keras = (" (a Keras layer's twin is made the Keras way: twin.set_weights(layer.get_weights()) before "
                     "layer.quantize(...))") if keras_of(m) is not None else ""
            raise ValueError(f"copy_params_into: {name} must be an flax.nnx.Module or an equinox.Module, "
                             f"got {type(m).__name__}{keras}")
    if kinds[0] != kinds[1]:
        raise ValueError(f"copy_params_into: layer and reference must both be NNX modules or both Equinox modules, "
                         f"got {type(layer).__name__} ({kinds[0]}) and {type(reference).__name__} ({kinds[1]})")
    if kinds[0] == "nnx":
        src = {path_name(p): v[...] for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
        dst_state = nnx.state(reference, nnx.Param)
        dst = {path_name(p): v[...] for p, v in nnx.to_flat_state(dst_state)}
        word = "Params"
    else:
        eqx = equinox_of(reference)
        src = equinox_param_leaves(equinox_split(eqx, layer)[0])
        dst_params, dst_rest = equinox_split(eqx, reference)
        dst = equinox_param_leaves(dst_params)
        word = "parameters"

    def listing() -> str:
        return f"layer {word}: {', '.join(src) or '(none)'}; reference {word}: {', '.join(dst) or '(none)'}"

    for path in sorted(set(src) | set(dst)):
        if path not in dst:
            raise ValueError(f"copy_params_into: layer parameter {path} has no counterpart in reference ({listing()})")
        if path not in src:
            raise ValueError(f"copy_params_into: reference parameter {path} has no counterpart in layer ({listing()})")
        a, b = src[path], dst[path]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"copy_params_into: parameter {path} is {a.dtype}{list(a.shape)} in layer but "
                             f"{b.dtype}{list(b.shape)} in reference ({listing()})")

    def copied(old: Any, new: Any) -> Any:
        # device_put copies a numpy leaf (one changed in place later must not reach the twin) and keeps
        # the twin's own sharding.
        return jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else np.array(new)

    if kinds[0] == "equinox":
        named = named_array_type()

        def put(path: Any, v: Any) -> Any:
            if isinstance(v, named):  # the NamedArray keeps its axes, its array is the layer's
                return v if v.array is None else jax.tree_util.tree_map(
                    lambda old: copied(old, src[path_name(path)]), v)
            return copied(v, src[path_name(path)])

        params = jax.tree_util.tree_map_with_path(put, dst_params, is_leaf=lambda v: isinstance(v, named))
        return eqx.combine(params, dst_rest)
    for p, v in nnx.to_flat_state(dst_state):
        v.set_value(copied(v[...], src[path_name(p)]))
    nnx.update(reference, dst_state)
    return reference
