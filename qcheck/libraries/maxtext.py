"""MaxText 0.2.5: the reader of its ``config.quantization``, its machinery (its own copies of the Linen/NNX bridge
and of its quantization wrappers, so a MaxText matmul points at the MaxText layer line that asked for it) and its
megablox kernels."""

from __future__ import annotations

from typing import Any

from qcheck.libraries._declaration import Declaration, RoleFormat
from qcheck.libraries._kernel import KernelRoles, KnownKernel
from qcheck.libraries._library import Library

#: MaxText 0.2.5's ``config.quantization`` on its AQT/Flax path (``use_qwix_quantization=False``):
#: ``int8`` is AQT v2 ``config_v3(fwd_bits=8)``, whose forward codes are qcheck's ``int8_aqt``
#: (maxtext/layers/quantizations.py:636); ``fp8`` and ``nanoo_fp8`` are Flax's delayed-scaling
#: e4m3fn / e4m3fnuz ops, at scale 1 on a fresh layer.
MAXTEXT_AQT = {
    "int8": {"activations": "int8_aqt", "weights": "int8_aqt"},
    "fp8": {"activations": "e4m3fn", "weights": "e4m3fn"},
    "nanoo_fp8": {"activations": "e4m3fnuz", "weights": "e4m3fnuz"},
}


#: MaxText 0.2.5's megablox ``gmm`` (``sparse_matmul`` and ``megablox`` on, qwix path off) quantizes its operands
#: itself, with a qwix ``QtRule`` of the AQT config's int8 dtypes and absmax calibration
#: (maxtext/kernels/megablox/ops.py:102-108, 255-290): qwix's int8 (absmax / 127.5), the lhs one scale per row
#: (``channelwise_axes=[0]``), the rhs one per output column shared across experts (``[2]``: "this makes the
#: bwd pass unable to reuse the scale" otherwise). Its fp8 operands take the config's e4m3 types, as declared.
MEGABLOX = {
    "int8": {"activations": RoleFormat("int8_qwix", per=(0,)), "weights": RoleFormat("int8_qwix", per=(2,))},
}

#: MaxText 0.2.5's ``config.quantization`` on its qwix path (``use_qwix_quantization=True``, applied by
#: ``maybe_quantize_model``): the dtype of its rules' ``weight_qtype``/``act_qtype``
#: (maxtext/layers/quantizations.py:1162-1204; ``fp8_full``'s rule, 1109-1159, is e4m3fn too). qwix's int8 is
#: qcheck's ``int8_qwix`` (absmax / 127.5, codes -128..127). ``fp8_nanoo`` is the MI300 configuration: its
#: provider (``NANOOFp8Provider``) casts ``dot_general`` sites to e4m3fnuz (Flax's NANOO op), which is what it
#: declares here; its rule's e4m3fn would reach only the einsums qwix's own einsum casts, the latent defect a
#: declaration of e4m3fnuz names. int4 and fp4 have no qcheck format: nothing is read.
MAXTEXT_QWIX = {
    "int8": "int8_qwix",
    **dict.fromkeys(("fp8", "fp8_e4m3", "fp8_gpu", "fp8_full"), "e4m3fn"),
    "fp8_nanoo": "e4m3fnuz",
    "fp8_e5m2": "e5m2",
}


def _maxtext(layer: Any) -> Declaration | None:
    # qwix's quantize_model hands back an instance of a subclass it makes (module "abc"): any MaxText class counts.
    if not any(c.__module__.startswith("maxtext.") for c in type(layer).__mro__):
        return None
    config = getattr(layer, "config", None)
    quantization = getattr(config, "quantization", None)
    quantization = getattr(quantization, "value", quantization)  # MaxText's QuantizationType is a str enum
    if not isinstance(quantization, str):
        return None
    qwix = bool(getattr(config, "use_qwix_quantization", False))
    if quantization == "":
        return Declaration({"weights": None, "activations": None}, "MaxText config.quantization=''")
    if qwix:
        fmt = MAXTEXT_QWIX.get(quantization)
        if fmt is None:
            return None
        return Declaration({"activations": RoleFormat(fmt), "weights": RoleFormat(fmt)},
                           f"MaxText config.quantization={quantization!r}, use_qwix_quantization (qwix rule: {fmt})")
    roles = MAXTEXT_AQT.get(quantization)
    if roles is None:
        return None
    kernels = {}
    if getattr(config, "sparse_matmul", False) and getattr(config, "megablox", False) and quantization in MEGABLOX:
        kernels = {"gmm": MEGABLOX[quantization]}
    return Declaration({k: RoleFormat(v) for k, v in roles.items()},
                       f"MaxText config.quantization={quantization!r}" + (", megablox" if kernels else ""), kernels)


_MEGABLOX = "maxtext/kernels/megablox/"
#: MaxText 0.2.5's megablox: ``backend.gmm(lhs, rhs, group_sizes, ...)`` and
#: ``backend.tgmm`` (maxtext/kernels/megablox/backend.py) call ``qwix.pallas.pallas_call`` on
#: ``(group_metadata, group_offset, lhs, rhs, existing_out)``, the first two as scalar prefetch, lhs and rhs
#: arrays or qwix ``QArray`` (codes and scale) when MaxText's quantization rule quantizes them
#: (ops.py ``_fwd_quantize_activation_and_weight``). Their backward kernels (ops.py ``_gmm_bwd``: the dlhs
#: ``gmm``, the drhs ``tgmm``) are traced under the custom_vjp's call, ``ops.gmm``, their only megablox
#: frame: told apart by the xprof metadata each function attaches.
KERNELS: tuple[KnownKernel, ...] = (
    KnownKernel("MaxText megablox", ((_MEGABLOX + "backend.py", "gmm"), (_MEGABLOX + "ops.py", "gmm")),
                frozenset({"preferred_element_type", "tiling", "transpose_rhs"}),
                KernelRoles("gmm", 0, 1, qarrays=True, lhs_contracting=(1,), rhs_contracting=(1,))),
    KnownKernel("MaxText megablox", ((_MEGABLOX + "backend.py", "tgmm"), (_MEGABLOX + "ops.py", "gmm")),
                frozenset({"prefer_element_type", "tiling", "num_actual_groups"}),
                KernelRoles("tgmm", 0, 1, qarrays=True, lhs_contracting=(0,), rhs_contracting=(0,))),
)

LIBRARY = Library(
    "MaxText",
    reads=("config.quantization: int8, fp8, nanoo_fp8 with use_qwix_quantization off (AQT, Flax's fp8 ops); with it "
           "on, its qwix rule's dtype (int8, fp8, fp8_e4m3, fp8_e5m2, fp8_gpu, fp8_nanoo, fp8_full)"),
    reader=_maxtext,
    machinery=("maxtext.layers.nnx_wrappers", "maxtext.layers.quantizations"),
    kernels=KERNELS,
)
