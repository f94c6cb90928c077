"""What an exact check says: a result that is not its reference, or a reference that equals a known bug.

Every bitwise check (fresh fp8 casts, call sites on probes and through the
layer, their gradients) holds a result to a reference and knows the bugs it
exists for. Two messages serve them all: :func:`refuse_known_bugs`, the
ValueError for inputs on which the reference equals a bug (the check could not
fail on that bug, so it must not run), and :func:`mismatch`, the
AssertionError that names how many elements differ, the first of them with
both values, and the known bug the result equals where it equals one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from qcheck.checks._bits import bits, bitwise_equal


def refuse_known_bugs(subject: str, want: np.ndarray, bugs: Iterable[tuple[str, np.ndarray]], *, advice: str,
                      operands: str = "these operands", reference: str = "the reference") -> dict[str, np.ndarray]:
    """``bugs`` as a dict, or a ValueError where ``want`` equals one of them bitwise: that bug would pass."""
    known = {}
    for desc, bug in bugs:
        if bitwise_equal(bug, want):
            raise ValueError(f"{subject}: for {operands} {reference} equals {desc} bitwise, so that bug would "
                             f"pass; {advice}")
        known[desc] = bug
    return known


def mismatch(subject: str, got: np.ndarray, want: np.ndarray, *, reference: str = "the reference",
             result: str = "result", bugs: Mapping[str, np.ndarray] = {}, hints: Mapping[str, str] = {},
             otherwise: Callable[[], str]) -> AssertionError:
    """The failure of ``got`` against ``want`` (not bitwise equal), to raise.

    ``subject`` starts the message (the site, the matmul and what is held to
    what). The reason is the first known bug of ``bugs`` that ``got`` equals,
    with its hint, else ``otherwise()`` (a figure: a relative norm, a count).
    """
    if got.shape != want.shape or got.dtype != want.dtype:
        return AssertionError(f"{subject} {result} is {got.dtype}{list(got.shape)}, {reference} "
                              f"{want.dtype}{list(want.shape)}")
    off = bits(got) != bits(want)
    first = tuple(int(i) for i in np.argwhere(off)[0])
    matched = next((desc for desc, bug in bugs.items() if bitwise_equal(got, bug)), None)
    if matched is None:
        why = otherwise()
    else:
        why = f"it equals {matched} bitwise" + (f" ({hints[matched]})" if matched in hints else "")
    return AssertionError(f"{subject} differs from {reference} at {int(off.sum())} of {off.size} elements, first "
                          f"at {first}: got {got[first]!r}, expected {want[first]!r}; {why}")
