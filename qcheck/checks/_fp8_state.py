"""fp8 scaling state through a training step: find it, and hold two steps that must agree to the same state.

The delayed-scaling bugs that reach large codebases live in the training loop,
not in the layer: gradient accumulation that sums the fp8 collection like a
gradient or keeps the last microbatch's amax only, an optimizer that clips or
decays the fp8 state with the parameters, one fp8 op used twice so autodiff
adds what travels in its gradient channel. Nothing fails and nothing is NaN;
the scale comes out wrong and quality drops. They show as *relations* between
two steps that must leave the same fp8 state: a batch against the same batch
in microbatches, a step with clipping or weight decay against one without, an
op applied to two inputs against the op applied once to both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import fp8_ops

from qcheck.checks._assertion import assertion
from qcheck.layers.bridge import Fp8Meta

_OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
#: Above this a relative tolerance would admit the bugs the check exists for
#: (a sum over 2 microbatches is a factor 2, a clip factor well below 1).
MAX_RTOL = 1e-3
# A factor this close to 1 is rounding, not a clip factor (a clip threshold that close to the gradients' norm
# would be a coincidence).
_ROUNDING = 1e-5
_SEARCHED = (f"Linen's {_OWG!r} collection at any depth (a variable dict, a TrainState's params), "
             f"NNX variables of that collection ({Fp8Meta.__name__!r}, Flax's fp8 ops behind "
             "nnx.bridge.ToNNX and qcheck's recipes) in an NNX state or module")


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flat(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(tuple(_key_name(k) for k in path), leaf) for path, leaf in leaves]


def _is_fp8(names: tuple[str, ...], leaf: Any) -> bool:
    return isinstance(leaf, Fp8Meta) or (isinstance(leaf, nnx.Variable) and type(leaf).__name__ == _OWG) or (
        _OWG in names)


def _value(leaf: Any) -> Any:
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def _numpy(x: Any) -> np.ndarray:
    if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.extended):  # Flax's fp32_max_grad
        x = jax.lax.convert_element_type(x, jnp.float32)
    return np.array(x, copy=True)  # a copy: a later step may donate the buffer


def _describe(tree: Any) -> str:
    if isinstance(tree, nnx.Module):
        return f"an NNX module ({type(tree).__name__})"
    if isinstance(tree, dict) or hasattr(tree, "keys"):
        return f"a {type(tree).__name__} with keys {sorted(map(str, tree.keys()))}"
    return f"a {type(tree).__name__}"


def fp8_state(state: Any, *, required: bool = True) -> dict[str, np.ndarray]:
    """The fp8 scaling state (amax histories and scales) in ``state``, by path.

    ``state`` is a Linen variable dict (the ``_overwrite_with_gradient``
    collection, found at any depth, so a ``TrainState`` or a tuple holding one
    works too), an NNX state or module (Flax's fp8 variables, as
    ``nnx.bridge.ToNNX`` turns a Linen fp8 op into NNX), or a qcheck layer or
    its step's ``fp8_meta``. Each leaf is named by its path joined with ``/``
    (``params/_overwrite_with_gradient/Dense_0/Fp8DirectDotGeneralOp_0/input_amax_history``)
    and returned as a numpy copy. Finding none is a ``ValueError`` naming what
    was searched, unless ``required=False``.
    """
    found = {"/".join(names): _numpy(_value(leaf)) for names, leaf in _flat(state) if _is_fp8(names, leaf)}
    if required and not found:
        raise ValueError(f"fp8_state: found no fp8 scaling state in {_describe(state)}; searched {_SEARCHED}")
    return found


def _params(state: Any) -> dict[str, np.ndarray]:
    """The floating-point leaves that are not fp8 state; those named ``params`` (or ``nnx.Param``) if any are."""
    floats = {}
    named = {}
    for names, leaf in _flat(state):
        value = _value(leaf)
        if _is_fp8(names, leaf) or not jnp.issubdtype(getattr(value, "dtype", np.int32), jnp.inexact):
            continue
        key = "/".join(names)
        floats[key] = value
        if isinstance(leaf, nnx.Param) or "params" in names:
            named[key] = value
    return {k: np.asarray(v) for k, v in (named or floats).items()}


def _copy(state: Any) -> Any:
    # Each step gets its own copy: a step may donate its input, or update an NNX module in place.
    if isinstance(state, nnx.Module):
        return nnx.clone(state)
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, state)


def _run(step: Callable[[Any, Any], Any], name: str, state: Any, batch: Any) -> Any:
    mine = _copy(state)
    new = step(mine, batch)
    if new is None:
        if not isinstance(mine, nnx.Module):
            raise TypeError(f"{name} returned None; a step returns the new state "
                            "(or updates an NNX module it is given in place)")
        new = mine
    return new


def history_rolls(before: np.ndarray, after: np.ndarray, most: int = 64) -> int | None:
    """How many times Flax's update (roll by -1, newest at 0) turns ``before`` into ``after``; None if none fits."""
    n = before.shape[0]
    if np.array_equal(before, after):
        return 0
    for k in range(1, min(most, n - 1) + 1):
        # After k updates: the untouched old entries moved down by k, the old newest at n - k.
        if np.array_equal(after[1:n - k], before[1 + k:]) and after[n - k] == before[0]:
            return k
    return None


