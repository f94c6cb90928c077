"""Declared quantization: what a layer says each matmul operand is, and each site held to it.

A declaration names, per operand role, a number format of :mod:`qcheck.formats`
(or None: full precision): ``{"weights": "int8", "activations": None}`` is a
weight-only int8 scheme. Roles come from the program's data flow
(:attr:`MatmulRecord.lhs_role`): an operand that derives from the layer's
parameters and state only is a weight, one that derives from the call's inputs
an activation, one that derives from the output gradient a gradient. ``lhs``
and ``rhs`` name operands by position instead. A role's value may be
``{"format": NAME, "per": AXES}``: the axes of the quantizer's input that keep
their own scale (every other axis shares one), for a library whose
granularity is not the format's own rule (one scale per index of every axis
but the matmul's contraction axes).

Each declared operand of a site is held to its format three ways, each a line
of :attr:`MatmulRecord.findings` when it fails:

* its type: a narrow type it was cast to that the format does not use
  (``float8_e4m3fnuz`` where ``e4m3fn`` is declared);
* its codes, bitwise: the codes the layer's quantizer produced equal the
  referee's (:func:`qcheck.referees.reference_quantize`, numpy and ml_dtypes)
  codes of the quantizer's own input (divided by the scale the layer holds,
  for the fp8 formats at scale 1), scaled at the declared granularity; a
  mismatch names the first differing element and what the codes match instead
  (the other fp8 flavour, one scale shared across an axis, fewer levels);
* full precision where a format is declared, and a quantized operand where
  full precision is declared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from qcheck import formats, referees
from qcheck._coverage._records import MatmulRecord, OperandQuant, whole_axes
from qcheck.libraries import Declaration, RoleFormat, block_of, role_key

# -- what a format's codes are -------------------------------------------------------

def _element_types(fmt: str) -> frozenset[str]:
    """The narrow types a site in ``fmt`` casts to: its codes' type and its scales' narrow types."""
    return _record_types(formats.get_format(fmt))


@functools.cache  # by record: a plug-in format registered again under the same name is another record
def _record_types(record: formats.Format) -> frozenset[str]:
    fmt = record.name
    # Its types only: traced, never run (run, a format compiles a handful of small programs).
    q = jax.eval_shape(lambda x: formats.quantize(x, fmt, axis=-1), jax.ShapeDtypeStruct((2, 32), np.float32))
    names = {str(np.dtype(q.codes.dtype))}
    names |= {str(np.dtype(s.dtype)) for s in q.scales.values() if np.dtype(s.dtype).itemsize == 1}
    return frozenset(names)


_NARROW_FLOATS = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float4_e2m1fn",
                            "float8_e8m0fnu", "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4"})


# Integer types of at most 8 bits a cast to which is a quantization (ml_dtypes' and numpy's names).
_NARROW_INTS = frozenset({"int8", "uint8", "int4"})


def _as_f32(codes: np.ndarray) -> np.ndarray:
    return np.asarray(codes).astype(np.float32)


_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _codes_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where two code arrays hold other codes: exact values, NaN equal to NaN, -0 the same code as 0."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == b.dtype and a.shape == b.shape and a.dtype.itemsize in _UINTS:
        # The same bits are the same code: only the elements whose bits differ are converted and compared as
        # values (-0 and 0, NaNs of other payloads), so a layer-sized float32 copy is made only where they do.
        uint = _UINTS[a.dtype.itemsize]
        differ = a.view(uint) != b.view(uint)
        if differ.any():
            at = np.nonzero(differ)
            differ[at] = _values_differ(a[at], b[at])
        return differ
    return _values_differ(a, b)


def _values_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = _as_f32(a), _as_f32(b)
    return ~((a == b) | (np.isnan(a) & np.isnan(b)))


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return np.shape(a) == np.shape(b) and not np.any(_codes_differ(a, b))


def _reference_codes(x: np.ndarray, fmt: str, axes: tuple[int, ...], xla_reciprocal: bool | str) -> np.ndarray | None:
    ftz = jax.default_backend() == "cpu"  # XLA's CPU backend flushes float32 subnormals
    try:
        # A block of zeros scales by E8M0's smallest code: numpy warns on the scale's overflowing inverse, whose
        # product with the zeros is still zero; the codes say what came out.
        with np.errstate(over="ignore"):
            codes, _ = referees.reference_quantize(x, fmt, axis=axes or tuple(range(x.ndim)), ftz=ftz,
                                                   xla_reciprocal=xla_reciprocal)
    except ValueError:  # not a whole number of blocks along these axes
        return None
    return codes


def _matching_form(x: np.ndarray, codes: np.ndarray, fmt: str, axes: tuple[int, ...]) -> str | None:
    """The first of the format's admissible forms (its record's ``forms``) under which the referee's codes of ``x``
    are ``codes`` bitwise, the whole tensor in that one form; None where none is. A form whose codes are not
    finite where ``x`` is is no hold: the rule computed so is itself the defect."""
    return next((form for form in formats.get_format(fmt).forms
                 if (r := _reference_codes(x, fmt, axes, form)) is not None and _bits_equal(codes, r)
                 and referees.keeps_finite(x, r)), None)


def _matches(x: np.ndarray, codes: np.ndarray, fmt: str, axes: tuple[int, ...]) -> bool:
    return _matching_form(x, codes, fmt, axes) is not None


def _stochastic_ok(x: np.ndarray, codes: np.ndarray, fmt: str, axes: tuple[int, ...]) -> bool:
    """A stochastic format with e2m1 codes (nvfp4): every code one grid step at most from round-to-nearest's."""
    ref = _reference_codes(x, fmt, axes, False)
    e2m1 = np.dtype(ml_dtypes.float4_e2m1fn)  # the sign-magnitude nibbles read below
    if ref is None or formats.get_format(fmt).element != e2m1 or np.dtype(np.asarray(codes).dtype) != e2m1:
        return False
    def signed(c):
        b = np.asarray(c).view(np.uint8).astype(np.int16)
        return np.where(b & 0x8, -(b & 0x7), b & 0x7)
    return bool(np.all(np.abs(signed(codes) - signed(ref)) <= 1))


