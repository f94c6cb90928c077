"""Codes packed into bytes and read back by bit operations: a 4- or 2-bit field of a narrow integer's codes,
unpacked by shifts and masks, is a narrow code (Keras's int4 kernels, two codes to an int8 byte)."""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from qcheck._coverage._records import OperandQuant
from qcheck._coverage._values import Val, named_dtype, narrow_bits

#: Bit-field widths whose unpacked values are the codes of a type ml_dtypes names (int4, uint4, int2, uint2).
_CODE_FIELDS = (2, 4)
#: Ops that move an unpacked field's values without changing them (the halves of a byte interleaved back).
_FIELD_LAYOUT = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "slice", "rev",
                           "copy", "copy_p", "stack", "concatenate", "sharding_constraint", "optimization_barrier"})


def _literal(eqn: jcore.JaxprEqn, i: int) -> int | None:
    """The integer literal operand ``i`` of ``eqn`` is (a shift count, a mask), or None where it is no literal."""
    v = eqn.invars[i]
    if not isinstance(v, jcore.Literal) or np.ndim(v.val) != 0:
        return None
    value = np.asarray(v.val)
    return int(value) if np.issubdtype(value.dtype, np.integer) else None


def _container(eqn: jcore.JaxprEqn) -> int | None:
    """The bits of the eqn's integer result type; None for any other type (floats, PRNG keys)."""
    dtype = getattr(eqn.outvars[0].aval, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or not jnp.issubdtype(dtype, jnp.integer):
        return None
    return jnp.iinfo(dtype).bits


#: The ops :meth:`PackedFields.unpack` reads; every other op leaves a field behind.
_FIELD_OPS = _FIELD_LAYOUT | {"convert_element_type", "and", "xor", "shift_right_arithmetic", "shift_right_logical",
                              "shift_left", "sub", "add"}


class PackedFields:
    """The walk's methods that read unpacked bit fields (mixed into :class:`qcheck._coverage._walk.Walker`)."""

    @staticmethod
    def field_of(v: Val) -> tuple[int, bool] | None:
        """``(width, signed)`` of the bits ``v`` holds: an unpacked field, or all of a narrow integer's codes."""
        if v.field is not None:
            return v.field
        if v.quant is not None and v.quant.kind == "cast" and v.quant.dtype is not None:
            dtype = named_dtype(v.quant.dtype)
            if jnp.issubdtype(dtype, jnp.integer) and (bits := narrow_bits(dtype)):
                return bits, bool(jnp.issubdtype(dtype, jnp.signedinteger))
        return None

    def unpack(self, eqn: jcore.JaxprEqn, ins: list[Val], actual: Any) -> Val | None:
        """Packed codes unpacked: a field of a narrow integer's bits read by shifts and masks is a narrow code.

        Keras's ``unpack_int4`` (keras 3.15.1, quantizers.py:754-900) reads two int4 codes from each int8 byte:
        ``(b & 15) ^ 8) - 8`` and ``((b >> 4) & 15) ^ 8) - 8``; others sign-extend a nibble by
        ``(b << 4) >> 4`` (arithmetic) or take the high one as ``b >> 4``. The source must be a narrow integer's
        codes (a stored int8/uint8, widened or not): an int32 index masked to 4 bits is no code, nor is an int8
        shifted by 0 (still all of its 8 bits). A field of 4 or 2 bits reads as quantized, ``int4``/``uint4``
        (``int2``/``uint2``), its codes stored: no quantizer to trace them to. None: not such an op.
        """
        name = eqn.primitive.name
        if name not in _FIELD_OPS or len(eqn.outvars) != 1 or not ins:
            return None
        container = _container(eqn)
        src = self.field_of(ins[0])
        field: tuple[int, bool] | None = None
        if name in _FIELD_LAYOUT:
            if not any(v.field is not None for v in ins):
                return None
            fields = {self.field_of(v) for v in ins if not v.const}
            field = fields.pop() if len(fields) == 1 and None not in fields else None
            if field is None:
                return None
        elif container is None:
            return None
        elif name == "convert_element_type":
            if ins[0].field is None or container < ins[0].field[0] + (0 if ins[0].field[1] else 1):
                return None  # all of a narrow integer's codes widened: the usual rules keep their grid
            field = ins[0].field
        elif name in ("and", "xor"):
            pairs = [(self.field_of(ins[i]), _literal(eqn, 1 - i)) for i in (0, 1)]
            src, lit = next(((f, c) for f, c in pairs if f is not None and c is not None), (None, None))
            if src is None or lit is None or lit < 0:
                return None
            width, signed = src
            if name == "and" and lit & (lit + 1) == 0:  # a mask of the low k bits
                # The low k bits, unsigned: a signed field's negative values become their k-bit two's complement.
                k = lit.bit_length()
                field = src if k >= container or (not signed and k >= width) else (k, False)
            elif name == "xor" and not signed and lit < 2**width:
                field = src  # bits flipped inside the field: still its width, unsigned
        elif name in ("shift_right_arithmetic", "shift_right_logical", "shift_left"):
            s = _literal(eqn, 1)
            if src is None or s is None or s < 0:
                return None
            width, signed = src
            if name == "shift_right_arithmetic" and 0 < s < width:
                field = (width - s, signed)
            elif name == "shift_right_logical" and 0 < s < width and (not signed or width == container):
                field = (width - s, False)
            elif name == "shift_left" and s > 0:
                # Into the container's top bits, a field reads as the container's signed integer (the first half
                # of the sign extension (b << 4) >> 4); short of them, as a field s bits wider.
                field = (container, True) if width + s >= container else (width + s, signed)
        elif name in ("sub", "add") and src is not None and ins[0].field is not None:
            width, signed = src
            lit = _literal(eqn, 1)
            if not signed and lit is not None and (lit if name == "sub" else -lit) == 2 ** (width - 1):
                field = (width, True)  # an offset binary field made signed: (u ^ 8) - 8
        if field is None:
            return None
        width, signed = field
        quant = (OperandQuant("cast", f"{'' if signed else 'u'}int{width}", "unpack") if width in _CODE_FIELDS
                 else None)
        return Val(quant, all(v.const for v in ins), getattr(eqn.outvars[0].aval, "size", 2) == 1, actual, actual,
                   grad=any(v.grad for v in ins), casts=frozenset({quant.dtype}) if quant else frozenset(),
                   data=self.data_of(eqn, ins), ident=eqn.outvars[0],
                   closed=all(v.const or v.closed for v in ins), field=field)