def _ratio(a: float, b: float) -> float:
    if a == 0:
        return np.inf if b != 0 else 1.0
    return b / a


def _summed(ratio: float) -> int | None:
    m = round(ratio) if np.isfinite(ratio) else 0
    return m if m >= 2 and abs(ratio - m) <= 1e-6 * m else None


def _why(ratio: float) -> str:
    if m := _summed(ratio):
        return (f"a ratio of {m}: summed across {m} microbatches or uses (the fp8 state accumulated like a "
                f"gradient, or one fp8 op used {m} times)")
    if ratio > 1:
        return ("larger than step_a's: more than the max of what the site saw (summed across microbatches or uses "
                "of different ranges)")
    if ratio == 0:
        return "step_b recorded 0 there: that part of the batch not recorded"
    return "smaller than step_a's: part of the batch not recorded (the last microbatch only?)"


def _one_factor(x: np.ndarray, y: np.ndarray, rtol: float) -> float | None:
    """The c with y == c * x at every entry (entries where x is 0 must be 0 in y too), or None."""
    x, y = x.astype(np.float64).reshape(-1), y.astype(np.float64).reshape(-1)
    nz = x != 0
    if not nz.any() or np.any(np.abs(y[~nz]) > 0):
        return None
    c = y[nz] / x[nz]
    return float(c[0]) if np.allclose(c, c[0], rtol=rtol, atol=0) else None