def _describe_first(x: np.ndarray, codes: np.ndarray, ref: np.ndarray) -> str:
    a, b = _as_f32(codes), _as_f32(ref)
    differ = _codes_differ(a, b)
    idx = tuple(int(i) for i in np.argwhere(differ)[0])
    return (f"{int(differ.sum())} of {a.size} codes differ from the referee's; first at {list(idx)}: "
            f"{a[idx]:g} where the referee gives {b[idx]:g} (input {float(x[idx]):.6g})")


def _diagnose(x: np.ndarray, codes: np.ndarray, fmt: str, axes: tuple[int, ...]) -> str:
    """What the layer's codes match instead of the declared ones."""
    record = formats.get_format(fmt)
    if record.kind == "cast" and record.siblings and _matches(x, codes, record.siblings[0], axes):
        return f"they are {record.siblings[0]}'s codes, the other fp8 flavour"
    # Another rule of the same kind and width (int8 / int8_aqt / int8_qwix / int8_keras: absmax over 127 or 127.5,
    # or Keras's 127 over absmax + 1e-7), then of the same kind and another width (int4_keras's codes held in int8,
    # as Keras's AbsMaxQuantizer(value_range=(-8, 7), output_dtype="int8") leaves them; or int8 codes declared int4).
    same = [f for f in map(formats.get_format, formats.format_names()) if f.name != fmt and f.kind == record.kind and f.block == record.block]
    for other in sorted(same, key=lambda f: f.element != record.element):
        if _matches(x, codes, other.name, axes):
            same_as = "kind and width" if other.element == record.element else f"kind, {other.element.name} codes"
            return f"they are {other.name}'s codes: another rule of the same {same_as}"
    kept = [a for a in range(x.ndim) if a not in axes]
    if formats.get_format(fmt).kind != "cast":  # a scale per slice, block or tensor
        if kept and _matches(x, codes, fmt, tuple(range(x.ndim))):
            if formats.get_format(fmt).block:
                return (f"they match {fmt}'s blocks along the quantizer's own last axis: blocked along other axes "
                        f"than the matmul contracts")
            return "they match one scale for the whole tensor"
        for k in kept:
            if _matches(x, codes, fmt, tuple(sorted(axes + (k,)))):
                return f"they match one scale shared across axis {k} (size {x.shape[k]})"
        if kept and axes and _matches(x, codes, fmt, tuple(kept)):  # the scales run along the other axes
            return f"they match scales reduced over axes {tuple(kept)} instead: one scale per index of axes {axes}"
    c = _as_f32(codes)
    if jax.numpy.issubdtype(record.element, jax.numpy.integer):
        levels = int(np.unique(c).size)
        top = float(np.max(np.abs(c))) if c.size else 0.0
        full = int(jax.numpy.iinfo(record.element).max)  # the declared format's largest code: 127, or int4's 7
        if top < (full + 1) / 2:
            return (f"the codes reach only ±{top:g} ({levels} distinct levels): fewer bits than {fmt}'s "
                    f"±{full}")
    return "they match no other format or granularity qcheck tries"


