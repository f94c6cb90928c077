"""A library as qcheck must know it to read a stack: one record (:class:`Library`) of its reader, its stored
weights, its machinery and plumbing, its known kernels."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qcheck.libraries._declaration import Declaration, Stored
from qcheck.libraries._kernel import KnownKernel


def _names(value: Any, field: str, what: str) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"{what}: {field} must be a tuple of module names (non-empty str), got {value!r}")


@dataclasses.dataclass(frozen=True)
class Library:
    """What qcheck knows of one library (a user's own too: ``register_library``, or an entry point of the
    ``qcheck.libraries`` group).

    ``name`` is printed in messages. ``reader(layer)`` returns the layer's
    :class:`Declaration` (what the user configured the library to quantize,
    never a site's own quantizer object), a str saying why a layer of this
    library is not read, or None where the layer is not this library's;
    ``reads`` says in words what it reads. ``stored(layer)`` returns the
    weights the layer keeps only as codes (:class:`Stored`, by the path of the
    float parameter its unquantized twin holds). ``machinery``: modules (dotted
    names, prefixes of a frame's module) whose frames are never a user's call
    site; ``plumbing``: the part of that machinery that is never even a stock
    layer's line (a stock layer checked bare is located at its own line past
    them). ``kernels``: the opaque kernels it ships and their operands' roles.
    ``packages``: the import paths of its own packages that none of those name
    (a library read only by its layers' module, gemma's), so that qcheck's own
    modules are held to name none of them outside ``qcheck/libraries/``.
    """

    name: str
    reads: str = ""
    reader: Callable[[Any], Declaration | str | None] | None = None
    stored: Callable[[Any], dict[str, Stored]] | None = None
    machinery: tuple[str, ...] = ()
    plumbing: tuple[str, ...] = ()
    kernels: tuple[KnownKernel, ...] = ()
    packages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise TypeError(f"Library: name must be a non-empty str, got {self.name!r}")
        what = f"Library({self.name!r})"
        if not isinstance(self.reads, str):
            raise TypeError(f"{what}: reads must be a str (what its reader reads), got {type(self.reads).__name__}")
        for field in ("reader", "stored"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise TypeError(f"{what}: {field} must be a function of the layer or None, got "
                                f"{type(getattr(self, field)).__name__}")
        for field in ("machinery", "plumbing", "packages"):
            _names(getattr(self, field), field, what)
        if not isinstance(self.kernels, tuple) or not all(isinstance(k, KnownKernel) for k in self.kernels):
            raise TypeError(f"{what}: kernels must be a tuple of qcheck.libraries.KnownKernel, got {self.kernels!r}")

    def import_paths(self) -> tuple[str, ...]:
        """The top-level packages it names (its machinery's, plumbing's, kernels' files' and ``packages``)."""
        found = [m.split(".")[0] for m in (*self.machinery, *self.plumbing, *self.packages)]
        found += [path.split("/")[0] for k in self.kernels for path, _ in k.calls]
        return tuple(dict.fromkeys(found))
