"""qwix 0.1.8: the reader of the rules ``qwix.quantize_model`` was given, the weights its ``PtqProvider`` keeps as
codes, and its frames as machinery."""

from __future__ import annotations

import re
import sys
from typing import Any

import numpy as np

from qcheck.libraries._declaration import Declaration, RoleFormat, Stored
from qcheck.libraries._library import Library

#: qwix 0.1.8's rule qtypes (``QtRule``/``QuantizationRule`` ``weight_qtype``/``act_qtype``, by their dtype's name)
#: with absmax calibration, as qcheck's formats: its int8 is ``int8_qwix`` (absmax / 127.5, codes -128..127), its
#: fp8 types the element type under the layer's own scale (absmax / fmax per channel: the codes are the cast of
#: x / scale, held bitwise as the declared fp8 format). ``minmax`` int8 is ``int8_qwix_minmax``. qwix's own
#: ``mxfp8`` and ``nvfp4`` are not qcheck's (qcheck.referees._libraries), nor are int4, nf4 and the rest: read as
#: nothing, saying so.
QWIX_ABSMAX = {"int8": "int8_qwix", "float8_e4m3fn": "e4m3fn", "float8_e5m2": "e5m2",
               "float8_e4m3fnuz": "e4m3fnuz", "float8_e5m2fnuz": "e5m2fnuz"}
QWIX_MINMAX = {"int8": "int8_qwix_minmax"}


def _qwix_provider(layer: Any) -> Any:
    """The provider ``qwix.quantize_model`` wrapped the model's method with, or None.

    qwix 0.1.8 (qwix/_src/model.py:182-200, interception.py:124-184) replaces the model's class by a subclass
    holding ``_unquantized_type`` whose call method is an intercepting wrapper; the provider is bound, as
    ``functools.partial(_input_transform, provider)``, in that wrapper's closure.
    """
    import functools

    cls = type(layer)
    if "_unquantized_type" not in cls.__dict__:
        return None
    for fn in cls.__dict__.values():
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(v, functools.partial) and v.args and \
                    any(c.__module__.startswith("qwix.") for c in type(v.args[0]).__mro__):
                return v.args[0]
    return None


def _qwix_rule_roles(rule: Any) -> dict[str, RoleFormat | None] | str:
    """A qwix rule's formats by role, or why they are not a qcheck format."""
    def one(qtype: Any, method: str | None, what: str) -> RoleFormat | None | str:
        if qtype is None:
            return None
        name = qtype if isinstance(qtype, str) else str(np.dtype(qtype))
        table = {"absmax": QWIX_ABSMAX, "minmax": QWIX_MINMAX}.get(str(method))
        fmt = None if table is None else table.get(name)
        if fmt is None:
            return f"{what} {name} with calibration {method!r}, which is no qcheck format"
        return RoleFormat(fmt)

    if getattr(rule, "tile_size", None) is not None:
        return f"tile_size={rule.tile_size} (subchannel scales), which no qcheck format declares"
    if getattr(rule, "act_static_scale", False):
        return "act_static_scale=True (a calibrated scale, not the format's per-call rule)"
    roles = {"weights": one(rule.weight_qtype, rule.weight_calibration_method, "weight_qtype"),
             "activations": one(rule.act_qtype, rule.act_calibration_method or "absmax", "act_qtype")}
    bad = [v for v in roles.values() if isinstance(v, str)]
    return bad[0] if bad else roles