def _formats_of(types: set[str], evidence: tuple[int, Any] | None, quantizers: Sequence[tuple[Any, ...]]) -> str:
    """What a site cast to ``types`` is instead: the format whose codes its quantizer's are (where the walk saw
    its quantizer), else the formats whose codes are of those types (int4 codes stored, unpacked: int4_keras)."""
    kin = [f.name for f in formats.FORMATS if types and types <= _element_types(f.name)]
    if not kin:
        return ""
    if evidence is not None:
        q, axes = evidence
        x, codes, *_ = quantizers[q]
        whole = None if any(a is None for a in axes) else whole_axes(axes)
        if not _stacked(quantizers[q]) and whole is not None and np.shape(x) == np.shape(codes):
            merged = _merged_layout(np.shape(x), whole)
            if merged is not None:
                shape, red = merged
                xs, cs = np.asarray(x, np.float32).reshape(shape), np.asarray(codes).reshape(shape)
                same = [name for name in kin if _matches(xs, cs, name, red)]
                if same:  # int8 and int8_keras part only on small slices: every rule they match is named
                    return f"; they are the codes of {', '.join(same)}"
    return f"; {', '.join(sorted(types))} is the code type of {', '.join(kin)}"


def _stacked(quantizer: tuple[Any, ...]) -> bool:
    return len(quantizer) > 3 and bool(quantizer[3])


