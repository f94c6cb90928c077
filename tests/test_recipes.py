"""The recipe registry and what each built-in recipe declares."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import qcheck
from qcheck.recipes import ApplyRngs, Expect, Recipe, Reference, Unsupported


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
    assert recipe.reference.cast_dtype == (None if cast is None else np.dtype(cast))


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
    with pytest.raises(ValueError, match=r"^a recipe named 'fp8' is already registered; registered recipes: none, "
                                         r"int8, fp8, nanoo_fp8, nvfp4"):
        qcheck.register_recipe(qcheck.get_recipe("fp8"))
    with pytest.raises(TypeError, match="expects a qcheck.Recipe, got str"):
        qcheck.register_recipe("fp8")


def test_a_recipe_registered_for_a_block_should_be_gone_after_it_also_on_error():
    before = qcheck.recipe_names()
    planted = Recipe("planted_int8", lhs="int8", rhs="int8")
    with qcheck.registered(planted):
        assert qcheck.get_recipe("planted_int8") is planted
        qcheck.register_recipe(Recipe("planted_inside", lhs="int8", rhs="int8"))  # registered in the block: gone too
        assert qcheck.recipe_names() == (*before, "planted_int8", "planted_inside")
    assert qcheck.recipe_names() == before
    with pytest.raises(RuntimeError, match="a failing test"), qcheck.recipes.registered(planted):
        raise RuntimeError("a failing test")
    assert qcheck.recipe_names() == before


def test_a_recipe_registered_for_a_block_should_fail_on_a_name_already_taken():
    before = qcheck.recipe_names()
    taken = Recipe("fp8", lhs="e4m3fn", rhs="e4m3fn")
    with pytest.raises(ValueError, match=r"^a recipe named 'fp8' is already registered; registered recipes: none, "
                                         r"int8, fp8, nanoo_fp8, nvfp4(, \w+)*$"):
        with qcheck.registered(Recipe("planted_first", lhs="int8", rhs="int8"), taken):
            pytest.fail("the block ran")
    assert qcheck.recipe_names() == before and qcheck.get_recipe("fp8") is not taken  # the first unregistered


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"name": "Bad-Name"}, ValueError, "must match"),
        ({"apply_rngs": "shared"}, TypeError, "apply_rngs must be an ApplyRngs"),
        ({"expect": {"max_rel_norm": 0.3}}, TypeError, r"^expect must be a qcheck.Expect, got \{'max_rel_norm': 0.3\}$"),
        ({"reference": Expect()}, TypeError, r"^reference must be a qcheck.Reference, got Expect\("),
        ({"bogus": 1}, TypeError, r"unexpected keyword argument 'bogus'$"),
    ],
)
def test_recipe_constructor_validates(kwargs, error, message):
    args = {"name": "ok", "lhs": "int8", "rhs": "int8", **kwargs}
    with pytest.raises(error, match=message):
        Recipe(args.pop("name"), **args)


def _unsupported() -> Unsupported:
    return Unsupported(library="lib", kind="gradient", paths=("sparse",), reason="r", reproduce=lambda: None)


@pytest.mark.parametrize(
    "declaration, kwargs, error, message",
    [
        (Expect, {"max_rel_norm": 0.0}, ValueError, r"^max_rel_norm must lie in \(0, 1\), got 0.0$"),
        (Expect, {"max_rel_norm": "0.2"}, ValueError, r"^max_rel_norm must lie in \(0, 1\), got '0.2'$"),
        (Expect, {"max_grad_rel_norm": 1.5}, ValueError, r"^max_grad_rel_norm must lie in \(0, 1\), got 1.5$"),
        (Expect, {"fp8_target": "h100"}, ValueError, r"^unknown fp8_target 'h100'; valid fp8_targets: nvidia, mi300$"),
        (Expect, {"paths": "dense"}, TypeError, r"^paths must be a non-empty tuple of dense, sparse, got 'dense'$"),
        (Expect, {"paths": ()}, TypeError, r"^paths must be a non-empty tuple of dense, sparse, got \(\)$"),
        (Expect, {"paths": ("ragged",)}, ValueError, r"^unknown path 'ragged'; valid paths: dense, sparse$"),
        (Expect, {"backward_paths": "sparse"}, TypeError, r"^backward_paths must be a tuple of dense, sparse, got"),
        (Expect, {"backward_paths": ("both",)}, ValueError, r"^unknown path 'both'; valid paths: dense, sparse$"),
        (Expect, {"unsupported": (None,)}, TypeError,
         r"^unsupported must be a tuple of qcheck.recipes.Unsupported, got \(None,\)$"),
        (Expect, {"known_defects": (_unsupported(),)}, TypeError,
         r"^known_defects must be a tuple of qcheck.recipes.KnownDefect, got \(Unsupported\("),
        (Reference, {"matmul": "int"}, ValueError, r"^unknown matmul 'int'; valid matmuls: float, integer$"),
        (Reference, {"grad_operands": "originals"}, ValueError,
         r"^grad_operands must be one of quantized, original, got 'originals'$"),
        (Reference, {"cast_dtype": "e4m3"}, TypeError, r"^cast_dtype must be a numpy or ml_dtypes dtype, got 'e4m3'$"),
    ],
)
def test_declarations_validate_each_field(declaration, kwargs, error, message):
    with pytest.raises(error, match=message):
        declaration(**kwargs)


def test_declarations_normalise_what_they_accept():
    expect = Expect(max_rel_norm=np.float32(0.25), paths=["sparse"], unsupported=[_unsupported()])
    assert (expect.paths, type(expect.unsupported), expect.max_grad_rel_norm) == (("sparse",), tuple, 0.3)
    assert type(expect.max_rel_norm) is float and expect.max_rel_norm == 0.25
    assert Reference(cast_dtype=jnp.float8_e4m3fnuz).cast_dtype == np.dtype("float8_e4m3fnuz")
    with pytest.raises(dataclasses.FrozenInstanceError):
        expect.max_rel_norm = 0.5


def test_a_subclass_declares_by_class_attribute_and_an_argument_replaces_it():
    class Coarse(Recipe):
        expect = Expect(max_rel_norm=0.4, backward_paths=("dense",))
        reference = Reference(grad_operands="original")

    default, given = Coarse("coarse", lhs="int8", rhs="int8"), Coarse("fine", lhs="int8", rhs="int8", expect=Expect())
    assert (default.expect.max_rel_norm, default.expect.backward_paths) == (0.4, ("dense",))
    assert default.reference.grad_operands == "original"
    assert given.expect == Expect() and given.reference == Coarse.reference


def test_narrow_backward_keeps_only_the_paths_given():
    assert Expect().narrow_backward(("dense",)).backward_paths == ("dense",)
    assert Expect(backward_paths=("sparse",)).narrow_backward(("dense",)).backward_paths == ()
    assert Expect(max_rel_norm=0.3).narrow_backward(()) == Expect(max_rel_norm=0.3, backward_paths=())
    with pytest.raises(ValueError, match=r"^unknown path 'ragged'"):
        Expect().narrow_backward(("ragged",))


def test_a_recipe_without_formats_or_site_module_says_so():
    with pytest.raises(TypeError, match=r"Recipe 'bare' needs lhs= and rhs= formats \(one of int8, .*\), or a subclass"):
        Recipe("bare")
    with pytest.raises(TypeError, match="give both lhs= and rhs="):
        Recipe("half", lhs="int8")
    with pytest.raises(ValueError, match="unknown grad format 'e5m3'; valid grad formats: int8, e4m3fn"):
        Recipe("bad", lhs="int8", rhs="int8", grad="e5m3")


def test_a_declarative_recipe_fake_quantizes_operands_and_gradients():
    import jax

    recipe = Recipe("probe_mx", lhs="mxfp8", rhs="e4m3fn", grad="e5m2")
    site = recipe.site_module("wi_0")
    q = qcheck.formats.qdq
    lhs = np.linspace(-3, 3, 64 * 32, dtype=np.float32).reshape(64, 32)
    rhs = np.linspace(0.3, 0.7, 32 * 8, dtype=np.float32).reshape(32, 8)
    g = np.linspace(-1, 1, 64 * 8, dtype=np.float32).reshape(64, 8) * 1.37
    y, vjp = jax.vjp(lambda a, b: site.apply({}, "ab,bc->ac", a, b), lhs, rhs)
    ql, qr, qg = np.asarray(q(lhs, "mxfp8", axis=1)), np.asarray(q(rhs, "e4m3fn")), np.asarray(q(g, "e5m2"))
    assert np.array_equal(np.asarray(y), np.asarray(jnp.einsum("ab,bc->ac", ql, qr)))
    dlhs, drhs = (np.asarray(d) for d in vjp(g))
    # Gradient wiring, not an exact check: the transposed dot may sum in another order.
    np.testing.assert_allclose(dlhs, qg @ qr.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(drhs, ql.T @ qg, rtol=1e-6, atol=1e-6)
    assert not np.allclose(dlhs, g @ qr.T, rtol=1e-4)  # the gradient really was quantized
    assert recipe.apply_rngs is ApplyRngs.NONE and recipe.expect.max_rel_norm == 0.22


def test_plugin_recipes_come_from_entry_points():
    from qcheck.recipes import recipe_source

    # Entry points load in name order: qcheck's "adapters" before "fp8_current" and "mxfp8".
    assert [n for n in qcheck.recipe_names() if n in ("fp8_current", "mxfp8")] == ["fp8_current", "mxfp8"]
    assert repr(qcheck.get_recipe("mxfp8")) == "Recipe('mxfp8', lhs='mxfp8', rhs='mxfp8', grad='mxfp8')"
    assert recipe_source("mxfp8") is None  # installed, so `golden add` needs no --recipes


def test_nvfp4_declares_its_own_bound():
    assert 0.22 < qcheck.get_recipe("nvfp4").expect.max_rel_norm < 0.5
