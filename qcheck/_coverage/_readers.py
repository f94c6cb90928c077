"""Where a layer's own library states its quantization: the declaration read from the layer.

One row per library: what is read, and the declaration it gives
(:data:`READERS`). ``check_layer`` reads a layer's declaration here when its
caller gives none, and says in its figures what it read.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from qcheck import formats
from qcheck._coverage._declaration import Declaration, RoleFormat, Stored, as_declaration

#: MaxText 0.2.5's ``config.quantization`` on its AQT/Flax path (``use_qwix_quantization=False``):
#: ``int8`` is AQT v2 ``config_v3(fwd_bits=8)``, whose forward codes are qcheck's ``int8_aqt``
#: (maxtext/layers/quantizations.py:636); ``fp8`` and ``nanoo_fp8`` are Flax's delayed-scaling
#: e4m3fn / e4m3fnuz ops, at scale 1 on a fresh layer.
MAXTEXT_AQT = {
    "int8": {"activations": "int8_aqt", "weights": "int8_aqt"},
    "fp8": {"activations": "e4m3fn", "weights": "e4m3fn"},
    "nanoo_fp8": {"activations": "e4m3fnuz", "weights": "e4m3fnuz"},
}


#: MaxText 0.2.5's megablox ``gmm`` (``sparse_matmul`` and ``megablox`` on, qwix path off) quantizes its operands
#: itself, with a qwix ``QtRule`` of the AQT config's int8 dtypes and absmax calibration
#: (maxtext/kernels/megablox/ops.py:102-108, 255-290): qwix's int8 (absmax / 127.5), the lhs one scale per row
#: (``channelwise_axes=[0]``), the rhs one per output column shared across experts (``[2]``: "this makes the
#: bwd pass unable to reuse the scale" otherwise). Its fp8 operands take the config's e4m3 types, as declared.
MEGABLOX = {
    "int8": {"activations": RoleFormat("int8_qwix", per=(0,)), "weights": RoleFormat("int8_qwix", per=(2,))},
}


def _qcheck_moe(layer: Any) -> Declaration | None:
    from qcheck.layers.moe import MoE

    if not isinstance(layer, MoE):
        return None
    quantized, lhs, rhs, grad = layer.recipe_formats
    source = f"the layer's recipe {layer.recipe_name!r}"
    if not quantized:
        return Declaration({"weights": None, "activations": None}, source)
    if lhs is None or rhs is None:
        return None  # a recipe that names no formats (a library's own configuration): nothing to read
    roles = {"activations": RoleFormat(lhs), "weights": RoleFormat(rhs)}
    if grad is not None:
        roles["grads"] = RoleFormat(grad)
    return Declaration(roles, source)


#: MaxText 0.2.5's ``config.quantization`` on its qwix path (``use_qwix_quantization=True``, applied by
#: ``maybe_quantize_model``): the dtype of its rules' ``weight_qtype``/``act_qtype``
#: (maxtext/layers/quantizations.py:1162-1204; ``fp8_full``'s rule, 1109-1159, is e4m3fn too). qwix's int8 is
#: qcheck's ``int8_qwix`` (absmax / 127.5, codes -128..127). ``fp8_nanoo`` is the MI300 configuration: its
#: provider (``NANOOFp8Provider``) casts ``dot_general`` sites to e4m3fnuz (Flax's NANOO op), which is what it
#: declares here; its rule's e4m3fn would reach only the einsums qwix's own einsum casts, the latent defect a
#: declaration of e4m3fnuz names. int4 and fp4 have no qcheck format: nothing is read.
MAXTEXT_QWIX = {
    "int8": "int8_qwix",
    **dict.fromkeys(("fp8", "fp8_e4m3", "fp8_gpu", "fp8_full"), "e4m3fn"),
    "fp8_nanoo": "e4m3fnuz",
    "fp8_e5m2": "e5m2",
}


def _maxtext(layer: Any) -> Declaration | None:
    # qwix's quantize_model hands back an instance of a subclass it makes (module "abc"): any MaxText class counts.
    if not any(c.__module__.startswith("maxtext.") for c in type(layer).__mro__):
        return None
    config = getattr(layer, "config", None)
    quantization = getattr(config, "quantization", None)
    quantization = getattr(quantization, "value", quantization)  # MaxText's QuantizationType is a str enum
    if not isinstance(quantization, str):
        return None
    qwix = bool(getattr(config, "use_qwix_quantization", False))
    if quantization == "":
        return Declaration({"weights": None, "activations": None}, "MaxText config.quantization=''")
    if qwix:
        fmt = MAXTEXT_QWIX.get(quantization)
        if fmt is None:
            return None
        return Declaration({"activations": RoleFormat(fmt), "weights": RoleFormat(fmt)},
                           f"MaxText config.quantization={quantization!r}, use_qwix_quantization (qwix rule: {fmt})")
    roles = MAXTEXT_AQT.get(quantization)
    if roles is None:
        return None
    kernels = {}
    if getattr(config, "sparse_matmul", False) and getattr(config, "megablox", False) and quantization in MEGABLOX:
        kernels = {"gmm": MEGABLOX[quantization]}
    return Declaration({k: RoleFormat(v) for k, v in roles.items()},
                       f"MaxText config.quantization={quantization!r}" + (", megablox" if kernels else ""), kernels)


#: gemma 4.0.1's ``gm.nn.QuantizationAwareWrapper(method=...)``: weight-only QAT, a straight-through
#: estimator around ``peft.simulate_quantize(kernel, method)``; INT8 scales by 127 · (1/absmax) with absmax
#: over every axis of the kernel but the last (gemma/peft/_quantization.py:316-331, 398-451). Activations
#: stay float.
GEMMA_QAT = {
    "INT8": {"weights": RoleFormat("int8", per=(-1,)), "activations": None},
    "NONE": {"weights": None, "activations": None},
}


def _gemma(layer: Any) -> Declaration | None:
    # check_layer takes a Linen module as a (module, variables) pair; gemma is imported by the layer, never here.
    module = layer[0] if isinstance(layer, tuple) and len(layer) == 2 else layer
    if type(module).__name__ != "QuantizationAwareWrapper" or not type(module).__module__.startswith("gemma."):
        return None
    method = getattr(module, "method", None)
    name = str(getattr(method, "name", method)).upper()
    roles = GEMMA_QAT.get(name)
    if roles is None:
        return None
    return Declaration(dict(roles), f"gemma QuantizationAwareWrapper(method={name})")


#: haliax's dot ops (haliax/quantization.py), which ``quantize_linear_layers`` (Levanter's
#: ``TrainerConfig.quantization``) sets on every ``hnn.Linear``: ``Fp8DotGeneralOp`` casts both operands to
#: its ``fwd_dtype`` and the output gradient to its ``rev_dtype`` (e4m3fn / e5m2: delayed scaling, scale 1 on
#: a fresh op); ``Int8DotGeneralOp`` is AQT v2 ``config_v3()``, int8 forward on both operands, scale
#: absmax / 127.5 per index of every axis but the contraction's: qcheck's ``int8_aqt``.
HALIAX_FP8 = {"float8_e4m3fn": "e4m3fn", "float8_e4m3fnuz": "e4m3fnuz", "float8_e5m2": "e5m2",
              "float8_e5m2fnuz": "e5m2fnuz"}
_HALIAX_OPS = ("Fp8DotGeneralOp", "Int8DotGeneralOp")


def _haliax_op(node: Any) -> str | None:
    return next((c.__name__ for c in type(node).__mro__
                 if c.__module__ == "haliax.quantization" and c.__name__ in _HALIAX_OPS), None)


def _aqt_int8(numerics: Any) -> str | None:
    if type(numerics).__name__ != "IntSymmetric" or getattr(numerics, "bits", None) != 8:
        return None
    return "int8" if getattr(numerics, "preserve_max_val", False) else "int8_aqt"  # absmax/127 or /127.5


def _haliax_roles(op: Any) -> tuple[tuple[str, str], ...] | None:
    if _haliax_op(op) == "Fp8DotGeneralOp":
        fwd, rev = (HALIAX_FP8.get(str(np.dtype(d))) for d in (op.fwd_dtype, op.rev_dtype))
        if fwd is None or rev is None:
            return None
        return (("activations", fwd), ("weights", fwd), ("grads", rev))
    quantizer = getattr(getattr(getattr(op, "cfg", None), "fwd", None), "dg_quantizer", None)
    lhs, rhs = (_aqt_int8(getattr(getattr(quantizer, side, None), "numerics", None)) for side in ("lhs", "rhs"))
    if lhs is None or rhs is None:
        return None
    return (("activations", lhs), ("weights", rhs))  # haliax's Linear puts the input on the lhs


def _haliax(layer: Any) -> Declaration | None:
    # An Equinox module (or any pytree: a jax.tree_util.Partial of a function and the block) holding the ops;
    # a plain function holds nothing to read. haliax is never imported here: a layer using it has imported it.
    if "haliax" not in sys.modules or isinstance(layer, type):
        return None
    import jax

    ops = [leaf for leaf in jax.tree_util.tree_leaves(layer, is_leaf=lambda n: _haliax_op(n) is not None)
           if _haliax_op(leaf) is not None]
    if not ops:
        return None
    kinds = {(_haliax_op(op), _haliax_roles(op)) for op in ops}
    if len(kinds) != 1 or (kind := kinds.pop())[1] is None:
        return None  # ops of several kinds or formats: no one declaration (one format per role is then checked)
    name, roles = kind
    return Declaration({k: RoleFormat(v) for k, v in roles},
                       f"haliax {name} on {len(ops)} Linear layer(s): {', '.join(f'{k} {v}' for k, v in roles)}")


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


#: qwix 0.1.8's rule qtypes (``QtRule``/``QuantizationRule`` ``weight_qtype``/``act_qtype``, by their dtype's name)
#: with absmax calibration, as qcheck's formats: its int8 is ``int8_qwix`` (absmax / 127.5, codes -128..127), its
#: fp8 types the element type under the layer's own scale (absmax / fmax per channel: the codes are the cast of
#: x / scale, held bitwise as the declared fp8 format). ``minmax`` int8 is ``int8_qwix_minmax``. qwix's own
#: ``mxfp8`` and ``nvfp4`` are not qcheck's (qcheck.referees._libraries), nor are int4, nf4 and the rest: read as
#: nothing, saying so.
QWIX_ABSMAX = {"int8": "int8_qwix", "float8_e4m3fn": "e4m3fn", "float8_e5m2": "e5m2",
               "float8_e4m3fnuz": "e4m3fnuz", "float8_e5m2fnuz": "e5m2fnuz"}
QWIX_MINMAX = {"int8": "int8_qwix_minmax"}


def _qwix_provider(layer: Any) -> Any:
    """The provider ``qwix.quantize_model`` wrapped the model's method with, or None.

    qwix 0.1.8 (qwix/_src/model.py:182-200, interception.py:124-184) replaces the model's class by a subclass
    holding ``_unquantized_type`` whose call method is an intercepting wrapper; the provider is bound, as
    ``functools.partial(_input_transform, provider)``, in that wrapper's closure.
    """
    import functools

    cls = type(layer)
    if "_unquantized_type" not in cls.__dict__:
        return None
    for fn in cls.__dict__.values():
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(v, functools.partial) and v.args and \
                    any(c.__module__.startswith("qwix.") for c in type(v.args[0]).__mro__):
                return v.args[0]
    return None


def _qwix_rule_roles(rule: Any) -> dict[str, RoleFormat | None] | str:
    """A qwix rule's formats by role, or why they are not a qcheck format."""
    def one(qtype: Any, method: str | None, what: str) -> RoleFormat | None | str:
        if qtype is None:
            return None
        name = qtype if isinstance(qtype, str) else str(np.dtype(qtype))
        table = {"absmax": QWIX_ABSMAX, "minmax": QWIX_MINMAX}.get(str(method))
        fmt = None if table is None else table.get(name)
        if fmt is None:
            return f"{what} {name} with calibration {method!r}, which is no qcheck format"
        return RoleFormat(fmt)

    if getattr(rule, "tile_size", None) is not None:
        return f"tile_size={rule.tile_size} (subchannel scales), which no qcheck format declares"
    if getattr(rule, "act_static_scale", False):
        return "act_static_scale=True (a calibrated scale, not the format's per-call rule)"
    roles = {"weights": one(rule.weight_qtype, rule.weight_calibration_method, "weight_qtype"),
             "activations": one(rule.act_qtype, rule.act_calibration_method or "absmax", "act_qtype")}
    bad = [v for v in roles.values() if isinstance(v, str)]
    return bad[0] if bad else roles


