"""A user's MoE layer against the float64 numpy referee of its style (:func:`qcheck.referees.reference_moe`).

``check_layer`` holds a quantized layer to its unquantized twin: a bug in code
both run (a router softmax over the wrong experts, a missing renormalisation,
the wrong activation) moves both alike and stays invisible. This check holds
the layer itself, run in float32, to a reference written from the style's
definition and run in float64 on the layer's own weights.

Two things a float32 layer may do otherwise without a bug are not failures:

* near-ties: a token whose k-th and (k+1)-th router logits are within
  ``tie_rtol`` of the scale of their float32 rounding (``|x| @ |router|``)
  may pick either expert; it is left out and counted (with token dropping,
  so is every later token of its batch row routed to either of the two
  experts, whose slots it may have moved);
* rounding: a token passes when ``||layer - referee|| <= atol + rtol ||referee||``
  over its output vector (2-norms), so one element cancelling to near 0 does
  not fail it. The default ``rtol`` leaves room for float32 sums over wide
  layers; a float32 matmul run at bfloat16 precision (TPU's default) needs more.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qcheck._choices import require_choice
from qcheck.checks._assertion import assertion
from qcheck.checks._figures import Figures
from qcheck.checks._layer_forms import call_module, equinox_params
from qcheck.referees import MOE_STYLES, reference_capacity, reference_experts, reference_moe

#: The referee's roles for ``params``'s values. gate, up and down (and the shared ones) take
#: the experts stacked on a leading axis, or one expert each as ``"gate[3]"``; ``".T"`` after a
#: role marks a weight stored [out, in] (PyTorch's Linear), which the referee multiplies transposed.
ROLES = ("router", "expert_scale", "gate", "up", "down", "shared_gate", "shared_up", "shared_down")
_PER_EXPERT = frozenset({"gate", "up", "down", "shared_gate", "shared_up", "shared_down"})
_ROLE = re.compile(r"^(\w+?)(?:\[(\d+)\])?(\.T)?$")


def _path(keys: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys)


def module_params(module: nnx.Module) -> dict[str, np.ndarray]:
    """Every ``nnx.Param`` of ``module`` by path (``"experts/0/w1/kernel"``), as host arrays."""
    return {_path(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def referee_weights(found: Mapping[str, np.ndarray], params: Mapping[str, str], *, style: str,
                    emb: int) -> dict[str, np.ndarray]:
    """The referee's weights by role (:data:`ROLES`, experts stacked, [in, out]) from the layer's ``found`` ones.

    ``params`` maps the layer's parameter paths to roles; a path it lacks, an
    unknown role, a role missing or given twice, or a weight of the wrong shape
    is a ValueError naming it (a path, with every path the layer has).
    """
    if unknown := [p for p in params if p not in found]:
        raise ValueError(f"params names {', '.join(map(repr, unknown))}, not parameters of the layer; its "
                         f"parameter paths: {', '.join(found) or '(none)'}")
    pieces: dict[str, dict[int | None, tuple[str, np.ndarray]]] = {}
    for path, role in params.items():
        m = _ROLE.match(role) if isinstance(role, str) else None
        name = m.group(1) if m else role
        require_choice("role", name, ROLES)
        if m.group(2) is not None and name not in _PER_EXPERT:
            raise ValueError(f"params: role {role!r} of {path!r}: only {', '.join(sorted(_PER_EXPERT))} take an index")
        w = np.asarray(found[path], np.float64)
        if m.group(3):
            w = np.swapaxes(w, -1, -2)
        index = None if m.group(2) is None else int(m.group(2))
        if index in pieces.setdefault(name, {}) or (pieces[name] and (index is None) != (None in pieces[name])):
            raise ValueError(f"params: role {name!r} given twice or both stacked and per expert "
                             f"({', '.join(p for p, _ in pieces[name].values())}, {path})")
        pieces[name][index] = (path, w)

    weights, paths = {}, {}
    for name, by_index in pieces.items():
        if None in by_index:
            paths[name], weights[name] = by_index[None]
        elif sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"params: {name!r} is given for experts {sorted(by_index)}, not 0..{len(by_index) - 1}")
        else:
            paths[name] = ", ".join(by_index[i][0] for i in sorted(by_index))
            weights[name] = np.stack([by_index[i][1] for i in sorted(by_index)])
    required = ["router", "gate", "up", "down"] + (["expert_scale"] if style == "gemma" else [])
    shared = [r for r in ROLES if r.startswith("shared_")]
    if any(r in weights for r in shared):
        required += shared
    if missing := [r for r in required if r not in weights]:
        raise ValueError(f"params maps no parameter to role(s) {', '.join(missing)} (style {style!r}); the layer's "
                         f"parameter paths: {', '.join(found)}")
    if "expert_scale" in weights and style != "gemma":
        raise ValueError(f"params: expert_scale ({paths['expert_scale']}) belongs to style 'gemma', not {style!r}")

    experts, hidden = weights["gate"].shape[0], weights["gate"].shape[-1]
    s_hidden = weights["shared_gate"].shape[-1] if "shared_gate" in weights else 0
    n_shared = weights["shared_gate"].shape[:-2] if "shared_gate" in weights else ()
    want = {"router": (emb, experts), "expert_scale": (experts,), "gate": (experts, emb, hidden),
            "up": (experts, emb, hidden), "down": (experts, hidden, emb), "shared_gate": (*n_shared, emb, s_hidden),
            "shared_up": (*n_shared, emb, s_hidden), "shared_down": (*n_shared, s_hidden, emb)}
    for name, w in weights.items():
        if w.shape != want[name]:
            hint = "; it fits transposed: add '.T' to its role" if w.shape[:-2] + w.shape[:-3:-1] == want[name] else ""
            raise ValueError(f"params: {name} ({paths[name]}) has shape {list(w.shape)}, the referee takes "
                             f"{list(want[name])} (emb {emb}, experts {experts}, hidden {hidden}){hint}")
    return weights


def _excluded_near_ties(ref, x: np.ndarray, router: np.ndarray, tie_rtol: float, dropping: bool) -> np.ndarray:
    """Tokens whose top-k boundary is within float32 noise, and with dropping the later tokens that hang on it."""
    if (ref.runner_up < 0).all():
        return np.zeros(ref.margin.shape, bool)
    noise = np.abs(x) @ np.abs(router)  # how far float32 rounding can move each logit, to a factor ~ emb * eps
    kth = np.take_along_axis(noise, ref.experts[..., -1:], axis=-1)[..., 0]
    second = np.take_along_axis(noise, ref.runner_up[..., None], axis=-1)[..., 0]
    tie = ref.margin <= tie_rtol * np.maximum(kth, second)
    if dropping:
        for b, s in np.argwhere(tie.copy()):
            pair = [ref.experts[b, s, -1], ref.runner_up[b, s]]
            tie[b, s + 1:] |= np.isin(ref.experts[b, s + 1:], pair).any(axis=-1)
    return tie


def _layer_mix(x_t: np.ndarray, got_t: np.ndarray, want_t: np.ndarray, w: Mapping[str, np.ndarray],
               activation: str, chosen: list[int]) -> str:
    """What the layer's output at one token is, read as a mix of the referee's expert outputs (least squares).

    A mix explains the difference when it leaves a tenth of it or less: a routing bug leaves float32 rounding,
    while other experts' outputs (another activation, other weights) lie mostly outside the span of the
    referee's.
    """
    if not np.isfinite(got_t).all():
        return f"the layer's output there has {int(np.sum(~np.isfinite(got_t)))} non-finite values"
    basis = reference_experts(x_t, w["gate"], w["up"], w["down"], activation)  # [experts, emb]
    if basis.shape[1] < basis.shape[0]:
        return "the layer's own choice cannot be read from its output (fewer features than experts)"
    target = got_t
    if "shared_gate" in w:
        shared = [w[r] if w[r].ndim == 3 else w[r][None] for r in ("shared_gate", "shared_up", "shared_down")]
        target = got_t - reference_experts(x_t, *shared, activation).sum(0)
    coef = np.linalg.lstsq(basis.T, target, rcond=None)[0]
    residual = np.linalg.norm(basis.T @ coef - target)
    if not residual <= 0.1 * np.linalg.norm(got_t - want_t):
        return (f"the layer's output there is no mix of the referee's expert outputs (the best leaves "
                f"{residual / max(np.linalg.norm(target), 1e-300):.3g} of its norm): its experts compute otherwise "
                "(activation, weights, shared experts)")
    used = [int(e) for e in np.flatnonzero(np.abs(coef) > 1e-3 * np.abs(coef).max())]
    verdict = "the same experts, other weights" if used == sorted(chosen) else "other experts: the choice differs"
    return (f"the layer's output there is the referee's experts {used} mixed with weights "
            f"[{', '.join(f'{coef[e]:.4g}' for e in used)}] (least squares): {verdict}")


def compare_with_referee(
    got: Any,
    x: Any,
    w: Mapping[str, np.ndarray],
    *,
    style: str,
    top_k: int,
    activation: str | None = None,
    capacity: int | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    rtol: float,
    atol: float,
    tie_rtol: float = 1e-5,
) -> Figures:
    """``got`` (a layer's output on ``x``) against :func:`~qcheck.referees.reference_moe` of ``w`` (by role).

    Raises AssertionError naming the first token (in index order) beyond
    ``atol + rtol * ||referee||``, its worst element, the referee's experts there
    and what the layer's output is made of. Returns the worst relative
    difference (``max_rel``), with ``max_abs``, ``tokens`` compared,
    ``near_ties`` left out and ``dropped`` assignments.
    """
    x = np.asarray(x, np.float64)
    got = np.asarray(got, np.float64)
    if got.shape != x.shape:
        raise ValueError(f"the layer's output has shape {got.shape}, not its input's {x.shape}")
    shared = (w["shared_gate"], w["shared_up"], w["shared_down"]) if "shared_gate" in w else None
    ref = reference_moe(x, w["router"], w["gate"], w["up"], w["down"], top_k=top_k, style=style,
                        activation=activation, expert_scale=w.get("expert_scale"), shared=shared, capacity=capacity,
                        norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    excluded = _excluded_near_ties(ref, x, w["router"], tie_rtol, capacity is not None)
    if excluded.all():
        raise ValueError(f"every one of the {excluded.size} tokens is a near-tie in the router (tie_rtol {tie_rtol}): "
                         "nothing to compare")
    diff = np.linalg.norm(got - ref.output, axis=-1)
    norm = np.linalg.norm(ref.output, axis=-1)
    bad = ~(diff <= atol + rtol * norm) & ~excluded  # NaN fails
    ties = f"; {int(excluded.sum())} near-tie token(s) left out" if excluded.any() else ""
    if bad.any():
        t = tuple(int(i) for i in np.argwhere(bad)[0])
        e = int(np.argmax(np.where(np.isnan(got[t]), np.inf, np.abs(got[t] - ref.output[t]))))
        chosen = [int(c) for c, k in zip(ref.experts[t], ref.kept[t]) if k]
        dropped = [int(c) for c, k in zip(ref.experts[t], ref.kept[t]) if not k]
        raise AssertionError(
            f"token {t} differs from the float64 referee by {diff[t] / max(norm[t], 1e-300):.4g} of its norm "
            f"(|diff| {diff[t]:.4g}; rtol {rtol}, atol {atol}); worst at output{[*t, e]}: {got[t][e]:.9g} against "
            f"the referee's {ref.output[t][e]:.9g}; {int(bad.sum())} of {bad.size} tokens differ{ties}. The referee "
            f"({style}) routes it to experts {chosen} with weights "
            f"[{', '.join(f'{ref.weights[t][list(ref.experts[t]).index(c)]:.4g}' for c in chosen)}]"
            f"{f' (experts {dropped} dropped: capacity full)' if dropped else ''}; "
            + _layer_mix(x[t], got[t], ref.output[t], w, ref.activation, chosen))
    keep = ~excluded
    rel = diff[keep & (norm > 0)] / norm[keep & (norm > 0)]
    max_rel = float(rel.max()) if rel.size else 0.0
    return Figures(max_rel, max_rel=max_rel, max_abs=float(diff[keep].max()), tokens=int(keep.sum()),
                   near_ties=int(excluded.sum()), dropped=int((~ref.kept).sum()))


def _run(layer: Any, x: jax.Array, output: Any, *, module: bool, call: Any) -> Any:
    # One program, as check_layer runs a layer; a module on a copy of its state, left as it was.
    out = call_module(layer, x, call) if module else jax.jit(layer)(x)
    if output is None:
        return out
    return output(out) if callable(output) else out[output]


def _parameters(layer: Any, call: Any, weights: Any) -> tuple[bool, dict[str, np.ndarray]]:
    """Whether ``layer`` is a module, and its parameters by path: a module's own, or a function's ``weights``."""
    eqx_found = equinox_params(layer)
    module = isinstance(layer, nnx.Module) or eqx_found is not None
    if module:
        if weights is not None:
            raise ValueError("weights is for a layer given as a function of x; a module's parameters are its own")
        return True, module_params(layer) if eqx_found is None else {p: np.asarray(v) for p, v in eqx_found.items()}
    if callable(layer) and not isinstance(layer, type):
        if call is not None:
            raise ValueError("call is how a module is called on x; a layer given as a function of x is called as it is")
        if weights is None:
            raise ValueError("a layer given as a function of x takes its parameters from weights= (a pytree; "
                             "params names paths into it), which is missing")
        return False, {_path(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(weights)[0]}
    raise ValueError(f"layer must be an flax.nnx.Module, an equinox.Module or a function of x, "
                     f"got {type(layer).__name__}")


@assertion
def assert_moe_matches_referee(
    layer: Any,
    x: Any,
    params: Mapping[str, str],
    *,
    style: str,
    top_k: int,
    call: Callable[[Any, jax.Array], Any] | None = None,
    activation: str | None = None,
    capacity_factor: float | None = None,
    capacity: int | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    weights: Any = None,
    output: int | str | Callable[[Any], Any] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    tie_rtol: float = 1e-5,
    label: str = "",
) -> Figures:
    """A routed MoE layer, run in float32, computes its style's function: the float64 numpy referee's.

    ``layer``: an NNX or Equinox module (run jitted on a copy of its state,
    as ``check_layer`` runs it; ``call(module, x)`` calls it where ``module(x)``
    does not, e.g. haliax's named arrays in, its NamedArray read as its array)
    or a function of ``x`` (jitted; ``x`` [..., emb], [batch, seq, emb] with
    dropping), whose parameters are then ``weights`` (any pytree). ``params``
    maps the layer's parameter paths (``"experts/0/w1/kernel"``; an Equinox
    module's field paths, ``"experts/w1/weight"``) to the referee's roles (:data:`ROLES`):
    ``{"gate": "router", "wi_0": "gate", "wi_1": "up", "wo": "down"}`` for
    stacked experts, ``"gate[0]"`` per expert, ``"router.T"`` for a weight
    stored [out, in]. ``style``: ``"mixtral"``, ``"gemma"`` (needs an
    ``expert_scale``) or ``"deepseek"`` (``norm_topk_prob``,
    ``routed_scaling_factor``); shared experts in any style.
    ``activation``: ``"silu"``, ``"gelu_tanh"`` or ``"gelu"`` (exact; default:
    the style's). Token dropping: ``capacity_factor`` (slots
    ``ceil(seq * top_k * capacity_factor / experts)``) or ``capacity`` slots
    per expert per batch row. ``output`` selects the output array of a
    tuple or dict (an index, a key, or a function of the output).

    Fails naming the first token (in index order) beyond ``atol + rtol ·
    ‖referee‖`` (2-norms over the token's output), its worst element, the
    experts and weights the referee gives it, and the experts the layer's
    output there is a mix of (least squares over the referee's expert
    outputs) or that it is no such mix. Near-ties in the router, within
    ``tie_rtol`` of float32 rounding, are left out and counted. Returns the
    worst relative difference (:class:`~qcheck.checks.Figures`: ``max_rel``,
    ``max_abs``, ``tokens``, ``near_ties``, ``dropped``). See
    :mod:`qcheck.referees` (``reference_moe``) for each style's definition.
    """
    require_choice("style", style, MOE_STYLES)
    if call is not None and (not callable(call) or isinstance(call, type)):
        raise ValueError(f"call must be a function (module, x) -> output, got {type(call).__name__}")
    module, found = _parameters(layer, call, weights)
    if not isinstance(params, Mapping) or not params:
        raise ValueError(f"params must map the layer's parameter paths to roles; its parameter paths: "
                         f"{', '.join(found) or '(none: pass weights= for a function)'}")
    if capacity_factor is not None and capacity is not None:
        raise ValueError("give capacity_factor or capacity, not both")
    for name, v in (("rtol", rtol), ("atol", atol), ("tie_rtol", tie_rtol)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    x = jnp.asarray(x, jnp.float32)
    w = referee_weights(found, params, style=style, emb=x.shape[-1])
    if capacity_factor is not None:
        if x.ndim != 3:
            raise ValueError(f"with token dropping x must be [batch, seq, emb], got shape {x.shape}")
        capacity = reference_capacity(x.shape[1], top_k, w["router"].shape[-1], capacity_factor)
    got = _run(layer, x, output, module=module, call=call)
    return compare_with_referee(got, x, w, style=style, top_k=top_k, activation=activation, capacity=capacity,
                                norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
                                rtol=rtol, atol=atol, tie_rtol=tie_rtol)