@dataclasses.dataclass(frozen=True)
class Hold:
    """How strongly one declared operand of a site was held: ``strength`` and, below bitwise, ``reason``.

    * ``bitwise``: its codes held to the referee's codes of its quantizer's input;
    * ``type``: only the narrow types it was cast to (the codes could not be read: ``reason`` says why);
    * ``none``: nothing (an opaque kernel whose roles are unknown).

    ``accepted_by``: the ``accept_weaker`` rule that accepted a hold below bitwise, else None. ``form``: for a
    bitwise hold, the referee's form (``qcheck.referees.FORMS``) its codes matched in, where the format has several.
    """

    strength: str
    reason: str | None = None
    accepted_by: str | None = None
    form: str | None = dataclasses.field(default=None, compare=False)

    @property
    def bitwise(self) -> bool:
        return self.strength == "bitwise"

    def __str__(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        why += f" (its divisions {self.form})" if self.form and self.form != "as written" else ""
        accepted = f" (accepted by {self.accepted_by})" if self.accepted_by else ""
        return f"{self.strength}{why}{accepted}"


BITWISE = Hold("bitwise")


def _instances(x: np.ndarray, codes: np.ndarray, divisor: Any, stacked: tuple[str, ...]):
    """Each run of a quantizer inside bodies (``stacked``: what its leading axes enumerate) as its own values."""
    for where, idx, xi, ci, di in _runs(x, codes, divisor, stacked):
        yield where, xi, ci, di


def _runs(x: np.ndarray, codes: np.ndarray, divisor: Any, stacked: tuple[str, ...]):
    """:func:`_instances` with each run's index into the stacked axes."""
    if not stacked:
        yield "", (), x, codes, divisor
        return
    n = len(stacked)
    for idx in np.ndindex(*np.shape(codes)[:n]):
        where = " (" + ", ".join(f"{label} {i}" for label, i in zip(stacked, idx)) + ")"
        d = None if divisor is None else (np.asarray(divisor[0])[idx], divisor[1])
        yield where, idx, np.asarray(x)[idx], np.asarray(codes)[idx], d


_ONCE: dict[Any, tuple[str | None, Hold]] | None = None  # inside judged_once(): each judgment by its inputs' bits
# Inside judged_once(): a read-only array's digest by its identity (a weak reference beside it, so a freed array's
# id reused by another is told apart). check_layer's edge runs on a slice hand the judge one quantizer's values,
# the same arrays, once a run: hashing them again each run cost as much as a run.
_DIGESTS: dict[int, tuple[Any, tuple[Any, ...]]] = {}


@contextlib.contextmanager
def judged_once():
    """Within it, codes whose inputs are the same bits as codes judged already get that judgment again (the
    referee is a function of those bits alone): the edge rows' runs repeat every weight's quantizer, unchanged."""
    global _ONCE
    outer = _ONCE
    _ONCE = {} if outer is None else outer
    try:
        yield
    finally:
        _ONCE = outer
        if outer is None:
            _DIGESTS.clear()


def _digest(a: Any) -> tuple[Any, ...]:
    # SHA-256, not BLAKE2: x86's and Arm's SHA extensions run it at 1.2 GB/s where blake2b ran 0.5 on this CI's
    # CPU, and the edge runs hash every weight's input and codes again (10 s of a check at emb 1024). A
    # cryptographic digest: a collision would hand one quantizer's judgment to other bits.
    kept = isinstance(a, np.ndarray) and not a.flags.writeable and _ONCE is not None
    if kept and (seen := _DIGESTS.get(id(a))) is not None and seen[0]() is a:
        return seen[1]
    c = np.ascontiguousarray(a)
    digest = c.shape, str(c.dtype), hashlib.sha256(c.view(np.uint8).reshape(-1)).digest()
    if kept:
        _DIGESTS[id(a)] = (weakref.ref(a), digest)
    return digest


def _judge_codes(x: np.ndarray, codes: np.ndarray, divisor: Any, fmt: RoleFormat,
                 axes: tuple[int | None, ...]) -> tuple[str | None, Hold]:
    """A finding for codes that are not the declared format's codes of ``x`` (None when they are), and the hold."""
    if _ONCE is None:
        return _judged(x, codes, divisor, fmt, axes)
    key = (_digest(x), _digest(codes), None if divisor is None else (_digest(divisor[0]), bool(divisor[1])), fmt,
           axes)
    if key not in _ONCE:
        _ONCE[key] = _judged(x, codes, divisor, fmt, axes)
    return _ONCE[key]


def _judged(x: np.ndarray, codes: np.ndarray, divisor: Any, fmt: RoleFormat,
            axes: tuple[int | None, ...]) -> tuple[str | None, Hold]:
    x = np.asarray(x, np.float32)
    if x.shape != np.shape(codes):
        return None, Hold("type", f"the quantizer's input {x.shape} and its codes {np.shape(codes)} differ in shape")
    if divisor is not None:
        scale, multiplied = divisor
        scale = np.asarray(scale, np.float32)
        broken = ~np.isfinite(scale) if multiplied else (~np.isfinite(scale)) | (scale == 0)
        if np.any(broken):
            # A zero amax with no guard (0 / 0), or a tiny one past an "== 0" guard: codes NaN or inf follow. In
            # every format: an integer cast of a NaN code is whatever the backend makes of it (0 on XLA's CPU, so
            # the codes can even match), never a code the format defines.
            what = "0" if not multiplied and np.any(scale == 0) else "not finite"
            return (f"its scale is {what} at {int(np.count_nonzero(broken))} of {scale.size} scale values (codes "
                    f"{'NaN' if what == '0' else 'not finite'}): a scale must be finite and nonzero"), BITWISE
        if formats.get_format(fmt.format).kind == "cast":  # the element type at scale 1: a layer scales it
            x = (x * scale if multiplied else x / scale).astype(np.float32)
    if fmt.per is not None:
        keep = {a % x.ndim for a in fmt.per}
        red = tuple(a for a in range(x.ndim) if a not in keep)
    elif formats.get_format(fmt.format).per_axis:
        whole = None if any(a is None for a in axes) else whole_axes(axes)
        merged = None if whole is None else _merged_layout(x.shape, whole)
        if merged is None:
            return None, Hold("type", "the matmul's contraction axes do not trace back to the quantizer's axes "
                                      "(declare the axes that keep their own scale: {'format': ..., 'per': AXES})")
        shape, red = merged
        x, codes = x.reshape(shape), np.asarray(codes).reshape(shape)
    else:
        red = tuple(range(x.ndim))
    if (form := _matching_form(x, codes, fmt.format, red)) is not None:
        return None, Hold("bitwise", form=form if len(formats.get_format(fmt.format).forms) > 1 else None)
    if formats.get_format(fmt.format).stochastic and _stochastic_ok(x, codes, fmt.format, red):
        return None, BITWISE
    ref = _reference_codes(x, fmt.format, red, formats.get_format(fmt.format).forms[0])
    if ref is None:
        return (f"its codes cannot be laid out in {fmt} blocks along axes {red} of the quantizer's input {x.shape}",
                BITWISE)
    if ref.shape != np.shape(codes):
        return None, Hold("type", f"the referee's codes {ref.shape} and the layer's {np.shape(codes)} differ in shape")
    return f"codes are not {fmt}'s: {_describe_first(x, codes, ref)}; {_diagnose(x, codes, fmt.format, red)}", BITWISE


def _judge_zero_point(zero_point: np.ndarray, x: np.ndarray, fmt: RoleFormat, axes: tuple[int | None, ...] | None
                      ) -> tuple[str | None, Hold]:
    """A finding for the codes of a zero point (the codes another quantizer added to ``x`` / scale before its
    rounding) that are not the declared format's zero point of ``x`` (None when they are), and the hold."""
    if "zero_point" not in formats.get_format(fmt.format).scales:
        return (f"its codes are a zero point (added to a quantizer's scaled input before the rounding); declared "
                f"{fmt}, which has none"), BITWISE
    if axes is None:
        return None, Hold("type", "the zero point's quantizer reaches no matmul whose contraction axes name its "
                                  "slices")
    x = np.asarray(x, np.float32)
    if fmt.per is not None:
        keep = {a % x.ndim for a in fmt.per}
        red = tuple(a for a in range(x.ndim) if a not in keep)
    elif any(a is None or isinstance(a, tuple) for a in axes):
        return None, Hold("type", "the matmul's contraction axes do not trace back to the quantizer's axes "
                                  "(declare the axes that keep their own scale: {'format': ..., 'per': AXES})")
    else:
        red = tuple(sorted({int(a) % x.ndim for a in axes}))
    ftz = jax.default_backend() == "cpu"
    refs = [referees.reference_quantize(x, fmt.format, axis=red or tuple(range(x.ndim)), ftz=ftz,
                                        xla_reciprocal=form)[1]["zero_point"]
            for form in formats.get_format(fmt.format).forms]
    zero_point = np.asarray(zero_point)
    if refs[0].shape != zero_point.shape:
        return None, Hold("type", f"the zero point {zero_point.shape} is not one per slice of the quantizer's input "
                                  f"{x.shape} along axes {red} ({refs[0].shape})")
    if any(_bits_equal(zero_point, r) for r in refs):
        return None, BITWISE
    differ = _codes_differ(zero_point, refs[0])
    idx = tuple(int(i) for i in np.argwhere(differ)[0])
    return (f"zero point is not {fmt}'s: {int(differ.sum())} of {zero_point.size} differ from the referee's; first "
            f"at {list(idx)}: {_as_f32(zero_point)[idx]:g} where the referee gives {_as_f32(refs[0])[idx]:g}"), BITWISE


def _judge_zero_points(zero_point: tuple[Any, ...], main: tuple[Any, ...], fmt: RoleFormat,
                       axes: tuple[int | None, ...] | None) -> tuple[str | None, Hold]:
    """:func:`_judge_zero_point` on each run of the quantizer ``main`` (its values stacked over a body's runs) with
    the zero point's own run: the same run where both are the body's, one zero point for every run where the
    zero point was made outside the body (handed in). A finding is prefixed with the run it names."""
    zp_stacked, main_stacked = (q[3] if len(q) > 3 else () for q in (zero_point, main))
    if tuple(main_stacked[:len(zp_stacked)]) != tuple(zp_stacked):
        return None, Hold("type", "the zero point was made in another body than the quantizer it shifts")
    hold = Hold("type", "inside a body that ran no iteration: no codes to hold")
    zp = np.asarray(zero_point[1])
    for at, index, x, _, _ in _runs(main[0], main[1], None, main_stacked):
        msg, hold = _judge_zero_point(zp[index[:len(zp_stacked)]], x, fmt, axes)
        if msg is not None:
            return f"{at}: {msg}", hold
        if not hold.bitwise:
            break
    return None, hold


def _merged_layout(shape: tuple[int, ...], axes: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The quantizer's layout with each run of its axes that one contraction axis flattens (a tuple in ``axes``:
    blocks reshaped back onto their axis) merged, and the contraction axes in it; None where runs overlap."""
    runs = {a[0]: a for a in axes if isinstance(a, tuple)}
    inside = [k for run in runs.values() for k in run]
    singles = {a for a in axes if isinstance(a, int)}
    if len(inside) != len(set(inside)) or singles & set(inside):
        return None
    new_shape: list[int] = []
    index: dict[Any, int] = {}
    j = 0
    while j < len(shape):
        run = runs.get(j, (j,))
        index[run if len(run) > 1 else j] = len(new_shape)
        new_shape.append(int(np.prod([shape[k] for k in run])))
        j += len(run)
    try:
        return tuple(new_shape), tuple(sorted({index[a if isinstance(a, int) or len(a) > 1 else a[0]] for a in axes}))
    except KeyError:
        return None


def _no_evidence(r: MatmulRecord) -> str:
    """Why an operand of ``r`` has no quantizer values to hold its codes to."""
    if r.opaque:
        return f"an opaque kernel ({r.kernel}): its code inputs are not traced back to a quantizer"
    if r.no_values:
        return r.no_values
    if "gather" in (r.lhs.step, r.rhs.step):
        return "codes looked up in a constant table (a gather): not traced to the values they quantize"
    return "its codes do not trace back to a quantizer the walk saw (narrow from the start, or through an op " \
           "that loses their layout)"


def judge(records: Sequence[MatmulRecord], declaration: Declaration, quantizers: Sequence[tuple[Any, ...]],
          operands: Sequence[tuple[int, str, int, tuple[int | None, ...]]],
          zero_points: Mapping[int, int] | None = None) -> list[MatmulRecord]:
    """``records`` with each operand's declared format, its hold and the site's findings against ``declaration``.

    ``quantizers`` and ``operands`` are the walk's evidence (numpy values):
    each quantizer's input, codes, divisor and, where it ran inside bodies,
    what its leading axes enumerate; and which matmul operand reached which
    quantizer with which contraction axes. A declared format's operand that
    cannot be held bitwise gets a finding saying why (every format qcheck
    knows fixes its bits), unless the caller accepts the weaker hold.
    ``zero_points``: the quantizers whose codes are another's zero point (to
    that one); an operand that reached one (qwix's correction matmul of the
    zero point) is held to the referee's zero point of the other's input.
    """
    evidence = {(i, side): (q, axes) for i, side, q, axes in operands}
    zero_points = zero_points or {}
    axes_of = {q: axes for _, _, q, axes in operands}
    out = []
    for i, r in enumerate(records):
        found: list[str] = []
        declared: dict[str, str | None] = {}
        holds: dict[str, Hold | None] = {"lhs": None, "rhs": None}
        for side in ("lhs", "rhs"):
            role = getattr(r, f"{side}_role")
            known, fmt = declaration.for_operand(side, role, r.kernel, r.scope)
            declared[side] = None if not known else ("full precision" if fmt is None else str(fmt))
            if not known:
                continue
            if r.roles_unknown:  # an unreadable kernel fails as such (assert_quantized)
                holds[side] = Hold("none", f"an opaque kernel ({r.kernel}) whose roles are unknown")
                continue
            quant = getattr(r, side)
            label = f"{side} ({role})"
            if fmt is None:
                holds[side] = Hold("type", "declared full precision: no codes to hold")
                if quant.quantized:
                    found.append(f"{label} is quantized ({quant}) but declared full precision")
                continue
            if not quant.quantized:
                holds[side] = Hold("type", "full precision where a format is declared")
                found.append(f"{label} reaches the matmul in full precision; declared {fmt}")
                continue
            want = _element_types(fmt.format)
            narrow = {c for c in getattr(r, f"{side}_casts") if c in _NARROW_FLOATS or c in _NARROW_INTS}
            stray = sorted(narrow - want)
            if stray:
                holds[side] = Hold("type", "cast to another type than the declared format's")
                found.append(f"{label} is cast to {', '.join(stray)}; declared {fmt}, whose codes and scales are "
                             f"{', '.join(sorted(want))}{_formats_of(narrow, evidence.get((i, side)), quantizers)}")
                continue
            if (i, side) not in evidence:
                holds[side], more = _no_quantizer(r, role, label, declaration, fmt, quant)
                found += more
                continue
            q, axes = evidence[i, side]
            if q in zero_points:
                main = zero_points[q]
                msg, holds[side] = _judge_zero_points(quantizers[q], quantizers[main], fmt, axes_of.get(main))
                if msg is not None:
                    found.append(f"{label}{msg}")
                continue
            x, codes, divisor, *rest = quantizers[q]
            stacked = rest[0] if rest else ()
            # A body that never ran (a scan of length 0, a mesh of no shard) holds no codes: not bitwise.
            hold = Hold("type", "inside a body that ran no iteration: no codes to hold")
            for at, xi, ci, di in _instances(x, codes, divisor, stacked):
                msg, hold = _judge_codes(xi, ci, di, fmt, axes)
                if msg is not None:
                    found.append(f"{label}{at}: {msg}")
                if msg is not None or not hold.bitwise:
                    break
            holds[side] = hold
        out.append(dataclasses.replace(r, lhs_declared=declared["lhs"], rhs_declared=declared["rhs"],
                                       findings=tuple(found), lhs_hold=holds["lhs"], rhs_hold=holds["rhs"]))
    return out


def held_at(declaration: Declaration, scope: str | None) -> tuple[tuple[str, str | None], ...]:
    """The stored weights check_layer held in the innermost module of ``declaration.held`` holding ``scope``."""
    scope = scope or ""
    inside = [p for p in declaration.held if p == "" or scope == p or scope.startswith(p + "/")]
    return declaration.held[max(inside, key=len)] if inside else ()


#: Group sizes tried where stored grouped codes are not the declared group size's.
_GROUPS = (16, 32, 64, 128, 256, 512)


def _same_scale(mine: np.ndarray, ref: np.ndarray) -> bool:
    """A stored scale equals the referee's bitwise, in either layout a library keeps (its size-1 axes dropped;
    a [groups, channels] matrix where the referee's is [channels, groups])."""
    a, b = np.squeeze(np.asarray(mine)), np.squeeze(np.asarray(ref))
    if a.shape != b.shape and a.ndim == 2 and a.T.shape == b.shape:
        a = a.T
    return _bits_equal(a, b)