def _qwix(layer: Any) -> Declaration | str | None:
    # An NNX model qwix.quantize_model handed back (qwix is never imported here: such a model has imported it).
    if "qwix" not in sys.modules or isinstance(layer, type):
        return None
    provider = _qwix_provider(layer)
    if provider is None:
        return None
    kind = type(provider).__name__
    if kind not in ("QtProvider", "PtqProvider"):
        # ODML and LoRA providers compute otherwise: not read.
        return f"qwix {kind}: only QtProvider's and PtqProvider's rules are read"
    # QuantizationProvider keeps its rules, defaults filled in (_init_rule), as ``_rules``: qwix 0.1.8
    # qconfig.py:118; it has no public accessor (get_unused_rules lists the unmatched ones only).
    if not isinstance(getattr(provider, "_rules", None), (list, tuple)):
        # Another qwix keeps them elsewhere: say so, rather than read "no rule reaches any module".
        return f"qwix {kind} keeps no _rules list (qwix 0.1.8's): its rules cannot be read"
    rules = list(provider._rules)
    from flax import nnx

    if not isinstance(layer, nnx.Module):
        return "a Linen model: only an NNX model's module paths are read"
    # qwix matches each rule's module_path regex against the path of the module whose method runs the op,
    # "/"-joined (qconfig.py:210-216): the first rule that matches wins. op_names narrow a rule to some ops.
    if any(getattr(r, "op_names", ()) for r in rules):
        return "qwix rules with op_names (per-op formats within a module), which are not read"
    read = {i: _qwix_rule_roles(r) for i, r in enumerate(rules)}
    iter_modules = getattr(nnx, "iter_modules", None) or type(layer).iter_modules  # flax 0.12 / before
    scopes: dict[str, dict[str, RoleFormat | None]] = {}
    used: set[int] = set()
    for path, _ in iter_modules(layer):
        p = "/".join(map(str, path))
        idx = next((i for i, r in enumerate(rules) if re.fullmatch(r.module_path, p)), None)
        if idx is not None and isinstance(read[idx], str):
            return f"qwix QtRule(module_path={rules[idx].module_path!r}): {read[idx]}"
        scopes[p] = {"weights": None, "activations": None} if idx is None else read[idx]
        used |= set() if idx is None else {idx}
    if not used:
        return None  # no rule reaches any module: nothing quantized to read
    top = scopes.get("", {"weights": None, "activations": None})
    said = "; ".join(f"module_path={rules[i].module_path!r}: " + ", ".join(
        f"{k} {'full precision' if v is None else v}" for k, v in read[i].items()) for i in sorted(used))
    source = f"qwix {kind} rules on {len(scopes)} module(s) ({said})"
    # PtqProvider keeps each weight its rules reach as codes and a scale (ptq.py WithAux): held by check_layer
    # against the twin's float weight, by its type elsewhere (no float source), accepted with this reason.
    stored = {"weights": QWIX_STORED} if kind == "PtqProvider" else {}
    kept = _qwix_stored_params(layer) if kind == "PtqProvider" else {}
    if all(v == top for v in scopes.values()):
        return Declaration(dict(top), source, stored=stored, stored_params=kept)
    return Declaration(dict(top), source, scopes=scopes, stored=stored, stored_params=kept)


