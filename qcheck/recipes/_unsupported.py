"""What a recipe's library refuses by design, declared with the proof that it still does.

An adapter recipe wraps a library that may refuse some case outright (AQT's
``ragged_dot`` has no backward pass). Such a case is neither a pass nor a
qcheck failure. The recipe lists it in ``Expect.unsupported``; the suite runs
none of the checks it covers there, the matrix says
``not supported by <library> <version>: <reason>`` in those cells, and pytest
runs ``reproduce`` — the library on the refused case — and asserts it still
raises: the day upstream supports the case, that test fails and says to drop
the declaration. Never a silent skip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from importlib import metadata

from qcheck._choices import require_choice
from qcheck._versions import parse_version

#: What a declaration can cover. "gradient": anything that differentiates the
#: layer (the suite's backward, grads, state and rng checks, golden gradients).
UNSUPPORTED_KINDS = ("gradient",)
#: The layer paths a declaration can name (the layers' own, qcheck.layers.moe.PATHS, sit above recipes).
PATHS = ("dense", "sparse")


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` ("not installed" if it is not)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """One refusal: ``library`` (its distribution name) refuses ``kind`` on ``paths``, for ``reason``.

    ``reproduce`` runs the library on the refused case and must raise
    ``raises`` (whose message must match ``match``, if given) while the refusal
    lasts.
    """

    library: str
    kind: str
    paths: tuple[str, ...]
    reason: str
    reproduce: Callable[[], object] = dataclasses.field(compare=False, repr=False)
    raises: type[BaseException] | tuple[type[BaseException], ...] = Exception
    match: str = ""

    def __post_init__(self):
        require_choice("unsupported kind", self.kind, UNSUPPORTED_KINDS)
        if isinstance(self.paths, str) or not self.paths:
            raise TypeError(f"paths must be a non-empty tuple of {', '.join(PATHS)}, got {self.paths!r}")
        for path in self.paths:
            require_choice("path", path, PATHS)
        if not callable(self.reproduce):
            raise TypeError(f"reproduce must be a callable that runs {self.library} on the refused case, "
                            f"got {self.reproduce!r}")
        if not self.reason.strip():
            raise ValueError("reason must say why the library refuses the case")

    @property
    def version(self) -> str:
        """The installed version of ``library`` ("not installed" if it is not)."""
        return installed_version(self.library)

    def text(self) -> str:
        """``not supported by <library> <version>: <reason>``: the matrix's note for the cells it covers."""
        return f"not supported by {self.library} {self.version}: {self.reason}"


def assert_still_unsupported(declared: Unsupported, label: str = "") -> str:
    """Run ``declared.reproduce``: it must raise ``declared.raises`` (matching ``match``). Returns the cell note.

    Raises AssertionError, telling to drop the declaration, when the library
    now runs the case; any other exception propagates as it is.
    """
    __tracebackhide__ = True
    import re

    where = f"{label}: " if label else ""
    prefix = f"{where}assert_still_unsupported: {declared.library} {declared.version} {declared.kind} on " \
             f"{'/'.join(declared.paths)}"
    try:
        declared.reproduce()
    except declared.raises as e:
        if declared.match and not re.search(declared.match, str(e)):
            raise AssertionError(f"{prefix}: still raises {type(e).__name__}, but not matching "
                                 f"{declared.match!r}: {e}") from None
        return f"{declared.text()} ({type(e).__name__}: {e})"
    names = getattr(declared.raises, "__name__", None) or "/".join(t.__name__ for t in declared.raises)
    raise AssertionError(f"{prefix}: the library ran the refused case without raising {names}; it is supported "
                         "now: drop this Unsupported declaration from the recipe so the suite checks it")


@dataclasses.dataclass(frozen=True)
class KnownDefect:
    """A defect of ``library`` that qcheck's ``invariant`` catches on ``paths``: its failure is expected.

    The suite still runs the check there and asserts it fails with a message
    matching ``match``. ``seen``: the versions of ``library`` it was seen on (empty: every version);
    ``fixed_in``: the first version upstream fixed it in, from which the cell is checked as any other and
    must pass. The day it passes on a version in ``seen`` (or with ``seen`` empty) that assertion fails and
    says to drop or narrow the declaration; on a version it was never seen on, the cell passes and says the
    defect does not show there.
    """

    library: str
    invariant: str
    paths: tuple[str, ...]
    reason: str
    match: str
    #: The models (qcheck.MODELS names) it shows on; empty: every model. A defect
    #: seen on one model's shapes only (qwix's sharded ragged_dot) declares that one.
    models: tuple[str, ...] = ()
    #: Whether it shows on the token-dropping layer only (True), the dropless one only (False), or both (None).
    dropping: bool | None = None
    seen: tuple[str, ...] = ()
    fixed_in: str | None = None
    #: The distribution whose versions ``seen`` and ``fixed_in`` name, where it is not ``library``: a library's
    #: defect that shows on some jax releases only (qwix's int8 ragged_dot on a mesh) is keyed on jax's.
    seen_in: str | None = None

    def __post_init__(self):
        what = f"KnownDefect of {self.library} ({self.invariant})"
        if isinstance(self.seen, str):
            raise TypeError(f"{what}: seen must be a tuple of version strings, got the string {self.seen!r}")
        for v in self.seen:
            parse_version(v, f"{what}, seen")
        if self.fixed_in is not None:
            fixed = parse_version(self.fixed_in, f"{what}, fixed_in")
            late = [v for v in self.seen if parse_version(v, what) >= fixed]
            if late:
                raise ValueError(f"{what}: seen on {', '.join(late)}, at or after fixed_in {self.fixed_in}")
        if isinstance(self.paths, str) or not self.paths:
            raise TypeError(f"paths must be a non-empty tuple of {', '.join(PATHS)}, got {self.paths!r}")
        for path in self.paths:
            require_choice("path", path, PATHS)
        if isinstance(self.models, str) or not all(isinstance(m, str) and m for m in self.models):
            raise TypeError(f"models must be a tuple of model names (empty: every model), got {self.models!r}")
        if not self.match:
            raise ValueError("match must be a pattern of the expected failure message")

    version = Unsupported.version

    @property
    def keyed_on(self) -> str:
        """The distribution ``seen`` and ``fixed_in`` name versions of."""
        return self.seen_in or self.library

    @property
    def keyed_version(self) -> str:
        """The installed version of :attr:`keyed_on` ("not installed" if it is not)."""
        return installed_version(self.keyed_on)

    @property
    def fixed_here(self) -> bool:
        """Whether the installed version is at or after ``fixed_in``: the cell is then checked as any other."""
        installed = self.keyed_version
        return (self.fixed_in is not None and installed != "not installed"
                and parse_version(installed, self.keyed_on) >= parse_version(self.fixed_in, self.keyed_on))

    @property
    def seen_here(self) -> bool:
        """Whether the installed version is one it was seen on (every version, where ``seen`` is empty)."""
        return not self.seen or self.keyed_version in self.seen

    def text(self) -> str:
        on = "" if self.seen_in is None else f"{self.seen_in} "
        seen = f" (seen on {on}{', '.join(self.seen)})" if self.seen else ""
        return f"known defect of {self.library} {self.version}{seen}: {self.reason}"
