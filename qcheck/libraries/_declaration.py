"""What a layer declares: each operand role's format (:class:`RoleFormat`), the weights a library keeps as codes
(:class:`Stored`), and the declaration that holds them (:class:`Declaration`), with ``declared=``'s shapes read
into one (:func:`as_declaration`).

The records a library's reader returns (``qcheck.libraries``), so they sit below the coverage map that holds
each site to them (``qcheck._coverage._declaration``): both import them from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from qcheck import formats
from qcheck._choices import require_choice

#: The keys a declaration takes: roles by data flow, or operands by position.
ROLES = ("weights", "activations", "grads", "lhs", "rhs")
_ROLE_OF = {"weight": "weights", "activation": "activations", "grad": "grads"}


def role_key(role: str) -> str:
    """The declaration's key for a data-flow role of :attr:`MatmulRecord.lhs_role` (``weight`` -> ``weights``)."""
    return _ROLE_OF.get(role, role)


@dataclasses.dataclass(frozen=True)
class RoleFormat:
    """One role's declared format, the axes that keep their own scale (None: the format's own rule), and the
    group size of a format whose rule takes one (``block``, a name of its record's ``parameters``; None: its
    default, the record's ``block``)."""

    format: str
    per: tuple[int, ...] | None = None
    block: int | None = None

    def __str__(self) -> str:
        at = "" if self.block is None else f" at block {self.block}"
        return self.format + at + ("" if self.per is None else f" per axes {self.per}")


@dataclasses.dataclass(frozen=True)
class Stored:
    """A weight a library keeps only as codes (a reader reads where): ``source`` is the path of the float
    parameter the unquantized twin holds in its place, ``codes`` / ``scale`` / ``zero_point`` the paths of the
    arrays the layer keeps instead (check_layer's names), ``axes`` the float parameter's axes its format reduces
    (its contraction axes: every other keeps its own scale), ``packed`` the axis along which codes are packed:
    int4 two to a byte, or 8-bit codes four to a uint32 (None: one code a byte), ``scope`` the module path its
    matmuls are traced under."""

    source: str
    codes: str
    axes: tuple[int, ...]
    scale: str | None = None
    zero_point: str | None = None
    packed: int | None = None
    scope: str = ""


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What a layer declares each operand role to be; ``source`` says where it was read.

    ``kernels``: roles of the matmuls inside opaque kernels by kernel name, where the library quantizes them
    its own way (MaxText's megablox ``gmm`` quantizes with its own qwix rule whatever the config's AQT).

    ``stored``: roles (``weights``) whose codes the library stores already quantized, by the reason: a reader
    sets it where the library keeps no float values to hold them to (Keras's ``quantize("int8")`` replaces the
    kernel by its int8 codes). An operand of such a role whose codes trace back to no quantizer is held by its
    type, accepted with that reason (the hold says so); everything else about it is held as declared.
    """

    roles: Mapping[str, RoleFormat | None]
    source: str = "given"
    kernels: Mapping[str, Mapping[str, RoleFormat | None]] = dataclasses.field(default_factory=dict)
    stored: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Roles by module path (``/``-separated, as :attr:`MatmulRecord.scope` names a site's module), where a
    #: library's rules differ per module (qwix's ``module_path`` regexes): a site takes its innermost module's.
    scopes: Mapping[str, Mapping[str, RoleFormat | None]] = dataclasses.field(default_factory=dict)
    #: The stored weights a reader found (:class:`Stored`, by ``source``): what check_layer holds bitwise against
    #: its twin's float parameters.
    stored_params: Mapping[str, Stored] = dataclasses.field(default_factory=dict)
    #: By module path: each stored weight held there (check_layer fills it), ``(source, finding or None)``; a
    #: weight operand with no quantizer of its own in that module is held by them (bitwise, or failing).
    held: Mapping[str, tuple[tuple[str, str | None], ...]] = dataclasses.field(default_factory=dict)

    def for_operand(self, side: str, role: str, kernel: str | None = None,
                    scope: str | None = None) -> tuple[bool, RoleFormat | None]:
        """``(declared, format)`` for an operand at ``side`` ("lhs"/"rhs") with data-flow ``role`` (of ``kernel``,
        in module ``scope``)."""
        roles = self.roles
        if kernel is not None and kernel in self.kernels:
            roles = self.kernels[kernel]
        elif scope is not None and self.scopes:
            inside = [p for p in self.scopes if p == "" or scope == p or scope.startswith(p + "/")]
            if inside:
                roles = self.scopes[max(inside, key=len)]
        for key in (side, role_key(role)):
            if key in roles:
                return True, roles[key]
        return False, None

    @property
    def any_format(self) -> bool:
        """Whether any role (of any module in ``scopes``) is declared a format, not full precision."""
        return any(v is not None for roles in (self.roles, *self.scopes.values()) for v in roles.values())

    def __str__(self) -> str:
        parts = [f"{k} {'full precision' if v is None else v}" for k, v in self.roles.items()]
        for name, roles in self.kernels.items():
            parts.append(f"kernel {name}: " + ", ".join(f"{k} {'full precision' if v is None else v}"
                                                      for k, v in roles.items()))
        # The modules declared otherwise than the top's, the first few by name (a model has hundreds).
        other = [(path, roles) for path, roles in self.scopes.items() if roles != self.roles]
        for path, roles in other[:3]:
            parts.append(f"module {path}: " + ", ".join(f"{k} {'full precision' if v is None else v}"
                                                       for k, v in roles.items()))
        if len(other) > 3:
            parts.append(f"{len(other) - 3} more module(s) declared otherwise")
        return f"{', '.join(parts)} ({self.source})"


def _choice(what: str, kind: str, value: Any, valid: Sequence[str]) -> str:
    try:
        return require_choice(kind, value, valid)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _role_format(key: str, value: Any, what: str) -> RoleFormat | None:
    if value is None:
        return None
    if isinstance(value, RoleFormat):
        return value
    if isinstance(value, str):
        return RoleFormat(_choice(what, f"{key} format", value, formats.format_names()))
    if isinstance(value, Mapping):
        extra = set(value) - {"format", "per", "block"}
        if extra or "format" not in value:
            raise ValueError(f"{what}: {key} must be a format name, None, or {{'format': NAME, 'per': AXES, "
                             f"'block': N}}; got keys {sorted(map(str, value))}")
        per = value.get("per")
        if per is not None:
            per = (per,) if isinstance(per, int) and not isinstance(per, bool) else per
            if not (isinstance(per, Sequence) and all(isinstance(a, int) and not isinstance(a, bool) for a in per)):
                raise ValueError(f"{what}: {key}'s per must be a tuple of axes (ints), got {value.get('per')!r}")
            per = tuple(per)
        name = _choice(what, f"{key} format", value["format"], formats.format_names())
        return RoleFormat(name, per, _block(value.get("block"), name, f"{what}: {key}"))
    raise ValueError(f"{what}: {key} must be a format name, None, or {{'format': NAME, 'per': AXES}}; "
                     f"got {type(value).__name__}")


def _block(block: Any, name: str, what: str) -> int | None:
    """A declared group size for format ``name``: None where it is the format's default."""
    if block is None:
        return None
    record = formats.get_format(name)
    if "block" not in record.parameters:
        takes = [f.name for f in formats.FORMATS if "block" in f.parameters]
        raise ValueError(f"{what}: block is no parameter of format {name!r} (its block, {record.block}, is fixed); "
                         f"formats that take one: {', '.join(takes)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{what}: block must be a positive int (the group size), got {block!r}")
    return None if block == record.block else block