#: Why a qwix PtqProvider weight is held by its type where no twin holds its float weight.
QWIX_STORED = ("the qwix reader: PtqProvider stores each weight as int8 codes (qvalue) and a scale, keeping no "
               "float weight")


def _qwix_stored_params(layer: Any) -> dict[str, Stored]:
    """The weights a qwix 0.1.8 ``PtqProvider`` model keeps as codes: each module attribute that is a ``WithAux``
    (qwix/_src/providers/ptq.py:37-80) holding a ``QArray`` (its ``qvalue``, ``scale``, ``zero_point`` each an
    ``nnx.Param``), quantized as its ``how`` says: one scale per index of its ``channelwise_axes``, the others
    reduced (the contraction axes qwix found in the op's dimension numbers). Tiled (subchannel) weights are not
    read. By the attribute's path, which the float twin's parameter has."""
    if "qwix" not in sys.modules or isinstance(layer, type):
        return {}
    from flax import nnx

    if not isinstance(layer, nnx.Module):
        return {}
    iter_modules = getattr(nnx, "iter_modules", None) or type(layer).iter_modules
    out: dict[str, Stored] = {}
    for path, module in iter_modules(layer):
        scope = "/".join(map(str, path))
        for name, v in vars(module).items():
            if type(v).__name__ != "WithAux" or not type(v).__module__.startswith("qwix."):
                continue
            how, array = getattr(v, "how", None), getattr(v, "array", None)
            if how is None or getattr(how, "tiled_axes", None) or not hasattr(array, "qvalue"):
                continue
            source = f"{scope}/{name}" if scope else str(name)
            kept = set(getattr(how, "channelwise_axes", ()) or ())
            axes = tuple(a for a in range(len(v.shape)) if a not in kept)
            zero = f"{source}/array/zero_point" if getattr(array, "zero_point", None) is not None else None
            out[source] = Stored(source, f"{source}/array/qvalue", axes, f"{source}/array/scale", zero, None, scope)
    return out


