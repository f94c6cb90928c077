"""The quantization libraries people ship, run through qcheck as recipes.

Flax's fp8 modules are always available (qcheck depends on Flax), and so are
JAX's own ``jax.nn.scaled_dot_general`` recipes (``jax_mxfp8``, ``jax_nvfp4``),
offered by :func:`installed_recipes` only where the backend lowers it (not CPU
on jax 0.10.2). AQT v2
(``pip install 'qcheck[aqt]'``) and qwix (``qcheck[qwix]``, an interception
recipe: qwix applied to the ``none`` layer's call sites) load on first use
of their names, so importing this package needs neither; without them those
names raise ImportError saying which extra to install.

Nothing here registers itself: build a recipe and pass it to
``qcheck.build_moe`` or ``qcheck.register_recipe``, or list it under the
``qcheck.recipes`` entry point of a package.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from qcheck.recipes import Recipe

from qcheck.adapters._flax import (
    FLAX_FP8_MODULES,
    FlaxFp8Recipe,
    flax_fp8,
    flax_fp8_recipe,
    flax_nanoo_fp8,
)
from qcheck.adapters._jax import JaxScaledDotRecipe, jax_mxfp8, jax_nvfp4, scaled_dot_general_runs
from qcheck.adapters._ragged import ragged_dot_from_einsum

__all__ = [
    "AQT_RAGGED",
    "AQT_RAGGED_NO_GRADIENT",
    "AQT_RAGGED_SHARED_SCALE",
    "FLAX_FP8_MODULES",
    "AqtRecipe",
    "FlaxFp8Recipe",
    "JaxScaledDotRecipe",
    "QwixRecipe",
    "aqt_int8",
    "aqt_int8_ragged",
    "aqt_recipe",
    "flax_fp8",
    "flax_fp8_recipe",
    "flax_nanoo_fp8",
    "installed_recipes",
    "jax_mxfp8",
    "jax_nvfp4",
    "qwix_int8",
    "qwix_quantize_model",
    "ragged_dot_from_einsum",
    "scaled_dot_general_runs",
]

_LAZY = {name: "qcheck.adapters._aqt" for name in ("AQT_RAGGED", "AQT_RAGGED_NO_GRADIENT", "AQT_RAGGED_SHARED_SCALE",
                                                   "AqtRecipe", "aqt_int8", "aqt_int8_ragged", "aqt_recipe")}
_LAZY["qwix_quantize_model"] = "qcheck.adapters._qwix"
_LAZY.update({name: "qcheck.adapters._qwix_recipe" for name in ("QwixRecipe", "qwix_int8")})

if TYPE_CHECKING:
    from qcheck.adapters._aqt import (AQT_RAGGED, AQT_RAGGED_NO_GRADIENT, AQT_RAGGED_SHARED_SCALE, AqtRecipe, aqt_int8, aqt_int8_ragged,
                                      aqt_recipe)
    from qcheck.adapters._qwix import qwix_quantize_model
    from qcheck.adapters._qwix_recipe import QwixRecipe, qwix_int8


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qcheck.adapters' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def installed_recipes() -> tuple[Recipe, ...]:
    """The ready adapter recipes whose library is installed, for a ``qcheck.recipes`` entry point.

    A library that is missing contributes nothing (qcheck's registry would
    otherwise fail for everyone without it); one that is installed but fails to
    import raises.
    """
    recipes: list[Recipe] = [flax_fp8(), flax_nanoo_fp8()]
    if scaled_dot_general_runs():  # jax 0.10.2 has no CPU lowering for it
        recipes += [jax_mxfp8(), jax_nvfp4()]
    if _has("aqt"):
        aqt = importlib.import_module("qcheck.adapters._aqt")
        recipes += [aqt.aqt_int8(), aqt.aqt_int8_ragged()]
    if _has("qwix"):
        recipes.append(importlib.import_module("qcheck.adapters._qwix_recipe").qwix_int8())
    return tuple(recipes)
