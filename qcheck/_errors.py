"""One policy for an error of the code under check, whichever entry point traced or ran it.

A layer's own ``AssertionError`` (MaxText asserts its tile sizes, AQT its
shapes) must not read as a failed check, and its ``ValueError`` must not read
as a usage error of qcheck: both become one :class:`UserCodeError`, saying
which call failed and on what backend, with the original chained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class UserCodeError(ValueError):
    """The code under check raised while qcheck traced or ran it; the original is its ``__cause__``."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


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
    passes as it is, so the innermost call names the code.
    """
    __tracebackhide__ = True
    try:
        yield
    except (UserCodeError, *passthrough):
        raise
    except Exception as e:  # noqa: BLE001 - any error of the user's code, reported once, chained
        import jax  # not at import time: ``import qcheck`` stays free of JAX

        raise UserCodeError(f"{entry}: {what} could not be traced and run on {jax.default_backend()}: "
                            f"{type(e).__name__}: {_first_line(e)}{_mesh_hint(e)}") from e
