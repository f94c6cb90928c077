"""The one result type of every check that measures something: its figures."""

from __future__ import annotations

import numbers

from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from types import MappingProxyType


class Figures(float):
    """What a passing check measured: a float equal to its main figure, with every figure it measured by name.

    A float so that a check's result compares, formats, serialises (JSON,
    pickle) and computes as its main figure, as the plain float it replaced
    did (``assert_tracks(...) <= 0.22``, ``f"{rel:.3g}"``); a read-only mapping
    of the figures by name (``figures["dgrad"]``, ``set(figures)``,
    ``figures.values()``) for checks that measure more than one. Arithmetic
    gives plain floats; printed, it shows as its main figure did (a count as
    an int).
    """

    _figures: Mapping[str, float]
    _number: float | int

    def __new__(cls, value: float | int, figures: Mapping[str, float] | None = None, /, **named: float) -> Figures:
        self = super().__new__(cls, value)
        self._figures = MappingProxyType({**(figures or {}), **named})
        self._number = int(value) if isinstance(value, numbers.Integral) else float(value)
        return self

    def __reduce__(self):
        return (Figures, (self._number, dict(self._figures)))

    def __repr__(self) -> str:
        # Shown as the number it is (a count stays "7"), as the plain result it replaced was.
        return repr(self._number)

    __str__ = __repr__

    @property
    def figures(self) -> Mapping[str, float]:
        return self._figures

    def __getitem__(self, name: str) -> float:
        try:
            return self._figures[name]
        except KeyError:
            raise KeyError(f"no figure {name!r}; figures: {', '.join(self._figures) or '(none)'}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._figures)

    def __len__(self) -> int:
        return len(self._figures)

    def keys(self) -> KeysView[str]:
        return self._figures.keys()

    def values(self) -> ValuesView[float]:
        return self._figures.values()

    def items(self) -> ItemsView[str, float]:
        return self._figures.items()
