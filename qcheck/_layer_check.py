"""The invariants on any layer: a user's quantized layer against its unquantized twin.

:func:`check_layer` runs the checks qcheck's own suite runs on its layers
(coverage, tracks, gradients, determinism) on a layer it did not build: an NNX
module or a plain function of ``x``. :func:`copy_params_into` makes the twin
from the user's own unquantized constructor, so both compute with the same
weights.

Each layer costs one compiled program: the forward output, the gradients and
the state after the call come out of one ``jax.value_and_grad`` under plain
``jax.jit``, cached on the module's graph definition (or the function), so a
second check of a layer of the same structure compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qcheck import checks
from qcheck._coverage import MatmulRecord, assert_quantized

__all__ = ["DEFAULT_MAX_GRAD_REL_NORM", "INPUT_GRAD", "LayerFigures", "check_layer", "copy_params_into"]

#: The key of the gradient with respect to the input ``x`` in :attr:`LayerFigures.grad_rel_norms`.
INPUT_GRAD = "(input x)"

#: The default bound on each gradient's relative norm against the twin's.
#: Measured with :func:`check_layer` on qcheck's own layers against their
#: ``none`` twins (``build_moe(model, recipe, path=path)``, seed 0; x ~ N(0, 1)
#: of shape (2, 32, 32), numpy seed 0; jax 0.10.2, CPU): the forward rel-norm,
#: then the worst gradient and its parameter. Dense and sparse agree to 0.01.
#:
#:   recipe       mixtral dense / sparse         gemma dense / sparse
#:   int8         0.017; wo 0.022 / wo 0.022     0.015; wo 0.019 / wo 0.019
#:   fp8          0.067; wi_0 0.101 / wi_0 0.101 0.064; wi_0 0.098 / wi_0 0.098
#:   nanoo_fp8    0.067; wo 0.099 / wo 0.099     0.064; wi_1 0.089 / wi_1 0.089
#:   nvfp4        0.225; wo 0.306 / wo 0.312     0.243; wo 0.303 / wo 0.307
#:   fp8_current  0.066; wi_1 0.101 / wo 0.103   0.063; wo 0.093 / wo 0.093
#:   mxfp8        0.082; wo 0.129 / wo 0.127     0.077; wi_0 0.113 / wi_0 0.113
#:
#: A gradient sits 1.3-1.5x further from its twin than the output does. qcheck's
#: routers are not quantized; a quantized router moves the routing itself and
#: its own gradient (a difference of expert outputs) further still: the same
#: Mixtral layers with the router's einsum quantized in e4m3 (current scaling)
#: measure gate 0.205 (fp8), 0.229 (mxfp8), 0.199 (int8), 0.346 (nvfp4) against
#: forward 0.144-0.264, and tests/maxtext_like.py's fp8 block (4 experts,
#: router quantized) gate/kernel 0.366 against forward 0.122. The worst of all
#: is 0.366; 0.5 leaves a third above it, and stays far below what the bugs the
#: check is for give: a twin with other weights 1.3-1.7, a quantized einsum
#: without a straight-through gradient 5-8.5 (its forward passes).
DEFAULT_MAX_GRAD_REL_NORM = 0.5


@dataclasses.dataclass(frozen=True)
class LayerFigures:
    """What :func:`check_layer` measured on a layer that passed.

    ``rel_norm``: the forward output against the twin's. ``grad_rel_norms``:
    per parameter path (``"a/b/kernel"``), and :data:`INPUT_GRAD` for ``x``,
    the gradient's relative norm against the twin's gradient at the same path.
    ``coverage``: the layer's matmuls, as :func:`qcheck.coverage` reports them.
    """

    rel_norm: float
    grad_rel_norms: Mapping[str, float]
    coverage: tuple[MatmulRecord, ...]

    @property
    def worst_grad(self) -> tuple[str, float]:
        """The gradient furthest from the twin's: ``(path, rel_norm)``."""
        return max(self.grad_rel_norms.items(), key=lambda kv: kv[1])


