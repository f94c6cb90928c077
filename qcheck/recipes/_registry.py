"""The recipe registry: built-ins, recipes from installed packages, recipes from a named module.

Installed packages add recipes through the ``qcheck.recipes`` entry-point
group; each entry point names a :class:`Recipe`, a callable returning one or
more, or a module that registers its recipes when imported. They are loaded the
first time anyone asks what is registered. A module named on the command line
(``--recipes`` / ``--qcheck-recipes``) is imported by :func:`import_recipes`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterable, Iterator
from pathlib import Path

from qcheck.recipes._base import Recipe

ENTRY_POINT_GROUP = "qcheck.recipes"

_REGISTRY: dict[str, Recipe] = {}
#: recipe name -> the --recipes argument that registered it (absent: built in or installed).
_SOURCE: dict[str, str] = {}
#: --recipes argument -> the names it registered, so naming a module twice is harmless.
_IMPORTED: dict[str, tuple[str, ...]] = {}
_entry_points_state = "unloaded"  # -> "loading" -> "loaded"
#: Recipes qcheck itself ships (its built-ins and its own entry points): their
#: golden cases ship inside the package.
_BUILTIN: set[str] = set()


def register_recipe(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to the registry; a name already taken is a ValueError."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"register_recipe expects a qcheck.Recipe, got {type(recipe).__name__}")
    if recipe.name in _REGISTRY:
        raise ValueError(f"a recipe named {recipe.name!r} is already registered; registered recipes: "
                         f"{', '.join(_REGISTRY)}")
    _REGISTRY[recipe.name] = recipe
    return recipe


@contextlib.contextmanager
def registered(*recipes: Recipe) -> Iterator[tuple[Recipe, ...]]:
    """Register ``recipes`` for the ``with`` block only (it yields them): a test's planted recipe, gone after it.

    Whatever the block registers besides (``register_recipe``, ``import_recipes``) is gone after it too,
    also when the block raises. A name already taken is register_recipe's ValueError, before anything
    is registered.
    """
    _load_entry_points()  # plug-ins loaded inside the block would be forgotten with it
    saved = dict(_REGISTRY), dict(_SOURCE), dict(_IMPORTED)
    try:
        for recipe in recipes:
            register_recipe(recipe)
        yield recipes
    finally:
        for table, old in zip((_REGISTRY, _SOURCE, _IMPORTED), saved):
            table.clear()
            table.update(old)


def step_aside(name: str) -> None:
    """Unregister ``name`` (if registered): inside :func:`registered`, which puts it back after the block.

    For tests that follow a guide registering a name the run may already hold; not exported.
    """
    _REGISTRY.pop(name, None)


def recipe_names() -> tuple[str, ...]:
    """Registered recipe names: built-ins, then installed plug-ins, then imported modules."""
    _load_entry_points()
    return tuple(_REGISTRY)


def get_recipe(name: str | Recipe) -> Recipe:
    """The registered recipe called ``name`` (a Recipe passes through)."""
    if isinstance(name, Recipe):
        return name
    _load_entry_points()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        why = _NOT_OFFERED.get(name, "") if isinstance(name, str) else ""
        raise ValueError(
            f"unknown recipe {name!r}{why}; registered recipes: {', '.join(_REGISTRY)}"
        ) from None


# Adapter recipes qcheck.adapters.installed_recipes leaves out where they cannot run: why, for the message.
_NOT_OFFERED = dict.fromkeys(
    ("jax_mxfp8", "jax_nvfp4"),
    " (offered only where jax.nn.scaled_dot_general lowers on the default backend: not on CPU with jax 0.10.2)")


def recipe_source(name: str) -> str | None:
    """The ``--recipes`` argument that registered ``name``; None for built-in and installed recipes."""
    return _SOURCE.get(name)


def register_builtin(recipe: Recipe) -> None:
    """Register one of the recipes qcheck itself ships (its golden cases ship with qcheck)."""
    register_recipe(recipe)
    _BUILTIN.add(recipe.name)


def is_builtin(name: str) -> bool:
    """Whether qcheck itself ships the recipe ``name`` (its golden cases then ship with qcheck)."""
    _load_entry_points()
    return name in _BUILTIN


def _register_all(obj: object, where: str) -> list[str]:
    """Register what an entry point gave; returns the names it added."""
    if isinstance(obj, types.ModuleType):
        return []  # importing it registered whatever it registers
    if callable(obj) and not isinstance(obj, Recipe):
        obj = obj()
    found = [obj] if isinstance(obj, Recipe) else list(obj) if isinstance(obj, Iterable) else [obj]
    for recipe in found:
        if not isinstance(recipe, Recipe):
            raise TypeError(f"{where} gave {type(recipe).__name__}, not a qcheck.Recipe")
        if _REGISTRY.get(recipe.name) is not recipe:
            register_recipe(recipe)
    return [r.name for r in found]


def _load_entry_points() -> None:
    global _entry_points_state
    if _entry_points_state != "unloaded":  # "loading": a plug-in asking while it is imported
        return
    _entry_points_state = "loading"
    try:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        seen = set()
        for ep in sorted(eps, key=lambda e: (e.dist.name if e.dist else "", e.name)):
            # One entry point seen twice is one plug-in installed twice (qcheck's own metadata left behind under
            # its old distribution name, "qcheck", beside "qcheck-jax"): its recipes are registered once.
            if (ep.name, ep.value) in seen:
                continue
            seen.add((ep.name, ep.value))
            where = f"entry point {ep.name} = {ep.value!r} (group {ENTRY_POINT_GROUP})"
            try:
                before = set(_REGISTRY)
                _register_all(ep.load(), where)
                if ep.value.partition(":")[0].split(".")[0] == "qcheck":  # a module of qcheck's own: it ships
                    _BUILTIN.update(set(_REGISTRY) - before)
            except Exception as e:
                raise RuntimeError(f"qcheck could not load recipes from {where}: {type(e).__name__}: {e}") from e
    finally:
        _entry_points_state = "loaded"


def _load_module(spec: str) -> None:
    path = Path(spec)
    if spec.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ValueError(f"recipe module {spec!r}: no such file")
        name = f"_qcheck_recipes_{path.stem}_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return
    try:
        importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name and spec.startswith(e.name):
            raise ValueError(
                f"recipe module {spec!r} not found: give an importable module name "
                "(on sys.path) or a path to a .py file"
            ) from None
        raise


def import_recipes(spec: str) -> tuple[str, ...]:
    """Import the recipe module ``spec`` (a dotted name or a .py path); returns the names it registered.

    Importing the same ``spec`` again registers nothing new and returns the same names.
    """
    _load_entry_points()  # plug-ins first, so the order of names does not depend on who asked
    if spec in _IMPORTED:
        return _IMPORTED[spec]
    before = set(_REGISTRY)
    _load_module(spec)
    added = tuple(n for n in _REGISTRY if n not in before)
    for name in added:
        _SOURCE[name] = spec
    _IMPORTED[spec] = added
    return added
