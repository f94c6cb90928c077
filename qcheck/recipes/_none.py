"""The unquantized recipe: every layer's reference twin."""

from __future__ import annotations

from flax import linen as nn

from qcheck.recipes._base import ApplyRngs, Recipe
from qcheck.recipes._plain import PlainSite


class NoQuant(Recipe):
    def __init__(self, name: str = "none"):
        super().__init__(name, apply_rngs=ApplyRngs.NONE)

    @property
    def quantized(self) -> bool:
        return False

    def site_module(self, name: str) -> nn.Module:
        return PlainSite()
