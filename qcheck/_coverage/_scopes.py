"""Where a matmul is: the user's line past the libraries' machinery, and NNX module paths as named scopes."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from typing import Any

import jax
import jax.extend.core as jcore


# -- source locations ---------------------------------------------------------

#: Packages and modules whose frames are quantization machinery, never a user's
#: call site: a record's location is the innermost frame outside them (and
#: outside the standard library and qcheck's plumbing). JAX, Flax (its fp8 ops
#: and its Linen/NNX bridge), AQT and qwix, and MaxText's own copies of that
#: plumbing (its ``ToNNX`` bridge and its quantization wrappers), so a MaxText
#: matmul points at the MaxText layer line that asked for it; Equinox (its
#: ``filter_jit`` wrapper would otherwise be the innermost frame of every
#: matmul haliax's ``hax.dot`` traces) and haliax's fp8/int8 dot ops, so a
#: haliax matmul points at the ``Linear`` line that called its op. Pass more as
#: ``machinery=`` to :func:`coverage` and the checks built on it (a team's
#: own quantization library, say). A dotted module counts once its package is
#: imported (looking it up never imports it).
MACHINERY: tuple[str, ...] = ("jax", "jaxlib", "flax", "aqt", "qwix", "maxtext.layers.nnx_wrappers",
                              "maxtext.layers.quantizations", "equinox", "haliax.quantization", "haliax._src.fp8")


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
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep  # qcheck/_coverage/
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # qcheck/
    packages = [p for p in (_prefix_of(name) for name in (*MACHINERY, *extra)) if p]
    # qcheck's own layers of a call site (the checks, the recipes' sites, the bridge, the formats): a
    # matmul is located at the user's line that reached them, not inside them.
    return (
        *packages,
        os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
        here, root + "checks" + os.sep, root + "recipes" + os.sep,
        root + "layers" + os.sep + "bridge.py", root + "formats.py",
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
    tb = eqn.source_info.traceback
    if tb is None:
        return ()
    return tuple((f"{_display(code.co_filename)}:{tb.code_addr2line(code, lasti)}", code.co_qualname)
                 for code, lasti in zip(*tb.raw_frames()) if not _is_machinery(code.co_filename, prefixes))


def scope_names(eqn: jcore.JaxprEqn) -> tuple[str, ...]:
    """The named scopes of an eqn's name stack (relative to its jaxpr), without transformations (jvp, transpose)."""
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return tuple(s.name for s in stack if type(s).__name__ == "Scope" and getattr(s, "name", None))


# -- NNX module paths as named scopes ---------------------------------------------

class ModuleScopes:
    """While tracing an NNX module, open a ``jax.named_scope`` named by each submodule's path as its methods run.

    A profile hook sees each Python call; a method of a module class in the
    graph whose ``self`` is one of the graph's modules opens the scope of that
    module's path (relative to the module whose method is running), and closes
    it when the method returns. Tracing only: nothing of JAX is patched.
    """

    def __init__(self, module: Any):
        from flax import nnx

        self.paths: dict[int, tuple[str, ...]] = {}
        self.codes: set[Any] = set()
        base = set(nnx.Module.__mro__)  # the module machinery itself: getattr, setattr, graph methods
        for path, node in nnx.iter_graph(module):
            if isinstance(node, nnx.Module) and id(node) not in self.paths:
                self.paths[id(node)] = tuple(str(k) for k in path)
                for cls in type(node).__mro__:
                    if cls in base:
                        continue
                    for value in vars(cls).values():
                        fn = getattr(value, "__func__", value)
                        if hasattr(fn, "__code__"):
                            self.codes.add(fn.__code__)
        self.active: list[tuple[Any, tuple[str, ...], Any]] = []
        self.previous: Any = None

    def enter(self, frame: Any) -> None:
        path = self.paths.get(id(frame.f_locals.get("self")))
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


