"""Skip rules: the matmuls a layer means to keep in full precision, by module, function, place or predicate."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any


from qcheck._coverage._records import MatmulRecord


# -- skip rules -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Skip:
    """A rule sparing matmuls meant to stay in full precision, for :func:`assert_quantized` and ``check_layer``.

    ``name`` is how failures and the report name the rule; ``matches(record)``
    selects records. A rule spares a record it matches whose operands are not
    both quantized. Build one with :func:`skip_modules`, :func:`skip_functions`,
    :func:`skip_at` or :func:`skip_where`.
    """

    name: str
    matches: Callable[[MatmulRecord], bool]

    def __call__(self, record: MatmulRecord) -> bool:
        return bool(self.matches(record))

    def __str__(self) -> str:
        return self.name


def _names(what: str, names: tuple[Any, ...], noun: str = "names") -> tuple[str, ...]:
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{what} needs one or more {noun}, got {names!r}")
    return names


def skip_functions(*names: str) -> Skip:
    """Spare matmuls called from a function named in ``names`` anywhere on the user's stack.

    Names are qualified (``Class.method``, ``f.<locals>.g``); every frame of the
    record's ``stack`` counts, not only the innermost, so
    ``skip_functions("GateLogit.__call__")`` spares the router's matmul however
    deep in the layer's own helpers it happens.
    """
    wanted = frozenset(_names("skip_functions", names, "function names"))
    return Skip(f"skip_functions({', '.join(map(repr, names))})",
                lambda r: r.function in wanted or any(fn in wanted for _, fn in r.stack))


def _components(path: str) -> tuple[str, ...]:
    return tuple(c for c in path.split("/") if c)


def skip_modules(*paths: str) -> Skip:
    """Spare matmuls traced under a module path or ``jax.named_scope`` name in ``paths``.

    A path is ``/``-separated (``"gate"``, ``"moe/gate"``) and matches a
    contiguous run of the record's ``scope``: an NNX submodule by its attribute
    path, or a named scope the code opens around the matmul. Edits that move
    lines do not move a module path.
    """
    wanted = [_components(p) for p in _names("skip_modules", paths, "module paths or scope names")]

    def matches(record: MatmulRecord) -> bool:
        scope = _components(record.scope)
        return any(scope[i:i + len(w)] == w for w in wanted for i in range(len(scope) - len(w) + 1))

    return Skip(f"skip_modules({', '.join(map(repr, paths))})", matches)


def skip_at(file: str, function: str | None = None) -> Skip:
    """Spare matmuls called from ``file`` (a path suffix, ``"maxtext/layers/moe.py"``), in ``function`` if given.

    Any frame of the record's ``stack`` counts; no line number, so the rule
    survives edits that move code within the function.
    """
    (file,) = _names("skip_at", (file,), "file paths (a non-empty file)")
    if function is not None:
        _names("skip_at", (function,), "function names (function must be a non-empty name or None)")
    parts = _components(file.replace(os.sep, "/"))

    def matches(record: MatmulRecord) -> bool:
        for location, fn in record.stack or ((record.location, record.function),):
            path = _components(location.rsplit(":", 1)[0].replace(os.sep, "/"))
            if path[-len(parts):] == parts and (function is None or fn == function):
                return True
        return False

    return Skip(f"skip_at({file!r}" + (f", {function!r})" if function else ")"), matches)


def skip_where(predicate: Callable[[MatmulRecord], bool], description: str) -> Skip:
    """Spare matmuls for which ``predicate(record)`` holds, named ``description`` in reports.

    For matmuls known by their shapes or types, e.g. the router's:
    ``skip_where(lambda r: r.rhs_shape[-1] == num_experts, "the matmul producing expert logits")``.
    """
    if not callable(predicate):
        raise ValueError(f"skip_where: predicate must be a callable (record) -> bool, got {type(predicate).__name__}")
    (description,) = _names("skip_where", (description,), "descriptions (a non-empty description)")
    return Skip(f"skip_where({description!r})", predicate)


SkipArg = Skip | Callable[[MatmulRecord], bool] | Sequence[Skip | Callable[[MatmulRecord], bool]] | None


def as_skips(skip: SkipArg, who: str) -> tuple[Skip, ...]:
    """``skip`` as rules: one rule, a plain predicate (named by its function), or a sequence of them."""
    if skip is None:
        return ()
    items = list(skip) if isinstance(skip, (list, tuple)) else [skip]
    rules = []
    for item in items:
        if isinstance(item, Skip):
            rules.append(item)
        elif callable(item) and not isinstance(item, (str, bytes)):
            rules.append(Skip(getattr(item, "__qualname__", None) or repr(item), item))
        else:
            raise TypeError(f"{who}: skip must be a callable (record) -> bool, a qcheck skip rule or a list of them, "
                            f"got {type(item).__name__}")
    return tuple(rules)


