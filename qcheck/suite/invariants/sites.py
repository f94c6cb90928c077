"""The ``sites`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

from flax import nnx

from qcheck.checks.harness import assertion
from qcheck.layers.moe import MoE
from qcheck.recipes import ApplyRngs, Recipe, get_recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = "no two call sites share a wrapper or a state array; a recipe that never draws carries no RNG stream"


@assertion
def assert_sites_independent(layer: MoE, *, label: str = "") -> None:
    """No two call sites are the same object or share a quantization-state array.

    RNG streams are left out: under ``ApplyRngs.SHARED`` every site holds the
    caller's stream by design.
    """
    __tracebackhide__ = True
    owner: dict[int, str] = {}
    seen_sites: dict[int, str] = {}
    for name, site in layer.sites.items():
        if id(site) in seen_sites:
            raise AssertionError(f"sites {seen_sites[id(site)]!r} and {name!r} are one object")
        seen_sites[id(site)] = name
        for path, var in nnx.to_flat_state(nnx.state(site, nnx.Not(nnx.RngState))):
            key = id(var.get_raw_value())
            if key in owner:
                raise AssertionError(
                    f"sites {owner[key]!r} and {name!r} share state ({'.'.join(map(str, path))})"
                )
            owner[key] = name


@assertion
def assert_sites_carry_no_rng_stream(layer: MoE, *, label: str = "") -> None:
    """The call sites of a recipe that never draws (ApplyRngs.NONE) hold no RNG stream.

    A stream kept anyway is the seed's cost: RNG state in the compiled step, once per site per layer.
    """
    __tracebackhide__ = True
    if carrying := [name for name, site in layer.sites.items() if nnx.state(site, nnx.RngState)]:
        raise AssertionError(
            f"sites {carrying} of a recipe that never draws carry RNG streams (forked per site?)")


def run(case: Case) -> None:
    """:func:`assert_sites_independent` on the case's fresh layer; no streams if the recipe never draws."""
    __tracebackhide__ = True
    layer = cases_mod.layer(case)
    assert_sites_independent(layer, label=case.id)
    if get_recipe(case.recipe).apply_rngs is ApplyRngs.NONE:
        assert_sites_carry_no_rng_stream(layer, label=case.id)


def applies(recipe: Recipe, variant: Variant) -> bool:
    return recipe.quantized