#: EasyDeL 0.3.0's ``QuantizationConfig`` (easydel/layers/quantization/_configs.py), which ``model.quantize`` records
#: as ``config.quantization_config`` on the model's config, the config every one of its modules holds. None: the
#: model is float. Every dtype it offers is ejkernel's packed weight-only codes dequantized into a float matmul
#: (ejkernel's quantized_matmul): INT8/AFFINE are affine (a uint32-packed code, a float16 scale and a float16 zero
#: point per group), NF4/MXFP4/NVFP4/MXFP8/NVFP8 a code and a scale per group. qcheck has no format for them yet, so
#: a quantized config is recognised and not read, saying why. # h-lib moves this to qcheck/libraries/easydel.py.
def _easydel(layer: Any) -> Declaration | str | None:
    if not any(c.__module__.startswith("easydel.") for c in type(layer).__mro__):
        return None
    config = getattr(layer, "config", None)
    if config is None or not hasattr(config, "quantization_config"):
        return None
    quantization = config.quantization_config
    if quantization is None:
        return Declaration({"weights": None, "activations": None}, "EasyDeL config.quantization_config=None")
    dtype = getattr(quantization.dtype, "value", quantization.dtype)
    return (f"EasyDeL QuantizationConfig(dtype={dtype!r}, group_size={quantization.group_size}, "
            f"bits={quantization.bits}) is ejkernel's packed {dtype} weights, which have no qcheck format yet")


