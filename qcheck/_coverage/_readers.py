"""Where a layer states its quantization: the declaration read from the layer, by default.

A layer that declares itself (a method ``qcheck_declaration(self)``: qcheck's
own ``MoE``, a team's in-house layer) is read first; then each registered
library's reader (``qcheck.libraries``: qcheck's own, installed plug-ins, a
user's ``register_library``), in registration order: the first that returns
a declaration wins, and one that says why it reads nothing (a layer of its
library configured as no qcheck format) ends the search saying so. This module
holds no library's table: a library is its record. ``check_layer`` reads a
layer's declaration here when its caller gives none, and says in its figures
what it read.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from qcheck._errors import UserCodeError, first_line
from qcheck.libraries import Declaration, Stored, as_declaration, registered_libraries

#: The name of the method a layer declares itself by.
SELF_DECLARED = "qcheck_declaration"


def _self_declared(layer: Any, entry: str) -> Declaration | None:
    """What ``layer``'s own ``qcheck_declaration()`` returns (any shape ``declared=`` takes), or None where it has
    no such method or returns None. A method that raises is the user's code failing: one UserCodeError."""
    # check_layer takes a Linen module as a (module, variables) pair: the module declares.
    module = layer[0] if isinstance(layer, tuple) and len(layer) == 2 else layer
    if isinstance(module, type) or not callable(getattr(type(module), SELF_DECLARED, None)):
        return None
    where = f"{type(module).__name__}.{SELF_DECLARED}()"
    try:
        spec = getattr(module, SELF_DECLARED)()
    except Exception as e:  # noqa: BLE001 -- the user's method: one error naming it, the original chained
        raise UserCodeError(f"{entry}: {where} raised {type(e).__name__}: {first_line(e)}") from e
    if spec is None:
        return None
    decl = as_declaration(spec, f"{entry}: {where}")
    if isinstance(spec, Declaration):
        return decl
    return dataclasses.replace(decl, source=where if decl.source == "given" else f"{where}: {decl.source}")


def _read(layer: Any, entry: str = "qcheck") -> tuple[Declaration | None, str | None, list[str]]:
    """The declaration read off ``layer``; or None and why a reader that recognised the layer read nothing; and a
    line for each reader that raised (warned too: a failing reader never hides the others, which still run)."""
    decl = _self_declared(layer, entry)
    if decl is not None:
        return decl, None, []
    failed = []
    for library in registered_libraries():
        if library.reader is None:
            continue
        try:
            decl = library.reader(layer)
        except Exception as e:  # noqa: BLE001 -- a plug-in's reader: said in one line, the others still read
            failed.append(f"the {library.name} reader failed on {type(layer).__name__}: {type(e).__name__}: "
                          f"{first_line(e)}")
            warnings.warn(f"qcheck: {failed[-1]}", stacklevel=3)
            continue
        if isinstance(decl, str):  # the layer is this library's, configured as no qcheck format
            return None, f"the {library.name} reader: {decl}", failed
        if decl is not None:
            return _named(decl, library.name, entry), None, failed
    return None, None, failed


def _named(spec: Any, library: str, entry: str) -> Declaration:
    """A reader's declaration (any shape ``declared=`` takes), its source naming the library that read it."""
    reader = f"the {library} reader"
    decl = as_declaration(spec, f"{entry}: {reader}'s declaration")
    if not isinstance(spec, Declaration) and decl.source == "given":
        return dataclasses.replace(decl, source=reader)
    return decl if library in decl.source else dataclasses.replace(decl, source=f"{reader}: {decl.source}")


def read_stored(layer: Any) -> dict[str, Stored]:
    """The weights ``layer`` keeps as codes, by the path of the float parameter its twin holds (Keras's int8/int4
    kernels, qwix's PtqProvider weights: each library's ``stored``); empty where none is read."""
    for library in registered_libraries():
        found = library.stored(layer) if library.stored is not None else None
        if found:
            return found
    return {}


def read_declaration(layer: Any) -> Declaration | None:
    """The quantization ``layer`` declares, or its library declares on it, or None where none is read."""
    return _read(layer)[0]


def _nothing_read(why: str | None, failed: list[str]) -> str:
    if why is None:
        names = [lib.name for lib in registered_libraries() if lib.reader is not None]
        why = f"no reader ({SELF_DECLARED}, {', '.join(names)}) finds a declaration on it"
    return f"nothing read: {why}" + "".join(f"; {line}" for line in failed)


def resolve_declaration(layer: Any, declared: Any, entry: str, what: str = "layer"
                        ) -> tuple[Declaration | None, str]:
    """The declaration ``declared`` asks for, and one line saying what it is and where it was read.

    None (the default) reads it from ``layer`` (its ``qcheck_declaration()``,
    then the registered libraries' readers) and, where nothing is read, holds
    nothing and says so; True reads it and fails where nothing is read; False
    holds nothing; anything else is a declaration given by hand
    (:func:`as_declaration`).
    """
    if declared is False:
        return None, "declared=False: no declaration held"
    if declared is None or declared is True:
        decl, why, failed = _read(layer, entry)
        also = "".join(f"; {line}" for line in failed)
        if decl is not None and not decl.any_format:
            # An unquantized layer by its own word: nothing to hold but that it is quantized at all.
            return None, f"read from the {what}: {decl.source}, which declares no quantized format{also}"
        if decl is not None:
            return decl, f"read from the {what}: {decl.source}{also}"
        if declared is True:
            raise ValueError(f"{entry}: declared=True, but {_nothing_read(why, failed).removeprefix('nothing read: ')}"
                             f" of {type(layer).__name__}; declare it by hand: declared='fp8' (a recipe) or "
                             f"declared={{'weights': 'int8', 'activations': 'int8'}}")
        return None, f"{_nothing_read(why, failed)} ({what} {type(layer).__name__}); pass declared= to hold its sites"
    if isinstance(declared, bool):
        raise ValueError(f"{entry}: declared must be None (read it from the {what}), True, False, a recipe name, a "
                         f"qcheck.Recipe or a mapping of roles to formats")
    decl = as_declaration(declared, f"{entry}: declared")
    return decl, f"given: {decl}"
