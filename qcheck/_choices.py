"""One wording for an unknown name, whatever the kind: it lists the valid ones."""

from __future__ import annotations

from collections.abc import Iterable


def require_choice(kind: str, value: object, valid: Iterable[str], *, where: str | None = None) -> str:
    """``value`` if it is one of ``valid``, else a ValueError naming the kind and every valid choice.

    ``where`` (the function or argument at fault) starts the message when given.
    """
    valid = tuple(valid)
    if value not in valid:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}unknown {kind} {value!r}; valid {kind}s: {', '.join(valid)}")
    return value
