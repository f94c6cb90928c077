"""qcheck: tiny quantized MoE layers in JAX/Flax, and numerical invariants that can fail.

The public names load lazily, so ``import qcheck`` (and the pytest plugin that
pytest loads in every session) stays cheap until JAX is actually needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Every assertion of qcheck.checks is also offered here, the same function under the same name.
# tests/test_public_api.py holds this and keeps _WHERE and TYPE_CHECKING in step with __all__.
__all__ = [
    "MODELS",
    "PATHS",
    "ApplyRngs",
    "Expect",
    "InterceptRecipe",
    "KernelRoles",
    "KnownDefect",
    "LayerFigures",
    "MatmulRecord",
    "MoE",
    "MoEConfig",
    "QuantSite",
    "Recipe",
    "Reference",
    "Skip",
    "Unsupported",
    "UserCodeError",
    "assert_amax_histories_follow_operands",
    "assert_format_matches_referee",
    "assert_fp8_dtypes_native",
    "assert_fp8_state_matches",
    "assert_fresh_cast_exact",
    "assert_layer_sites_backward_exact",
    "assert_layer_sites_exact",
    "assert_moe_matches_referee",
    "assert_native_matches_emulation",
    "assert_no_recompiles",
    "assert_no_uninitialized_reads",
    "assert_quantized",
    "assert_ragged_groups_independent",
    "assert_recipe_fp8_native",
    "assert_site_backward_exact",
    "assert_site_exact",
    "assert_tracks",
    "build_decoder",
    "build_moe",
    "check_layer",
    "checks",
    "copy_params_into",
    "coverage",
    "format_coverage",
    "formats",
    "fp8_state",
    "get_recipe",
    "native",
    "recipe_names",
    "referees",
    "register_recipe",
    "registered",
    "skip_at",
    "skip_functions",
    "skip_modules",
    "skip_where",
    "train",
    "warmed_up",
    "weights",
]

_WHERE = {
    "assert_amax_histories_follow_operands": "qcheck.checks",
    "assert_fp8_dtypes_native": "qcheck.checks",
    "assert_fp8_state_matches": "qcheck.checks",
    "assert_format_matches_referee": "qcheck.checks",
    "assert_fresh_cast_exact": "qcheck.checks",
    "assert_layer_sites_backward_exact": "qcheck.checks",
    "assert_layer_sites_exact": "qcheck.checks",
    "assert_moe_matches_referee": "qcheck.checks",
    "assert_native_matches_emulation": "qcheck.checks",
    "assert_no_recompiles": "qcheck.checks",
    "assert_no_uninitialized_reads": "qcheck.checks",
    "assert_quantized": "qcheck.checks",
    "assert_ragged_groups_independent": "qcheck.checks",
    "assert_recipe_fp8_native": "qcheck.checks",
    "assert_site_backward_exact": "qcheck.checks",
    "assert_site_exact": "qcheck.checks",
    "assert_tracks": "qcheck.checks",
    "MODELS": "qcheck.layers.moe",
    "PATHS": "qcheck.layers.moe",
    "MoE": "qcheck.layers.moe",
    "MoEConfig": "qcheck.layers.moe",
    "build_moe": "qcheck.layers.moe",
    "build_decoder": "qcheck.layers.decoder",
    "QuantSite": "qcheck.layers.bridge",
    "ApplyRngs": "qcheck.recipes",
    "Recipe": "qcheck.recipes",
    "Expect": "qcheck.recipes",
    "Reference": "qcheck.recipes",
    "InterceptRecipe": "qcheck.recipes",
    "KnownDefect": "qcheck.recipes",
    "Unsupported": "qcheck.recipes",
    "get_recipe": "qcheck.recipes",
    "recipe_names": "qcheck.recipes",
    "register_recipe": "qcheck.recipes",
    "registered": "qcheck.recipes",
    "MatmulRecord": "qcheck._coverage",
    "KernelRoles": "qcheck._coverage",
    "coverage": "qcheck._coverage",
    "format_coverage": "qcheck._coverage",
    "skip_functions": "qcheck._coverage",
    "skip_modules": "qcheck._coverage",
    "skip_at": "qcheck._coverage",
    "skip_where": "qcheck._coverage",
    "Skip": "qcheck._coverage",
    "warmed_up": "qcheck._coverage",
    "weights": "qcheck._coverage",
    "UserCodeError": "qcheck._errors",
    "LayerFigures": "qcheck.checks",
    "check_layer": "qcheck.checks",
    "copy_params_into": "qcheck.checks",
    "fp8_state": "qcheck.checks",
    "train": "qcheck.layers.trainer",
}

if TYPE_CHECKING:
    from qcheck.checks import (assert_amax_histories_follow_operands, assert_fp8_dtypes_native,
                               assert_fp8_state_matches, assert_format_matches_referee, assert_fresh_cast_exact,
                               assert_layer_sites_backward_exact, assert_layer_sites_exact,
                               assert_moe_matches_referee, assert_native_matches_emulation,
                               assert_no_recompiles, assert_no_uninitialized_reads, assert_quantized,
                               assert_ragged_groups_independent, assert_recipe_fp8_native, assert_site_backward_exact,
                               assert_site_exact, assert_tracks)
    from qcheck import checks, formats, native, referees
    from qcheck.checks import LayerFigures, check_layer, copy_params_into, fp8_state
    from qcheck._coverage import (KernelRoles, MatmulRecord, Skip, coverage, format_coverage, skip_at,
                                  skip_functions, skip_modules, skip_where, warmed_up, weights)
    from qcheck._errors import UserCodeError
    from qcheck.layers.trainer import train
    from qcheck.layers.bridge import QuantSite
    from qcheck.layers.decoder import build_decoder
    from qcheck.layers.moe import MODELS, PATHS, MoE, MoEConfig, build_moe
    from qcheck.recipes import (ApplyRngs, Expect, InterceptRecipe, KnownDefect, Recipe, Reference, Unsupported,
                                get_recipe, recipe_names, register_recipe, registered)


def __getattr__(name: str):
    if name in _WHERE or name in ("checks", "formats", "native", "referees"):
        from qcheck._versions import require_supported

        require_supported()
    if name in ("checks", "formats", "native", "referees"):
        return importlib.import_module(f"qcheck.{name}")
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'qcheck' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
