"""haliax (Levanter's layers): the reader of the dot ops ``quantize_linear_layers`` sets, and its fp8/int8 dot ops
as machinery, so a haliax matmul points at the ``Linear`` line that called its op."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from qcheck.libraries._declaration import Declaration, RoleFormat
from qcheck.libraries._library import Library
from qcheck.libraries.aqt import int8_format

#: haliax's dot ops (haliax/quantization.py), which ``quantize_linear_layers`` (Levanter's
#: ``TrainerConfig.quantization``) sets on every ``hnn.Linear``: ``Fp8DotGeneralOp`` casts both operands to
#: its ``fwd_dtype`` and the output gradient to its ``rev_dtype`` (e4m3fn / e5m2: delayed scaling, scale 1 on
#: a fresh op); ``Int8DotGeneralOp`` is AQT v2 ``config_v3()``, int8 forward on both operands, scale
#: absmax / 127.5 per index of every axis but the contraction's: qcheck's ``int8_aqt``.
HALIAX_FP8 = {"float8_e4m3fn": "e4m3fn", "float8_e4m3fnuz": "e4m3fnuz", "float8_e5m2": "e5m2",
              "float8_e5m2fnuz": "e5m2fnuz"}
_HALIAX_OPS = ("Fp8DotGeneralOp", "Int8DotGeneralOp")


def _haliax_op(node: Any) -> str | None:
    return next((c.__name__ for c in type(node).__mro__
                 if c.__module__ == "haliax.quantization" and c.__name__ in _HALIAX_OPS), None)


def _haliax_roles(op: Any) -> tuple[tuple[str, str], ...] | None:
    if _haliax_op(op) == "Fp8DotGeneralOp":
        fwd, rev = (HALIAX_FP8.get(str(np.dtype(d))) for d in (op.fwd_dtype, op.rev_dtype))
        if fwd is None or rev is None:
            return None
        return (("activations", fwd), ("weights", fwd), ("grads", rev))
    quantizer = getattr(getattr(getattr(op, "cfg", None), "fwd", None), "dg_quantizer", None)
    lhs, rhs = (int8_format(getattr(getattr(quantizer, side, None), "numerics", None)) for side in ("lhs", "rhs"))
    if lhs is None or rhs is None:
        return None
    return (("activations", lhs), ("weights", rhs))  # haliax's Linear puts the input on the lhs


def _haliax(layer: Any) -> Declaration | None:
    # An Equinox module (or any pytree: a jax.tree_util.Partial of a function and the block) holding the ops;
    # a plain function holds nothing to read. haliax is never imported here: a layer using it has imported it.
    if "haliax" not in sys.modules or isinstance(layer, type):
        return None
    import jax

    ops = [leaf for leaf in jax.tree_util.tree_leaves(layer, is_leaf=lambda n: _haliax_op(n) is not None)
           if _haliax_op(leaf) is not None]
    if not ops:
        return None
    kinds = {(_haliax_op(op), _haliax_roles(op)) for op in ops}
    if len(kinds) != 1 or (kind := kinds.pop())[1] is None:
        return None  # ops of several kinds or formats: no one declaration (one format per role is then checked)
    name, roles = kind
    return Declaration({k: RoleFormat(v) for k, v in roles},
                       f"haliax {name} on {len(ops)} Linear layer(s): {', '.join(f'{k} {v}' for k, v in roles)}")


def named_array_type() -> Any:
    """haliax's ``NamedArray`` (a pytree around its ``.array``), or a type nothing is, where haliax is not loaded."""
    haliax = sys.modules.get("haliax")
    return getattr(haliax, "NamedArray", _NoType)


class _NoType:
    pass


def overwritten_state_types() -> tuple[type, ...]:
    """haliax's quantized dot ops: fp8 scales and amax histories, inexact arrays that are state, not parameters.

    Levanter's train step overwrites them with their "gradient" instead of
    training them (``haliax.quantization.partition_for_grad_overwrite``), as
    NNX keeps fp8 state out of ``nnx.Param``; the twin has none of them.
    """
    quantization = sys.modules.get("haliax.quantization")
    found = (getattr(quantization, n, None) for n in ("CustomGradientAccumulation", "OverwriteWithGradient"))
    return tuple(t for t in found if isinstance(t, type))


LIBRARY = Library(
    "haliax",
    reads=("Fp8DotGeneralOp's fwd/rev dtypes and Int8DotGeneralOp's AQT config, as quantize_linear_layers sets them "
           "on the layer's Linears (a pytree: an Equinox module, or a Partial holding it)"),
    reader=_haliax,
    machinery=("haliax.quantization", "haliax._src.fp8"),
)
