"""Recording a golden case: running it now to produce the values its file pins.

What ``qcheck golden add/update`` writes (:mod:`qcheck.suite.golden.write`) and
what a check compares with the file (:mod:`qcheck.suite.golden.compare`): the
layer output and its relative norm against ``none``, what one call site fed its
matmul on a canonical einsum (traced from the site, not recomputed from the
recipe's declared formats), and the train step's entry parameters and
gradients. Everything comes from the case table's per-process caches
(:mod:`qcheck.suite.cases`), so recording a case the suite already ran costs
little.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from qcheck import checks
from qcheck.checks import harness
from qcheck.layers import step
from qcheck.recipes import get_recipe
from qcheck.suite import cases as cases_mod
from qcheck.suite._operands import site_operands
from qcheck.suite.cases import Case, Variant
from qcheck.suite.golden.store import CANONICAL_EQN, GoldenCase

__all__ = ["canonical_operands", "measure", "operand_codes", "train_step_entry_params"]


def canonical_operands(model: str) -> tuple[np.ndarray, np.ndarray]:
    """The canonical einsum's operands on ``model``: ``[4, emb]`` tokens, ``[emb, 32]`` weights.

    Four tokens of the layer input against the first 32 columns of expert 0's
    first input projection (the same weights for every recipe and path).
    """
    x = np.asarray(cases_mod.layer_input(model))[0, :4]
    w = np.asarray(cases_mod.layer(Case("none", Variant(model, "dense", False))).wi_0[...])[0, :, :32]
    return x, w


@functools.cache
def operand_codes(recipe_name: str, model: str) -> dict[str, np.ndarray]:
    """What the recipe's fresh ``wi_0`` site fed its matmul on the canonical einsum's operands.

    Taken from the site itself (:func:`qcheck.suite._operands.site_operands`),
    not recomputed from the recipe's declared formats: ``lhs``/``rhs`` are the
    operands the matmul received, bitwise (codes times scales), and
    ``<side>.<dtype>`` the narrow values (codes, block scales) computed on the
    way, so a plug-in that quantizes otherwise than it declares, or declares
    nothing, records what it does.
    """
    lhs, rhs = canonical_operands(model)
    site = cases_mod.layer(Case(recipe_name, Variant(model, "dense", False))).get_einsum("wi_0")
    return site_operands(site, CANONICAL_EQN, lhs, rhs)


@functools.cache
def train_step_entry_params(case: Case) -> dict[str, int]:
    """Entry parameters of the case's jitted train step, read off its lowering.

    Lowers the same jitted function the suite runs, so a step already traced is not traced again.
    """
    graphdef, params, meta, rest = step.split_for_step(cases_mod.layer(case))
    lowered = step.lower_train_step(graphdef, params, meta, rest, cases_mod.layer_input(case.variant.model))
    return harness.lowered_entry_params(lowered)


def measure(case: GoldenCase) -> dict[str, Any]:
    """The values a golden case pins, measured now: output, codes, rel_norm, entry params, gradients.

    Where the recipe cannot train on the variant
    (:func:`qcheck.suite.cases.train_step_runs`) there is no train step:
    its entry parameters and gradients are recorded as empty.
    """
    recipe = get_recipe(case.recipe)
    output = cases_mod.layer_output(case.case)
    rel = checks.rel_norm(output, cases_mod.layer_output(case.case.reference)) if recipe.quantized else 0.0
    trains = cases_mod.train_step_runs(recipe, case.variant)
    return {
        "rel_norm": rel,
        "entry_params": train_step_entry_params(case.case) if trains else {},
        "output": output,
        "codes": operand_codes(case.recipe, case.model),
        "grads": cases_mod.grad_leaves(cases_mod.layer_step(case.case).grads) if trains else {},
    }
