"""EasyDeL 0.3.0: its machinery (ejkernel's kernels, jaxtyping's checks around them) and the reader of its
``QuantizationConfig``."""

from __future__ import annotations

from typing import Any

from qcheck.libraries._declaration import Declaration
from qcheck.libraries._library import Library


#: EasyDeL's QuantizationType values qcheck has a format of (at 8 bits, their default): INT8 is ejkernel's affine mode.
FORMATS = {"int8": "int8_easydel"}


def _easydel(layer: Any) -> Declaration | str | None:
    """EasyDeL 0.3.0's ``QuantizationConfig`` (easydel/layers/quantization/_configs.py), which ``model.quantize``
    records as ``config.quantization_config`` on the model's config, the config every one of its modules holds.

    None: the model is float. Every dtype it offers is ejkernel's packed weight-only codes dequantized into a float
    matmul (ejkernel's quantized_matmul): INT8/AFFINE are affine (four 8-bit codes to a uint32, a float16 scale and a
    float16 zero point per group), NF4/MXFP4/NVFP4/MXFP8/NVFP8 a code and a scale per group. INT8 is qcheck's
    ``int8_easydel`` (held bitwise to EasyDeL's quantizer, tests/test_easydel.py), but its site multiplies weights
    decoded from packed words inside ejkernel's matmul, which no stored hold pairs with its codes yet; the others
    have no qcheck format. So a quantized config is recognised and not read, saying why.
    """
    if not any(c.__module__.startswith("easydel.") for c in type(layer).__mro__):
        return None
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
        return (f"{config} is {fmt}, but as ejkernel's packed words (four codes to a uint32) decoded inside "
                f"its quantized matmul, which qcheck cannot pair with their codes yet")
    return f"{config} is ejkernel's packed {dtype} weights, which have no qcheck format yet"


LIBRARY = Library(
    "EasyDeL",
    reads="config.quantization_config, as model.quantize records it: None (float); a QuantizationConfig is "
          "ejkernel's packed codes (INT8's are int8_easydel), which no stored hold pairs yet (not read, saying so)",
    reader=_easydel,
    # ejkernel's grouped and quantized matmuls, and jaxtyping's shape checks wrapped around them: without them an
    # expert's matmul is located at ejkernel/kernels/_xla/grouped_matmul/_xla_impl_fwd.py, not at EasyDeL's
    # easydel/layers/moe/_moe_module.py. EasyDeL's own modules are the model's code: not machinery.
    machinery=("ejkernel", "jaxtyping"),
    packages=("easydel",),
)
