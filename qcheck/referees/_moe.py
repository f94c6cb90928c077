"""A float64 reference of the routed MoE layers people ship, in numpy, written from their definitions.

Every style routes each token to its ``top_k`` experts by the router's logits
``x @ router`` and sums the chosen experts' gated FFNs
``(act(x @ gate) * (x @ up)) @ down`` with the router's weights:

* ``"mixtral"`` (Mixtral of Experts, arXiv:2401.04088; HF ``MixtralSparseMoeBlock``):
  the weights are the softmax over the chosen k logits (HF takes the softmax
  over all experts and renormalises the chosen ones: the same numbers); SiLU.
* ``"gemma"`` (Gemma-4-style, as ``qcheck.layers.moe`` builds it): the softmax
  over all experts, the chosen k renormalised to sum to 1, then each multiplied
  by its expert's output scale (``expert_scale``); GELU, tanh approximation.
* ``"deepseek"`` (DeepSeekMoE, arXiv:2401.06066; HF ``DeepseekV2MoE``): the
  softmax over all experts, the chosen k taken as they are (``norm_topk_prob``
  renormalises them, as DeepSeek-V2-Lite's config does not), times
  ``routed_scaling_factor``; SiLU. DeepSeek-V3's sigmoid scores, selection
  bias and group-limited routing are not modelled.

Shared experts (any style; DeepSeek's point) are gated FFNs every token passes
through with weight 1, added to the routed sum; several stacked ones sum.

Ties: the chosen experts are the k largest logits, largest first; of equal
logits the lowest expert index wins, as ``jax.lax.top_k`` picks.

Capacity (token dropping): with ``capacity`` slots per expert per batch row,
each row's tokens claim their experts' slots in token order, a token's choices
in rank order; an assignment past its expert's last slot is dropped and its
weight contributes nothing, the token's other weights unchanged (no
renormalisation). Switch Transformer and MaxText drop by token order too;
GShard's top-2 serves every token's first choice before any second choice,
which this reference does not do. :func:`reference_capacity` gives the slots
of a capacity factor.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from qcheck.referees._choice import choice

MOE_STYLES = ("mixtral", "gemma", "deepseek")
#: ``gelu_tanh``: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), Gemma's (and ``jax.nn.gelu``'s default);
#: ``gelu``: the exact 0.5 x (1 + erf(x / sqrt 2)).
MOE_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_DEFAULT_ACTIVATION = {"mixtral": "silu", "gemma": "gelu_tanh", "deepseek": "silu"}
_erf = np.vectorize(math.erf, otypes=[np.float64])


MoEReference = collections.namedtuple(
    "MoEReference", ["output", "logits", "experts", "weights", "kept", "runner_up", "margin", "activation"])
MoEReference.__doc__ = """The reference's output and how it routed, per token (``...``: the input's leading axes).

``output`` [..., emb]; ``logits`` [..., experts] (x @ router); ``experts``
[..., top_k], the chosen, largest logit first; ``weights`` [..., top_k], their
combine weights (0 where dropped); ``kept`` [..., top_k], False where the
expert's capacity was full; ``runner_up`` [...], the (top_k + 1)-th expert (-1
when every expert is chosen); ``margin`` [...], the k-th logit minus the
runner-up's (inf when every expert is chosen); ``activation``, the experts'.
"""


def reference_activation(name: str, h: np.ndarray) -> np.ndarray:
    """One of :data:`MOE_ACTIVATIONS` of ``h``, in float64."""
    h = np.asarray(h, np.float64)
    if choice("activation", name, MOE_ACTIVATIONS) == "silu":
        return h / (1 + np.exp(-h))
    if name == "gelu_tanh":
        return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    return 0.5 * h * (1 + _erf(h / math.sqrt(2)))


def reference_capacity(seq: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert per batch row: ``ceil(seq * top_k * capacity_factor / num_experts)``, at least 1."""
    return max(1, math.ceil(seq * top_k * capacity_factor / num_experts))


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _route(logits, top_k, style, expert_scale, norm_topk_prob, routed_scaling_factor):
    order = np.argsort(-logits, axis=-1, kind="stable")  # stable: of equal logits, the lower index first
    experts = order[..., :top_k]
    chosen = np.take_along_axis(logits, experts, axis=-1)
    if style == "mixtral":
        return experts, _softmax(chosen), order
    probs = np.take_along_axis(_softmax(logits), experts, axis=-1)
    if style == "gemma":
        return experts, probs / probs.sum(axis=-1, keepdims=True) * expert_scale[experts], order
    if norm_topk_prob:
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return experts, probs * routed_scaling_factor, order