#: (library, what is read, reader): the first reader that returns a declaration wins.
READERS: tuple[tuple[str, str, Callable[[Any], Declaration | None]], ...] = (
    ("qcheck", "MoE.recipe_name: the recipe the layer was built with", _qcheck_moe),
    ("MaxText", "config.quantization: int8, fp8, nanoo_fp8 with use_qwix_quantization off (AQT, Flax's fp8 ops); "
                "with it on, its qwix rule's dtype (int8, fp8, fp8_e4m3, fp8_e5m2, fp8_gpu, fp8_nanoo, fp8_full)",
     _maxtext),
    ("gemma", "QuantizationAwareWrapper.method (INT8, NONE): weight-only, one scale per index of the kernel's "
              "last axis", _gemma),
    ("haliax", "Fp8DotGeneralOp's fwd/rev dtypes and Int8DotGeneralOp's AQT config, as quantize_linear_layers "
               "sets them on the layer's Linears (a pytree: an Equinox module, or a Partial holding it)", _haliax),
    ("qwix", "the QtProvider or PtqProvider rules qwix.quantize_model was given (module_path, weight_qtype, "
             "act_qtype, calibration methods), per module path: int8 absmax int8_qwix, int8 minmax "
             "int8_qwix_minmax, fp8 absmax its element type; a module no rule reaches full precision; "
             "PtqProvider's weights stored as codes, for check_layer to hold against the twin's float weights",
     _qwix),
    ("Keras", "the mode quantize() recorded on the layers it reached (Layer.quantization_mode: int8, with its "
              "quantization_config; int4 per channel (block_size -1), weight-only unless its config quantizes the "
              "inputs; int4 grouped, at the config's block_size; float8): every matmul of the layer or model held "
              "to it; each Dense/EinsumDense kernel stored as codes, with its scale and zero point, for check_layer "
              "to hold against the twin's float kernel", _keras),
    ("EasyDeL", "config.quantization_config, as model.quantize records it: None (float); a QuantizationConfig is "
                "ejkernel's packed codes, which have no qcheck format yet (not read, saying so)",
     _easydel),  # h-lib moves this
)


