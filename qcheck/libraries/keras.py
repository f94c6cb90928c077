"""Keras 3.15.1: the reader of the mode ``quantize()`` recorded, the kernels it stores as codes, and its frames as
machinery (its layers, ops and JAX backend: ``keras/src/backend/jax/numpy.py``'s ``matmul`` is every Keras matmul's
innermost frame), so a Keras matmul points at the model's own line (a subclass's ``call``, keras-hub's, a separate
package); a stock layer checked bare, with no line of the user's on its stack, at its own line in Keras, past its
plumbing (``PLUMBING``). How a Keras layer is called is a layer form (``qcheck/checks/_layer_forms.py``)."""

from __future__ import annotations

import sys
from typing import Any

from qcheck import formats
from qcheck.libraries._declaration import Declaration, RoleFormat, Stored
from qcheck.libraries._library import Library

#: Keras 3.15.1's ``layer.quantize(mode)`` / ``model.quantize(mode)``, as each layer it reached records it
#: (``Layer.quantization_mode``, read off the layer's ``QuantizedDTypePolicy``; keras/src/layers/layer.py:842).
#: ``int8``: ``Dense``/``EinsumDense`` quantize the input in the call and store the kernel as int8 codes, both by
#: ``abs_max_quantize`` (an encode scale 127 / (absmax + 1e-7), codes ±127: qcheck's ``int8_keras``;
#: keras/src/quantizers/quantizers.py:67-119, dense.py:469-488, 781-813); the backward pass multiplies the float
#: output gradient by the dequantized kernel: no grads role. ``float8``: delayed-scaling e4m3fn on the input and
#: the kernel, the output gradient e5m2 (dense.py ``_float8_call``).
KERAS_MODES = {
    "int8": {"activations": "int8_keras", "weights": "int8_keras"},
    "float8": {"activations": "e4m3fn", "weights": "e4m3fn", "grads": "e5m2"},
}
#: Keras 3.15.1's ``quantize("int4")`` with ``Int4QuantizationConfig(block_size=None or -1)``: per output channel,
#: the kernel's codes by ``AbsMaxQuantizer(axis=0, value_range=(-8, 7))`` (an encode scale 7 / (absmax + 1e-7):
#: qcheck's ``int4_keras``; dense.py:1061-1074), stored two to an int8 byte (``pack_int4``) and unpacked by
#: shifts and masks in the call (``unpack_int4``, dense.py:847); the input quantized only where the config names
#: an activation quantizer (``_int4_build``: ``activation_quantizer_or_default(config, None)``, dense.py:676;
#: ``Int4QuantizationConfig``'s default is None, weight-only: quantization_config.py:115-117). Its default block
#: size, 128 (quantization_config.py:113), is the grouped form with zero points: the kernel's codes by
#: ``abs_max_quantize_grouped_with_zero_point(kernel, 128, to_numpy=True)`` (dense.py:1080, einsum_dense.py:1325;
#: qcheck's ``int4_keras_grouped``), stored packed the same way and dequantized in the call as
#: (codes - zero[g_idx]) · scale[g_idx] (``dequantize_with_sz_map``, dense.py:910); its call never quantizes the
#: input (dense.py:884-921), and a grouped config refuses an activation quantizer
#: (quantization_config.py:128-140): weight-only. Another block size is the same format at that block
#: (``RoleFormat(KERAS_INT4_GROUPED, block=64)``, printed "int4_keras_grouped at block 64"): the group size is
#: the layer's config, read from it.
KERAS_INT4 = "int4_keras"
KERAS_INT4_GROUPED = "int4_keras_grouped"
#: Why a Keras int8 or int4 kernel is held by its type where no twin holds its float kernel (coverage,
#: assert_quantized): quantize() stored its codes and kept no float kernel. check_layer holds it bitwise against
#: the twin's kernel instead (``Declaration.stored_params``, :func:`_keras_stored`): no acceptance there.
KERAS_STORED = {
    "int8": "the Keras reader: quantize('int8') stores the kernel as int8 codes, keeping no float kernel",
    "int4": "the Keras reader: quantize('int4') stores the kernel as int4 codes packed two to an int8 byte, "
            "keeping no float kernel",
}
_KERAS_EPSILON = 1e-7  # keras.backend.epsilon(), abs_max_quantize's default


def _keras_int8(quantizer: Any) -> bool:
    """Whether ``quantizer`` is Keras's ``AbsMaxQuantizer`` with its int8 defaults: qcheck's ``int8_keras``."""
    return (type(quantizer).__name__ == "AbsMaxQuantizer" and type(quantizer).__module__.startswith("keras.")
            and tuple(getattr(quantizer, "value_range", ())) == (-127, 127)
            and getattr(quantizer, "epsilon", None) == _KERAS_EPSILON
            and getattr(quantizer, "output_dtype", None) == "int8")


