"""The ``rng`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

import functools

from qcheck.checks import assert_rng_state_flat, harness
from qcheck.checks.harness import assertion, judged_as
from qcheck.layers import step
from qcheck.recipes import ApplyRngs, Recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = ("the train step's u32 entry parameters stay flat at 1, 2 and 8 layers, at the unquantized stack's count "
       "(recipes that share a stream; control: forced PRIVATE grows; the figure: the count)")


#: Depths of the unrolled decoder whose train steps the RNG invariant compares.
RNG_DEPTHS = (1, 2, 8)


#: The PRIVATE control only has to show growth; two depths do, at a third of the tracing.
RNG_CONTROL_DEPTHS = (1, 2)


def rng_entry_params(
    model: str, recipe: str, *, depths=RNG_DEPTHS, apply_rngs: ApplyRngs | None = None
) -> dict[int, dict[str, int]]:
    """Entry parameters of the jitted train step of an unrolled decoder, per depth."""
    return {n: dict(s.entry_params) for n, s in rng_states(model, recipe, depths=depths, apply_rngs=apply_rngs).items()}


def rng_states(
    model: str, recipe: str, *, depths=RNG_DEPTHS, apply_rngs: ApplyRngs | None = None
) -> dict[int, harness.StepRngState]:
    """The RNG state entering the train step of an unrolled decoder, per depth, as ``assert_rng_state_flat``
    counts it on a user's step."""
    return {n: _step_rng_state(model, recipe, n, apply_rngs) for n in depths}


@functools.cache
def _step_rng_state(model: str, recipe: str, layers: int, apply_rngs: ApplyRngs | None) -> harness.StepRngState:
    stack = cases_mod.decoder(model, recipe, layers, apply_rngs=apply_rngs)
    # Lowered, not compiled: the parameters are read off the lowered module (the suite holds both to agree).
    lowered = step.lower_train_step(*step.split_for_step(stack), cases_mod.layer_input(model))
    return harness.step_rng_state(lowered, stack)


@assertion
def assert_rng_state_grows(u32_by_depth: dict[int, int], *, label: str = "") -> None:
    """Control: with a private stream per site, u32 entry parameters strictly grow with depth."""
    __tracebackhide__ = True
    counts = [u32_by_depth[n] for n in sorted(u32_by_depth)]
    if not all(a < b for a, b in zip(counts, counts[1:])):
        raise AssertionError(
            f"forced PRIVATE, u32 entry parameters should grow with depth but are "
            f"{u32_by_depth}; the measurement is not seeing per-site streams"
        )


@assertion
def assert_rng_state_matches_twin(u32: int, twin_u32: int, *, label: str = "") -> int:
    """A recipe that shares the caller's stream adds no RNG state: the step's u32 entry parameters are the twin's.

    ``twin_u32``: the unquantized stack's at the same depth (its own stream's
    key and count). Flatness over depth does not see one stream made for the
    whole stack (a fork of the caller's stream every site shares): flat, but a
    stream that is not the caller's. Returns ``u32``.
    """
    __tracebackhide__ = True
    if u32 != twin_u32:
        raise AssertionError(
            f"the train step carries {u32} u32 entry parameters, the unquantized stack's {twin_u32}: "
            "RNG state beyond the caller's stream (a stream of the sites' own, shared across layers?)")
    return u32


def run(case: Case) -> int:
    """The recipe's own RNG mode keeps step RNG state flat over 1/2/8 layers, at the unquantized twin's; forced
    PRIVATE grows."""
    __tracebackhide__ = True
    model, label = case.variant.model, f"{case.recipe}-{case.variant.model}"

    # The public check's judgement: the train step's u32 entry parameters and the stack's RNG leaves flat.
    flat = judged_as(assert_rng_state_flat, harness.judge_rng_state_flat, rng_states(model, case.recipe),
                     label=label).u32
    private = rng_states(model, case.recipe, depths=RNG_CONTROL_DEPTHS, apply_rngs=ApplyRngs.PRIVATE)
    assert_rng_state_grows({n: s.u32 for n, s in private.items()}, label=f"{label} (private control)")
    # Flat, and no more than the unquantized stack carries: the caller's one stream. Traced, not compiled, and
    # cached per model (_step_rng_state): one twin per model and process, whatever the recipe.
    twin = rng_entry_params(model, "none", depths=(1,))[1].get("u32", 0)
    return assert_rng_state_matches_twin(flat, twin, label=case.id)


#: The RNG invariant runs on these models' plain dense layer. Streams reach a
#: layer only through its call sites, which both models build with the same code
#: (Gemma differs in its router, expert count and activation, none of which
#: draws), so Gemma's decoders would trace five more stacks (up to 8 layers) to
#: measure the same plumbing.
RNG_MODELS = ("mixtral",)


def applies(recipe: Recipe, variant: Variant) -> bool:
    # For recipes that draw from a shared stream. Recipes that never draw are held
    # to carrying no stream at all by `sites`, and their u32 entry parameters are
    # pinned by their golden cases.
    return (recipe.apply_rngs is ApplyRngs.SHARED and variant.model in RNG_MODELS
            and variant == Variant(variant.model, "dense", False))
