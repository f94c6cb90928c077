"""The pinned clients' table (.ci/clients.tsv), read once for every tool that needs it.

tox.ini cannot read a file, so its client environments are written from the table: between the two marker lines,
tox.ini is what ``tox_sections`` renders, and tests/test_ci_clients.py fails where the two differ.

    python3 .ci/clients.py tox          rewrite tox.ini's generated section from the table
    python3 .ci/clients.py check        exit 1, saying so, where tox.ini's section is not the table's
    python3 .ci/clients.py names        the clients' names, one a line (.ci/lock reads them)
    python3 .ci/clients.py rows         name, venv, lane and test files, tab-separated, one client a line (.ci/run)

Standard library only: .ci/run and .ci/lock run it with whatever python3 the machine has.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

CI = pathlib.Path(__file__).resolve().parent
TABLE = CI / "clients.tsv"
TOX = CI.parent / "tox.ini"
COLUMNS = ("name", "python", "venv", "lane", "tests", "description")
BEGIN = "# --- begin: the pinned clients, written from .ci/clients.tsv by `python3 .ci/clients.py tox`; do not edit ---"
END = "# --- end: the pinned clients ---"


@dataclasses.dataclass(frozen=True)
class Client:
    name: str
    python: str
    venv: str
    lane: str
    tests: tuple[str, ...]
    description: str


def clients(path: pathlib.Path = TABLE) -> list[Client]:
    """The table's rows, in order; a malformed row is a one-line error naming its line."""
    rows, header = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split("\t")
        if header is None:
            header = tuple(cells)
            if header != COLUMNS:
                raise ValueError(f"{path.name}:{number}: the header must be {'<TAB>'.join(COLUMNS)}, got {line!r}")
            continue
        if len(cells) != len(COLUMNS) or not all(c.strip() for c in cells):
            raise ValueError(f"{path.name}:{number}: {len(COLUMNS)} non-empty tab-separated cells wanted, got {line!r}")
        row = dict(zip(COLUMNS, cells))
        rows.append(Client(**{**row, "tests": tuple(row["tests"].split())}))
    names = [c.name for c in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"{path.name}: a client named twice in {names}")
    return rows


def tox_sections(rows: list[Client]) -> str:
    """tox.ini's client environments: each builds and runs exactly as its .ci/run stage does, through its script.

    tox creates the environment; the script's ``env`` installs the client's stack and qcheck from the lock into it
    (qcheck editable, with the extras the script names, so tox installs nothing itself), and its ``run`` sets what
    the client needs (KERAS_BACKEND, MaxText's variables) around pytest. The pins are the script's alone.
    """
    out = [BEGIN]
    for c in rows:
        out += ["", f"[testenv:{c.name}]",
                f"description = {c.description} (what .ci/{c.name}.sh builds, from .ci/locks/{c.name}.txt)",
                f"basepython = python{c.python}",
                "skip_install = true",
                "allowlist_externals = bash",
                f"commands_pre = bash {{toxinidir}}/.ci/{c.name}.sh env {{envdir}}",
                f"commands = bash {{toxinidir}}/.ci/{c.name}.sh run {{envpython}} pytest -p no:cacheprovider -n 0 "
                f"{' '.join(c.tests)} {{posargs}}"]
    return "\n".join(out + ["", END])


def _split(text: str) -> tuple[str, str, str]:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{TOX.name}: wants one line {BEGIN!r} and after it one line {END!r}")
    head, rest = text.split(BEGIN)
    body, tail = rest.split(END)
    return head, BEGIN + body + END, tail


def tox_differs(tox: str | None = None, rows: list[Client] | None = None) -> str | None:
    """None where tox.ini's generated section (of ``tox``, its text) is the table's; otherwise what to run."""
    _, section, _ = _split(TOX.read_text() if tox is None else tox)
    if section == tox_sections(clients() if rows is None else rows):
        return None
    return f"{TOX.name}'s client environments are not .ci/clients.tsv's: run python3 .ci/clients.py tox"


def main(argv: list[str]) -> int:
    if argv == ["tox"]:
        head, _, tail = _split(TOX.read_text())
        TOX.write_text(head + tox_sections(clients()) + tail)
        return 0
    if argv == ["check"]:
        message = tox_differs()
        print(message or f"{TOX.name} matches {TABLE.name}", file=sys.stderr if message else sys.stdout)
        return 1 if message else 0
    if argv == ["names"]:
        print("\n".join(c.name for c in clients()))
        return 0
    if argv == ["rows"]:
        print("\n".join("\t".join((c.name, c.venv, c.lane, " ".join(c.tests))) for c in clients()))
        return 0
    print("usage: python3 .ci/clients.py tox | check | names | rows", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
