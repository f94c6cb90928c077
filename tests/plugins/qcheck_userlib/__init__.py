"""A team's own quantization library, as a package outside qcheck: its layer, its ops and its kernel, and the
qcheck Library that teaches qcheck to read them, offered through the ``qcheck.libraries`` entry point of its
distribution (``qcheck_userlib-0.1.dist-info/entry_points.txt``). qcheck is not edited for it."""

from __future__ import annotations

from typing import Any

from qcheck.libraries import Declaration, KernelRoles, KnownKernel, Library, RoleFormat

from qcheck_userlib.layers import QDense
from qcheck_userlib.ops import KERNEL_NAME

#: The formats QDense's ``fmt`` configures, as qcheck names them: its ops cast both operands at scale 1.
FORMATS = {"fp8": "e4m3fn"}


def read(layer: Any) -> Declaration | str | None:
    """QDense's configured format; why not, for a format qcheck has no name for; None for another layer."""
    if not isinstance(layer, QDense):
        return None
    fmt = FORMATS.get(layer.fmt)
    if fmt is None:
        return f"QDense(fmt={layer.fmt!r}) is no qcheck format"
    return Declaration({"weights": RoleFormat(fmt), "activations": RoleFormat(fmt)},
                       f"UserLib QDense(fmt={layer.fmt!r})")


#: ops.kernel_matmul's Pallas kernel: its inputs are the lhs codes, their scale, the rhs codes, their scale.
KERNEL = KnownKernel("UserLib", (("qcheck_userlib/ops.py", "kernel_matmul"),), frozenset(),
                     KernelRoles(KERNEL_NAME, lhs=0, rhs=2, lhs_scale=1, rhs_scale=3))

LIBRARY = Library("UserLib", reads="QDense.fmt: fp8 (e4m3fn on both operands, at scale 1)", reader=read,
                  machinery=("qcheck_userlib.ops",), kernels=(KERNEL,))