def _ref_scale(ref_scales: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """The referee's ``zero_point``, or for ``scale`` its one float scale (``slice`` or ``block``); empty if none."""
    if name == "zero_point":
        return ref_scales.get("zero_point", np.zeros(0))
    return next((v for k, v in ref_scales.items() if k != "zero_point"), np.zeros(0))


def _rounding(codes: np.ndarray, ref: np.ndarray) -> str | None:
    """What rounding the codes took where they are the referee's or one step from it everywhere."""
    d = _as_f32(codes) - _as_f32(ref)
    if not np.all(np.isin(d, (-1.0, 0.0, 1.0))) or not np.any(d):
        return None
    if np.all(d <= 0):
        return "each code is the referee's or one below it: rounded down (floor), not to nearest"
    if np.all(d >= 0):
        return "each code is the referee's or one above it: rounded up (ceil), not to nearest"
    if np.all(np.abs(_as_f32(codes)) <= np.abs(_as_f32(ref))):
        return "each code is the referee's or one step nearer zero: truncated, not rounded to nearest"
    return None


def judge_stored(x: np.ndarray, codes: np.ndarray, scales: Mapping[str, np.ndarray], fmt: RoleFormat,
                 axes: tuple[int, ...], *, what: str) -> str | None:
    """None where stored ``codes`` and ``scales`` (``scale``, ``zero_point``; those a library keeps) are the
    referee's of the float ``x`` bitwise, reduced over ``axes`` (``fmt.per`` overrides them) in one of the format's
    forms; else the finding, naming what differs (``what``: the codes and their source, as the line says them)."""
    x = np.asarray(x, np.float32)
    record = formats.get_format(fmt.format)
    if x.shape != np.shape(codes):
        return f"{what}: its codes {list(np.shape(codes))} do not lay out the float {list(x.shape)}"
    red = tuple(a for a in range(x.ndim) if a not in {p % x.ndim for p in fmt.per}) if fmt.per is not None else axes
    red = red or tuple(range(x.ndim))
    ftz = jax.default_backend() == "cpu"

    def reference(form: str, flush: bool, block: int | None = fmt.block):
        try:
            with np.errstate(over="ignore"):
                return referees.reference_quantize(x, fmt.format, axis=red, ftz=flush, xla_reciprocal=form,
                                                   block=block)
        except ValueError:  # not a whole number of blocks along these axes
            return None

    def held(got: Any) -> bool:
        return got is not None and _bits_equal(codes, got[0]) and all(
            _same_scale(v, _ref_scale(got[1], k)) for k, v in scales.items())

    # A library may quantize on the host (Keras's int4 grouped, in numpy): no flush of subnormals there.
    tried = [reference(form, flush) for form in record.forms for flush in dict.fromkeys((ftz, False))]
    if any(held(got) for got in tried):
        return None
    first = next((got for got in tried if got is not None), None)
    if first is None:
        return f"{what}: its float cannot be laid out in {fmt} blocks along axes {red}"
    ref_codes, ref_scales = first
    if "zero_point" in scales and "zero_point" not in ref_scales:
        return f"{what}: it keeps a zero point; declared {fmt}, which has none"
    if "block" in record.parameters:
        at = block_of(fmt)
        other = next((b for b in _GROUPS if b != at and held(reference(record.forms[0], ftz, b))), None)
        if other is not None:
            return f"{what}: its codes and scales are grouped by {other}, where {fmt} groups by {at}"
    if not _bits_equal(codes, ref_codes):
        # Another rule or granularity first: a coarser scale also moves each code by a step at most.
        why = _diagnose(x, codes, fmt.format, red)
        if why.startswith("they match no other"):
            why = _rounding(codes, ref_codes) or why
        return f"{what}: codes are not {fmt}'s: {_describe_first(x, codes, ref_codes)}; {why}"
    for name, v in scales.items():
        want = _ref_scale(ref_scales, name)
        if not _same_scale(v, want):
            return (f"{what}: its codes are {fmt}'s, its {name} is not the referee's ({np.size(v)} values, the "
                    f"referee's {np.size(want)})")
    return None


def _no_quantizer(r: MatmulRecord, role: str, label: str, declaration: Declaration, fmt: RoleFormat,
                  quant: OperandQuant) -> tuple[Hold, list[str]]:
    """The hold of an operand whose codes reach no quantizer the walk saw, and its findings: stored codes marked
    with their float source, or a weight stored as codes that check_layer held against the twin's float parameter
    (bitwise, or its findings), else its type, accepted where its reader says the library stores it."""
    source = quant.stored if role == "weight" and not r.opaque else None
    if source is not None:
        if fmt not in source.judged:  # once per format: every site the codes reach holds the same finding
            source.judged[fmt] = judge_stored(source.x, source.codes, source.scales, fmt, source.axes,
                                              what=f"stored {source.codes.dtype}{list(source.codes.shape)} codes "
                                                   f"against their source (qcheck.weights(..., source=))")
        finding = source.judged[fmt]
        return (Hold("bitwise", "stored codes held bitwise against their source (qcheck.weights(..., source=))"),
                [] if finding is None else [f"{label}: {finding}"])
    held = held_at(declaration, r.scope) if role == "weight" and not r.opaque else ()
    if held:
        return (Hold("bitwise", "stored codes held bitwise against the reference's "
                     + ", ".join(source for source, _ in held)),
                [f"{label}: {finding}" for _, finding in held if finding is not None])
    stored = declaration.stored.get(role_key(role)) if not r.opaque else None
    return Hold("type", _no_evidence(r), accepted_by=stored), []


def weaker_holds(r: MatmulRecord) -> list[str]:
    """Each declared, quantized-format operand of ``r`` held less than bitwise, not accepted: one line each."""
    lines = []
    for side in ("lhs", "rhs"):
        hold, declared = getattr(r, f"{side}_hold"), getattr(r, f"{side}_declared")
        if hold is None or hold.bitwise or hold.accepted_by or declared in (None, "full precision"):
            continue
        if hold.strength == "type" and hold.reason in ("full precision where a format is declared",
                                                        "cast to another type than the declared format's"):
            continue  # already a finding of its own
        if hold.strength == "none":
            continue  # an unreadable kernel fails as such
        if getattr(r, f"{side}_role") == "grad" and formats.get_format(declared.split()[0]).stochastic:
            continue  # a gradient in a format that may round stochastically (NVFP4's DGRAD): its bits are not fixed
        lines.append(f"{side} ({getattr(r, f'{side}_role')}) held by its type only, not bitwise as {declared} "
                     f"fixes its bits: {hold.reason}")
    return lines


def mixed_formats(records: Sequence[MatmulRecord]) -> list[str]:
    """With nothing declared: the sites whose operands of one role are cast to a minority narrow type.

    A layer whose weights are e4m3fnuz at every site but one, e4m3fn there,
    mixes formats within a role; the odd site is named.
    """
    by_role: dict[str, list[tuple[MatmulRecord, str]]] = {}
    for r in records:
        if r.backward or r.opaque:
            continue
        for side in ("lhs", "rhs"):
            q = getattr(r, side)
            if q.kind == "cast" and q.dtype in _NARROW_FLOATS:
                by_role.setdefault(getattr(r, f"{side}_role"), []).append((r, q.dtype))
    problems = []
    for role, seen in by_role.items():
        counts: dict[str, int] = {}
        for _, d in seen:
            counts[d] = counts.get(d, 0) + 1
        if len(counts) < 2:
            continue
        top = max(counts.values())
        common = [d for d, n in counts.items() if n == top]
        if len(common) > 1:  # no majority to hold the others to: every site, with its type
            problems.append(f"{role} operands of one layer are cast to {', '.join(sorted(counts))}: " + "; ".join(
                f"{d} at {r.location} ({r.function})" for r, d in seen) + ": formats mixed within one role")
            continue
        for r, d in seen:
            if d != common[0]:
                problems.append(f"{r.primitive} at {r.location} ({r.function}): its {role} operand is {d} where "
                                f"{top} other {role} operands are {common[0]}: formats mixed within one role")
    return problems
