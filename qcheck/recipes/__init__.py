"""Quantization recipes and their registry.

Built-in recipes register themselves on import; users add their own with
:func:`register_recipe`.
"""

from qcheck.recipes._base import ApplyRngs, Recipe, get_recipe, recipe_names, register_recipe
from qcheck.recipes._fp8 import DelayedScalingFp8, fp8, nanoo_fp8
from qcheck.recipes._int8 import Int8
from qcheck.recipes._none import NoQuant
from qcheck.recipes._nvfp4 import NVFP4

__all__ = [
    "ApplyRngs",
    "DelayedScalingFp8",
    "Int8",
    "NVFP4",
    "NoQuant",
    "Recipe",
    "get_recipe",
    "recipe_names",
    "register_recipe",
]

for _recipe in (NoQuant(), Int8(), fp8(), nanoo_fp8(), NVFP4()):
    register_recipe(_recipe)
del _recipe
