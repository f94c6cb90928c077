"""EasyDeL 0.3.0: its machinery (ejkernel's kernels, jaxtyping's checks around them) and the reader of its
``QuantizationConfig``."""

from __future__ import annotations

from typing import Any

from qcheck.libraries._declaration import Declaration, RoleFormat, Stored
from qcheck.libraries._library import Library


#: EasyDeL's QuantizationType values qcheck has a format of (at 8 bits, their default): INT8 is ejkernel's affine mode.
FORMATS = {"int8": "int8_easydel"}


def _easydel(layer: Any) -> Declaration | str | None:
    """EasyDeL 0.3.0's ``QuantizationConfig`` (easydel/layers/quantization/_configs.py), which ``model.quantize``
    records as ``config.quantization_config`` on the model's config, the config every one of its modules holds.

    None: the model is float. Every dtype it offers is ejkernel's packed weight-only codes dequantized into a float
    matmul (ejkernel's quantized_matmul): INT8/AFFINE are affine (four 8-bit codes to a uint32, a float16 scale and a
    float16 zero point per group), NF4/MXFP4/NVFP4/MXFP8/NVFP8 a code and a scale per group. INT8 is qcheck's
    ``int8_easydel`` (held bitwise to EasyDeL's quantizer, tests/test_easydel.py); the others have no qcheck
    format. A model or block is recognised and not read, saying why: ``model.quantize`` leaves its experts float
    whatever the config says (tests/test_easydel.py), so no one declaration holds a block. Each quantized
    projection is read on its own (:func:`_projection`).
    """
    if not any(c.__module__.startswith("easydel.") for c in type(layer).__mro__):
        return None
    if any(c.__name__ == "ParallelLinearQuantized" for c in type(layer).__mro__):
        return _projection(layer)
    config = getattr(layer, "config", None)
    if config is None or not hasattr(config, "quantization_config"):
        return None
    quantization = config.quantization_config
    if quantization is None:
        return Declaration({"weights": None, "activations": None}, "EasyDeL config.quantization_config=None")
    dtype = getattr(quantization.dtype, "value", quantization.dtype)
    config = (f"EasyDeL QuantizationConfig(dtype={dtype!r}, group_size={quantization.group_size}, "
              f"bits={quantization.bits})")
    fmt = FORMATS.get(dtype) if quantization.bits in (None, 8) else None
    if fmt is not None:
        return (f"{config} is {fmt} on its quantized projections, each read on its own (check_layer on one, "
                f"beside its float twin, holds its packed codes), but model.quantize leaves the experts float: "
                f"no one declaration holds the model or a block")
    return f"{config} is ejkernel's packed {dtype} weights, which have no qcheck format yet"


def _projection(layer: Any) -> Declaration | str:
    """One quantized linear of EasyDeL 0.3.0 (easydel/layers/linears/_linear_quantized.py), which keeps its
    ``QuantizationConfig`` as ``config``: INT8 at 8 bits is int8_easydel at its ``group_size``, weight-only (its
    input reaches ejkernel's matmul unquantized), its ``kernel`` stored as ``quant_kernel`` (the codes four to a
    uint32 along the output axis, which the groups also run along), ``quant_scales`` and ``quant_biases`` (the
    float16 zero points): check_layer holds them bitwise against the float twin's ``kernel``."""
    quantization = layer.config
    dtype = getattr(quantization.dtype, "value", quantization.dtype)
    said = (f"EasyDeL {type(layer).__name__}(QuantizationConfig(dtype={dtype!r}, "
            f"group_size={quantization.group_size}, bits={quantization.bits}))")
    fmt = FORMATS.get(dtype) if quantization.bits in (None, 8) else None
    if fmt is None:
        return f"{said} is ejkernel's packed {dtype} weights, which have no qcheck format yet"
    stored = Stored("kernel", "quant_kernel", (1,), "quant_scales", "quant_biases", packed=1, scope="")
    return Declaration({"weights": RoleFormat(fmt, block=int(layer._ej_group_size)), "activations": None}, said,
                       stored_params={"kernel": stored})


LIBRARY = Library(
    "EasyDeL",
    reads="config.quantization_config, as model.quantize records it: None (float); a quantized model or block is "
          "not read, saying why; a quantized projection's own QuantizationConfig: INT8 at 8 bits is int8_easydel at "
          "its group size, weight only, its packed words, scales and zero points stored for check_layer to hold",
    reader=_easydel,
    # ejkernel's grouped and quantized matmuls, and jaxtyping's shape checks wrapped around them: without them an
    # expert's matmul is located at ejkernel/kernels/_xla/grouped_matmul/_xla_impl_fwd.py, not at EasyDeL's
    # easydel/layers/moe/_moe_module.py. EasyDeL's own modules are the model's code: not machinery.
    machinery=("ejkernel", "jaxtyping"),
    packages=("easydel",),
)
