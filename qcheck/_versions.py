"""The jax and flax versions qcheck supports, checked once, at first use, against what is installed.

pip installs qcheck beside an older jax when another package pins one and only
warns; qcheck's first trace would then fail deep inside the walk. The window
starts at EasyDeL 0.3.0's pins (jax 0.9.2, flax 0.12.3), its pinned client's. The lower bounds are the ones pyproject.toml
declares, read from the installed distribution, so they are stated once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re

#: The distributions whose versions qcheck's code depends on.
CHECKED = ("jax", "flax")
#: qcheck's own distribution (the import name stays ``qcheck``; ``qcheck`` on the package index is another
#: project, a data validator of 2020).
DISTRIBUTION = "qcheck-jax"


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string (``0.12.0.1`` -> (0, 12, 0, 1); ``0.4.36.dev20241120`` -> (0, 4, 36))."""
    numbers = []
    for part in version.split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.group() != part:
            break
    return tuple(numbers)


_VERSION = re.compile(r"\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?")


def parse_version(version: str, what: str) -> tuple[int, ...]:
    """The release numbers of ``version``; a ValueError of one line naming ``what`` where it is not a version."""
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        raise ValueError(f"{what}: {version!r} is not a version qcheck can parse (a release such as '0.12.1')")
    return _release(version)


def _minimums() -> dict[str, str]:
    """``{distribution: minimum}`` from qcheck's own metadata; empty when qcheck runs uninstalled."""
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    found = {}
    for req in requires:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*)\s*", req)
        if match and match.group(1).lower() in CHECKED:
            found[match.group(1).lower()] = match.group(2)
    return found


def unsupported(installed: dict[str, str], minimums: dict[str, str]) -> str | None:
    """The one-line message for ``installed`` versions below ``minimums``; None when all are supported."""
    low = [d for d, v in minimums.items() if d in installed and _release(installed[d]) < _release(v)]
    if not low:
        return None
    supported = " and ".join(f"{d}>={v}" for d, v in minimums.items())
    have = " and ".join(f"{d} {installed[d]}" for d in minimums if d in installed)
    upgrade = " ".join(f"'{d}>={minimums[d]}'" for d in low)
    return f"qcheck supports {supported}; this environment has {have}: pip install -U {upgrade}"


@functools.cache
def require_supported() -> None:
    """Raise ImportError with one line if the installed jax or flax is older than qcheck supports."""
    installed = {}
    for dist in CHECKED:
        try:
            installed[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass  # the import that needs it says so
    message = unsupported(installed, _minimums())
    if message is not None:
        raise ImportError(message)