# -- one program per layer ------------------------------------------------------

def _path(path: tuple[Any, ...]) -> str:
    return "/".join(str(k) for k in path)


class _NotAnArray(Exception):
    pass


def _loss(out: Any) -> jax.Array:
    if not isinstance(out, jax.Array) or not jnp.issubdtype(out.dtype, jnp.floating):
        raise _NotAnArray(type(out).__name__ if not isinstance(out, jax.Array) else f"an array of {out.dtype}")
    # A fixed scalar of the whole output, so every output element sends back a gradient.
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


@functools.partial(jax.jit, static_argnums=0)
def _module_step(graphdef: Any, params: nnx.State, rest: nnx.State, x: jax.Array):
    def loss(params, x):
        module = nnx.merge(graphdef, params, rest, copy=True)
        out = module(x)
        _, _, after = nnx.split(module, nnx.Param, ...)
        return _loss(out), (out, after)

    (_, (out, after)), (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return out, g_params, g_x, after


@functools.partial(jax.jit, static_argnums=0)
def _function_step(fn: Callable[[jax.Array], jax.Array], x: jax.Array):
    (_, out), g_x = jax.value_and_grad(lambda x: (_loss(y := fn(x)), y), has_aux=True)(x)
    return out, g_x


@dataclasses.dataclass
class _Run:
    out: np.ndarray
    grads: dict[str, np.ndarray]  # parameter path -> gradient; INPUT_GRAD -> the input's
    again: np.ndarray | None = None  # the output of a second call, from the state the first left


def _run(what: str, fn: Any, x: jax.Array, *, twice: bool) -> _Run:
    try:
        return _run_programs(fn, x, twice=twice)
    except _NotAnArray as e:
        raise ValueError(f"check_layer: {what} must return one floating-point array, got {e}") from None


def _run_programs(fn: Any, x: jax.Array, *, twice: bool) -> _Run:
    if isinstance(fn, nnx.Module):
        graphdef, params, rest = nnx.split(fn, nnx.Param, ...)
        out, g_params, g_x, after = _module_step(graphdef, params, rest, x)
        grads = {_path(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(g_params)}
        again = _module_step(graphdef, params, after, x)[0] if twice else None
    else:
        try:
            hash(fn)
        except TypeError:  # a static argument must hash: a callable object that does not goes in a wrapper
            fn = _Hashable(fn)
        out, g_x = _function_step(fn, x)
        grads = {}
        again = _function_step(fn, x)[0] if twice else None
    grads[INPUT_GRAD] = np.asarray(g_x)
    return _Run(np.asarray(out), grads, None if again is None else np.asarray(again))


@dataclasses.dataclass(frozen=True, eq=False)
class _Hashable:
    fn: Callable[[jax.Array], jax.Array]

    def __call__(self, x):
        return self.fn(x)


# -- the check -------------------------------------------------------------------

def _nonfinite(x: np.ndarray) -> int:
    return int(x.size - np.count_nonzero(np.isfinite(x)))


def _grad_rel_norm(g: np.ndarray, ref: np.ndarray) -> float:
    if not np.any(ref):
        return 0.0 if not np.any(g) else float("inf")
    return checks.rel_norm(g, ref)


def _check_args(layer: Any, reference: Any, x: Any, max_rel_norm: float, max_grad_rel_norm: float,
                skip: Any, skip_grads: Any) -> tuple[jax.Array, frozenset[str]]:
    for name, fn in (("layer", layer), ("reference", reference)):
        if not (isinstance(fn, nnx.Module) or callable(fn)):
            raise ValueError(f"check_layer: {name} must be an flax.nnx.Module or a function of x, "
                             f"got {type(fn).__name__}")
    if not isinstance(x, (np.ndarray, jax.Array)) or not jnp.issubdtype(x.dtype, jnp.floating):
        what = f"{type(x).__name__} of {x.dtype}" if hasattr(x, "dtype") else type(x).__name__
        raise ValueError(f"check_layer: x must be a floating-point numpy or JAX array, got {what}")
    for name, bound in (("max_rel_norm", max_rel_norm), ("max_grad_rel_norm", max_grad_rel_norm)):
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0:
            raise ValueError(f"check_layer: {name} must be a positive number, got {bound!r}")
    if skip is not None and not callable(skip):
        raise ValueError(f"check_layer: skip must be a callable (record) -> bool, got {type(skip).__name__}")
    if isinstance(skip_grads, str) or not all(isinstance(n, str) for n in skip_grads):
        raise ValueError(f"check_layer: skip_grads must be a collection of parameter paths, got {skip_grads!r}")
    return jnp.asarray(x), frozenset(skip_grads)


def check_layer(
    layer: nnx.Module | Callable[[jax.Array], jax.Array],
    reference: nnx.Module | Callable[[jax.Array], jax.Array],
    x: np.ndarray | jax.Array,
    *,
    max_rel_norm: float = 0.22,
    max_grad_rel_norm: float = DEFAULT_MAX_GRAD_REL_NORM,
    skip: Callable[[MatmulRecord], bool] | None = None,
    skip_grads: Collection[str] = (),
) -> LayerFigures:
    """Check a quantized ``layer`` against its unquantized twin ``reference`` on input ``x``.

    Both are NNX modules or plain functions of ``x``; make a module's twin with
    :func:`copy_params_into`. Neither is changed (each runs on a copy of its
    state, as ``nnx.jit`` would). The checks:

    * coverage: every matmul of ``layer`` multiplies quantized operands
      (:func:`qcheck.assert_quantized`; ``skip`` spares matmuls meant to stay in
      full precision, e.g. ``qcheck.skip_functions("MoE.route")``);
    * tracks: the output is within ``max_rel_norm`` of the twin's and not bitwise
      equal to it (:func:`qcheck.checks.assert_tracks`);
    * gradients: one backward pass of ``mean(out ** 2)``; every gradient is
      finite, and each parameter's gradient (when both are modules: every
      ``nnx.Param``, by path, but those named in ``skip_grads``) and the input's
      is within ``max_grad_rel_norm`` of the twin's at the same path;
    * determinism: a second call, from the state the first left (RNG counts
      advanced), gives the same bits.

    Fails with one ``AssertionError`` listing every failed check and its figure;
    returns the :class:`LayerFigures` when all pass. A layer whose output shape
    differs from the reference's is a ``ValueError``.

    Why the gradient bound is looser than the forward one: the gradients of a
    quantized layer pass through quantized matmuls twice (forward residuals and
    the backward product, often in e5m2), and a router gradient is a difference
    of expert outputs, so small forward errors move it relatively further;
    a quantized router moves the routing itself, and with it every expert's
    gradient. :data:`DEFAULT_MAX_GRAD_REL_NORM` gives the measurement.
    """
    __tracebackhide__ = True
    x, skip_grads = _check_args(layer, reference, x, max_rel_norm, max_grad_rel_norm, skip, skip_grads)
    both_modules = isinstance(layer, nnx.Module) and isinstance(reference, nnx.Module)
    paths = [INPUT_GRAD]
    if both_modules:
        paths += sorted({_path(p) for m in (layer, reference) for p, _ in nnx.to_flat_state(nnx.state(m, nnx.Param))})
    if unknown := skip_grads - set(paths[1:]):
        raise ValueError(f"check_layer: skip_grads names {sorted(unknown)}, which are not parameters; "
                         f"parameter paths: {', '.join(paths[1:]) or '(none)'}")
    failures: list[str] = []
    records: list[MatmulRecord] = []
    try:
        records = assert_quantized(layer, x, skip=skip)
    except AssertionError as e:
        failures.append(f"coverage: {e}")

    run = _run("layer", layer, x, twice=True)
    ref = _run("reference", reference, x, twice=False)
    if run.out.shape != ref.out.shape:
        raise ValueError(f"check_layer: layer output has shape {run.out.shape} but reference output has shape "
                         f"{ref.out.shape}")
    figure = float("nan")
    try:
        figure = checks.assert_tracks(run.out, ref.out, max_rel_norm=max_rel_norm)
    except AssertionError as e:
        failures.append(f"tracks: {e}")

    grad_figures: dict[str, float] = {}
    for path in (p for p in paths if p not in skip_grads):
        g, r = run.grads.get(path), ref.grads.get(path)
        if g is None or r is None:
            failures.append(f"gradients: parameter {path} is in the {'layer' if r is None else 'reference'} only")
            continue
        if g.shape != r.shape:
            failures.append(f"gradients: {path} has shape {g.shape} in the layer, {r.shape} in the reference")
            continue
        bad = [(who, a, n) for who, a in (("layer", g), ("reference", r)) if (n := _nonfinite(a))]
        for who, a, n in bad:
            failures.append(f"gradients: {path} ({a.dtype}) has {n} non-finite values out of {a.size} "
                            f"in the {who}")
        if bad:
            continue
        grad_figures[path] = f = _grad_rel_norm(g, r)
        if not f <= max_grad_rel_norm:
            failures.append(f"gradients: {path} ({g.dtype}) has relative norm {f:.4f} against the reference's, "
                            f"above the bound {max_grad_rel_norm}")

    if run.again is not None and run.again.tobytes() != run.out.tobytes():
        differ = int(np.count_nonzero(run.again != run.out))
        failures.append(f"determinism: a second call on the same input changed {differ} of {run.out.size} "
                        f"output values ({run.out.dtype}; worst by "
                        f"{float(np.max(np.abs(run.again.astype(np.float64) - run.out))):.3g})")
    if failures:
        raise AssertionError(f"check_layer: {len(failures)} check(s) failed:\n" +
                             "\n".join("  " + f.replace("\n", "\n  ") for f in failures))
    return LayerFigures(figure, types.MappingProxyType(grad_figures), tuple(records))


# -- the twin ---------------------------------------------------------------------

def copy_params_into(layer: nnx.Module, reference: nnx.Module) -> nnx.Module:
    """Copy every ``nnx.Param`` of ``layer`` into ``reference`` at the same path; return ``reference``.

    ``reference`` is the unquantized twin the user built with their own
    constructor. Only parameters travel: quantization state (fp8 scales and amax
    histories, ``qcheck.bridge.Fp8Meta``), RNG streams and any other non-Param
    leaf stay as each module has them, and the layer may have such leaves the
    reference lacks. Every Param path of either module must exist in the other
    with the same shape and dtype, else a ``ValueError`` names the first that
    does not (in sorted path order) and lists both modules' Param paths.
    """
    for name, m in (("layer", layer), ("reference", reference)):
        if not isinstance(m, nnx.Module):
            raise ValueError(f"copy_params_into: {name} must be an flax.nnx.Module, got {type(m).__name__}")
    src = {_path(p): v for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    dst_state = nnx.state(reference, nnx.Param)
    dst = {_path(p): v for p, v in nnx.to_flat_state(dst_state)}

    def listing() -> str:
        return f"layer Params: {', '.join(src) or '(none)'}; reference Params: {', '.join(dst) or '(none)'}"

    for path in sorted(set(src) | set(dst)):
        if path not in dst:
            raise ValueError(f"copy_params_into: layer parameter {path} has no counterpart in reference ({listing()})")
        if path not in src:
            raise ValueError(f"copy_params_into: reference parameter {path} has no counterpart in layer ({listing()})")
        a, b = src[path][...], dst[path][...]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"copy_params_into: parameter {path} is {a.dtype}{list(a.shape)} in layer but "
                             f"{b.dtype}{list(b.shape)} in reference ({listing()})")
    for p, v in nnx.to_flat_state(dst_state):
        old, new = v[...], src[_path(p)][...]
        # device_put copies a numpy leaf (one changed in place later must not reach the twin) and keeps
        # the twin's own sharding.
        v.set_value(jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else np.array(new))
    nnx.update(reference, dst_state)
    return reference