def _keras_int8_activations(layer: Any) -> str | None:
    """``int8_keras`` or ``"none"`` (weight-only) as the layer's ``quantization_config`` configures its inputs, or
    None where it configures a quantizer that is not int8_keras (nothing is read then)."""
    config = getattr(layer, "quantization_config", None)
    if config is not None and getattr(config, "weight_quantizer", None) is not None \
            and not _keras_int8(config.weight_quantizer):
        return None
    if config is None:
        return "int8_keras"  # Dense/EinsumDense's default: AbsMaxQuantizer()
    activations = getattr(config, "activation_quantizer", None)
    if activations is None:
        return "none"
    return "int8_keras" if _keras_int8(activations) else None


def _keras_int4(quantizer: Any) -> bool:
    """Whether ``quantizer`` is Keras's ``AbsMaxQuantizer`` with int4's range: qcheck's ``int4_keras``."""
    return (type(quantizer).__name__ == "AbsMaxQuantizer" and type(quantizer).__module__.startswith("keras.")
            and tuple(getattr(quantizer, "value_range", ())) == (-8, 7)
            and getattr(quantizer, "epsilon", None) == _KERAS_EPSILON)


def _keras_int4_roles(layer: Any) -> tuple[Any, str] | None:
    """An int4 layer's weights format (grouped: with its block size) and ``"none"`` (weight-only) or ``int8_keras``
    as its config quantizes its inputs; None where its quantizers are not Keras's."""
    # The block size the call reads (dense.py:837, einsum_dense.py's _int4_call likewise), set by _int4_build from
    # the config or the dtype policy (get_block_size_for_layer, quantization_config.py:303-335).
    block = getattr(layer, "_int4_block_size", getattr(getattr(layer, "dtype_policy", None), "block_size", None))
    if block is not None and block > 0:
        return (KERAS_INT4_GROUPED, int(block)), "none"  # a grouped call never quantizes its input (dense.py:884-921)
    config = getattr(layer, "quantization_config", None)
    weights = getattr(config, "weight_quantizer", None)
    if weights is not None and not _keras_int4(weights):
        return None
    activations = getattr(config, "activation_quantizer", None)
    if activations is None:
        return KERAS_INT4, "none"
    return (KERAS_INT4, "int8_keras") if _keras_int8(activations) else None


def _keras(layer: Any) -> Declaration | None:
    # A Keras layer or model (a user's subclass too): keras is never imported here, a Keras layer has imported it.
    if "keras" not in sys.modules or isinstance(layer, type):
        return None
    if not any(c.__module__.startswith("keras.") for c in type(layer).__mro__):
        return None
    flatten = getattr(layer, "_flatten_layers", None)
    layers = flatten(include_self=True, recursive=True) if callable(flatten) else [layer]
    reached: dict[str, list[Any]] = {}
    for sub in layers:
        mode = getattr(sub, "quantization_mode", None)
        if mode is not None:
            reached.setdefault(str(mode), []).append(sub)
    if len(reached) != 1:
        return None  # nothing quantized (nothing to read), or several modes: no one declaration
    mode, subs = reached.popitem()
    roles: dict[str, RoleFormat | None] = {k: RoleFormat(v) for k, v in KERAS_MODES.get(mode, {}).items()}
    detail = ""
    if mode == "int4":
        found = {_keras_int4_roles(sub) for sub in subs}
        if len(found) != 1 or None in found:
            return None  # another block size, quantizers not Keras's, or mixed: nothing to read
        weights, act = found.pop()
        if isinstance(weights, tuple):  # grouped: the block size is the layer's config, a parameter of the format
            name, block = weights
            default = formats.get_format(name).block
            weights = RoleFormat(name, block=None if block == default else block)
            grouping = f", grouped by {block} with zero points"
        else:
            weights, grouping = RoleFormat(weights), ", per channel"
        roles = {"weights": weights, "activations": None if act == "none" else RoleFormat(act)}
        detail = grouping + (", weight-only" if act == "none" else "")
    if not roles:
        return None  # gptq, awq: no qcheck format for their packed codes
    stored = {}
    if mode == "int8":
        activations = {_keras_int8_activations(sub) for sub in subs}
        if len(activations) != 1 or None in activations:
            return None  # quantizers configured otherwise than Keras's int8, or mixed: nothing to read
        if activations.pop() == "none":
            roles["activations"] = None
    if mode in KERAS_STORED:
        stored = {"weights": KERAS_STORED[mode]}
    names = sorted({type(sub).__name__ for sub in subs})
    return Declaration(roles, f"Keras quantize({mode!r}{detail}) on {len(subs)} layer(s) ({', '.join(names)})",
                       stored=stored, stored_params=_keras_stored(subs, mode) if mode in KERAS_STORED else {})


