"""Where a layer's own library states its quantization: the declaration read from the layer.

One row per library: what is read, and the declaration it gives
(:data:`READERS`). ``check_layer`` reads a layer's declaration here when its
caller gives none, and says in its figures what it read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qcheck._coverage._declared import Declaration, RoleFormat, as_declaration

__all__ = ["READERS", "read_declaration"]

#: MaxText 0.2.5's ``config.quantization`` on its AQT/Flax path (``use_qwix_quantization=False``):
#: ``int8`` is AQT v2 ``config_v3(fwd_bits=8)``, whose forward codes are qcheck's ``int8_aqt``
#: (maxtext/layers/quantizations.py:636); ``fp8`` and ``nanoo_fp8`` are Flax's delayed-scaling
#: e4m3fn / e4m3fnuz ops, at scale 1 on a fresh layer.
MAXTEXT_AQT = {
    "int8": {"activations": "int8_aqt", "weights": "int8_aqt"},
    "fp8": {"activations": "e4m3fn", "weights": "e4m3fn"},
    "nanoo_fp8": {"activations": "e4m3fnuz", "weights": "e4m3fnuz"},
}


def _qcheck_moe(layer: Any) -> Declaration | None:
    from qcheck.layers.moe import MoE

    if isinstance(layer, MoE):
        decl = as_declaration(layer.recipe_name)
        return Declaration(decl.roles, f"the layer's recipe {layer.recipe_name!r}")
    return None


def _maxtext(layer: Any) -> Declaration | None:
    if not type(layer).__module__.startswith("maxtext."):
        return None
    config = getattr(layer, "config", None)
    quantization = getattr(config, "quantization", None)
    if not isinstance(quantization, str) or getattr(config, "use_qwix_quantization", False):
        return None
    if quantization == "":
        return Declaration({"weights": None, "activations": None}, "MaxText config.quantization=''")
    roles = MAXTEXT_AQT.get(quantization)
    if roles is None:
        return None
    return Declaration({k: RoleFormat(v) for k, v in roles.items()},
                       f"MaxText config.quantization={quantization!r}")


#: (library, what is read, reader): the first reader that returns a declaration wins.
READERS: tuple[tuple[str, str, Callable[[Any], Declaration | None]], ...] = (
    ("qcheck", "MoE.recipe_name: the recipe the layer was built with", _qcheck_moe),
    ("MaxText", "config.quantization (int8, fp8, nanoo_fp8) with use_qwix_quantization off", _maxtext),
)


def read_declaration(layer: Any) -> Declaration | None:
    """The quantization ``layer``'s library declares on it (:data:`READERS`), or None where none is read."""
    for _, _, reader in READERS:
        if (decl := reader(layer)) is not None:
            return decl
    return None