def _within_capacity(experts: np.ndarray, capacity: int) -> np.ndarray:
    """Per batch row, each assignment in token order, then rank order, while its expert has a slot left."""
    kept = np.zeros(experts.shape, bool)
    for row in range(experts.shape[0]):
        used: dict[int, int] = {}
        for token in range(experts.shape[1]):
            for rank, e in enumerate(experts[row, token].tolist()):
                kept[row, token, rank] = used.get(e, 0) < capacity
                used[e] = used.get(e, 0) + 1
    return kept


def _ffn(x, gate, up, down, act):
    return (reference_activation(act, x @ gate) * (x @ up)) @ down


def reference_experts(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                      activation: str) -> np.ndarray:
    """Every expert's gated FFN of every token, unweighted: [..., experts, emb] (weights as :func:`reference_moe`'s)."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    return np.stack([_ffn(x, g, u, d, activation) for g, u, d in zip(gate, up, down)], axis=-2)


def reference_moe(
    x: np.ndarray,
    router: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    *,
    top_k: int,
    style: str,
    activation: str | None = None,
    expert_scale: np.ndarray | None = None,
    shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    capacity: int | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
) -> MoEReference:
    """The MoE layer of ``style`` on ``x`` ([..., emb]; [batch, seq, emb] with a ``capacity``), in float64.

    Weights multiply from the right: ``router`` [emb, experts], ``gate`` and
    ``up`` [experts, emb, hidden], ``down`` [experts, hidden, emb],
    ``expert_scale`` [experts] (``"gemma"`` only, and there required);
    ``shared``: the shared experts' ``(gate, up, down)``, one FFN
    ([emb, h], [emb, h], [h, emb]) or several stacked on a leading axis.
    ``activation`` defaults to the style's (:data:`MOE_ACTIVATIONS`).
    """
    choice("style", style, MOE_STYLES)
    act = choice("activation", activation or _DEFAULT_ACTIVATION[style], MOE_ACTIVATIONS)
    if (style == "gemma") != (expert_scale is not None):
        raise ValueError(f"reference_moe: style {style!r} {'needs' if style == 'gemma' else 'takes no'} expert_scale")
    if style != "deepseek" and (norm_topk_prob or routed_scaling_factor != 1.0):
        raise ValueError(f"reference_moe: norm_topk_prob and routed_scaling_factor belong to style 'deepseek', "
                         f"not {style!r}")
    x, router, gate, up, down = (np.asarray(a, np.float64) for a in (x, router, gate, up, down))
    num_experts = router.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"reference_moe: top_k {top_k} is not in 1..{num_experts} (the router's experts)")
    if capacity is not None and x.ndim != 3:
        raise ValueError(f"reference_moe: with a capacity x must be [batch, seq, emb], got shape {x.shape}")
    scale = None if expert_scale is None else np.asarray(expert_scale, np.float64)

    logits = x @ router
    experts, weights, order = _route(logits, top_k, style, scale, norm_topk_prob, routed_scaling_factor)
    kept = np.ones(experts.shape, bool) if capacity is None else _within_capacity(experts, capacity)
    weights = np.where(kept, weights, 0.0)

    tokens = x.reshape(-1, x.shape[-1])
    out = np.zeros(tokens.shape, np.float64)
    for e in range(num_experts):  # each expert on the tokens it serves (a token chooses an expert at most once)
        token, rank = np.nonzero(((experts == e) & kept).reshape(-1, top_k))
        out[token] += weights.reshape(-1, top_k)[token, rank, None] * _ffn(tokens[token], gate[e], up[e], down[e], act)
    if shared is not None:  # one FFN, or several stacked: each with weight 1
        out += reference_experts(tokens, *(a if np.ndim(a) == 3 else np.asarray(a)[None] for a in shared), act).sum(-2)
    out = out.reshape(x.shape)

    if top_k < num_experts:
        runner_up = order[..., top_k]
        kth = np.take_along_axis(logits, experts[..., -1:], axis=-1)[..., 0]
        margin = kth - np.take_along_axis(logits, runner_up[..., None], axis=-1)[..., 0]
    else:
        runner_up, margin = np.full(x.shape[:-1], -1), np.full(x.shape[:-1], np.inf)
    return MoEReference(out, logits, experts, weights, kept, runner_up, margin, act)
