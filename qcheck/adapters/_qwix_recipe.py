"""qwix (pip ``qwix``) as an interception recipe: a qwix provider applied to each call site of the ``none`` layer.

How qwix decides, and what that means here (qwix 0.1.8, read from
qwix/_src/providers/qt.py and qwix/_src/utils/flax_util.py):

- It intercepts ``jnp.einsum``, ``jax.lax.dot_general`` and
  ``jax.lax.ragged_dot`` inside the one method ``quantize_model`` wraps, and
  picks a rule by the module path of the nearest calling NNX module.
- An operand is a weight only if it is one of that module's own
  ``nnx.Param`` (``find_param``). qcheck's call sites receive the layer's
  weights as arguments, and a site cannot hold them as params without moving
  them in the layer's state tree (NNX files a shared Param under its first path,
  ``sites/...``), so qwix sees both operands of every site as activations.
- The quantization axes and calibration do not depend on that call
  (``dot_general.get_how_to_quantize`` takes neither), only the qtype, the
  calibration method, static scales and the backward tile size do; ragged_dot
  takes lhs as the activation and rhs as the weight whatever it finds. So a
  rule that treats weights and activations alike computes here exactly what it
  computes on a model that owns its weights; :class:`QwixRecipe` accepts only
  such rules and says why for any other.

Each site is quantized on its own (``quantize_model`` on the site, wrapping the
one method its path calls: ``__call__`` on the dense path, ``ragged_dot`` on the
sparse one), so a site run alone (the ``exact`` invariant's probes) is the same
quantized function as inside the layer, and the router and the combine, which
run in the layer itself, stay unquantized as on every qcheck layer. A rule's
``module_path`` is matched against the site's own path, which is ``""``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

try:
    import qwix
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("qcheck.adapters' qwix recipes need qwix: pip install 'qcheck[qwix]'") from e

from qcheck.recipes import Expect, InterceptRecipe, KnownDefect, Reference

# qwix 0.1.8 walks NNX modules with APIs flax 0.12 deprecates; qcheck's tests turn warnings into errors.
_QWIX_DEPRECATIONS = (r"The 'm\.iter_modules\(\)' method is deprecated", r"'\.value' access is now deprecated")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        for message in _QWIX_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)
        yield


def _quietly(method):
    # qwix walks the site's modules again on every call (process_model_inputs), under the caller's trace.
    @functools.wraps(method)
    def call(*args, **kwargs):
        with _quiet():
            return method(*args, **kwargs)

    return call


def _qtype(qtype) -> str:
    try:
        return jnp.dtype(qtype).name
    except TypeError:  # qwix also takes names of its own types ("nf4", "mxfp8")
        return str(qtype)


def _check_rule(recipe: str, i: int, rule) -> None:
    if not isinstance(rule, qwix.QtRule):
        raise TypeError(f"QwixRecipe {recipe!r}: rules[{i}] must be a qwix.QtRule, got {type(rule).__name__}")
    act_method = rule.act_calibration_method or "absmax"  # qwix's default for XLA
    why = None
    if rule.weight_qtype is None or rule.act_qtype is None:
        why = (f"weight_qtype={rule.weight_qtype!r}, act_qtype={rule.act_qtype!r}: qwix's QT provider skips a "
               "matmul without weight_qtype, and one without act_qtype leaves what it takes for an activation in "
               "full precision")
    elif _qtype(rule.weight_qtype) != _qtype(rule.act_qtype):
        why = f"weight_qtype {_qtype(rule.weight_qtype)} differs from act_qtype {_qtype(rule.act_qtype)}"
    elif rule.weight_calibration_method != act_method:
        why = (f"weight_calibration_method {rule.weight_calibration_method!r} differs from "
               f"act_calibration_method {act_method!r}")
    elif rule.act_static_scale:
        why = "act_static_scale=True would give the weights running activation statistics"
    elif rule.bwd_weight_grad_tile_size is not None:
        why = "bwd_weight_grad_tile_size applies only to operands qwix takes for weights"
    if why is not None:
        raise ValueError(
            f"QwixRecipe {recipe!r}: rules[{i}] treats weights and activations differently ({why}). qwix takes an "
            "operand for a weight only if it is an nnx.Param of the module calling the matmul (flax_util.find_param, "
            "qwix 0.1.8), and a qcheck call site receives the layer's weights as arguments, so qwix would quantize "
            "them as activations. Give weights and activations the same qtype and calibration, or check a model "
            "that owns its weights with qcheck.checks (docs/libraries.md)")


class QwixRecipe(InterceptRecipe):
    """``qwix.quantize_model`` with a fresh ``qwix.QtProvider(rules)`` on each call site of the ``none`` layer."""

    #: Skip qwix's initializing call of each site (``skip_nnx_init``): with weights and activations alike
    #: and dynamic scales, it creates no state. False runs it, as qwix does by default.
    skip_init: bool = True

    #: qwix's QAT keeps the original operands for the backward pass: without ``bwd_qtype`` a dense site's
    #: gradients are g against the operands as received, bitwise (qwix 0.1.8). Its ``ragged_dot``'s are
    #: neither those nor the quantized operands' (tests/test_intercept.py), so no sparse reference (the
    #: constructor narrows any ``expect``'s backward paths to the dense one); a rule with ``bwd_qtype``
    #: quantizes g in a way no qcheck referee models, so no reference at all.
    reference = Reference(grad_operands="original")
    expect = Expect()

    def __init__(
        self,
        name: str,
        rules: Sequence[qwix.QtRule],
        *,
        lhs: str | None = None,
        rhs: str | None = None,
        reference: Reference | None = None,
        expect: Expect | None = None,
    ):
        rules = tuple(rules)
        if not rules:
            raise ValueError(f"QwixRecipe {name!r}: rules must hold at least one qwix.QtRule")
        for i, rule in enumerate(rules):
            _check_rule(name, i, rule)
        super().__init__(name, self._quantize_sites, lhs=lhs, rhs=rhs, reference=reference, expect=expect)
        self.rules = rules
        self.expect = self.expect.narrow_backward(() if any(r.bwd_qtype is not None for r in rules) else ("dense",))

    def _quantize_sites(self, layer: nnx.Module, sample_input: jax.Array) -> nnx.Module:
        batch, seq, _ = sample_input.shape
        specs = layer.site_specs(batch, seq)
        with _quiet():
            for name, spec in specs.items():
                method, inputs = spec.matmul.site_call(jnp.ones(spec.lhs_shape, layer.dtype),
                                                       jnp.ones(spec.rhs_shape, layer.dtype))
                provider = qwix.QtProvider(list(self.rules))
                # qwix's first call only creates state (converted weights, static-scale statistics),
                # and the rules accepted here create none (tests/test_intercept.py holds the two
                # bitwise alike); run eagerly, that call compiled some 60 one-op programs per layer.
                site = qwix.quantize_model(layer.sites[name], provider, *inputs, methods=(method,),
                                           skip_nnx_init=self.skip_init)
                cls = type(site)
                site.__class__ = type(cls.__name__, (cls,), {method: _quietly(getattr(cls, method))})
                layer.sites[name] = site
        return layer

    def __repr__(self) -> str:
        return f"QwixRecipe({self.name!r}, {list(self.rules)!r})"


#: qwix 0.1.8 (jax 0.10.2, 0.11.2 and 0.12.0.1, CPU): on the 2 x 4 mesh, Mixtral's sparse layer computes another
#: function than on one device; its first site (wi_0) already differs, in 24 of 128 rows, for the same operands. On
#: jax 0.12.1 the two agree (the cell says so), so it is keyed on jax's versions.
QWIX_INT8_SHARDED_SPARSE = KnownDefect(
    library="qwix", invariant="sharded", paths=("sparse",), models=("mixtral",), seen_in="jax",
    seen=("0.10.2", "0.11.2", "0.12.0.1"),
    reason="int8 ragged_dot gives other results on a 2 x 4 mesh than on one device",
    match=r"qwix_int8-mixtral-sparse: assert_sharded_matches: the sharded layer differs from the single-device one at "
          r"\d+ of 2048 values",
)


#: qwix 0.1.8's ragged_dot calibrates the weight per output column over all experts (ragged_dot_qt.py:
#: channelwise_axes=[2]); the `exact` check names it on the sparse path of both models.
QWIX_INT8_RAGGED_SHARED_SCALE = KnownDefect(
    library="qwix", invariant="exact", paths=("sparse",),
    reason="ragged_dot shares one weight scale across experts",
    match=r"it equals rhs with one weight scale shared across groups \(calibrated over groups and contraction\), "
          r"in integer arithmetic bitwise",
)


#: The same defect, seen by the coverage map holding each site to the recipe's declared int8_qwix codes.
QWIX_INT8_RAGGED_SHARED_SCALE_CODES = dataclasses.replace(
    QWIX_INT8_RAGGED_SHARED_SCALE, invariant="coverage",
    match=r"rhs \(weight\): codes are not int8_qwix's: .* they match one scale shared across axis 0")


def qwix_int8(name: str = "qwix_int8") -> QwixRecipe:
    """qwix's QAT int8 (weights and activations int8, absmax, dynamic scales; gradients straight through).

    Its codes are ``int8_qwix`` on both operands, and with both operands int8
    qwix multiplies the codes and applies the scales after
    (``dot_general.dot_general``'s fast path), so the ``exact`` check runs in
    integer arithmetic; on the sparse path it fails as declared.
    """
    rule = qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8)
    return QwixRecipe(name, [rule], lhs="int8_qwix", rhs="int8_qwix",
                      reference=dataclasses.replace(QwixRecipe.reference, matmul="integer"),
                      expect=Expect(known_defects=(QWIX_INT8_RAGGED_SHARED_SCALE, QWIX_INT8_RAGGED_SHARED_SCALE_CODES,
                                                   QWIX_INT8_SHARDED_SPARSE)))
