"""The library registry: qcheck's own libraries, then those of installed packages, then those registered in code.

Installed packages add libraries through the ``qcheck.libraries`` entry-point
group, each entry point naming a :class:`Library` (or a callable returning
one or more). They load at first use, as recipes' do, and again for a package
put on ``sys.path`` after that (a path not scanned yet is scanned once).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import sys
from collections.abc import Iterable, Iterator

from qcheck.libraries._kernel import KnownKernel
from qcheck.libraries._library import Library

ENTRY_POINT_GROUP = "qcheck.libraries"

_REGISTRY: dict[str, Library] = {}
#: (name, value) of each entry point loaded.
_LOADED: set[tuple[str, str]] = set()
_scanned: tuple[str, ...] | None = None  # the sys.path the last whole scan saw (None: not scanned yet)
_loading = False  # a plug-in asking while it is imported


def _builtins() -> tuple[Library, ...]:
    """qcheck's own libraries, in their readers' order: the first reader that returns a declaration wins."""
    from qcheck.libraries import aqt, easydel, equinox, flax, gemma, haliax, jax, keras, maxtext, qwix, tokamax

    return tuple(m.LIBRARY for m in (jax, flax, aqt, equinox, maxtext, gemma, haliax, qwix, keras, tokamax, easydel))


def register_library(library: Library, *, replace: bool = False) -> Library:
    """Add ``library`` to the registry (its reader runs after those registered before it); returns it.

    A name already taken is a ValueError unless ``replace``: the library then takes the old one's place.
    """
    if not isinstance(library, Library):
        raise TypeError(f"register_library: library must be a qcheck.Library, got {type(library).__name__}")
    _ensure_loaded()
    old = _REGISTRY.get(library.name)
    if old is not None and old is not library and not replace:
        raise ValueError(f"register_library: a library named {library.name!r} is already registered (pass "
                         f"replace=True to replace it); registered libraries: {', '.join(_REGISTRY)}")
    _REGISTRY[library.name] = library
    return library


def registered_libraries() -> tuple[Library, ...]:
    """The registered libraries in registration order: qcheck's own, installed plug-ins, then registered in code."""
    _ensure_loaded()
    return tuple(_REGISTRY.values())


@contextlib.contextmanager
def registered(*libraries: Library, replace: bool = False) -> Iterator[tuple[Library, ...]]:
    """Register ``libraries`` for the ``with`` block only (it yields them): a test's planted library.

    Whatever the block registers besides (``register_library``, an entry point of a package put on
    ``sys.path`` inside it) is gone after it too, also when the block raises.
    """
    global _scanned
    _ensure_loaded()
    saved = dict(_REGISTRY), set(_LOADED), _scanned
    try:
        for library in libraries:
            register_library(library, replace=replace)
        yield libraries
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved[0])
        _LOADED.clear()
        _LOADED.update(saved[1])
        _scanned = saved[2]


def known_kernels() -> tuple[KnownKernel, ...]:
    """Every registered library's known kernels."""
    return tuple(k for lib in registered_libraries() for k in lib.kernels)


def machinery() -> tuple[str, ...]:
    """Every registered library's machinery modules."""
    return tuple(dict.fromkeys(m for lib in registered_libraries() for m in lib.machinery))


def plumbing() -> dict[str, tuple[str, ...]]:
    """Per machinery module of a library that has plumbing: that plumbing."""
    return {m: lib.plumbing for lib in registered_libraries() if lib.plumbing for m in lib.machinery}


def _ensure_loaded() -> None:
    global _loading, _scanned
    if not _REGISTRY:
        for library in _builtins():
            _REGISTRY[library.name] = library
    if _loading or _scanned == tuple(sys.path):
        return
    _loading = True
    try:
        _load_entry_points()
        _scanned = tuple(sys.path)
    finally:
        _loading = False


def _as_libraries(obj: object, where: str) -> list[Library]:
    if callable(obj) and not isinstance(obj, Library):
        obj = obj()
    found = [obj] if isinstance(obj, Library) else list(obj) if isinstance(obj, Iterable) else [obj]
    for library in found:
        if not isinstance(library, Library):
            raise TypeError(f"{where} gave {type(library).__name__}, not a qcheck.Library")
    return found


def _load_entry_points() -> None:
    """Load each entry point not loaded yet; one that fails is a one-line RuntimeError naming it, and stays
    unloaded (so the next use says it again, rather than reading on without its library)."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in sorted(eps, key=lambda e: (e.dist.name if e.dist else "", e.name)):
        if (ep.name, ep.value) in _LOADED:
            continue
        where = f"entry point {ep.name} = {ep.value!r} (group {ENTRY_POINT_GROUP})"
        try:
            for library in _as_libraries(ep.load(), where):
                if _REGISTRY.get(library.name) is not library:
                    register_library(library)
        except Exception as e:  # noqa: BLE001 -- a plug-in's failure, said once in one line naming it
            text = str(e).strip().splitlines()
            raise RuntimeError(f"qcheck could not load the library of {where}: {type(e).__name__}: "
                               f"{text[0] if text else '(no message)'}") from e
        _LOADED.add((ep.name, ep.value))
