"""One wording for an unknown name, whatever the kind: it lists the valid ones."""

from __future__ import annotations

from collections.abc import Iterable


def require_choice(kind: str, value: object, valid: Iterable[str]) -> str:
    """``value`` if it is one of ``valid``, else a ValueError naming the kind and every valid choice."""
    valid = tuple(valid)
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid {kind}s: {', '.join(valid)}")
    return value
