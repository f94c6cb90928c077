"""Quantization recipes and their registry.

Built-in recipes register themselves on import; users add their own with
:func:`register_recipe`, an installed package's ``qcheck.recipes`` entry point,
or a module named with ``--recipes`` / ``--qcheck-recipes``.
"""

from qcheck.recipes._axes import MatmulAxes, einsum_axes
from qcheck.recipes._base import ApplyRngs, Recipe
from qcheck.recipes._declarations import DEFAULT_RECIPE_MAX_GRAD_REL_NORM, Expect, Reference
from qcheck.recipes._fp8 import DelayedScalingFp8
from qcheck.recipes._fp8 import fp8 as _fp8_recipe  # the built-ins' factories, not exported
from qcheck.recipes._fp8 import nanoo_fp8 as _nanoo_fp8_recipe
from qcheck.recipes._intercept import InterceptRecipe
from qcheck.recipes._matmul import (EINSUM_LAYOUTS, EINSUM_PARTIAL_SUMS, Einsum, Matmul, Ragged, as_matmul,
                                    uneven_group_sizes)
from qcheck.recipes._none import NoQuant
from qcheck.recipes._nvfp4 import NVFP4, NVFP4_MAX_GRAD_REL_NORM, NVFP4_MAX_REL_NORM
from qcheck.recipes._plain import UnquantizedSite
from qcheck.recipes._registry import (
    ENTRY_POINT_GROUP,
    get_recipe,
    import_recipes,
    is_builtin,
    recipe_names,
    recipe_source,
    register_recipe,
    registered,
)
from qcheck.recipes._sites import SiteOps
from qcheck.recipes._unsupported import UNSUPPORTED_KINDS, KnownDefect, Unsupported, assert_still_unsupported

__all__ = [
    "DEFAULT_RECIPE_MAX_GRAD_REL_NORM",
    "EINSUM_LAYOUTS",
    "EINSUM_PARTIAL_SUMS",
    "ENTRY_POINT_GROUP",
    "Einsum",
    "Expect",
    "KnownDefect",
    "ApplyRngs",
    "DelayedScalingFp8",
    "InterceptRecipe",
    "Matmul",
    "MatmulAxes",
    "NVFP4",
    "NVFP4_MAX_GRAD_REL_NORM",
    "NVFP4_MAX_REL_NORM",
    "NoQuant",
    "Ragged",
    "Recipe",
    "Reference",
    "SiteOps",
    "UNSUPPORTED_KINDS",
    "UnquantizedSite",
    "Unsupported",
    "as_matmul",
    "assert_still_unsupported",
    "einsum_axes",
    "get_recipe",
    "import_recipes",
    "is_builtin",
    "recipe_names",
    "recipe_source",
    "register_recipe",
    "registered",
    "uneven_group_sizes",
]

from qcheck.recipes import _registry

# AQT's int8 with preserve_max_val=True is declarative: per-slice absmax over the contraction axes,
# gradients straight through; PRIVATE streams, as AQT keeps them upstream.
_INT8 = Recipe("int8", lhs="int8", rhs="int8", apply_rngs=ApplyRngs.PRIVATE)

for _recipe in (NoQuant(), _INT8, _fp8_recipe(), _nanoo_fp8_recipe(), NVFP4()):
    _registry.register_builtin(_recipe)
del _recipe