def _keras_stored_params(layer: Any) -> dict[str, Stored]:
    """The kernels a Keras layer or model keeps as codes (int8, int4), whatever its quantizers: where they are is
    a fact of the layer, held by check_layer to whatever format is declared for them."""
    if "keras" not in sys.modules or isinstance(layer, type) or \
            not any(c.__module__.startswith("keras.") for c in type(layer).__mro__):
        return {}
    flatten = getattr(layer, "_flatten_layers", None)
    layers = flatten(include_self=True, recursive=True) if callable(flatten) else [layer]
    out: dict[str, Stored] = {}
    for sub in layers:
        mode = getattr(sub, "quantization_mode", None)
        if mode in KERAS_STORED:
            out.update(_keras_stored([sub], str(mode)))
    return out


def _keras_kernel_axes(sub: Any) -> tuple[int, ...] | None:
    """The axes of a Dense or EinsumDense kernel that its matmul contracts (its int8/int4 scales reduce them)."""
    kind = next((c.__name__ for c in type(sub).__mro__ if c.__module__.startswith("keras.")
                 and c.__name__ in ("Dense", "EinsumDense")), None)
    if kind == "Dense":
        return (0,)
    equation = getattr(sub, "equation", None)
    if kind != "EinsumDense" or not isinstance(equation, str) or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    if len(inputs.split(",")) != 2:
        return None
    kernel = inputs.split(",")[1]
    return tuple(i for i, c in enumerate(kernel) if c not in out)


def _keras_stored(subs: list[Any], mode: str) -> dict[str, Stored]:
    """Each Dense/EinsumDense kernel ``quantize(mode)`` stored as codes (keras 3.15.1): the ``kernel`` variable
    (int8; int4 packed two to a byte along its last axis, pack_int4(axis=-1), dense.py:1087,
    einsum_dense.py:1332), ``kernel_scale`` and, grouped, ``kernel_zero``, by their paths; the float kernel of
    the twin has the kernel's path. An int4 EinsumDense kernel of more than two axes is flattened first: not read."""
    out = {}
    for sub in subs:
        axes = _keras_kernel_axes(sub)
        by_name = {v.name: v.path for v in getattr(sub, "variables", ())}
        if axes is None or "kernel" not in by_name or "kernel_scale" not in by_name:
            continue
        kernel = next(v for v in sub.variables if v.name == "kernel")
        if mode == "int4" and len(kernel.shape) != 2:
            continue
        out[by_name["kernel"]] = Stored(by_name["kernel"], by_name["kernel"], axes, by_name["kernel_scale"],
                                        by_name.get("kernel_zero"), -1 if mode == "int4" else None,
                                        scope=str(getattr(sub, "path", sub.name)))
    return out


def keras_of(layer: Any) -> Any:
    """The ``keras`` package where ``layer`` is a Keras layer or model (a ``keras.layers.Layer``), else None.

    Never imports it: a Keras layer exists only once Keras is loaded.
    """
    keras = sys.modules.get("keras")
    base = getattr(getattr(keras, "layers", None), "Layer", None)
    return keras if isinstance(base, type) and not isinstance(layer, type) and isinstance(layer, base) else None


#: Keras's plumbing (ops, backend, base classes, tracebacks, quantizers, the functional graph): where a matmul has no
#: frame outside the machinery (a stock layer checked bare: the check's own caller lies outside the traced program),
#: its location is the innermost frame outside these: the stock layer's own line (keras/src/layers/core/dense.py,
#: ``Dense._float8_call``), never ``keras/src/backend/jax/numpy.py``.
PLUMBING = ("keras.src.backend", "keras.src.ops", "keras.src.utils", "keras.src.layers.layer", "keras.src.quantizers",
            "keras.src.models", "keras.src.dtype_policies", "keras.src.trainers")

LIBRARY = Library(
    "Keras",
    reads=("the mode quantize() recorded on the layers it reached (Layer.quantization_mode: int8, with its "
           "quantization_config; int4 per channel (block_size -1), weight-only unless its config quantizes the "
           "inputs; int4 grouped, at the config's block_size; float8): every matmul of the layer or model held to "
           "it; each Dense/EinsumDense kernel stored as codes, with its scale and zero point, for check_layer to "
           "hold against the twin's float kernel"),
    reader=_keras,
    stored=_keras_stored_params,
    machinery=("keras",),
    plumbing=PLUMBING,
)
