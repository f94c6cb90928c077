"""The ``state`` invariant: what it holds (``doc``), where (``applies``), and its checks (``run``)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from qcheck.checks.harness import assertion
from qcheck.layers import step
from qcheck.layers.bridge import Fp8Meta
from qcheck.layers.moe import MoE
from qcheck.recipes import Recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import Case, Variant

#: What the invariant holds, in one line (the CLI's help and the README's table show it).
doc = "fp8 scales and amax histories move only in the backward pass"


def fp8_meta_leaves(state: nnx.State) -> dict[str, np.ndarray]:
    """The fp8 scales and amax histories in ``state``, by dotted path."""
    return {
        ".".join(map(str, path)): np.asarray(v.get_value())
        for path, v in nnx.to_flat_state(nnx.filter_state(state, Fp8Meta))
    }


def _unmoved(before: dict[str, np.ndarray], after: dict[str, np.ndarray], suffix: str) -> list[str]:
    return [k for k in before if k.endswith(suffix) and np.array_equal(before[k], after[k])]


def run(case: Case) -> None:
    """:func:`assert_fp8_state_moves_only_in_backward` on the case's fresh layer."""
    __tracebackhide__ = True
    layer = cases_mod.layer(case)
    assert_fp8_state_moves_only_in_backward(
        layer, cases_mod.layer_input(case.variant.model), label=case.id, first=cases_mod.layer_step(case)
    )


@assertion
def assert_fp8_state_moves_only_in_backward(
    layer: MoE, x, *, label: str = "", first: step.StepOutput | None = None
) -> None:
    """Fresh scales are 1 and histories 0; a forward pass moves none; backward passes move them all.

    The forward pass is the one inside the train step: its effect on the fp8
    variables is read right after the call, before gradients overwrite them.

    One backward pass writes every amax history. The scales it returns are still
    computed from the (empty) history the forward pass saw, so they move on the
    second step — delayed scaling, as in Flax and TransformerEngine.
    """
    __tracebackhide__ = True
    fresh = fp8_meta_leaves(nnx.state(layer))
    if not fresh:
        raise AssertionError("the layer has no fp8 scales or amax histories")
    wrong = [k for k, v in fresh.items() if not np.all(v == (1 if k.endswith("_scale") else 0))]
    if wrong:
        raise AssertionError(f"fresh layer has scales != 1 or histories != 0 at {wrong}")

    if first is None:  # the case table passes its cached step: one run per case
        first = step.train_step(layer, x)
    after_forward = fp8_meta_leaves(first.fp8_meta_after_forward)
    if moved := [k for k, v in after_forward.items() if not np.array_equal(v, fresh[k])]:
        raise AssertionError(f"a forward pass changed fp8 state at {moved}")

    if still := _unmoved(fresh, fp8_meta_leaves(first.fp8_meta), "_history"):
        raise AssertionError(f"one backward pass left amax histories unchanged at {still}")
    second = step.train_step(layer, x, fp8_meta=first.fp8_meta)
    if still := _unmoved(fresh, fp8_meta_leaves(second.fp8_meta), "_scale"):
        raise AssertionError(f"two backward passes left scales unchanged at {still}")


def applies(recipe: Recipe, variant: Variant) -> bool:
    return recipe.materialize_at_build
