"""One policy for an error of the code under check, whichever entry point traced or ran it.

A layer's own ``AssertionError`` (MaxText asserts its tile sizes, AQT its
shapes) must not read as a failed check, and its ``ValueError`` must not read
as a usage error of qcheck: both become one :class:`UserCodeError`, saying
which call failed and on what backend, with the original chained.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


class UserCodeError(ValueError):
    """The code under check raised while qcheck traced or ran it; the original is its ``__cause__``."""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


#: qcheck's checking machinery: an error raised in its own frames is a bug of qcheck's, never the user's.
_MACHINERY = tuple(str(Path(__file__).resolve().parent / part) + os.sep for part in ("_coverage", "checks"))


def raised_by_qcheck(e: BaseException) -> bool:
    if type(e).__module__.split(".")[0] in ("jax", "jaxlib"):
        return False  # compiling or running the program under check (a callback of it that raised, say)
    # JAX cuts its own frames from a traceback that crosses its API and keeps them whole in the cause it adds:
    # read that one, or a primitive failing inside JAX would seem raised where qcheck's walk bound it.
    whole = e.__cause__ if type(e.__cause__).__name__ == "UnfilteredStackTrace" else e
    tb = whole.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(_MACHINERY)


def _mesh_hint(e: BaseException) -> str:
    """Where the code needs a mesh (a ``shard_map`` taking the context's) and the caller entered none: say so."""
    import jax

    if "mesh" not in str(e).lower() or not jax.sharding.get_abstract_mesh().empty:
        return ""
    return " (no mesh is entered and the code needs one: call qcheck inside `with jax.set_mesh(mesh):`)"


@contextlib.contextmanager
def user_code(entry: str, what: str, *, passthrough: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run the code under check: any exception it raises becomes one :class:`UserCodeError`.

    ``entry`` is the public call (``coverage``), ``what`` the argument whose code
    ran (``fn``, ``layer``). ``passthrough``: qcheck's own exceptions that may
    rise from inside the region (a check's failure, a usage error found while
    tracing) and keep their type. A :class:`UserCodeError` of a nested call
    passes as it is, so the innermost call names the code, and so does an
    error raised in qcheck's own checking code (a bug of qcheck's, not the user's).
    """
    __tracebackhide__ = True
    try:
        yield
    except (UserCodeError, *passthrough):
        raise
    except Exception as e:  # noqa: BLE001 - any error of the user's code, reported once, chained
        if raised_by_qcheck(e):
            raise
        import jax  # not at import time: ``import qcheck`` stays free of JAX

        raise UserCodeError(f"{entry}: {what} could not be traced and run on {jax.default_backend()}: "
                            f"{type(e).__name__}: {first_line(e)}{_mesh_hint(e)}") from e