def _read(layer: Any) -> tuple[Declaration | None, str | None]:
    """The declaration read off ``layer``, or None and why a reader that recognised the layer read nothing."""
    for library, _, reader in READERS:
        decl = reader(layer)
        if isinstance(decl, str):  # the layer is this library's, configured as no qcheck format
            return None, f"the {library} reader: {decl}"
        if decl is not None:
            return decl, None
    return None, None


def read_stored(layer: Any) -> dict[str, Stored]:
    """The weights ``layer`` keeps as codes, by the path of the float parameter its twin holds (Keras's int8/int4
    kernels, qwix's PtqProvider weights); empty where none is read."""
    for reader in (_keras_stored_params, _qwix_stored_params):
        found = reader(layer)
        if found:
            return found
    return {}


def read_declaration(layer: Any) -> Declaration | None:
    """The quantization ``layer``'s library declares on it (:data:`READERS`), or None where none is read."""
    return _read(layer)[0]


def _nothing_read(why: str | None = None) -> str:
    if why is not None:
        return f"nothing read: {why}"
    return f"nothing read: no reader ({', '.join(lib for lib, _, _ in READERS)}) finds a declaration on it"


def resolve_declaration(layer: Any, declared: Any, entry: str, what: str = "layer"
                        ) -> tuple[Declaration | None, str]:
    """The declaration ``declared`` asks for, and one line saying what it is and where it was read.

    None (the default) reads it from ``layer`` (:data:`READERS`) and, where
    nothing is read, holds nothing and says so; True reads it and fails where
    nothing is read; False holds nothing; anything else is a declaration
    given by hand (:func:`as_declaration`).
    """
    if declared is False:
        return None, "declared=False: no declaration held"
    if declared is None or declared is True:
        decl, why = _read(layer)
        if decl is not None and not decl.any_format:
            # An unquantized layer by its own word: nothing to hold but that it is quantized at all.
            return None, f"read from the {what}: {decl.source}, which declares no quantized format"
        if decl is not None:
            return decl, f"read from the {what}: {decl.source}"
        if declared is True:
            raise ValueError(f"{entry}: declared=True, but {_nothing_read(why).removeprefix('nothing read: ')} of "
                             f"{type(layer).__name__}; declare it by hand: declared='fp8' (a recipe) or "
                             f"declared={{'weights': 'int8', 'activations': 'int8'}}")
        return None, f"{_nothing_read(why)} ({what} {type(layer).__name__}); pass declared= to hold its sites"
    if isinstance(declared, bool):
        raise ValueError(f"{entry}: declared must be None (read it from the {what}), True, False, a recipe name, a "
                         f"qcheck.Recipe or a mapping of roles to formats")
    decl = as_declaration(declared, f"{entry}: declared")
    return decl, f"given: {decl}"
