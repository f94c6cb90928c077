"""The recipe registry and what each built-in recipe declares."""

import jax.numpy as jnp
import numpy as np
import pytest

import qcheck
from qcheck.recipes import ApplyRngs, Recipe


def test_builtin_recipes_are_registered_in_order():
    assert qcheck.recipe_names()[:5] == ("none", "int8", "fp8", "nanoo_fp8", "nvfp4")


@pytest.mark.parametrize(
    "name, mode, cast",
    [
        ("none", ApplyRngs.NONE, None),
        ("int8", ApplyRngs.PRIVATE, None),
        ("fp8", ApplyRngs.NONE, jnp.float8_e4m3fn),
        ("nanoo_fp8", ApplyRngs.NONE, jnp.float8_e4m3fnuz),
        ("nvfp4", ApplyRngs.SHARED, None),
    ],
)
def test_builtin_recipe_declarations(name, mode, cast):
    recipe = qcheck.get_recipe(name)
    assert recipe.apply_rngs is mode
    assert recipe.cast_dtype == (None if cast is None else np.dtype(cast))


def test_nanoo_fp8_quantizes_gradients_to_e5m2fnuz():
    site = qcheck.get_recipe("nanoo_fp8").site_module("wi_0")
    assert (site.e4m3_dtype, site.e5m2_dtype) == (jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)
    assert site.amax_history_length == 1024


def test_get_recipe_unknown_name_lists_registered():
    with pytest.raises(ValueError, match=r"unknown recipe 'fp9'; registered recipes: none, int8, fp8"):
        qcheck.get_recipe("fp9")
    with pytest.raises(ValueError, match="unknown recipe 3"):
        qcheck.get_recipe(3)


def test_register_recipe_rejects_duplicates_and_non_recipes():
    with pytest.raises(ValueError, match="'fp8' is already registered"):
        qcheck.register_recipe(qcheck.get_recipe("fp8"))
    with pytest.raises(TypeError, match="expects a qcheck.Recipe, got str"):
        qcheck.register_recipe("fp8")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "Bad-Name"}, "must match"),
        ({"max_rel_norm": 0.0}, r"max_rel_norm must lie in \(0, 1\)"),
        ({"apply_rngs": "shared"}, "apply_rngs must be an ApplyRngs"),
    ],
)
def test_recipe_constructor_validates(kwargs, message):
    args = {"name": "ok", **kwargs}
    with pytest.raises((ValueError, TypeError), match=message):
        Recipe(args.pop("name"), **args)


def test_a_recipe_without_site_module_says_so():
    with pytest.raises(NotImplementedError, match=r"Recipe must define site_module\(name\)"):
        Recipe("bare").site_module("wi_0")


def test_nvfp4_declares_its_own_bound():
    assert 0.22 < qcheck.get_recipe("nvfp4").max_rel_norm < 0.5
