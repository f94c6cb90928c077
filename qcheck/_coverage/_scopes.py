"""Where a matmul is: the user's line past the libraries' machinery, and NNX module paths as named scopes."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from typing import Any

import jax
import jax.extend.core as jcore

from qcheck import libraries


# -- source locations ---------------------------------------------------------

# The machinery (modules whose frames are never a user's call site: a record's location is the innermost frame
# outside them, the standard library and qcheck's plumbing) and the plumbing (the part of a library's machinery
# that is never even its stock layer's line) are each registered library's (``qcheck.libraries``: JAX, Flax,
# AQT, qwix, MaxText's bridge and wrappers, Equinox, haliax's dot ops, Keras, and a user's own), read at each
# walk. Pass more as ``machinery=`` to :func:`coverage` and the checks built on it. A dotted module counts once
# its package is imported (looking it up never imports it).


def _prefix_of(package: str) -> str | None:
    """The directory (or file) of a package or module; None when it is not installed or not yet imported."""
    import importlib.util

    if os.sep in package or package.endswith(".py"):
        return os.path.abspath(package) + ("" if package.endswith(".py") or os.path.isfile(package) else os.sep)
    parent = package.rpartition(".")[0]
    if parent and parent not in sys.modules:
        return None  # finding a submodule would import its package
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.path.abspath(list(spec.submodule_search_locations)[0]) + os.sep
    return os.path.abspath(spec.origin) if spec.origin else None


def machinery_prefixes(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The path prefixes of the machinery (the registered libraries', the ``extra`` packages, the stdlib, qcheck's own
    call-site layers) a frame is skipped over in, to locate a matmul at the user's line."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep  # qcheck/_coverage/
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # qcheck/
    packages = [p for p in (_prefix_of(name) for name in (*libraries.machinery(), *extra)) if p]
    # qcheck's own layers of a call site (the checks, the recipes' sites, the bridge, the formats): a
    # matmul is located at the user's line that reached them, not inside them.
    return (
        *packages,
        os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
        here, root + "checks" + os.sep, root + "recipes" + os.sep,
        root + "layers" + os.sep + "bridge.py", root + "formats" + os.sep,
    )


@functools.lru_cache(maxsize=65536)
def _is_machinery(filename: str, prefixes: tuple[str, ...]) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(prefixes) or filename.startswith("<")


def _display(filename: str) -> str:
    path = os.path.abspath(filename)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def user_frames(eqn: jcore.JaxprEqn, prefixes: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``(file:line, function)`` of each frame of ``eqn``'s traceback outside the ``prefixes``, innermost first;
    where none is, outside a library's plumbing only (its ``plumbing``), and where none is still, outside the
    machinery but that library."""
    tb = eqn.source_info.traceback
    if tb is None:
        return ()
    frames = list(zip(*tb.raw_frames()))
    kept = [(code, lasti) for code, lasti in frames if not _is_machinery(code.co_filename, prefixes)]
    # Then the library's own op: a functional model's ops.einsum runs in Keras's plumbing alone (its location
    # keras/src/backend/jax/numpy.py's einsum, not <unknown>).
    by_library = tuple((n, p) for n, p in libraries.plumbing().items() if n in sys.modules) if not kept else ()
    for plumbing in (True, False) if not kept else ():
        if (inner := _plumbing_only(prefixes, plumbing, by_library)) is None:
            break  # no library with plumbing is machinery here
        if kept := [(code, lasti) for code, lasti in frames if not _is_machinery(code.co_filename, inner)]:
            break
    return tuple((f"{_display(code.co_filename)}:{tb.code_addr2line(code, lasti)}", code.co_qualname)
                 for code, lasti in kept)


@functools.lru_cache(maxsize=64)
def _plumbing_only(prefixes: tuple[str, ...], plumbing: bool, loaded: tuple[tuple[str, tuple[str, ...]], ...]
                   ) -> tuple[str, ...] | None:
    """``prefixes`` with each machinery module that has plumbing narrowed to its plumbing (``plumbing``), or
    left out; None where none is in them. ``loaded``: those imported, with their plumbing (only then are their
    modules found, and only then can a frame be theirs)."""
    found = {p: modules for name, modules in loaded if (p := _prefix_of(name)) is not None and p in prefixes}
    if not found:
        return None
    kept = [p for modules in found.values() for m in modules if (p := _prefix_of(m)) is not None]
    return tuple(p for p in prefixes if p not in found) + (tuple(kept) if plumbing else ())


