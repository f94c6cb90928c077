"""Known upstream defects: cells of the case table a library recipe fails, held to that failure."""

from __future__ import annotations

import dataclasses
import re

__all__ = ["KnownDefect"]


@dataclasses.dataclass(frozen=True)
class KnownDefect:
    """The ``invariant`` fails on the variant ``variant`` (e.g. ``"mixtral-sparse"``) with a message matching ``match``.

    Declared on a recipe (``Recipe.known_defects``) whose library has the
    defect. The suite still runs that cell and requires it to fail with that
    message: the matrix shows ``defect [n]`` and the note, the pytest plugin
    marks the case a strict expected failure, so a fixed library shows up as a
    cell that passes where it should not.
    """

    invariant: str
    variant: str
    match: str
    reason: str

    def __post_init__(self):
        for field in ("invariant", "variant", "match", "reason"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise TypeError(f"KnownDefect.{field} must be a non-empty string, got {getattr(self, field)!r}")
        re.compile(self.match)

    def matches(self, message: str) -> bool:
        return re.search(self.match, message) is not None
