"""The invariants on any layer: a user's quantized layer against its unquantized twin.

:func:`check_layer` runs the checks qcheck's own suite runs on its layers
(coverage, tracks, gradients, determinism) on a layer it did not build: an NNX
module as its library builds it (unhashable configs, Linen modules bridged by
``ToNNX``, state that changes when called, submodules created on the first
call, tuple outputs), a Linen module with its variables, an Equinox module
(haliax's named arrays, through ``call=``), a Keras layer or model (called
in Keras's ``StatelessScope``, as ``layer.stateless_call`` maps its variables),
or a plain function of ``x``.
:func:`copy_params_into` makes the twin from the user's own
unquantized constructor, so both compute with the same weights. It also runs
both programs with their unwritten ``jax.lax.empty`` buffers filled, which a
comparison of the two cannot see (:mod:`qcheck.checks._uninitialized`).

Each layer costs one trace and one compiled program (plain ``jax.jit``, ahead
of time from that trace): the forward output, the gradients and the state after
the call come out of one ``jax.value_and_grad``, and the determinism check's
second call runs the same program (where the edges run on a slice of x's
rows, the slice's program, twice). It is cached on the module's graph
definition where it hashes and on the traced program, so a second check of a
layer of the same structure compiles nothing. A program holding a
``jax.lax.empty`` buffer costs one more: its filled copies. Coverage traces
each layer's forward pass once more; under a declaration, the walk that records
its quantizers' values (and, with ``grads`` declared, the backward pass's) is
compiled into the layer's own program, which computes the forward pass they
share once, and the edges (the token rows, the tiny tensor) run that one
program again; from 512 token rows of ``x`` on, they run on a slice of its
first 64 token rows instead, by one more program of the slice's shape that
returns only what the edges read (each gradient's count of values not finite,
the quantizers that read x), and one small program for the quantizers that do
not (the weights'), run once. A lazy NNX module costs one small program more,
the call that builds it, on a copy.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qcheck._coverage import (CoverageMap, Declaration, KernelRoles, MatmulRecord, Prepared, SkipArg,
                              as_kernel_roles, as_skips, coverage, judged_once, judged_runs, machinery_tuple,
                              mixed_formats, prepare, quantized_records, read_stored, resolve_declaration)
from qcheck._errors import user_code
from qcheck.checks._edges import EDGE_ROWS, check_skip_edges, edge_rows, rows_of, token_slice
from qcheck.checks._flush import flushed_gradients
from qcheck.checks._layer_forms import Form, is_module, keras_of, path_name
from qcheck.checks._layer_programs import INPUT_GRAD, Outcome, Run, retrace_step, run_lean, run_step, trace_step, valued
from qcheck.checks._stored import held_stored
from qcheck.checks._tracks import assert_tracks, count_nonfinite, rel_norm
from qcheck.checks._uninitialized import uninitialized_reads, unspecified_buffers

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

    ``rel_norms``: per compared output leaf (``"[0]"``, ``"out"``; ``""`` for a
    single array), its relative norm against the twin's; ``rel_norm``: the
    largest. ``grad_rel_norms``: per parameter path (``"a/b/kernel"``), and
    :data:`INPUT_GRAD` for ``x``, the gradient's relative norm against the
    twin's gradient at the same path. ``coverage``: the layer's matmuls, as
    :func:`qcheck.coverage` reports them (a ``CoverageMap``: ``format_coverage`` prints what was held), each
    spared one naming its rule, each declared operand with its hold.
    """

    rel_norm: float
    grad_rel_norms: Mapping[str, float]
    coverage: Sequence[MatmulRecord]
    rel_norms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    #: The declaration every site was held to (given, or read from the layer: its ``source`` says
    #: which); None where nothing declared and only "quantized somehow" and one format per role held.
    declared: Declaration | None = None
    #: One line: what was held and where it was read, or why nothing was.
    declared_from: str = ""
    #: With a ``grads`` role declared: the backward pass's matmuls, each gradient operand's hold.
    backward: tuple[MatmulRecord, ...] = ()
    #: Each edge kind (the token rows zeros, tiny, huge, saturation, and the whole tiny_tensor): "run", "run, codes
    #: held bitwise" (under a declaration), or why it was not (the user's reason, no fp8 format declared for the
    #: activations, an input type with no value below the smallest guarded amax). From 512 token rows of x on,
    #: where they ran: "run on 64 of 1024 token rows, ..." (a slice of x's first rows), or "run on all 1024 token
    #: rows (a slice of 64 did not run: why), ..."
    edges: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Per parameter path that one side has as state, not a parameter (a Keras kernel ``quantize("int8")``
    #: stored as int8 codes, no gradient), which side and what each holds there; its gradient is not compared.
    frozen: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Where the determinism check's second call ran: "run" (on x), or, from 512 token rows of x on where the
    #: edges run on a slice of x's first rows, "run on 64 of 1024 token rows" (that slice, twice: the slice's
    #: own call, then a second from the state it left).
    determinism: str = ""

    @property
    def worst_grad(self) -> tuple[str, float]:
        """The gradient furthest from the twin's: ``(path, rel_norm)``."""
        return max(self.grad_rel_norms.items(), key=lambda kv: kv[1])

    @property
    def spared(self) -> Mapping[str, tuple[MatmulRecord, ...]]:
        """Per skip rule, the full-precision matmuls it spared."""
        out: dict[str, list[MatmulRecord]] = {}
        for r in self.coverage:
            if r.skipped_by:
                out.setdefault(r.skipped_by, []).append(r)
        return types.MappingProxyType({k: tuple(v) for k, v in out.items()})


# -- a layer in any form, as pure functions ----------------------------------------

# -- the check -------------------------------------------------------------------

def _grad_rel_norm(g: np.ndarray, ref: np.ndarray) -> float:
    if not np.any(ref):
        return 0.0 if not np.any(g) else float("inf")
    return rel_norm(g, ref)


def _check_call(layer: Any, reference: Any, call: Any) -> None:
    if call is None:
        return
    if not callable(call) or isinstance(call, type):
        raise ValueError(f"check_layer: call must be a function (module, x) -> output, got {type(call).__name__}")
    if not any(is_module(m) or keras_of(m) is not None for m in (layer, reference)):
        raise ValueError("check_layer: call is how a module is called on x, and neither layer nor reference is a "
                         "module (an flax.nnx.Module, a (linen.Module, variables) pair, an equinox.Module or a "
                         "Keras layer): a function of x is called as it is")


def _check_args(layer: Any, reference: Any, x: Any, max_rel_norm: float, max_grad_rel_norm: float,
                skip: Any, skip_grads: Any, output: Any) -> tuple[jax.Array, frozenset[str]]:
    for name, fn in (("layer", layer), ("reference", reference)):
        if not (is_module(fn) or (callable(fn) and not isinstance(fn, type))):
            raise ValueError(f"check_layer: {name} must be an flax.nnx.Module, a (linen.Module, variables) pair, "
                             f"an equinox.Module, a Keras layer or a function of x, got {type(fn).__name__}")
        if keras_of(fn) is not None and not fn.built:  # its variables are what runs statelessly
            raise ValueError(f"check_layer: {name} is a Keras {type(fn).__name__} not built yet (it has no "
                             f"variables): build it ({name}.build(input_shape)) or call it once on x")
    if not isinstance(x, (np.ndarray, jax.Array)) or not jnp.issubdtype(x.dtype, jnp.floating):
        what = f"{type(x).__name__} of {x.dtype}" if hasattr(x, "dtype") else type(x).__name__
        raise ValueError(f"check_layer: x must be a floating-point numpy or JAX array, got {what}")
    for name, bound in (("max_rel_norm", max_rel_norm), ("max_grad_rel_norm", max_grad_rel_norm)):
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0:
            raise ValueError(f"check_layer: {name} must be a positive number, got {bound!r}")
    try:
        as_skips(skip, "check_layer")
    except TypeError as e:
        raise ValueError(str(e)) from None
    if isinstance(skip_grads, str) or not all(isinstance(n, str) for n in skip_grads):
        raise ValueError(f"check_layer: skip_grads must be a collection of parameter paths, got {skip_grads!r}")
    if not (output is None or callable(output) or isinstance(output, (int, str))) or isinstance(output, bool):
        raise ValueError(f"check_layer: output must be None (every floating-point leaf), an index or key, or a "
                         f"function of the output, got {type(output).__name__}")
    # device_put, not jnp.asarray: that compiles a program of its own for a numpy array (jax.lax.stage).
    return (x if isinstance(x, jax.Array) else jax.device_put(x)), frozenset(skip_grads)


def _frozen(form: Form, twin: Form, run: Run, ref: Run) -> dict[str, str]:
    """The parameters of one side that the other holds as state (a Keras kernel quantize() froze into codes, a
    qwix PtqProvider weight kept as an int8 ``qvalue`` and its scale under its path): per path, which side froze
    it and what each holds. Their gradients are not compared: one side has none."""
    def held(f: Form, path: str) -> str:
        state = f.state_leaves()
        kept = [(k, v) for k, v in state.items() if k == path or k.startswith(path + "/")]
        return ", ".join(f"{'' if k == path else k + ' '}{v.dtype}{list(v.shape)}" for k, v in kept
                         if hasattr(v, "dtype")) or "state"

    def frozen_in(f: Form, path: str) -> bool:
        return path in f.state_names or any(n.startswith(path + "/") for n in f.state_names)

    frozen = {}
    for path in sorted(set(ref.params) - set(run.params)):
        if frozen_in(form, path):
            frozen[path] = (f"frozen in the layer ({held(form, path)}, state: no gradient); a parameter of the "
                            f"reference ({ref.params[path].dtype}{list(ref.params[path].shape)})")
    for path in sorted(set(run.params) - set(ref.params)):
        if frozen_in(twin, path):
            frozen[path] = (f"frozen in the reference ({held(twin, path)}, state: no gradient); a parameter of "
                            f"the layer ({run.params[path].dtype}{list(run.params[path].shape)})")
    return frozen


def _compare_params(run: Run, ref: Run, skip_grads: frozenset[str], frozen: Collection[str] = (),
                    twin_hint: str = "qcheck.copy_params_into(layer, twin)") -> None:
    only_layer = sorted(set(run.params) - set(ref.params) - skip_grads - set(frozen))
    only_ref = sorted(set(ref.params) - set(run.params) - skip_grads - set(frozen))
    if only_layer or only_ref:
        parts = ([f"in layer only: {', '.join(only_layer)}"] if only_layer else []) + (
            [f"in reference only: {', '.join(only_ref)}"] if only_ref else [])
        raise ValueError(f"check_layer: reference has another structure than layer: parameters {'; '.join(parts)} "
                         f"(build the twin with the layer's constructor, unquantized, or name them in skip_grads)")
    for path in sorted(set(run.params) & set(ref.params)):
        a, b = run.params[path], ref.params[path]
        if a.shape == b.shape and a.dtype == b.dtype and a.tobytes() != b.tobytes():
            differ = int(np.count_nonzero(a != b))
            raise ValueError(f"check_layer: reference's weights differ from layer's: {path} ({a.dtype}{list(a.shape)}) "
                             f"differs in {differ} of {a.size} values; make the twin with {twin_hint}")


def check_layer(
    layer: Any,
    reference: Any,
    x: np.ndarray | jax.Array,
    *,
    output: int | str | Callable[[Any], Any] | None = None,
    max_rel_norm: float = 0.22,
    max_grad_rel_norm: float = DEFAULT_MAX_GRAD_REL_NORM,
    skip: SkipArg = None,
    skip_grads: Collection[str] = (),
    machinery: Collection[str] = (),
    declared: Any = None,
    call: Callable[[Any, jax.Array], Any] | None = None,
    kernels: KernelRoles | Sequence[KernelRoles] | None = None,
    accept_weaker: Any = None,
    skip_edges: Mapping[str, str] | None = None,
) -> LayerFigures:
    """Check a quantized ``layer`` against its unquantized twin ``reference`` on input ``x``.

    Each is an NNX module, a ``(linen_module, variables)`` pair, an Equinox
    module, a Keras layer or model (JAX backend), or a plain function of
    ``x``; make an NNX or Equinox twin with :func:`copy_params_into`, a Keras
    twin the Keras way, ``twin.set_weights(layer.get_weights())`` before
    ``layer.quantize(mode)``. ``call(module, x)``: how a module is called
    (default ``module(x)``). Each side runs on a copy of its state, after its
    first call where that builds submodules (:func:`qcheck.warmed_up`).
    ``output``: what is compared, every floating-point leaf of the output
    (default), an index or key, or a function of the output.

    The checks, each a row of :data:`SUB_CHECKS` (docs/checking-your-layer.md,
    "What it checks", says what each catches):

    * coverage: every matmul multiplies quantized operands
      (:func:`qcheck.assert_quantized`), but those ``skip`` spares (held to
      the twin as its control); ``machinery`` names more packages that are not
      the user's call site; ``kernels`` the roles of opaque kernels;
    * tracks: each output leaf within ``max_rel_norm`` of the twin's, not equal;
    * gradients: all finite; each parameter's (by path) and the input's within
      ``max_grad_rel_norm`` of the twin's, but ``skip_grads``; one a side holds
      as state (a frozen Keras kernel) is named in ``LayerFigures.frozen``;
    * determinism: a second call, from the state the first left, the same bits (``.determinism``: where);
    * uninitialized, on both: ``jax.lax.empty`` buffers filled with NaN, then
      a large value, change no output, gradient or state;
    * declared quantization: each matmul's codes held bitwise to what the
      layer declares: read by default (its ``qcheck_declaration()``, else its library's), ``declared=True``
      fails where nothing is read, ``False`` holds nothing, or given (a recipe
      or format name, a ``qcheck.Recipe``, ``{"weights": "int8",
      "activations": None}``); a weight the layer stores as codes (Keras's
      ``quantize``, qwix's ``PtqProvider``) held, codes and scales, against the
      twin's float parameter of its path; a site whose codes cannot be read fails
      unless ``accept_weaker`` accepts it; with a ``grads`` role, the backward
      pass's gradient operands too;
    * edges: the compiled program again on edge rows of ``x`` (zeros, tiny, 1e5,
      the largest code) and on a whole tensor of tiny values: all finite, codes
      held there too; ``skip_edges`` turns an edge kind off with a reason.

    Fails with one ``AssertionError`` listing every failed check and its
    figure, else returns the :class:`LayerFigures`. A usage error is one
    ``ValueError`` naming the argument, either side's own exception one
    :class:`qcheck.UserCodeError` (:data:`DEFAULT_MAX_GRAD_REL_NORM`: the bound).
    """
    __tracebackhide__ = True
    x, skip_grads = _check_args(layer, reference, x, max_rel_norm, max_grad_rel_norm, skip, skip_grads, output)
    _check_call(layer, reference, call)
    as_kernel_roles(kernels, "check_layer")  # a misuse is check_layer's ValueError, before anything runs
    edge_kinds = check_skip_edges(skip_edges)
    declaration, declared_from = _declaration(layer, declared, accept_weaker)
    traced = trace_step("layer", layer, x, call, output)
    traced_twin = trace_step("reference", reference, x, call, output, like=layer)
    paths = _param_paths(form := traced.form, twin := traced_twin.form, skip_grads)
    walks = _walks(form, x, declaration, machinery, kernels)
    run = run_step("layer", traced, x, output, walks=list(walks.values()))
    ref = run_step("reference", traced_twin, x, output)
    frozen = _paired(form, twin, run, ref, skip_grads)
    declaration = _hold_stored(declaration, layer, form, ref, walks)
    sliced = _edge_slice(traced, x, output, declaration, machinery, kernels, edge_kinds)  # where the edges run
    c = _Checked(form, twin, run, ref, x, declaration, declared_from, max_rel_norm, max_grad_rel_norm, skip,
                 sorted(paths - skip_grads - set(frozen)), tuple(machinery), kernels, accept_weaker, walks=walks,
                 edges=edge_rows(x, declaration, edge_kinds, sliced.keep), output=output, sliced=sliced)
    return _verdict(c, frozen)


@dataclasses.dataclass
class _EdgeRun:
    """Where the edges run: on x's whole batch (``run`` None: the layer's own program, its run on x the baseline),
    or on a slice of x's token rows (``keep``) by a program of the slice's shape, its run on the slice the
    baseline; ``on``: what the edges line says of it."""

    run: Run | None = None
    walks: dict[str, Prepared] = dataclasses.field(default_factory=dict)
    keep: tuple[slice, ...] | None = None
    on: str = ""


def _edge_slice(traced: Any, x: jax.Array, output: Any, declaration: Declaration | None,
                machinery: Collection[str], kernels: Any, kinds: Mapping[str, str | None]) -> _EdgeRun:
    """The edges' program on a slice of x's token rows, where x holds enough of them (:func:`token_slice`) and an
    edge runs; x's whole batch where the layer's step does not trace or run on the slice (a static batch size),
    saying so. The determinism check's second call runs where the edges do."""
    keep = token_slice(np.shape(x))
    if keep is None or all(v is not None for v in kinds.values()):
        return _EdgeRun()
    part = x[keep]
    rows, n = rows_of(np.shape(x)), rows_of(np.shape(part))
    try:
        sliced = retrace_step("layer", traced, part, output)
        # The forward walk only: the edges judge its sites' codes; the backward walk's are x's alone.
        walks = {k: w for k, w in _walks(sliced.form, part, declaration, machinery, kernels).items()
                 if k == "forward"}
        run = run_lean("layer", sliced, part, output, walks=list(walks.values()))
    except Exception as e:  # noqa: BLE001 - whatever stops the slice, the whole batch still runs
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        return _EdgeRun(on=f" on all {rows} token rows (a slice of {n} did not run: {type(e).__name__}: {why})")
    return _EdgeRun(run, walks, keep, f" on {n} of {rows} token rows")


def _declaration(layer: Any, declared: Any, accept_weaker: Any) -> tuple[Declaration | None, str]:
    declaration, declared_from = resolve_declaration(layer, declared, "check_layer")
    if accept_weaker not in (None, False) and declaration is None:
        raise ValueError(f"check_layer: accept_weaker accepts weaker holds of a declaration, and none is held "
                         f"({declared_from})")
    return declaration, declared_from


def _paired(form: Form, twin: Form, run: Run, ref: Run, skip_grads: frozenset[str]) -> dict[str, str]:
    """What one side froze (:func:`_frozen`), once both sides have the same parameters, weights and outputs."""
    frozen = _frozen(form, twin, run, ref)
    _compare_params(run, ref, skip_grads, frozen, "twin.set_weights(layer.get_weights()) before layer.quantize(...)"
                    if form.kind == "keras" else "qcheck.copy_params_into(layer, twin)")
    _compare_outputs(run, ref)
    return frozen


def _hold_stored(declaration: Declaration | None, layer: Any, form: Form, ref: Run,
                 walks: dict[str, Prepared]) -> Declaration | None:
    """The declaration with the weights the layer keeps as codes held against the twin's float parameters of
    their paths (numpy, no program), for the forward walk to judge its sites by."""
    declaration = _with_stored(declaration, layer)
    if declaration is not None and declaration.stored_params:  # else the layer's state is not read
        declaration = held_stored(declaration, form.state_leaves(), ref.params)
    if "forward" in walks:  # the backward walk holds the grads role alone: no stored weight
        walks["forward"].declaration = declaration
    return declaration


def _with_stored(declaration: Declaration | None, layer: Any) -> Declaration | None:
    """A declaration given by hand (or read with none found stored) with the weights a reader finds stored as
    codes: where they are is a fact of the layer, whatever format is declared for them."""
    if declaration is None or declaration.stored_params:
        return declaration
    stored = read_stored(layer)
    return dataclasses.replace(declaration, stored_params=stored) if stored else declaration


def _param_paths(form: Form, twin: Form, skip_grads: frozenset[str]) -> set[str]:
    """Both sides' parameter paths, once every path ``skip_grads`` names is one of them."""
    paths = {p for f in (form, twin) for p in f.param_leaves(f.params)}
    if unknown := skip_grads - paths:
        raise ValueError(f"check_layer: skip_grads names {sorted(unknown)}, which are not parameters; "
                         f"parameter paths: {', '.join(sorted(paths)) or '(none)'}")
    return paths


def _compare_outputs(run: Run, ref: Run) -> None:
    if list(run.out) != list(ref.out):
        leaves = [", ".join(k or "the output" for k in r.out) for r in (run, ref)]
        raise ValueError(f"check_layer: layer output has another structure than reference output: leaves "
                         f"{leaves[0]} against {leaves[1]} (output= selects what to compare)")
    for k in run.out:
        if run.out[k].shape != ref.out[k].shape:
            raise ValueError(f"check_layer: layer output{f' {k}' if k else ''} has shape {run.out[k].shape} but "
                             f"reference output{f' {k}' if k else ''} has shape {ref.out[k].shape}")


def _verdict(c: _Checked, frozen: dict[str, str]) -> LayerFigures:
    """Every sub-check's failure lines as one AssertionError, else the figures."""
    __tracebackhide__ = True
    # A line may qualify its check's name (" (layer): ..."), else it follows it after a colon.
    failures = [name + (line if line.startswith(" (") else f": {line}")
                for name, sub_check in SUB_CHECKS for line in sub_check(c)]
    if failures:
        raise AssertionError(f"check_layer: {len(failures)} check(s) failed:\n" +
                             "\n".join("  " + f.replace("\n", "\n  ") for f in failures)
                             + "".join(f"\nnot compared: the gradient of {k}, {v}" for k, v in frozen.items())
                             + f"\ndeclared: {c.declared_from}")
    return LayerFigures(max(c.figures.values()), types.MappingProxyType(c.grad_figures),
                        CoverageMap(c.records, c.declaration, c.declared_from),
                        types.MappingProxyType(c.figures), c.declaration, c.declared_from, tuple(c.backward_records),
                        types.MappingProxyType(c.edges_run), types.MappingProxyType(frozen), c.determinism)


# -- the sub-checks: each a function of what check_layer ran, returning its failure lines -----------

@dataclasses.dataclass
class _Checked:
    """What the sub-checks read: both layers as run, the declaration, the options; and what they measure."""

    form: Form
    twin: Form
    run: Run
    ref: Run
    x: jax.Array
    declaration: Declaration | None
    declared_from: str
    max_rel_norm: float
    max_grad_rel_norm: float
    skip: SkipArg
    grad_paths: list[str]
    machinery: tuple[str, ...]
    kernels: Any
    accept_weaker: Any
    edges: dict[str, Any] = dataclasses.field(default_factory=dict)  # kind -> edge x, or why it is not run
    records: list[MatmulRecord] = dataclasses.field(default_factory=list)
    edge_records: dict[str, list[MatmulRecord]] = dataclasses.field(default_factory=dict)
    edges_run: dict[str, str] = dataclasses.field(default_factory=dict)
    backward_records: list[MatmulRecord] = dataclasses.field(default_factory=list)
    figures: dict[str, float] = dataclasses.field(default_factory=dict)
    grad_figures: dict[str, float] = dataclasses.field(default_factory=dict)
    walks: dict[str, Prepared] = dataclasses.field(default_factory=dict)  # "forward"/"backward" -> the walk
    # Edge kind -> what the layer's run on its row left not finite. The run itself is not kept: its outputs,
    # gradients and walked codes are layer-sized, and two edge runs are alive at a time, not five.
    reruns: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    output: Any = None  # check_layer's output=: what the step compares and differentiates
    sliced: _EdgeRun = dataclasses.field(default_factory=_EdgeRun)  # where the edges run
    determinism: str = ""  # where the determinism check's second call ran (LayerFigures.determinism)

    @property
    def edge_run(self) -> Run:
        """The run the edges are run and judged against: x's own, or the slice's."""
        return self.sliced.run or self.run

    def rerun(self, kind: str) -> list[Any]:
        """The layer's program on the edge row ``kind``: what it left not finite is kept (``reruns``), each walk's
        outputs are returned."""
        return self._finish(kind, self.edge_run.rerun(self.edges[kind]))

    def _finish(self, kind: str, result: tuple[Outcome, Any]) -> list[Any]:
        outcome, walked = result
        self.reruns[kind] = self._nonfinite(outcome)
        return walked

    @functools.cached_property
    def _finite_before(self) -> dict[str, bool]:
        """What x's own run left finite: an edge row is charged only with what it breaks anew."""
        base = self.edge_run.outcome()  # on a slice of x's rows, the slice's own run
        finite = {**{name: not count_nonfinite(v) for name, v in base.out.items()},
                  **{path: not n for path, (n, _) in base.nonfinite.items()}}
        finite.update({_state_path(path): not count_nonfinite(v)  # the state x itself left
                       for path, v in jax.tree_util.tree_leaves_with_path(base.after)
                       if jnp.issubdtype(getattr(v, "dtype", np.int32), jnp.inexact)})
        return finite

    def _nonfinite(self, outcome: Outcome) -> list[str]:
        before = self._finite_before
        bad = [f"{'output ' + name if name else 'the output'} ({n} of {np.size(v)})"
               for name, v in outcome.out.items() if before[name] and (n := count_nonfinite(v))]
        bad += [f"gradient of {path} ({n} of {size})" for path, (n, size) in outcome.nonfinite.items()
                if before.get(path, True) and n]
        bad += [f"{_state_path(path)} ({n})" for path, v in jax.tree_util.tree_leaves_with_path(outcome.after)
                if jnp.issubdtype(getattr(v, "dtype", np.int32), jnp.inexact)
                and before.get(_state_path(path), True) and (n := count_nonfinite(v))]
        return bad

    def walked(self, which: str, kinds: Sequence[str] = ()) -> tuple[Prepared, Any, Iterator[Any]] | None:
        """The walk ``which`` as the layer's program ran it: on x, then on each edge row of ``kinds``, run as
        the iterator is read (one edge run alive at a time)."""
        if which not in self.walks:
            return None
        at = list(self.walks).index(which)
        return self.walks[which], self.run.walked[at], self.edge_runs(at, kinds)

    def edge_runs(self, at: int, kinds: Sequence[str]) -> Iterator[Any]:
        """Walk ``at``'s outputs on each edge row of ``kinds``, run as the iterator is read."""
        # The next row's run is dispatched before this one's is read and judged, so that the program runs
        # while the host judges: two runs alive at a time, not every one.
        pending = None
        for kind in kinds:
            started = (kind, self.edge_run.rerun(self.edges[kind]))
            if pending is not None:
                yield self._finish(*pending)[at]
            pending = started
        if pending is not None:
            yield self._finish(*pending)[at]


def _walks(form: Form, x: jax.Array, declaration: Declaration | None, machinery: Collection[str],
           kernels: Any) -> dict[str, Prepared]:
    """Coverage's walks with values that the layer's own program runs (no compile of their own): the forward
    pass's under a declaration, and the backward pass's where ``grads`` are declared."""
    if declaration is None:
        return {}
    common = dict(errors=False, machinery=machinery_tuple(machinery, "check_layer"), entry="check_layer",
                  what="fn", kernels=as_kernel_roles(kernels, "check_layer"), warm=False)
    walks = {"forward": prepare(form.probe, (x,), {}, backward=False, declaration=declaration, **common)}
    if declaration.roles.get("grads", None) is not None:
        grads = Declaration({"grads": declaration.roles["grads"]}, declaration.source)
        walks["backward"] = prepare(form.probe, (x,), {}, backward=True, declaration=grads, **common)
    return walks


def _coverage_lines(c: _Checked) -> list[str]:
    """Every matmul quantized, each held to the declaration where one is held (:func:`qcheck.assert_quantized`)."""
    try:
        # The probes are as the steps ran: warmed up already where lazy, so coverage does not ask again. The
        # twin's coverage is the control of skip rules and of a declaration only: without them it is not traced.
        control = c.twin.probe if as_skips(c.skip, "check_layer") or c.declaration is not None else None
        rows = [k for k, v in c.edges.items() if not isinstance(v, str)]
        judged: list[list[MatmulRecord]] = []
        # x's run and the slice's runs quantize the same weights: their codes are judged once, not once a program.
        with judged_once():
            try:
                c.records = quantized_records(c.form.probe, (c.x,), {}, skip=c.skip, control=control,
                                              machinery=c.machinery, kernels=c.kernels, warm=False,
                                              accept_weaker=c.accept_weaker, entry="check_layer",
                                              declaration=c.declaration, declared_from=c.declared_from,
                                              prepared=c.walked("forward", [] if c.sliced.run else rows),
                                              also_out=judged)
            finally:
                if "forward" in c.walks:  # judged: x's layer-sized quantizer values go before the edge runs come
                    c.run.walked[list(c.walks).index("forward")] = None
                if c.sliced.run and judged and "forward" in c.sliced.walks:
                    # On the slice, its own walk judges the slice's run (the baseline), then each edge row's.
                    judged[:] = judged_runs(c.sliced.walks["forward"], _sliced_runs(c, rows))
                if judged:  # x's own records first, then the same program's codes on each edge row
                    c.edge_records = {"x": judged[0], **dict(zip(rows, judged[1:]))}
    except AssertionError as e:
        return [str(e).rsplit("\ndeclared: ", 1)[0]]
    return []


def _sliced_runs(c: _Checked, rows: Sequence[str]) -> Iterator[Any]:
    """The forward walk's outputs on the slice: its own run's (the baseline, let go once judged), then each edge
    row's, run as they are read."""
    baseline, c.sliced.run.walked[0] = c.sliced.run.walked[0], None
    yield baseline
    del baseline
    yield from c.edge_runs(0, rows)
    c.sliced.run.fixed = None  # the weights' quantizer values every run shared: judged, let go


def _formats_lines(c: _Checked) -> list[str]:
    """With nothing declared (none read, none given), one narrow format per operand role."""
    if c.declaration is not None or not c.records or c.declared_from.startswith("declared=False"):
        return []
    return mixed_formats(c.records)


def _tracks_lines(c: _Checked) -> list[str]:
    """Each compared output within ``max_rel_norm`` of the twin's, and not equal to it."""
    lines = []
    for name, out in c.run.out.items():
        try:
            c.figures[name] = assert_tracks(out, c.ref.out[name], max_rel_norm=c.max_rel_norm)
        except AssertionError as e:
            lines.append(f"{name + ': ' if name else ''}{e}")
    return lines


def _gradients_lines(c: _Checked) -> list[str]:
    """Every gradient finite, each within ``max_grad_rel_norm`` of the twin's at the same path."""
    lines, above = [], None  # above: the last line of a gradient above the bound
    for path in [INPUT_GRAD, *c.grad_paths]:
        g, r = c.run.grads[path], c.ref.grads[path]
        if g.shape != r.shape:
            lines.append(f"{path} has shape {g.shape} in the layer, {r.shape} in the reference")
            continue
        bad = [(who, a, n) for who, a in (("layer", g), ("reference", r)) if (n := count_nonfinite(a))]
        for who, a, n in bad:
            lines.append(f"{path} ({a.dtype}) has {n} non-finite values out of {a.size} in the {who}")
        if bad:
            continue
        c.grad_figures[path] = f = _grad_rel_norm(g, r)
        if not f <= c.max_grad_rel_norm:
            above = len(lines)
            lines.append(f"{path} ({g.dtype}) has relative norm {f:.4f} against the reference's, above the bound "
                         f"{c.max_grad_rel_norm}")
    if above is not None:
        # Why, where it is the layer's own gradient casts: their codes flushed to zero (a fresh delayed scale).
        # Evidence under a gradient's line that it explains (one above the bound, not a non-finite one after it),
        # not a check of its own: the count of failed checks stays the count of what failed.
        lines[above] += "".join("\n  " + line for line in
                                flushed_gradients(c.form.probe, c.x, c.output, c.machinery, c.kernels))
    return lines


def _determinism_lines(c: _Checked) -> list[str]:
    """A second call, from the state the first left, gives the same bits: on x's whole batch, or on the edges'
    slice of its token rows where they ran on one (``LayerFigures.determinism`` says which)."""
    # Where the edges ran on a slice of x's rows, there: one more run of the slice's program, not of the whole
    # batch (at emb 1024 a whole run is 7 to 10 s of the check). Run now, after coverage let its layer-sized
    # values go, not beside them.
    run, on = (c.sliced.run, f" ({c.sliced.on.strip()})") if c.sliced.run else (c.run, "")
    c.determinism = "run" + c.sliced.on if on else "run"
    second = run.second()
    lines = []
    for name, out in run.out.items():
        again = second[name]
        if again.tobytes() != out.tobytes():
            differ = int(np.count_nonzero(again != out))
            lines.append(f"a second call on the same input{on} changed {differ} of {out.size} output values"
                         f"{f' of {name}' if name else ''} ({out.dtype}; worst by "
                         f"{float(np.max(np.abs(again.astype(np.float64) - out))):.3g})")
    return lines


def _uninitialized_lines(c: _Checked) -> list[str]:
    """Neither program reads a buffer JAX leaves unspecified (:func:`qcheck.checks.assert_no_uninitialized_reads`)."""
    return [f" ({who}): {read}" for who, f, r in (("layer", c.form, c.run), ("reference", c.twin, c.ref))
            if (read := _uninitialized(who, f, r, c.x, c.machinery)) is not None]


def _backward_declared_lines(c: _Checked) -> list[str]:
    """With a ``grads`` role declared: the backward pass's gradient operands held to it, types always, codes
    bitwise (the other roles are the forward pass's coverage check's)."""
    if c.declaration is None or c.declaration.roles.get("grads", None) is None:
        return []
    walk = c.walked("backward")
    try:
        records = quantized_records(c.form.probe, (c.x,), {}, machinery=c.machinery, kernels=c.kernels, warm=False,
                                    backward=True, accept_weaker=c.accept_weaker, stale_ok=True, skip=c.skip,
                                    entry="check_layer", declaration=walk[0].declaration,
                                    declared_from=c.declared_from, prepared=walk)
    except AssertionError as e:
        return [str(e).rsplit("\ndeclared: ", 1)[0]]
    c.backward_records = [r for r in records if r.backward]
    if not any(h is not None for r in c.backward_records for h in (r.lhs_hold, r.rhs_hold)):
        return [f"grads are declared {c.declaration.roles['grads']}, and no matmul of the backward pass takes a "
                f"gradient operand the walk could tell (nothing held)"]
    return []


def _edges_lines(c: _Checked) -> list[str]:
    """The layer's program again on ``x`` with one token row replaced by each edge row, and on the tiny tensor (no
    compile): every output, gradient and state finite, and under a declaration every site's codes bitwise the
    referee's."""
    lines = []
    # What already fails on x is the other checks' to say: here only what the edge row breaks anew.
    normal = {i for i, r in enumerate(c.edge_records.get("x", [])) if r.findings}
    for kind, x_edge in c.edges.items():
        if isinstance(x_edge, str):
            c.edges_run[kind] = x_edge
            continue
        if kind not in c.reruns:  # not run by the declared check's walk already
            c.rerun(kind)
        bad = c.reruns[kind]
        sites = [f"{r.scope or r.location} ({r.primitive}): " + "; ".join(r.findings)
                 for i, r in enumerate(c.edge_records.get(kind, [])) if r.findings and i not in normal]
        if bad and not sites:
            sites = _first_nonfinite_site(c, x_edge)
        c.edges_run[kind] = "run" + c.sliced.on + (", codes held bitwise" if kind in c.edge_records else "")
        if bad or sites:
            what = EDGE_ROWS[kind] + (f" ({c.sliced.on.strip()})" if c.sliced.run else "")
            if bad:
                lines.append(f"{what}: not finite: {', '.join(bad)}")
            lines += [f"{what}: site {line}" for line in sites]
    return lines


def _state_path(path: tuple[Any, ...]) -> str:
    return "state " + "/".join(map(str, path))


def _first_nonfinite_site(c: _Checked, x_edge: jax.Array) -> list[str]:
    """Where a row first turns non-finite, with nothing declared: the first matmul whose output is not finite
    (one more program, on this failing path only)."""
    try:
        records = coverage(c.form.probe, x_edge, errors=True, declared=False, machinery=c.machinery,
                           kernels=c.kernels)
    except (AssertionError, ValueError):
        return []
    first = next((r for r in records if r.error is not None and not np.isfinite(r.error)), None)
    if first is None:
        return []
    where = f"{first.scope} ({first.primitive} at {first.location})" if first.scope else (
        f"{first.primitive} at {first.location} ({first.function})")
    return [f"{where}: its output is the first not finite (lhs [{first.lhs}], rhs [{first.rhs}])"]


#: check_layer's sub-checks, in the order their failures are listed: (name, function of what was run).
SUB_CHECKS = (
    ("coverage", _coverage_lines),
    ("formats", _formats_lines),
    ("tracks", _tracks_lines),
    ("gradients", _gradients_lines),
    ("determinism", _determinism_lines),
    ("uninitialized", _uninitialized_lines),
    ("backward declared", _backward_declared_lines),
    ("edges", _edges_lines),
)


def _uninitialized(what: str, form: Form, run: Run, x: jax.Array, machinery: Collection[str]) -> str | None:
    """Whether the program ``run`` compiled reads memory it never wrote (``jax.lax.empty``'s); None if not.

    The jaxpr is the one trace the program was compiled from; only a program
    holding such a buffer is compiled again, with its filled copies.
    """
    args = (form.params, form.rest, x)
    with user_code("check_layer", what):
        closed, returned = run.traced.closed, run.traced.shapes
        if not (buffers := unspecified_buffers(closed, machinery)):
            return None
        out_names = [f"output{f' {n}' if n else ''}" for n in run.out]

        def name(path: tuple[Any, ...]) -> str:  # (leaves, parameter gradients, input gradient, state after)
            at = path_name(path[1:]).removesuffix("/value")  # an NNX Variable's array
            if path[0].idx == 0:
                return out_names[path[1].idx]
            return {1: f"gradient of {at}", 2: "gradient of the input x"}.get(path[0].idx, f"state after the call {at}")

        names = [name(p) for p, _ in jax.tree_util.tree_flatten_with_path(returned)[0]]
        return uninitialized_reads(closed, valued(what, run.traced, args), names, buffers)


# -- the twin ---------------------------------------------------------------------