def scope_names(eqn: jcore.JaxprEqn) -> tuple[str, ...]:
    """The named scopes of an eqn's name stack (relative to its jaxpr), without transformations (jvp, transpose)."""
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return tuple(s.name for s in stack if type(s).__name__ == "Scope" and getattr(s, "name", None))


# -- NNX module paths as named scopes ---------------------------------------------

def _shape(variable: Any) -> tuple[int, ...] | None:
    value = variable.get_value() if hasattr(variable, "get_value") else getattr(variable, "value", None)
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


def _skeleton(module: Any) -> tuple[dict, dict]:
    """A module's submodules (relative path -> class) and variables (relative path -> (class, shape))."""
    from flax import nnx

    modules, variables = {}, {}
    for path, node in nnx.iter_graph(module):
        key = tuple(str(k) for k in path)
        if isinstance(node, nnx.Module):
            modules[key] = type(node)
        elif isinstance(node, nnx.Variable):
            variables[key] = (type(node), _shape(node))
    return modules, variables


def _one_axis_fewer(stacked: tuple[int, ...], sliced: tuple[int, ...]) -> bool:
    return len(stacked) == len(sliced) + 1 and any(
        stacked[:i] + stacked[i + 1:] == sliced for i in range(len(stacked)))


def _same_layer(copy: tuple[dict, dict], original: tuple[dict, dict]) -> bool:
    """Whether ``copy`` is ``original`` rebuilt: the same submodules and variables, each variable's shape
    the original's or one slice of it along some axis (a layer of a stacked, scanned module)."""
    if copy[0] != original[0] or copy[1].keys() != original[1].keys():
        return False
    for key, (cls, shape) in copy[1].items():
        ocls, oshape = original[1][key]
        if cls is not ocls:
            return False
        if shape is not None and oshape is not None and shape != oshape and not _one_axis_fewer(oshape, shape):
            return False
    return True


def _referenced(frame: Any) -> list[Any]:
    """The objects a frame's locals hold, and those inside a tuple, list or dict among them (one level)."""
    try:
        values = list(frame.f_locals.values())
    except Exception:  # a frame whose locals cannot be read
        return []
    out = []
    for v in values:
        out.append(v)
        if isinstance(v, (tuple, list)):
            out.extend(v)
        elif isinstance(v, dict):
            out.extend(v.values())
    return out


