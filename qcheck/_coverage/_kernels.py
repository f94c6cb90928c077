"""Opaque kernels (a ``pallas_call``, an FFI or custom call) read by their operands' roles.

The walk cannot look into a kernel's body, so a kernel is one record, read
from the operands it is called with. They split in two:

* metadata, never a matmul operand: a ``pallas_call``'s hoisted constants, its
  dynamic grid bounds and its scalar-prefetch operands
  (``PrefetchScalarGridSpec``: group offsets, tile ids), stated by its
  ``grid_mapping`` (``num_dynamic_grid_bounds``, ``num_index_operands``; its
  last ``num_inputs`` operands are the kernel's inputs), and every integer
  operand wider than 8 bits (indices, group sizes) or boolean one;
* the kernel's inputs, in the order the kernel takes them (a
  ``pallas_call``'s ``in_specs``; every operand of another kernel).

Which input is the lhs, which the rhs and which their scales is the kernel's
*roles*: declared by the user (:class:`KernelRoles`, passed as ``kernels=``
to ``coverage``, ``assert_quantized`` and ``check_layer``) or found in
the kernels of qcheck's libraries (``qcheck.libraries``: each ``Library``'s ``kernels``). A kernel neither
names has its roles unknown: its record says so, and ``assert_quantized``
fails on it (declare its roles, or spare it with a skip rule), whatever its
operands' types.

A kernel's name, what :class:`KernelRoles` is matched against: its
``pallas_call(name=...)`` (an FFI or custom call's target name), else the
kernel function's name, else (a ``lambda``: qwix's ``qwix.pallas.pallas_call``
wraps every kernel in one) the name its library's :class:`KnownKernel` gives,
else the function that called it (the record's ``function`` without its
class or enclosing functions).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from qcheck.libraries import KernelRoles, KnownKernel, known_kernels


def as_kernel_roles(kernels: Any, what: str) -> dict[str, KernelRoles]:
    """``kernels=`` (None, one :class:`KernelRoles` or a sequence of them) by kernel name."""
    if kernels is None:
        return {}
    if isinstance(kernels, KernelRoles):
        kernels = [kernels]
    if isinstance(kernels, (str, bytes)) or not isinstance(kernels, Sequence) or not all(
            isinstance(k, KernelRoles) for k in kernels):
        raise ValueError(f"{what}: kernels must be a qcheck.KernelRoles or a sequence of them, got {kernels!r}")
    names = [k.name for k in kernels]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{what}: kernels declares the roles of {twice} more than once")
    return {k.name: k for k in kernels}


@dataclasses.dataclass(frozen=True)
class KernelRead:
    """What the walk reads of one opaque kernel; positions are the eqn's operand indices.

    ``source``: where its roles came from ("declared", or the library of a row
    of a library's known kernels); None: roles unknown, and lhs/rhs are None.
    ``misfit``: why the declared roles do not fit this kernel (then unknown).
    """

    name: str
    data: tuple[int, ...]
    source: str | None = None
    lhs: int | None = None
    rhs: int | None = None
    lhs_scale: int | None = None
    rhs_scale: int | None = None
    misfit: str | None = None
    lhs_contracting: tuple[int, ...] | None = None
    rhs_contracting: tuple[int, ...] | None = None


def _metadata(aval: Any) -> bool:
    """An operand that is an index or a flag, never data: an integer wider than 8 bits, or a bool."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return True
    if jnp.issubdtype(dtype, jax.dtypes.extended):  # PRNG keys
        return True
    dtype = np.dtype(dtype)
    return dtype == np.bool_ or (jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize > 1)


def _inputs(eqn: jcore.JaxprEqn) -> tuple[int, ...]:
    """The operand indices of the kernel's inputs: a pallas_call's last ``num_inputs``; every operand else."""
    n = len(eqn.invars)
    gm = eqn.params.get("grid_mapping")
    count = getattr(gm, "num_inputs", None)
    if isinstance(count, int) and 0 <= count <= n:
        return tuple(range(n - count, n))
    # A pallas_call whose grid mapping states no inputs count: drop its leading metadata by the counts it has.
    skip = sum(getattr(gm, f, 0) or 0 for f in ("num_dynamic_grid_bounds", "num_index_operands")) if gm else 0
    return tuple(range(min(skip, n), n))


def _name(eqn: jcore.JaxprEqn, known: KnownKernel | None, caller: str) -> str:
    p = eqn.params
    for key in ("name", "kernel_name", "target_name", "call_target_name"):
        if isinstance(p.get(key), str) and p[key]:
            return p[key]
    debug = getattr(p.get("jaxpr"), "debug_info", None)
    fn = getattr(debug, "func_name", None)
    if isinstance(fn, str) and fn and not fn.startswith("<"):
        return fn
    if known is not None:
        return known.roles.name
    return caller.rsplit(".", 1)[-1] if caller and not caller.startswith("<") else eqn.primitive.name


def _metadata_keys(eqn: jcore.JaxprEqn) -> frozenset[str]:
    meta = eqn.params.get("metadata") or {}
    try:
        keys = json.loads(meta.get("xprof_metadata", "{}")) if hasattr(meta, "get") else {}
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(keys) if isinstance(keys, dict) else frozenset()


def _known(eqn: jcore.JaxprEqn) -> KnownKernel | None:
    """The known kernel of a registered library (``qcheck.libraries``) this kernel is, if any."""
    tb = eqn.source_info.traceback
    if tb is None:
        return None
    frames = {(code.co_filename.replace(os.sep, "/"), code.co_qualname) for code, _ in zip(*tb.raw_frames())}
    keys = _metadata_keys(eqn)
    for row in known_kernels():
        if row.named and eqn.params.get("name") != row.roles.name:
            continue
        if keys == row.metadata and any(f == function and path.endswith("/" + suffix)
                                        for path, f in frames for suffix, function in row.calls):
            return row
    return None


def _is_narrow(aval: Any) -> bool:
    """Codes: an integer or float type of at most 8 bits (int8, int4, the float8 types)."""
    dtype = np.dtype(aval.dtype)
    return (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize <= 1


def _is_scale_of(scale: Any, codes: Any) -> bool:
    """``scale`` can be the scale beside ``codes`` in a qwix QArray: a wider float of the same rank, each axis
    1 or a divisor of the codes' (per tensor, per channel, per block), one at least reduced to 1."""
    dtype, shape = np.dtype(scale.dtype), tuple(scale.shape)
    return (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > 1 and len(shape) == len(codes.shape)
            and all(s >= 1 and c % s == 0 for s, c in zip(shape, codes.shape))
            and any(s == 1 < c for s, c in zip(shape, codes.shape)))


def _input_names(eqn: jcore.JaxprEqn, inputs: tuple[int, ...]) -> list[str] | None:
    """The kernel's own names of its inputs where they show qwix's QArrays (a pallas_call's debug info:
    ``kernel_args[i].qvalue`` and ``kernel_args[i].scale``); None otherwise."""
    gm = eqn.params.get("grid_mapping")
    names = getattr(getattr(eqn.params.get("jaxpr"), "debug_info", None), "arg_names", None)
    start = getattr(gm, "num_index_operands", None)
    if not isinstance(start, int) or not names or len(names) < start + len(inputs):
        return None
    names = list(names[start:start + len(inputs)])
    # Only qwix's names say where a QArray is; a kernel's own parameter names say nothing of it.
    return names if all(isinstance(n, str) for n in names) and any(n.endswith(".qvalue") for n in names) else None


def _qarrays(eqn: jcore.JaxprEqn, inputs: tuple[int, ...]) -> list[tuple[int, int | None]]:
    """The inputs grouped as qwix passes them: (codes, scale) for a QArray, (array, None) otherwise.

    By qwix's argument names where the kernel has them; else by type and shape (narrow codes, then a scale).
    """
    names = _input_names(eqn, inputs)

    def pair(i: int) -> bool:
        if names is not None:
            return names[i].endswith(".qvalue") and names[i + 1] == names[i][:-len(".qvalue")] + ".scale"
        a = eqn.invars[inputs[i]].aval
        return _is_narrow(a) and _is_scale_of(eqn.invars[inputs[i + 1]].aval, a)

    groups, i = [], 0
    while i < len(inputs):
        if i + 1 < len(inputs) and pair(i):
            groups.append((inputs[i], inputs[i + 1]))
            i += 2
        else:
            groups.append((inputs[i], None))
            i += 1
    return groups


def read_kernel(eqn: jcore.JaxprEqn, declared: dict[str, KernelRoles], caller: str, location: str) -> KernelRead:
    """The kernel's name, data operands and (where declared or known and they fit) the operands of each role."""
    known = _known(eqn)
    name = _name(eqn, known, caller)
    inputs = _inputs(eqn)
    data = tuple(i for i in inputs if not _metadata(eqn.invars[i].aval))
    if name in declared:
        roles, source = declared[name], "declared"
    elif known is not None:
        source, roles = known.library, known.roles
    else:
        return KernelRead(name, data)
    try:
        return KernelRead(name, data, source, *_operands(eqn, roles, inputs, data, location),
                          lhs_contracting=roles.lhs_contracting, rhs_contracting=roles.rhs_contracting)
    except ValueError as e:
        # Declared roles that do not fit are the caller's mistake, said as such; a known kernel called
        # another way than the table's is unreadable.
        return KernelRead(name, data, misfit=str(e) if source == "declared" else None)


def _operands(eqn: jcore.JaxprEqn, roles: KernelRoles, inputs: tuple[int, ...], data: tuple[int, ...],
              location: str) -> tuple[int, int, int | None, int | None]:
    """The operand indices of lhs, rhs and their scales; a ValueError where ``roles`` do not fit the kernel."""
    what = f"KernelRoles({roles.name!r}) at {location}"
    if roles.qarrays:
        groups = _qarrays(eqn, inputs)
        slots = {"lhs": roles.lhs, "rhs": roles.rhs}
        if bad := {k: v for k, v in slots.items() if v >= len(groups)}:
            raise ValueError(f"{what}: {', '.join(f'{k}={v}' for k, v in bad.items())}, but the kernel takes "
                             f"{len(groups)} inputs (a QArray's codes and scale counted as one)")
        (lhs, lhs_scale), (rhs, rhs_scale) = groups[roles.lhs], groups[roles.rhs]
    else:
        slots = {"lhs": roles.lhs, "rhs": roles.rhs, "lhs_scale": roles.lhs_scale, "rhs_scale": roles.rhs_scale}
        if bad := {k: v for k, v in slots.items() if v is not None and v >= len(inputs)}:
            raise ValueError(f"{what}: {', '.join(f'{k}={v}' for k, v in bad.items())}, but the kernel takes "
                             f"{len(inputs)} inputs (as it takes them: a pallas_call's scalar-prefetch operands "
                             f"and grid bounds left out, metadata passed as inputs counted)")
        lhs, rhs = inputs[roles.lhs], inputs[roles.rhs]
        lhs_scale, rhs_scale = (None if p is None else inputs[p] for p in (roles.lhs_scale, roles.rhs_scale))
    for role, at in (("lhs", lhs), ("rhs", rhs), ("lhs_scale", lhs_scale), ("rhs_scale", rhs_scale)):
        if at is not None and at not in data:
            raise ValueError(f"{what}: its {role} is input {inputs.index(at)}, {eqn.invars[at].aval}: an index "
                             f"or a flag, not data a matmul multiplies")
    return lhs, rhs, lhs_scale, rhs_scale
