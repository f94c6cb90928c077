"""gemma 4.0.1: the reader of its ``QuantizationAwareWrapper``."""

from __future__ import annotations

from typing import Any

from qcheck.libraries._declaration import Declaration, RoleFormat
from qcheck.libraries._library import Library

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


LIBRARY = Library(
    "gemma",
    reads="QuantizationAwareWrapper.method (INT8, NONE): weight-only, one scale per index of the kernel's last axis",
    reader=_gemma,
    packages=("gemma",),
)