class ModuleScopes:
    """While tracing an NNX module, open a ``jax.named_scope`` named by each submodule's path as its methods run.

    A profile hook sees each Python call; a method of a module class in the
    graph whose ``self`` is one of the graph's modules opens the scope of that
    module's path (relative to the module whose method is running), and closes
    it when the method returns. Tracing only: nothing of JAX is patched.

    A transform rebuilds modules: ``nnx.merge`` inside a ``jax.lax.scan`` or
    ``jax.checkpoint`` body (MaxText's scanned decoder layers), ``nnx.scan``,
    ``nnx.vmap``, ``nnx.remat`` and ``nnx.jit`` all call the body with new
    module objects, which the graph does not hold. Such a module is matched,
    the first time one of its methods runs, to the graph's module it was
    rebuilt from: the one of its class with the same submodules and variables
    (each variable's shape the same, or one layer of a stacked module's);
    where several match (identical layers), the one the Python stack holds
    nearest (the transform's caller passed it in), or the only one under the
    module the stack holds. Its submodules then take its path. A module that
    matches none keeps its own submodules' paths under the running module's.
    """

    def __init__(self, module: Any):
        from flax import nnx

        self.paths: dict[int, tuple[str, ...]] = {}
        self.codes: set[Any] = set()
        self.by_class: dict[type, list[Any]] = {}
        base = set(nnx.Module.__mro__)  # the module machinery itself: getattr, setattr, graph methods
        for path, node in nnx.iter_graph(module):
            if isinstance(node, nnx.Module) and id(node) not in self.paths:
                self.paths[id(node)] = tuple(str(k) for k in path)
                self.by_class.setdefault(type(node), []).append(node)
                for cls in type(node).__mro__:
                    if cls in base:
                        continue
                    for value in vars(cls).values():
                        fn = getattr(value, "__func__", value)
                        if hasattr(fn, "__code__"):
                            self.codes.add(fn.__code__)
        self.skeletons: dict[int, tuple[dict, dict]] = {}
        # Rebuilt modules met during the trace, held so that their ids stay theirs until the trace ends.
        self.rebuilt: list[Any] = []
        self.active: list[tuple[Any, tuple[str, ...], Any]] = []
        self.previous: Any = None

    def skeleton(self, node: Any) -> tuple[dict, dict]:
        if id(node) not in self.skeletons:
            self.skeletons[id(node)] = _skeleton(node)
        return self.skeletons[id(node)]

    def origin(self, node: Any, frame: Any) -> tuple[str, ...] | None:
        """The path of the graph's module ``node`` was rebuilt from; None where none or several match."""
        mine = self.skeleton(node)
        matches = [m for m in self.by_class.get(type(node), ()) if _same_layer(mine, self.skeleton(m))]
        paths = {self.paths[id(m)] for m in matches}
        if len(paths) <= 1:
            return next(iter(paths), None)
        # Every module with a path is alive (the graph's, or held in self.rebuilt): an id among them is theirs.
        f = frame.f_back
        while f is not None:
            held = {self.paths[id(v)] for v in _referenced(f) if id(v) in self.paths}
            found = held & paths
            if len(found) == 1:
                return found.pop()
            under = {p for p in paths if any(p[:len(a)] == a and len(p) > len(a) for a in held)}
            if len(under) == 1:
                return under.pop()
            f = f.f_back
        return None

    def adopt(self, node: Any, frame: Any) -> tuple[str, ...] | None:
        """Give a module the graph does not hold (a transform rebuilt it) and its submodules their paths."""
        from flax import nnx

        if not isinstance(node, nnx.Module) or frame.f_code.co_name == "__init__":
            return None  # a module being built has no graph yet
        try:
            root = self.origin(node, frame)
            if root is None:
                root = self.active[-1][1] if self.active else ()
            for path, sub in nnx.iter_graph(node):
                if isinstance(sub, nnx.Module) and id(sub) not in self.paths:
                    self.paths[id(sub)] = root + tuple(str(k) for k in path)
                    self.rebuilt.append(sub)
        except Exception:  # noqa: BLE001 -- a scope is a label: never let finding one break the trace
            self.paths[id(node)] = self.active[-1][1] if self.active else ()
            self.rebuilt.append(node)
        return self.paths.get(id(node))

    def enter(self, frame: Any) -> None:
        me = frame.f_locals.get("self")
        path = self.paths.get(id(me))
        if path is None and me is not None:
            path = self.adopt(me, frame)
        top = self.active[-1][1] if self.active else ()
        if path is not None and path != top:
            rel = path[len(top):] if path[:len(top)] == top else path
            scope = jax.named_scope("/".join(rel)) if rel else None
            if scope is not None:
                scope.__enter__()
            self.active.append((frame, path, scope))

    def leave(self, frame: Any) -> None:
        # Frames an exception unwound (no return event) close with the first caller that returns.
        for i in range(len(self.active) - 1, -1, -1):
            if self.active[i][0] is frame:
                while len(self.active) > i:
                    _, _, scope = self.active.pop()
                    if scope is not None:
                        scope.__exit__(None, None, None)
                return

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if self.previous is not None:
            self.previous(frame, event, arg)
        if event == "call" and frame.f_code in self.codes:
            self.enter(frame)
        elif event == "return" and frame.f_code in self.codes:
            self.leave(frame)

    def __enter__(self) -> ModuleScopes:
        monitoring = getattr(sys, "monitoring", None)
        self.tool = None
        if monitoring is not None:  # Python 3.12+: events for the modules' own code objects only, nearly free
            self.tool = next((t for t in range(6) if monitoring.get_tool(t) is None), None)
        if self.tool is not None:
            events = monitoring.events
            monitoring.use_tool_id(self.tool, "qcheck.coverage")
            monitoring.register_callback(self.tool, events.PY_START, lambda code, offset: self.enter(sys._getframe(1)))
            monitoring.register_callback(self.tool, events.PY_RETURN,
                                         lambda code, offset, value: self.leave(sys._getframe(1)))
            for code in self.codes:
                monitoring.set_local_events(self.tool, code, events.PY_START | events.PY_RETURN)
            return self
        self.previous = sys.getprofile()
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.tool is not None:
            monitoring = sys.monitoring
            for code in self.codes:
                monitoring.set_local_events(self.tool, code, 0)
            monitoring.register_callback(self.tool, monitoring.events.PY_START, None)
            monitoring.register_callback(self.tool, monitoring.events.PY_RETURN, None)
            monitoring.free_tool_id(self.tool)
        else:
            sys.setprofile(self.previous)
        while self.active:
            _, _, scope = self.active.pop()
            if scope is not None:
                scope.__exit__(None, None, None)


