"""The one wrapper every public ``assert_*`` goes through (chex's ``chex_assertion`` is the model).

It gives every check the same message prefix, ``"[label: ]assert_name: "``, on
both ways a check can refuse to pass: ``AssertionError`` (the check ran and
failed) and ``ValueError``/``TypeError`` (the input makes the check
meaningless, so it must not pass either); a ``qcheck.UserCodeError`` (the code
under check raised) keeps its own message, which names the call. The message body is the check's own,
with its figures. A check called from inside another check is named once, by
the innermost: the outer one leaves an already named message alone.
``__tracebackhide__`` keeps pytest's traceback on the caller's line.

A check's judgement run on values computed elsewhere (the suite's one program
per case) speaks under the public check's name with :func:`judged_as`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from qcheck._errors import UserCodeError

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# Set on an exception once a check has put its name on the message.
_NAMED = "_qcheck_check"


def prefix(name: str, label: str = "") -> str:
    """The prefix of every message of check ``name`` called with ``label``."""
    return f"{label}: {name}: " if label else f"{name}: "


def assertion(fn: F) -> F:
    """Decorate a check: its messages get :func:`prefix` of the function's name.

    The check should take a keyword-only ``label: str = ""``; the wrapper reads
    it (the check need not use it) and shows it first. Exceptions keep their
    type and traceback; only the first argument (the message) is rewritten.
    """
    check = fn.__name__
    label_param = inspect.signature(fn).parameters.get("label")
    if label_param is None or label_param.kind is not inspect.Parameter.KEYWORD_ONLY:
        raise TypeError(f"assertion: {fn.__qualname__} must take a keyword-only label: str = ''")
    default_label = label_param.default

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return fn(*args, **kwargs)
        except (AssertionError, ValueError, TypeError) as e:
            _name(e, check, kwargs.get("label", default_label))
            raise

    wrapper.__qcheck_assertion__ = check  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _name(e: Exception, check: str, label: Any) -> None:
    # A UserCodeError already names the call whose code raised (qcheck._errors).
    if getattr(e, _NAMED, None) is None and not isinstance(e, UserCodeError):
        message = str(e.args[0]) if e.args else ""
        e.args = (prefix(check, label if isinstance(label, str) else str(label)) + message, *e.args[1:])
        setattr(e, _NAMED, check)


def judged_as(check: Callable[..., Any], judgement: Callable[..., T], *args: Any, label: str = "",
              **kwargs: Any) -> T:
    """``judgement(*args, **kwargs)``, its messages prefixed as those of public ``check`` (an :func:`assertion`):
    the check's judgement, run on values computed elsewhere."""
    __tracebackhide__ = True
    name = getattr(check, "__qcheck_assertion__", None)
    if name is None:
        raise TypeError(f"judged_as: {getattr(check, '__qualname__', check)!r} is not a check made by @assertion")
    try:
        return judgement(*args, **kwargs)
    except (AssertionError, ValueError, TypeError) as e:
        _name(e, name, label)
        raise
