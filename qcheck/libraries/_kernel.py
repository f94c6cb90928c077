"""An opaque kernel's operand roles (:class:`KernelRoles`: declared by a user, or known) and a kernel a library
ships, told by where it is called (:class:`KnownKernel`): the records ``kernels=`` and a library's ``kernels``
take, read by the coverage map's walk (``qcheck._coverage._kernels``).
"""

from __future__ import annotations

import dataclasses
from typing import Any


def _position(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclasses.dataclass(frozen=True)
class KernelRoles:
    """Which inputs of an opaque kernel named ``name`` are its matmul's lhs and rhs, and their scales.

    Positions count the kernel's inputs from 0 in the order the kernel takes
    them (a ``pallas_call``'s ``in_specs``): every operand it is called with
    but a ``pallas_call``'s scalar-prefetch operands and dynamic grid bounds.
    Metadata passed as plain inputs (tokamax's int32 group offsets ahead of
    its codes) counts like any input. ``lhs_scale``/``rhs_scale``: the input
    holding that operand's scales, whose type is part of its format.
    ``qarrays``: the kernel is called through ``qwix.pallas.pallas_call``,
    which passes a qwix ``QArray`` as two inputs (its codes, then its scale);
    positions then count each ``QArray`` as one input, and each operand's scale
    is found beside its codes (so ``lhs_scale``/``rhs_scale`` are not given).
    ``lhs_contracting``/``rhs_contracting``: the axes of each operand the
    kernel contracts, so that its codes are held bitwise at a format whose
    scales run along them (int8's, the block formats'); without them such
    codes are held by their types only.
    """

    name: str
    lhs: int
    rhs: int
    lhs_scale: int | None = None
    rhs_scale: int | None = None
    qarrays: bool = False
    lhs_contracting: tuple[int, ...] | None = None
    rhs_contracting: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"KernelRoles: name must be the kernel's name (a non-empty str), got {self.name!r}")
        what = f"KernelRoles({self.name!r})"
        for field in ("lhs", "rhs", "lhs_scale", "rhs_scale"):
            value = getattr(self, field)
            if not (_position(value) or (value is None and field.endswith("scale"))):
                raise ValueError(f"{what}: {field} must be an input's position (an int >= 0), got {value!r}")
        used = [p for p in (self.lhs, self.rhs, self.lhs_scale, self.rhs_scale) if p is not None]
        if len(set(used)) != len(used):
            raise ValueError(f"{what}: lhs, rhs and their scales must be different inputs, got positions {used}")
        for field in ("lhs_contracting", "rhs_contracting"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, tuple) and all(_position(a) for a in value)):
                raise ValueError(f"{what}: {field} must be a tuple of axes (ints >= 0), got {value!r}")
        if self.qarrays and (self.lhs_scale is not None or self.rhs_scale is not None):
            raise ValueError(f"{what}: with qarrays=True each operand's scale is read beside its codes; "
                             f"give lhs and rhs only")


@dataclasses.dataclass(frozen=True)
class KnownKernel:
    """A kernel a library ships (a :class:`~qcheck.libraries.Library`'s ``kernels``): a kernel is this one
    when a frame of its traceback is one of ``calls`` (the file's path ends in the suffix, the function's
    qualified name is the name) and the keys of its ``xprof_metadata`` are ``metadata`` (and, where ``named``, its own ``pallas_call(name=...)`` is
    ``roles.name``: kernels of one function told apart by their names alone); its name and roles are then
    ``roles``'."""

    library: str
    calls: tuple[tuple[str, str], ...]
    metadata: frozenset[str]
    roles: KernelRoles
    named: bool = False
