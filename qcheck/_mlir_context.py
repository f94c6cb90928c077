"""JAX 0.12's reuse of MLIR contexts, for qcheck's own processes on the JAX versions without it.

JAX lowers each program into a module inside an MLIR context. Up to jax 0.10
``mlir.make_ir_context`` builds a new context for every program, and
registering and loading JAX's dialects into it takes 3-4 ms: a third of
lowering a small program, and 5% of the suite's CPU time (the single-process
invariant, golden and RNG tests took 64.0 / 57.0 s of CPU with reuse against
65.2 / 62.2 s without, in interleaved runs). jax 0.12 keeps one context per
thread and reuses it for ten lowerings, which bounds the types and attributes
a context accumulates. :func:`install` gives older JAX that same behaviour.
The modules are the same either way (``tests/test_mlir_context.py``).
"""

from __future__ import annotations

import functools
import threading

__all__ = ["REUSES", "install", "installed"]

#: Lowerings per context after the one that creates it, as in jax 0.12.
REUSES = 10
_INSTALLED = "_qcheck_reuses_contexts"


def _jax_reuses(mlir) -> bool:
    # jax 0.12 keeps its thread's context in this module-level thread-local.
    return hasattr(mlir, "_thread_local_context")


def installed() -> bool:
    """Whether this process lowers programs into reused MLIR contexts (JAX's own reuse, or :func:`install`'s)."""
    from jax._src.interpreters import mlir

    return _jax_reuses(mlir) or getattr(mlir.make_ir_context, _INSTALLED, False)


def install() -> bool:
    """Reuse each thread's MLIR context for :data:`REUSES` lowerings where JAX does not already.

    For qcheck's own processes, like ``_fast_jit.install``. Returns whether
    contexts are reused now; False if JAX's private ``make_ir_context`` is
    missing or takes arguments, i.e. has changed in a way this does not know.
    """
    try:
        from jax._src.interpreters import mlir

        make = mlir.make_ir_context
    except (ImportError, AttributeError):
        return False
    if installed():
        return True
    if make.__code__.co_argcount or make.__code__.co_kwonlyargcount:
        return False
    local = threading.local()

    @functools.wraps(make)
    def make_ir_context():
        context, uses = getattr(local, "entry", (None, REUSES))
        if uses >= REUSES:
            context, uses = make(), -1
        local.entry = (context, uses + 1)
        return context

    setattr(make_ir_context, _INSTALLED, True)
    mlir.make_ir_context = make_ir_context
    return True
