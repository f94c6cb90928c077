"""qcheck: tiny quantized MoE layers in JAX/Flax, and numerical invariants that can fail.

The public names load lazily, so ``import qcheck`` (and the pytest plugin that
pytest loads in every session) stays cheap until JAX is actually needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: Every public name of qcheck -> the module it loads from on first use: the one table. ``__all__`` is its keys
#: and ``__getattr__`` loads from it (a name whose module is ``qcheck`` is a subpackage). The imports under
#: TYPE_CHECKING say the same for type checkers and IDEs: tests/test_public_api.py holds them to this table,
#: name and module, and holds that every assertion of qcheck.checks is offered here.
_WHERE: dict[str, str] = {
    # every assert_* of qcheck.checks, the same function under the same name; check_layer and what it reads
    "assert_amax_histories_follow_operands": "qcheck.checks",
    "assert_format_matches_referee": "qcheck.checks",
    "assert_fp8_dtypes_native": "qcheck.checks",
    "assert_fp8_state_matches": "qcheck.checks",
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
    "assert_rng_state_flat": "qcheck.checks",
    "assert_site_backward_exact": "qcheck.checks",
    "assert_site_exact": "qcheck.checks",
    "assert_tracks": "qcheck.checks",
    "check_layer": "qcheck.checks",
    "copy_params_into": "qcheck.checks",
    "fp8_state": "qcheck.checks",
    "LayerFigures": "qcheck.checks",
    "RngStateFigures": "qcheck.checks",
    # the coverage map, its records and skips
    "coverage": "qcheck._coverage",
    "format_coverage": "qcheck._coverage",
    "KernelRoles": "qcheck._coverage",
    "MatmulRecord": "qcheck._coverage",
    "Skip": "qcheck._coverage",
    "skip_at": "qcheck._coverage",
    "skip_functions": "qcheck._coverage",
    "skip_modules": "qcheck._coverage",
    "skip_where": "qcheck._coverage",
    "warmed_up": "qcheck._coverage",
    "weights": "qcheck._coverage",
    "UserCodeError": "qcheck._errors",
    # the libraries qcheck reads a stack through, and their registry
    "Library": "qcheck.libraries",
    "register_library": "qcheck.libraries",
    "registered_libraries": "qcheck.libraries",
    # recipes and their registry
    "ApplyRngs": "qcheck.recipes",
    "Expect": "qcheck.recipes",
    "InterceptRecipe": "qcheck.recipes",
    "KnownDefect": "qcheck.recipes",
    "Recipe": "qcheck.recipes",
    "Reference": "qcheck.recipes",
    "Unsupported": "qcheck.recipes",
    "get_recipe": "qcheck.recipes",
    "recipe_names": "qcheck.recipes",
    "register_recipe": "qcheck.recipes",
    "registered": "qcheck.recipes",
    # qcheck's own layers and trainer
    "MODELS": "qcheck.layers.moe",
    "PATHS": "qcheck.layers.moe",
    "MoE": "qcheck.layers.moe",
    "MoEConfig": "qcheck.layers.moe",
    "build_moe": "qcheck.layers.moe",
    "build_decoder": "qcheck.layers.decoder",
    "QuantSite": "qcheck.layers.bridge",
    "train": "qcheck.layers.trainer",
    # subpackages
    "checks": "qcheck",
    "formats": "qcheck",
    "native": "qcheck",
    "referees": "qcheck",
}

__all__ = sorted(_WHERE)

if TYPE_CHECKING:  # the table above, for type checkers: one import per module, each name its row's
    from qcheck import checks, formats, native, referees
    from qcheck._coverage import (KernelRoles, MatmulRecord, Skip, coverage, format_coverage, skip_at,
                                  skip_functions, skip_modules, skip_where, warmed_up, weights)
    from qcheck._errors import UserCodeError
    from qcheck.checks import (LayerFigures, RngStateFigures, assert_amax_histories_follow_operands, assert_format_matches_referee,
                               assert_fp8_dtypes_native, assert_fp8_state_matches, assert_fresh_cast_exact,
                               assert_layer_sites_backward_exact, assert_layer_sites_exact,
                               assert_moe_matches_referee, assert_native_matches_emulation, assert_no_recompiles,
                               assert_no_uninitialized_reads, assert_quantized, assert_ragged_groups_independent,
                               assert_recipe_fp8_native, assert_rng_state_flat, assert_site_backward_exact,
                               assert_site_exact, assert_tracks, check_layer, copy_params_into, fp8_state)
    from qcheck.layers.bridge import QuantSite
    from qcheck.layers.decoder import build_decoder
    from qcheck.layers.moe import MODELS, PATHS, MoE, MoEConfig, build_moe
    from qcheck.layers.trainer import train
    from qcheck.libraries import Library, register_library, registered_libraries
    from qcheck.recipes import (ApplyRngs, Expect, InterceptRecipe, KnownDefect, Recipe, Reference, Unsupported,
                                get_recipe, recipe_names, register_recipe, registered)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'qcheck' has no attribute {name!r}")
    from qcheck._versions import require_supported

    require_supported()
    if where == __name__:  # a subpackage: importing it binds it here, so this runs once
        return importlib.import_module(f"{__name__}.{name}")
    return getattr(importlib.import_module(where), name)


def __dir__() -> list[str]:
    return sorted(__all__)