def _qwix(layer: Any) -> Declaration | str | None:
    # An NNX model qwix.quantize_model handed back (qwix is never imported here: such a model has imported it).
    if "qwix" not in sys.modules or isinstance(layer, type):
        return None
    provider = _qwix_provider(layer)
    if provider is None:
        return None
    kind = type(provider).__name__
    if kind not in ("QtProvider", "PtqProvider"):
        # ODML and LoRA providers compute otherwise: not read.
        return f"qwix {kind}: only QtProvider's and PtqProvider's rules are read"
    # QuantizationProvider keeps its rules, defaults filled in (_init_rule), as ``_rules``: qwix 0.1.8
    # qconfig.py:118; it has no public accessor (get_unused_rules lists the unmatched ones only).
    if not isinstance(getattr(provider, "_rules", None), (list, tuple)):
        # Another qwix keeps them elsewhere: say so, rather than read "no rule reaches any module".
        return f"qwix {kind} keeps no _rules list (qwix 0.1.8's): its rules cannot be read"
    rules = list(provider._rules)
    from flax import nnx

    if not isinstance(layer, nnx.Module):
        return "a Linen model: only an NNX model's module paths are read"
    # qwix matches each rule's module_path regex against the path of the module whose method runs the op,
    # "/"-joined (qconfig.py:210-216): the first rule that matches wins. op_names narrow a rule to some ops.
    if any(getattr(r, "op_names", ()) for r in rules):
        return "qwix rules with op_names (per-op formats within a module), which are not read"
    read = {i: _qwix_rule_roles(r) for i, r in enumerate(rules)}
    iter_modules = getattr(nnx, "iter_modules", None) or type(layer).iter_modules  # flax 0.12 / before
    scopes: dict[str, dict[str, RoleFormat | None]] = {}
    used: set[int] = set()
    for path, _ in iter_modules(layer):
        p = "/".join(map(str, path))
        idx = next((i for i, r in enumerate(rules) if re.fullmatch(r.module_path, p)), None)
        if idx is not None and isinstance(read[idx], str):
            return f"qwix QtRule(module_path={rules[idx].module_path!r}): {read[idx]}"
        scopes[p] = {"weights": None, "activations": None} if idx is None else read[idx]
        used |= set() if idx is None else {idx}
    if not used:
        return None  # no rule reaches any module: nothing quantized to read
    top = scopes.get("", {"weights": None, "activations": None})
    said = "; ".join(f"module_path={rules[i].module_path!r}: " + ", ".join(
        f"{k} {'full precision' if v is None else v}" for k, v in read[i].items()) for i in sorted(used))
    source = f"qwix {kind} rules on {len(scopes)} module(s) ({said})"
    # PtqProvider keeps each weight its rules reach as codes and a scale (ptq.py WithAux): held by check_layer
    # against the twin's float weight, by its type elsewhere (no float source), accepted with this reason.
    stored = {"weights": QWIX_STORED} if kind == "PtqProvider" else {}
    kept = _qwix_stored_params(layer) if kind == "PtqProvider" else {}
    if all(v == top for v in scopes.values()):
        return Declaration(dict(top), source, stored=stored, stored_params=kept)
    return Declaration(dict(top), source, scopes=scopes, stored=stored, stored_params=kept)


#: Why a qwix PtqProvider weight is held by its type where no twin holds its float weight.
QWIX_STORED = ("the qwix reader: PtqProvider stores each weight as int8 codes (qvalue) and a scale, keeping no "
               "float weight")


def _qwix_stored_params(layer: Any) -> dict[str, Stored]:
    """The weights a qwix 0.1.8 ``PtqProvider`` model keeps as codes: each module attribute that is a ``WithAux``
    (qwix/_src/providers/ptq.py:37-80) holding a ``QArray`` (its ``qvalue``, ``scale``, ``zero_point`` each an
    ``nnx.Param``), quantized as its ``how`` says: one scale per index of its ``channelwise_axes``, the others
    reduced (the contraction axes qwix found in the op's dimension numbers). Tiled (subchannel) weights are not
    read. By the attribute's path, which the float twin's parameter has."""
    if "qwix" not in sys.modules or isinstance(layer, type):
        return {}
    from flax import nnx

    if not isinstance(layer, nnx.Module):
        return {}
    iter_modules = getattr(nnx, "iter_modules", None) or type(layer).iter_modules
    out: dict[str, Stored] = {}
    for path, module in iter_modules(layer):
        scope = "/".join(map(str, path))
        for name, v in vars(module).items():
            if type(v).__name__ != "WithAux" or not type(v).__module__.startswith("qwix."):
                continue
            how, array = getattr(v, "how", None), getattr(v, "array", None)
            if how is None or getattr(how, "tiled_axes", None) or not hasattr(array, "qvalue"):
                continue
            source = f"{scope}/{name}" if scope else str(name)
            kept = set(getattr(how, "channelwise_axes", ()) or ())
            axes = tuple(a for a in range(len(v.shape)) if a not in kept)
            zero = f"{source}/array/zero_point" if getattr(array, "zero_point", None) is not None else None
            out[source] = Stored(source, f"{source}/array/qvalue", axes, f"{source}/array/scale", zero, None, scope)
    return out


LIBRARY = Library(
    "qwix",
    reads=("the QtProvider or PtqProvider rules qwix.quantize_model was given (module_path, weight_qtype, act_qtype, "
           "calibration methods), per module path: int8 absmax int8_qwix, int8 minmax int8_qwix_minmax, fp8 absmax "
           "its element type; a module no rule reaches full precision; PtqProvider's weights stored as codes, for "
           "check_layer to hold against the twin's float weights"),
    reader=_qwix,
    stored=_qwix_stored_params,
    machinery=("qwix",),
)