def block_of(fmt: RoleFormat) -> int | None:
    """The group size ``fmt`` holds its codes to: declared, else its record's."""
    return fmt.block if fmt.block is not None else formats.get_format(fmt.format).block


def as_declaration(spec: Any, what: str = "declared") -> Declaration:
    """A :class:`Declaration` from a registered recipe's name, a format's name, a ``qcheck.Recipe``, or a mapping
    by role.

    A recipe declares its ``lhs`` format for activations, its ``rhs`` format
    for weights (qcheck's call sites take the activation first) and its
    ``grad`` format, if any, for gradients. A format's name (one no recipe
    takes: ``"int8_keras"``, ``"e4m3fn"``) declares it for weights and
    activations alike.
    """
    from qcheck.recipes import Recipe, get_recipe

    if isinstance(spec, Declaration):
        return spec
    if isinstance(spec, str):
        try:
            spec = get_recipe(spec)
        except (KeyError, ValueError) as e:
            if spec in formats.format_names():
                return Declaration({"weights": RoleFormat(spec), "activations": RoleFormat(spec)},
                                   f"format {spec!r} on weights and activations")
            raise ValueError(f"{what}: {e.args[0] if e.args else e}; formats: "
                             f"{', '.join(formats.format_names())}") from None
    if isinstance(spec, Recipe):
        if not spec.quantized:
            return Declaration({"weights": None, "activations": None}, f"recipe {spec.name!r}")
        if spec.lhs is None or spec.rhs is None:
            raise ValueError(f"{what}: recipe {spec.name!r} declares no lhs/rhs formats; declare the roles "
                             f"as a mapping, e.g. {{'weights': 'int8', 'activations': 'int8'}}")
        roles: dict[str, RoleFormat | None] = {"activations": RoleFormat(spec.lhs), "weights": RoleFormat(spec.rhs)}
        if spec.grad is not None:
            roles["grads"] = RoleFormat(spec.grad)
        return Declaration(roles, f"recipe {spec.name!r}")
    if isinstance(spec, Mapping):
        if not spec:
            raise ValueError(f"{what}: the mapping declares no role; keys: {', '.join(ROLES)}")
        for key in spec:
            _choice(what, "role", key, ROLES)
        if {"lhs", "rhs"} & set(spec) and {"weights", "activations"} & set(spec):
            raise ValueError(f"{what}: declare operands by role (weights, activations, grads) or by position "
                             f"(lhs, rhs), not both")
        return Declaration({k: _role_format(k, v, what) for k, v in spec.items()})
    raise ValueError(f"{what} must be a recipe or format name, a qcheck.Recipe or a mapping of roles "
                     f"({', '.join(ROLES)}) to format names; got {type(spec).__name__}")
