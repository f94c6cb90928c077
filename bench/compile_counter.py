"""Counts a process's XLA compilations for bench/compare.py, independently of the code being timed.

compare.py copies this file as ``sitecustomize.py`` into a temporary directory on
PYTHONPATH, so every Python process of a run (pytest, its xdist workers, the
matrix's spawned workers) imports it at start-up. It does nothing unless
QCHECK_BENCH_COMPILE_DIR names a directory. Then, as soon as ``jax`` has been
imported (and before anything can compile), it registers a ``jax.monitoring``
duration listener, and writes ``<pid>.json`` there:
``{"compiles": n, "compile_s": s, "argv": [...]}``: at exit, and also while
the count grows (on the first compilation, then at most once a second,
replacing the file whole). A process that ends without running its exit
handlers (``os._exit``, or killed, as pytest-xdist kills a worker that is
slow to exit) keeps all but its last second's count. With the exit-time write
alone, a run of qcheck's suite once came out one process and half its
compilations short.

The event is the one jax's ``_cached_compilation`` (pxla.py) reports around
``compile_or_get_cached``: "/jax/core/compile/backend_compile_duration" in jax
0.10.2 and 0.12.0.1 (``jax._src.dispatch.BACKEND_COMPILE_EVENT``). Listening to
every event and resolving the name at exit keeps the count right should the
constant move. A persistent-cache hit passes through the same call, so it counts.

Stdlib only, and no import of jax: a process that never imports jax writes 0.
"""

from __future__ import annotations

import atexit
import collections
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time

_DIR_ENV = "QCHECK_BENCH_COMPILE_DIR"
_KNOWN_EVENT = "/jax/core/compile/backend_compile_duration"

_durations: collections.Counter[str] = collections.Counter()
_counts: collections.Counter[str] = collections.Counter()
_registered = False
#: Seconds between the writes made while compiling (the exit-time write is always made).
FLUSH_EVERY_S = 1.0
_last_flush = [float("-inf")]


def _on_duration(event: str, seconds: float, *args, **kwargs) -> None:
    _counts[event] += 1
    _durations[event] += seconds
    if event == _KNOWN_EVENT and time.monotonic() - _last_flush[0] >= FLUSH_EVERY_S:
        _last_flush[0] = time.monotonic()
        _write()


def _register() -> None:
    global _registered
    if _registered:
        return
    from jax import monitoring  # jax itself is loaded: this import compiles nothing

    monitoring.register_event_duration_secs_listener(_on_duration)
    _registered = True


class _LoaderAfterJax(importlib.abc.Loader):
    """Runs jax's own loader, then registers the listener; everything else is the wrapped loader's."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _JaxFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "jax" or _registered:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderAfterJax(spec.loader)
                return spec
        return None


def _event_name() -> str:
    dispatch = sys.modules.get("jax._src.dispatch")
    return getattr(dispatch, "BACKEND_COMPILE_EVENT", _KNOWN_EVENT)


def _write() -> None:
    event = _event_name()
    record = {"compiles": _counts[event], "compile_s": round(_durations[event], 3), "argv": sys.argv[:4],
              "jax_imported": "jax" in sys.modules}
    path = os.path.join(os.environ[_DIR_ENV], f"{os.getpid()}.json")
    # Whole or not at all: a process killed while writing leaves its previous record. A part file of
    # its own per write, since JAX may report compilations from several threads (and exit meanwhile).
    part = f"{path}.{threading.get_ident()}.part"
    try:
        with open(part, "w") as f:
            json.dump(record, f)
        os.replace(part, path)
    except OSError:
        pass  # the directory is gone: the benchmark that wanted the count has stopped


def install() -> None:
    if not os.environ.get(_DIR_ENV):
        return
    if "jax" in sys.modules:  # too late to count from the start, but better than nothing
        _register()
    else:
        sys.meta_path.insert(0, _JaxFinder())
    atexit.register(_write)


install()
