"""The ``referee`` invariant: qcheck's unquantized MoE layer computes its model's function, by the float64 referee.

Every other invariant compares a quantized layer with its unquantized twin, or
pins numbers a run of the same code wrote (golden): a bug in the layer code
both run moves both alike. Here the twin itself is held to
:func:`qcheck.referees.reference_moe`, written from the routers' definitions,
through the same role mapping and comparison a user's layer gets
(:func:`qcheck.checks.assert_moe_matches_referee`).
"""

from __future__ import annotations

import numpy as np

from qcheck import referees
from qcheck.checks import Figures
from qcheck.checks.harness import assertion, compare_with_referee, module_params, referee_weights
from qcheck.layers import step
from qcheck.layers.moe import MoE

#: qcheck's activation names as the referee's: its "gelu" is ``jax.nn.gelu(approximate=True)``, the tanh form.
REFEREE_ACTIVATIONS = {"silu": "silu", "gelu": "gelu_tanh"}


def referee_params(layer: MoE) -> dict[str, str]:
    """The referee's role of each of ``layer``'s parameters (``assert_moe_matches_referee``'s ``params``)."""
    roles = {"gate": "router", "wi_0": "gate", "wi_1": "up", "wo": "down"}
    if layer.config.router == "gemma":
        roles["per_expert_scale"] = "expert_scale"
    return roles


@assertion
def assert_layer_matches_referee(layer: MoE, x, *, rtol: float, atol: float, output: np.ndarray | None = None,
                                 label: str = "") -> Figures:
    """``layer``'s output on ``x`` (``output`` where already computed) is the referee's for its model.

    The style is the model's router, the activation its config's, and with
    token dropping the slots follow from the capacity factor by the referee's
    own rule (:func:`qcheck.referees.reference_capacity`), not the layer's.
    Returns the worst relative difference per token.
    """
    __tracebackhide__ = True
    c = layer.config
    got = np.asarray(step.apply(layer, x)[0]) if output is None else output
    w = referee_weights(module_params(layer), referee_params(layer), style=c.router, emb=c.emb)
    capacity = (referees.reference_capacity(x.shape[1], c.top_k, c.num_experts, layer.capacity_factor)
                if layer.capacity_factor > 0 else None)
    return compare_with_referee(got, x, w, style=c.router, top_k=c.top_k,
                                activation=REFEREE_ACTIVATIONS[c.activation], capacity=capacity, rtol=rtol, atol=atol)
