"""Codes packed into integers and read back by bit operations: fields of 2, 4 or 8 bits packed into a word of any
width (two int4 codes to an int8 byte as Keras packs them, four 8-bit codes to a uint32 as EasyDeL and ejkernel do),
in two's complement or offset binary, unpacked by shifts, masks and a subtraction, are narrow codes.

The walk tracks what each bit of an integer value is (:class:`Bits`): the fields it holds, where, and whether the
bits above the top one copy its sign. A value that is one field at bit 0 of 2, 4 or 8 bits reads as codes of that
width. Fields come from a narrow integer's codes (all of their bits), from a stored integer word (a parameter or a
constant of the program, never an activation: its bits are whatever it packs), or from codes packed into a word in
the program (shifted into place and or-ed together); where the packed codes are a quantizer's, the unpacked field is
held to that quantizer bitwise, as its codes."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from qcheck._coverage._records import OperandQuant
from qcheck._coverage._values import Val, map_axes, named_dtype, narrow_bits

#: Bit-field widths whose unpacked values are the codes of a type ml_dtypes or numpy names (int2 .. uint8).
_CODE_FIELDS = (2, 4, 8)
#: Ops that move an unpacked field's values without changing them (the halves of a byte interleaved back, a word
#: taken by index: ejkernel's ``take(packed, word_idx)``, words padded to a tile: ejkernel 0.0.78's XLA quantized
#: matmul pads them with zeros, which it slices off or multiplies by x's zero padding).
_FIELD_LAYOUT = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "slice", "rev",
                           "copy", "copy_p", "stack", "concatenate", "sharding_constraint", "optimization_barrier",
                           "gather", "dynamic_slice", "pad"})
#: The ops :meth:`PackedFields.unpack` reads; every other op leaves a field behind.
_FIELD_OPS = _FIELD_LAYOUT | {"convert_element_type", "and", "or", "xor", "shift_right_arithmetic",
                              "shift_right_logical", "shift_left", "sub", "add", "select_n"}
#: Integer ops on constants the walk evaluates, in numpy, when it meets them (a shift count or a mask made by
#: ``jnp.arange`` and arithmetic, not written as a literal), on at most ``_FOLD_SIZE`` elements: never a weight.
_ELEMENTWISE = {"neg": np.negative, "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
                "min": np.minimum, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
                "not": np.invert, "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
                "gt": np.greater, "ge": np.greater_equal, "sign": np.sign, "rem": np.fmod}
_FOLDED = frozenset(_ELEMENTWISE) | {"iota", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
                                     "slice", "concatenate", "convert_element_type", "clamp", "select_n", "div",
                                     "shift_left", "shift_right_logical", "shift_right_arithmetic"}
_FOLD_SIZE = 1 << 16
#: Ops whose result takes exactly its operand's values: a constant too large to keep stands for its distinct
#: values by its operand (``jnp.where(split, x, 0)`` broadcasts its 0 to the whole word array).
_SAME_VALUES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose"})
#: More distinct shift counts or masks than this in one constant are no unpacking's.
_DISTINCT = 64


@dataclasses.dataclass(frozen=True)
class Bits:
    """The bits of an integer value: ``lanes``, the ``(offset, width)`` of each field it holds, lowest first and
    disjoint (the bits between them zeros); ``signed``: the bits above the top lane copy its top bit (else zeros).
    ``assumed``: the lanes are as wide as an offset says (int4 codes held in int8, plus 8, to be packed) but no
    mask bounds them yet; codes wider than that mix with their neighbours, which the bitwise hold then sees."""

    lanes: tuple[tuple[int, int], ...]
    signed: bool
    assumed: bool = False

    @property
    def top(self) -> int:
        """The bit above the top lane; 0 for a value with no field (zero: every lane masked or shifted out)."""
        return self.lanes[-1][0] + self.lanes[-1][1] if self.lanes else 0

    @property
    def field(self) -> tuple[int, bool] | None:
        """``(width, signed)`` where the value is one field at bit 0, its value that field's; else None."""
        return (self.lanes[0][1], self.signed) if len(self.lanes) == 1 and self.lanes[0][0] == 0 else None


