"""The ``coverage`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

from qcheck.checks.harness import assertion
from qcheck.layers.moe import MoE
from qcheck.recipes import Recipe, get_recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("every matmul but the router, the combine and the dropping masks takes quantized operands (the figure: how "
       "many; `qcheck coverage` prints the map); with an fp8_target, every fp8 cast, forward and backward, is a "
       "type that hardware multiplies")


def assert_layer_quantized(layer: MoE, x, *, label: str = ""):
    """Every matmul of ``layer`` but those it keeps in full precision by design takes quantized operands.

    Tracing only: the coverage map of the layer's forward pass
    (:func:`qcheck.coverage`), with the router, the combine and the dropping
    masks (``qcheck.layers.moe.UNQUANTIZED_BY_DESIGN``) skipped. It sees a single call
    site that multiplies in full precision on one path, which ``tracks`` cannot.
    """
    __tracebackhide__ = True
    from qcheck._coverage import assert_quantized, skip_functions
    from qcheck.layers.moe import UNQUANTIZED_BY_DESIGN

    try:
        return assert_quantized(layer, x, skip=skip_functions(*UNQUANTIZED_BY_DESIGN))
    except AssertionError as e:
        # assert_quantized names itself (it forwards every keyword to the traced function, so it takes no label=):
        # the label goes in front.
        if label:
            e.args = (f"{label}: {e.args[0] if e.args else ''}", *e.args[1:])
        raise


@assertion
def assert_layer_fp8_native(layer: MoE, x, recipe: Recipe, *, backward: bool = True, label: str = "") -> None:
    """The fp8 types ``layer``'s matmul operands are cast to, and those ``recipe`` declares, suit its target.

    Native to ``recipe.expect.fp8_target``, forward and backward; nothing to check
    without a target. Tracing only: one vjp trace (the forward pass alone
    without ``backward``). Folded into ``coverage``, not a column of its own:
    it reads the same coverage map of the same fresh layer, at the cost of a
    trace, and a recipe's flavour is a property of what its matmuls take.
    """
    __tracebackhide__ = True
    if recipe.expect.fp8_target is None:
        return
    from qcheck.checks import assert_fp8_dtypes_native, assert_recipe_fp8_native
    from qcheck.checks.harness import declared_operand_fp8_dtypes

    assert_recipe_fp8_native(recipe, label=label)
    if declared_operand_fp8_dtypes(recipe):  # else no fp8 type reaches an operand's chain (NVFP4)
        assert_fp8_dtypes_native(layer, x, target=recipe.expect.fp8_target, backward=backward, label=label)


def run(case: Case) -> int:
    """:func:`assert_layer_quantized` and :func:`assert_layer_fp8_native` on the case's fresh layer.

    Returns how many matmuls are quantized.
    """
    __tracebackhide__ = True
    layer, x = cases_mod.layer(case), cases_mod.layer_input(case.variant.model)
    records = assert_layer_quantized(layer, x, label=case.id)
    recipe = get_recipe(case.recipe)
    assert_layer_fp8_native(layer, x, recipe, backward=cases_mod.gradient_tiles(recipe, case.variant), label=case.id)
    if (quantized := sum(r.quantized for r in records)) == 0:
        raise AssertionError(f"{case.id}: no matmul of the layer is quantized ({len(records)} matmuls, all skipped)")
    return quantized


def applies(recipe: Recipe, variant: Variant) -> bool:
    return recipe.quantized