def _pattern(diffs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> str | None:
    """One cause for every differing leaf at once, where the figures show one: an optimizer's signature."""
    factors = [_one_factor(a, b, 1e-5) for a, b, _ in diffs]
    if None not in factors and np.allclose(factors, factors[0], rtol=1e-5, atol=0):
        if m := _summed(factors[0]):
            return f"every differing leaf is {m} times step_a's: {_why(m)}"
        if abs(factors[0] - 1) <= _ROUNDING:
            return (f"every differing leaf is step_a's times {factors[0]:.9g}: rounding, no bug's factor; the two "
                    "steps computed what the sites saw otherwise (microbatches whose matmuls sum in another order "
                    "than the whole batch's?): if they may, declare rtol")
        return (f"every differing leaf is step_a's times {factors[0]:.7g}: following the clip factor, the optimizer "
                "touched the fp8 state (clipped with the gradients, or scaled with the parameters)")
    # Weight decay added to the fp8 "gradients": step_b = step_a + wd * (the value before the step).
    decays = [_one_factor(before, b.astype(np.float64) - a, 1e-3) for a, b, before in diffs]
    if None not in decays and np.allclose(decays, decays[0], rtol=1e-3, atol=0):
        return (f"every differing leaf is step_a's plus {decays[0]:.4g} x its value before the step: weight decay "
                "applied to the fp8 state (the optimizer touched it)")
    return None


def _close(a: np.ndarray, b: np.ndarray, rtol: float) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if rtol == 0:
        return (a.view(np.uint8).reshape(a.shape + (-1,)) == b.view(np.uint8).reshape(b.shape + (-1,))).all(-1)
    return (np.abs(a64 - b64) <= rtol * np.abs(a64)) | ((a64 == b64) | (np.isnan(a64) & np.isnan(b64)))


@assertion
def assert_fp8_state_matches(
    step_a: Callable[[Any, Any], Any],
    step_b: Callable[[Any, Any], Any],
    state: Any,
    batch: Any,
    *,
    rtol: float = 0.0,
    label: str = "",
) -> dict[str, np.ndarray]:
    """Assert that two training steps, run from the same ``state`` on the same ``batch``, leave the same fp8 state.

    Each step is the user's own, ``step(state, batch) -> new_state``, jitted or
    not (each gets its own copy of ``state``, so donating it is fine; a step
    given an NNX module may update it in place and return None). The fp8 state
    is what :func:`fp8_state` finds; both new states must hold the same leaves.

    Put the reference step first: ratios are step_b's over step_a's. Relations
    that hold (pick the two steps so that they must agree):

    - a batch in one step == the same batch in M microbatches (the amax of a
      batch is the max of its microbatches' amaxes);
    - a step with clipping, a learning rate, weight decay == one without (the
      optimizer must not touch the fp8 state);
    - an op applied to two inputs == the op applied once to their concatenation.

    Tolerance: every leaf is compared bitwise by default. An amax is a max,
    which is order-free, so two steps that show a site the same values record
    the same amax exactly however they group them, and a scale follows exactly
    from its history. Where the two steps compute the values a site sees
    differently (microbatches whose matmuls round otherwise than the whole
    batch's, a scanned stack against an unrolled one), declare ``rtol``, at
    most :data:`MAX_RTOL` (1e-3): the bugs move a leaf by a factor (M, 1/M, the
    clip factor), far outside rounding.

    Parameters must move in both steps and the fp8 state must be written in
    both: a step that changes nothing passes nothing. A failure names each
    differing leaf, both figures at its first differing entry, their ratio
    and the likely cause. Returns the fp8 state after ``step_a``.
    """
    before, params_before = _checked_arguments(step_a, step_b, state, rtol)
    after = {name: _stepped(step, name, state, batch, before, params_before)
             for name, step in (("step_a", step_a), ("step_b", step_b))}
    rows, diffs = _differing_rows(before, after["step_a"], after["step_b"], rtol)
    if rows:
        raise AssertionError(_failure(rows, diffs, len(before), rtol))
    return after["step_a"]


def _checked_arguments(step_a: Any, step_b: Any, state: Any, rtol: float) -> tuple[dict, dict]:
    """The fp8 state and the parameters ``state`` holds, after the arguments' usage errors."""
    for name, step in (("step_a", step_a), ("step_b", step_b)):
        if not callable(step):
            raise TypeError(f"{name} must be a callable step(state, batch) -> new_state, "
                            f"got {type(step).__name__}")
    if not (isinstance(rtol, (int, float)) and 0 <= rtol <= MAX_RTOL):
        raise ValueError(f"rtol must be a number in [0, {MAX_RTOL:g}], got {rtol!r} (a larger "
                         "tolerance would admit a clip factor or a sum over microbatches)")
    try:
        before = fp8_state(state)
    except ValueError as e:
        raise ValueError(f"state: {e}") from None
    params_before = _params(state)
    if not params_before:
        raise ValueError("state holds no floating-point parameters besides its fp8 state")
    return before, params_before


def _stepped(step: Any, name: str, state: Any, batch: Any, before: dict, params_before: dict) -> dict:
    """The fp8 state after ``step``, which must keep the same leaves, move a parameter and write the state."""
    new = _run(step, name, state, batch)
    got = fp8_state(new, required=False)
    if sorted(got) != sorted(before):
        missing, extra = sorted(set(before) - set(got)), sorted(set(got) - set(before))
        raise AssertionError(f"{name}'s new state holds other fp8 leaves than the state it was given "
                             f"(missing {missing or 'none'}, new {extra or 'none'})")
    params = _params(new)
    if not any(k in params_before and not np.array_equal(params[k], params_before[k]) for k in params):
        raise AssertionError(f"{name} moved no parameter ({len(params_before)} leaves): a step that "
                             "changes nothing passes nothing")
    if all(np.array_equal(got[k], before[k]) for k in before):
        raise AssertionError(f"{name} left all {len(before)} fp8 leaves as they were: the fp8 state "
                             "was not written back (dropped from the step's result?)")
    return got


def _differing_rows(before: dict, a_state: dict, b_state: dict, rtol: float) -> tuple[list, list]:
    """One row per differing leaf (where, step_a's figure, step_b's, a cause if one is certain), and the leaves."""
    rows: list[tuple[str, float, float, str | None]] = []
    diffs = []
    for key in sorted(before):
        a, b = a_state[key], b_state[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            rows.append((key, np.nan, np.nan,
                         f"step_a gives {a.dtype}{list(a.shape)}, step_b {b.dtype}{list(b.shape)}"))
            continue
        close = _close(a, b, rtol)
        if close.all():
            continue
        diffs.append((a, b, before[key]))
        i = int(np.argmin(close.reshape(-1)))
        fa, fb = float(a.reshape(-1)[i]), float(b.reshape(-1)[i])
        roll = None
        if key.endswith("history") and a.ndim == 1:
            # Only a clean count explains it: a history scaled as a whole is no roll at all.
            ka, kb = history_rolls(before[key], a), history_rolls(before[key], b)
            if None not in (ka, kb) and ka != kb:
                roll = (f"step_a rolled it {ka} time(s), step_b {kb}: history "
                        f"{'not rolled' if kb == 0 else f'rolled {kb} times'} in one step "
                        "(Flax rolls each history once per step)")
        rows.append((f"{key}[{i}]" if a.size > 1 else key, fa, fb, roll))
    return rows, diffs


def _failure(rows: list, diffs: list, n_leaves: int, rtol: float) -> str:
    pattern = _pattern(diffs) if len(diffs) == len(rows) and not any(why for *_, why in rows) else None

    def line(where, fa, fb, why):
        if not np.isfinite(fa):
            return f"{where}: {why}"
        ratio = _ratio(fa, fb)
        shown = f"{ratio:.7g}" if f"{ratio:.7g}" != "1" else f"{ratio:.9g}"  # a rounding-size ratio is not 1
        return f"{where}: step_a {fa:.9g}, step_b {fb:.9g}, ratio {shown}" + (
            "" if pattern else f": {why or _why(ratio)}")

    lines = [line(*row) for row in rows]
    shown = lines[:12] + ([f"... and {len(lines) - 12} more"] if len(lines) > 12 else [])
    tolerance = "bitwise" if rtol == 0 else f"rtol {rtol:g}"
    cause = f"; likely cause: {pattern}" if pattern else ""
    return (f"{len(rows)} of {n_leaves} fp8 leaves differ between step_a and step_b "
            f"({tolerance}){cause}:\n  " + "\n  ".join(shown))
