"""The referees' one-line error for an unknown name: qcheck._choices.require_choice's wording, written again
because a referee imports nothing of qcheck's."""

from __future__ import annotations


def choice(kind: str, value: object, valid: tuple[str, ...]) -> str:
    """``value`` if it is one of ``valid``, else a ValueError naming the kind and every valid choice."""
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid {kind}s: {', '.join(valid)}")
    return value