def _bits(lanes: list[tuple[int, int]], signed: bool, container: int, signed_type: bool,
          assumed: bool = False) -> Bits | None:
    """Bits in a ``container``-bit integer: a top lane that reaches the container's top bit is signed as the
    type is (the container's sign bit is its top bit); a value with no lane left is zero."""
    lanes = sorted((o, w) for o, w in lanes if w > 0)
    if not lanes:
        return Bits((), False, assumed)
    if lanes[-1][0] + lanes[-1][1] > container:
        return None
    if lanes[-1][0] + lanes[-1][1] == container:
        signed = signed_type
    elif signed and not signed_type:
        return None  # sign copies in an unsigned type: a large number, not the field's value
    return Bits(tuple(lanes), signed, assumed)


def _integer(aval: Any) -> tuple[int, bool] | None:
    """``(bits, signed)`` of an integer type; None for any other type (floats, booleans, PRNG keys)."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or not jnp.issubdtype(dtype, jnp.integer):
        return None
    return jnp.iinfo(dtype).bits, bool(jnp.issubdtype(dtype, jnp.signedinteger))


def _constant(eqn: jcore.JaxprEqn, i: int, v: Val) -> list[int] | None:
    """The distinct integer values operand ``i`` of ``eqn`` takes where it is a constant the walk knows (a
    literal, a folded one: a shift count, a mask, a predicate); None where it is none, or takes too many."""
    var = eqn.invars[i]
    value = np.asarray(var.val) if isinstance(var, jcore.Literal) else v.known
    if value is None or not (np.issubdtype(np.asarray(value).dtype, np.integer) or np.asarray(value).dtype == bool):
        return None
    distinct = np.unique(np.asarray(value))
    return [int(x) for x in distinct] if distinct.size <= _DISTINCT else None


def _evaluate(name: str, vals: list[np.ndarray], params: dict, aval: Any) -> Any:
    """One integer op of :data:`_FOLDED` on constants, in numpy as XLA computes it (a shift by the type's width or
    more is 0 or the sign; division truncates); None for one it does not evaluate (a division by zero)."""
    if name in _ELEMENTWISE:
        return _ELEMENTWISE[name](*vals)
    if name == "iota":
        shape, dim = tuple(params["shape"]), params["dimension"]
        return np.broadcast_to(np.arange(shape[dim]).reshape([-1 if i == dim else 1 for i in range(len(shape))]),
                               shape)
    if name == "broadcast_in_dim":
        shape, dims = tuple(params["shape"]), tuple(params["broadcast_dimensions"])
        return np.broadcast_to(vals[0].reshape([vals[0].shape[dims.index(i)] if i in dims else 1
                                                for i in range(len(shape))]), shape)
    if name in ("reshape", "squeeze", "expand_dims"):
        return vals[0].reshape(aval.shape)
    if name == "transpose":
        return np.transpose(vals[0], params["permutation"])
    if name == "slice":
        strides = params["strides"] or (1,) * vals[0].ndim
        return vals[0][tuple(slice(a, z, k) for a, z, k in zip(params["start_indices"], params["limit_indices"],
                                                               strides))]
    if name == "concatenate":
        return np.concatenate(vals, axis=params["dimension"])
    if name == "convert_element_type":
        return vals[0].astype(aval.dtype)
    if name == "clamp":
        return np.clip(vals[1], vals[0], vals[2])
    if name == "select_n":
        return np.choose(vals[0].astype(np.int64), vals[1:])
    if name == "div":
        if np.any(vals[1] == 0):
            return None
        a, d = vals
        return np.sign(a) * np.sign(d) * (np.abs(a) // np.abs(d)) if np.issubdtype(a.dtype, np.signedinteger) \
            else a // d
    bits = np.iinfo(vals[0].dtype).bits
    s = vals[1].astype(np.int64)
    within = np.clip(s, 0, bits - 1)
    if name == "shift_left":
        return np.where((s >= 0) & (s < bits), np.left_shift(vals[0], within.astype(vals[0].dtype)), 0)
    if name == "shift_right_arithmetic":
        signed = vals[0].astype(np.dtype(f"int{bits}"))
        return np.right_shift(signed, within.astype(signed.dtype)).astype(vals[0].dtype)
    if name == "shift_right_logical":
        unsigned = vals[0].astype(np.dtype(f"uint{bits}"))
        return np.where((s >= 0) & (s < bits), np.right_shift(unsigned, within.astype(unsigned.dtype)), 0)
    return None


def _mask(b: Bits, m: int, container: int) -> Bits | None:
    """``b & m``: each lane kept whole, dropped, or cut to a run of its bits (``& 15``: a byte's low nibble,
    ``& 0xFF00``: a stored word's second byte, where it lies); the sign copies kept only whole."""
    m &= (1 << container) - 1  # a negative literal's two's complement in the container
    if not b.lanes:
        return b
    lanes = []
    for off, w in b.lanes:
        kept = (m >> off) & ((1 << w) - 1)
        low = (kept & -kept).bit_length() - 1 if kept else 0  # the run's lowest bit
        if (kept >> low) & ((kept >> low) + 1):
            return None  # not one run of the lane's bits: no field
        lanes.append((off + low, (kept >> low).bit_length()))
    above = ((1 << container) - 1) & ~((1 << b.top) - 1)
    whole_top = lanes[-1] == b.lanes[-1]
    if b.signed and m & above and (m & above != above or not whole_top):
        return None  # some sign copies kept, or copies of a sign bit cut off
    lanes = [(o, w) for o, w in lanes if w]
    return Bits(tuple(lanes), bool(lanes) and b.signed and whole_top and m & above == above)


def _shift(name: str, b: Bits, s: int, container: int, signed_type: bool) -> Bits | None:
    """``b`` shifted by ``s`` bits: left (lanes past the top cut), right (lanes past bit 0 cut; an arithmetic
    shift fills with the container's top bit, a logical one with zeros)."""
    if s == 0:
        return b  # one of several counts (w >> [0, 8, 16, 24]): the low lanes as they are
    if s < 0 or s >= container:
        return None
    if name == "shift_left":
        return _bits([(o + s, min(w, container - o - s)) for o, w in b.lanes if o + s < container], b.signed,
                     container, signed_type, b.assumed)
    lanes = list(b.lanes)
    top_bit = b.signed or b.top == container  # what an arithmetic shift fills with: a copy of the top lane's top bit
    if name == "shift_right_logical" and b.signed and b.top < container:
        lanes[-1] = (lanes[-1][0], container - lanes[-1][0])  # the sign copies shift down into the value
    moved = [(max(o - s, 0), w - max(s - o, 0)) for o, w in lanes if o + w > s]
    # The top lane of the container alone, shifted down: nothing lies above it, its width is bounded.
    assumed = b.assumed and not (len(moved) == 1 and b.top == container)
    return _bits(moved, name == "shift_right_arithmetic" and top_bit, container, signed_type, assumed)


def _combine(a: Bits, b: Bits, container: int, signed_type: bool) -> Bits | None:
    """``a | b`` (or ``a + b``) of fields in disjoint bits: a word packed; the lower one's bits above it zeros."""
    lanes = sorted(a.lanes + b.lanes)
    if any(o1 + w1 > o2 for (o1, w1), (o2, _) in zip(lanes, lanes[1:])):
        return None  # overlapping: the bits mix (a hash), no field
    high, low = (a, b) if a.top >= b.top else (b, a)
    if low.signed:
        return None  # its sign copies run into the higher field
    return _bits(lanes, high.signed, container, signed_type, a.assumed or b.assumed)


class PackedFields:
    """The walk's methods that read unpacked bit fields (mixed into :class:`qcheck._coverage._walk.Walker`)."""

    @staticmethod
    def bits_of(v: Val, var: Any) -> tuple[Bits, ...] | None:
        """What each bit of ``v`` (the value of ``var``) is, one :class:`Bits` per form its elements take: an
        unpacked field or packed word, all of a narrow integer's codes, or all of a stored integer's bits."""
        if v.field is not None:
            return v.field
        if v.quant is not None and v.quant.kind == "cast" and v.quant.dtype is not None:
            dtype = named_dtype(v.quant.dtype)
            if jnp.issubdtype(dtype, jnp.integer) and (bits := narrow_bits(dtype)):
                return (Bits(((0, bits),), bool(jnp.issubdtype(dtype, jnp.signedinteger))),)
        if v.stored and not v.data and (kind := _integer(getattr(var, "aval", None))):
            return (Bits(((0, kind[0]),), kind[1]),)
        if v.known is not None and _integer(getattr(var, "aval", None)) and not np.any(v.known):
            return (Bits((), False),)  # a constant zero: no field, packed beside one (ejkernel's high part)
        return None

    def integer_facts(self, eqn: jcore.JaxprEqn, ins: list[Val], out: Val) -> None:
        """What an op that is no field op keeps of its integers' bits: a stored word moved, codes made offset
        binary to be packed, a small constant's value."""
        out.stored = self.still_stored(eqn, ins)
        out.field = self.offset_field(eqn, ins)
        out.known = self.fold(eqn, ins)

    @staticmethod
    def still_stored(eqn: jcore.JaxprEqn, ins: list[Val]) -> bool:
        """Whether the eqn's result is a stored value still (moved, or its integer type changed, not computed):
        its bits may pack codes."""
        name = eqn.primitive.name
        if not ins or not ins[0].stored:
            return False
        if name == "convert_element_type":
            return _integer(eqn.invars[0].aval) is not None and _integer(eqn.outvars[0].aval) is not None
        return name in ("gather", "dynamic_slice") or (name in _FIELD_LAYOUT and all(v.stored or v.const for v in ins))

    @staticmethod
    def known_constant(aval: Any, value: Any) -> Any:
        """A constant of the program as the walk keeps it to read shift counts and masks from: small integers."""
        if value is None or getattr(aval, "size", _FOLD_SIZE + 1) > _FOLD_SIZE or not _integer(aval):
            return None
        return np.asarray(value)

    @staticmethod
    def fold(eqn: jcore.JaxprEqn, ins: list[Val]) -> Any:
        """The value of a small integer constant computed from known ones (a shift count, a mask), else None."""
        outs, name = eqn.outvars, eqn.primitive.name
        if name not in _FOLDED or len(outs) != 1 or any(v.known is None for v in ins):
            return None
        aval = outs[0].aval
        if not (_integer(aval) or getattr(aval, "dtype", None) == np.bool_):
            return None
        if getattr(aval, "size", _FOLD_SIZE + 1) > _FOLD_SIZE:
            return ins[0].known if name in _SAME_VALUES else None  # its values, not its shape (see _SAME_VALUES)
        if any(np.shape(v.known) != tuple(getattr(var.aval, "shape", ())) for v, var in zip(ins, eqn.invars)):
            return None  # a stand-in for an operand's values: not the operand itself
        try:
            with np.errstate(all="ignore"):
                value = _evaluate(name, [np.asarray(v.known) for v in ins], eqn.params, aval)
        except Exception:  # noqa: BLE001 -- params this evaluator does not read: the constant stays unknown
            return None
        return None if value is None else np.asarray(value).astype(aval.dtype)

    def unpack(self, eqn: jcore.JaxprEqn, ins: list[Val], actual: Any) -> Val | None:
        """Packed codes unpacked: a field of a packed word's bits read by shifts and masks is a narrow code.

        Keras's ``unpack_int4`` (keras 3.15.1, quantizers.py:754-900) reads two int4 codes from each int8 byte:
        ``(b & 15) ^ 8) - 8`` and ``((b >> 4) & 15) ^ 8) - 8``; others sign-extend a nibble by
        ``(b << 4) >> 4`` (arithmetic) or take the high one as ``b >> 4``. Four 8-bit codes in a uint32, offset
        binary (code + 128), read as ``((w >> 8 * i) & 255) - 128``; a shift count may be a constant array
        (``w[..., None] >> jnp.arange(0, 32, 8)``). The source must be a narrow integer's codes (a stored
        int8/uint8, widened or not), a stored word, or codes packed into one: an int32 index computed in the
        program (or a call's argument) masked to 4 bits is no code, nor is an int8 shifted by 0 (still all of its
        8 bits), nor a word whose bits mix (a hash). A field of 2, 4 or 8 bits reads as quantized,
        ``int8``/``uint8`` (``int4``, ``int2``, unsigned alike) ``unpack``. None: not such an op.
        """
        name = eqn.primitive.name
        if name not in _FIELD_OPS or len(eqn.outvars) != 1 or not ins:
            return None
        if name == "select_n":
            return self._selected(eqn, ins, actual)
        if name in _FIELD_LAYOUT:
            data = [0] if name in ("gather", "dynamic_slice") else [i for i, v in enumerate(ins) if not v.const]
            if not any(ins[i].field is not None for i in data):
                return None
            forms = {self.bits_of(ins[i], eqn.invars[i]) for i in data}
            bits = forms.pop() if len(forms) == 1 and None not in forms else None
        else:
            bits = self._bit_op(eqn, ins)
        if bits is None:
            return None
        return self._field_val(eqn, ins, bits, actual)

    def _bit_op(self, eqn: jcore.JaxprEqn, ins: list[Val]) -> tuple[Bits, ...] | None:
        """The bits of an integer op's result on fields: a conversion, a mask, a shift, an offset, a packing."""
        name = eqn.primitive.name
        kind = _integer(eqn.outvars[0].aval)
        if kind is None:
            return None
        container, signed_type = kind
        src = [self.bits_of(v, var) for v, var in zip(ins, eqn.invars)]
        consts = [_constant(eqn, i, v) for i, v in enumerate(ins)]
        results: set[Bits | None] = set()
        if name == "convert_element_type":
            old = _integer(eqn.invars[0].aval)
            if old is None or ins[0].field is None:
                return None  # all of a narrow integer's codes widened: the usual rules keep their grid
            for b in ins[0].field:
                if container >= old[0]:  # widened: the old top bit (a signed type's sign) extends
                    results.add(_bits(list(b.lanes), b.signed or (b.top == old[0] and old[1]), container,
                                      signed_type, b.assumed))
                else:  # narrowed: only all of a field, or what lies below the new top bit, read alike
                    results.add(_bits(list(b.lanes), b.signed, container, signed_type, b.assumed)
                                if b.top <= container
                                else None)
        elif name in ("and", "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic"):
            at = next((i for i in ((0, 1) if name in ("and", "xor") else (0,))
                       if src[i] is not None and consts[1 - i] is not None), None)
            if at is None:
                return None  # two computed values mixed (a hash's x ^ (x >> 16)): no field
            if name.startswith("shift") and consts[1] == [0]:
                return None  # by 0 alone: still all of the value's bits, no field narrower than its type
            for b in src[at]:
                for c in consts[1 - at]:
                    if name == "and":
                        results.add(_mask(b, c, container))
                    elif name == "xor":
                        # Bits flipped inside an unsigned value's lanes: still its fields ((u ^ 8) - 8 reads next).
                        inside = sum(((1 << w) - 1) << o for o, w in b.lanes)
                        results.add(b if not b.signed and c >= 0 and c & ~inside == 0 else None)
                    else:
                        results.add(_shift(name, b, c, container, signed_type))
        elif name in ("or", "add") and all(c is None for c in consts) and None not in src and len(ins) == 2:
            for a in src[0]:
                for b in src[1]:
                    results.add(_combine(a, b, container, signed_type))
        elif name in ("sub", "add"):
            at = next((i for i in ((0, 1) if name == "add" else (0,)) if src[i] is not None and consts[1 - i]), None)
            if at is None or len(consts[1 - at]) != 1:
                return None
            offset = consts[1 - at][0] * (-1 if name == "sub" else 1)
            for b in src[at]:
                field = b.field
                if field is None:
                    results.add(None)
                elif not field[1] and offset == -2 ** (field[0] - 1) and ins[at].field is not None:
                    results.add(Bits(b.lanes, True, b.assumed))  # offset binary made signed: u - 128, (u ^ 8) - 8
                elif field[1] and offset == 2 ** (field[0] - 1) and container > field[0]:
                    results.add(Bits(b.lanes, False, b.assumed))  # signed codes made offset binary: c + 128
                else:
                    results.add(None)
        if not results or None in results:
            return None
        return tuple(sorted(results, key=lambda b: (b.lanes, b.signed)))

    @staticmethod
    def _selected(eqn: jcore.JaxprEqn, ins: list[Val], actual: Any) -> Val | None:
        """``select_n`` whose predicate is a constant choosing one case everywhere: that case's value, fields
        and all (ejkernel's ``where(split, high, 0)``, where no code spans two words: the 0)."""
        which = _constant(eqn, 0, ins[0])
        if which is None or len(which) != 1 or not 0 <= which[0] < len(ins) - 1:
            return None
        chosen = ins[1 + which[0]]
        if chosen.field is None and chosen.known is None and not chosen.stored:
            return None
        return dataclasses.replace(chosen, actual=actual, shadow=actual, ident=eqn.outvars[0])

    @staticmethod
    def offset_field(eqn: jcore.JaxprEqn, ins: list[Val]) -> tuple[Bits, ...] | None:
        """Signed codes of a wider type plus 2^(k-1) for k of 2 or 4 (int4 codes held in int8, plus 8): what they
        are once packed, k-bit offset binary, :attr:`Bits.assumed` (the value itself reads as its codes still)."""
        if eqn.primitive.name != "add" or len(ins) != 2 or not (kind := _integer(eqn.outvars[0].aval)):
            return None
        for at in (0, 1):
            v, offset = ins[at], _constant(eqn, 1 - at, ins[1 - at])
            if v.field is not None or offset is None or len(offset) != 1:
                continue
            source = PackedFields.bits_of(v, eqn.invars[at])
            field = source[0].field if source and len(source) == 1 else None
            k = int(offset[0]).bit_length()
            if field and field[1] and k in _CODE_FIELDS and k < field[0] < kind[0] and offset[0] == 2 ** (k - 1):
                return (Bits(((0, k),), False, assumed=True),)
        return None

    def _field_val(self, eqn: jcore.JaxprEqn, ins: list[Val], bits: tuple[Bits, ...], actual: Any) -> Val:
        """The value a field op gives: a code of 2, 4 or 8 bits (see :meth:`unpack`), still the quantizer's codes
        the packed ones were where the walk saw them made, in their layout where it can tell."""
        name = eqn.primitive.name
        field = bits[0].field if len(bits) == 1 else None
        width, signed = field if field is not None else (0, False)
        quant = (OperandQuant("cast", f"{'' if signed else 'u'}int{width}", "unpack") if width in _CODE_FIELDS
                 else None)
        if any(b.assumed for b in bits):
            # No mask bounds it yet: the codes plus their offset read as the codes they were made from; shifted
            # into a word, as no codes.
            quant = next((v.quant for v in ins if not v.const and v.quant is not None), None) if field else None
        casts = frozenset({quant.dtype}) if quant and quant.step == "unpack" else (
            frozenset().union(*(v.casts for v in ins)) if quant else frozenset())
        out = Val(quant, all(v.const for v in ins), getattr(eqn.outvars[0].aval, "size", 2) == 1, actual, actual,
                  grad=any(v.grad for v in ins), casts=casts,
                  data=self.data_of(eqn, ins), ident=eqn.outvars[0],
                  closed=all(v.const or v.closed for v in ins), field=bits)
        carriers = [v for v in ins if v.qid is not None and not v.const]
        if actual is None or not carriers or len({v.qid for v in carriers}) != 1:
            return out
        carrier, ndim = carriers[0], len(getattr(eqn.outvars[0].aval, "shape", ()))
        out.qid, out.axis_map = carrier.qid, (None,) * ndim
        origin, codes, divisor = self.quantizers[carrier.qid]
        values_kept = name in _FIELD_LAYOUT or (name == "convert_element_type" and field is not None
                                               and field == self.bits_of(ins[0], eqn.invars[0])[0].field)
        if carrier.live and values_kept:
            out.live = True
            out.axis_map = map_axes(eqn, carrier.axis_map, tuple(np.shape(codes)))
            return out
        # Unpacked: the field is the quantizer's codes again where it fits their type (int4 codes held in int8 and
        # packed as nibbles) and has their shape. Held as its codes: a packing that lost or moved them differs
        # from the referee's bitwise, and fails.
        dtype = np.dtype(codes.dtype)
        own = (narrow_bits(dtype), bool(jnp.issubdtype(dtype, jnp.signedinteger))) if jnp.issubdtype(
            dtype, jnp.integer) else None
        if (field is not None and own is not None and own[0] is not None and field[1] == own[1]
                and field[0] <= own[0] and np.shape(actual) == np.shape(codes)):
            out.live, out.axis_map = True, tuple(range(ndim))
            self.quantizers[carrier.qid] = (origin, jnp.asarray(actual).astype(dtype), divisor)
            out.shadow = self.code_shadows.get(carrier.qid, actual)
        return out
