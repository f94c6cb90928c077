"""The pinned clients are one table, .ci/clients.tsv: .ci/run, tox.ini and .ci/lock read it, and nothing else names them.

tox.ini cannot read a file: its client environments are written from the table (.ci/clients.py), and these tests
fail where tox.ini, or what .ci/run would run (its --plan, which runs nothing), is not the table's.
"""

import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CI = ROOT / ".ci"

_spec = importlib.util.spec_from_file_location("ci_clients", CI / "clients.py")
clients = importlib.util.module_from_spec(_spec)
sys.modules["ci_clients"] = clients  # its dataclass looks its module up while it is built
_spec.loader.exec_module(clients)

ROWS = clients.clients()
needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python3") is None,
                                reason="needs bash and python3 on PATH, as .ci/run does")


def test_the_table_names_the_clients_should_pass():
    assert [c.name for c in ROWS][:5] == ["maxtext", "levanter", "gemma", "tokamax", "keras"]
    for c in ROWS:
        assert (CI / f"{c.name}.sh").is_file(), f"{c.name}: its install recipe .ci/{c.name}.sh is missing"
        assert (CI / "locks" / f"{c.name}.txt").is_file(), f"{c.name}: write its lock with bash .ci/lock {c.name}"
        assert f"use_lock {c.name}\n" in (CI / f"{c.name}.sh").read_text(), f".ci/{c.name}.sh must use its own lock"
        assert re.fullmatch(r"3\.\d+", c.python) and c.venv.startswith(".venv"), c
        for test in c.tests:
            assert (ROOT / test).is_file(), f"{c.name}: {test} is not a file"


def test_tox_ini_is_the_tables_should_pass():
    assert clients.tox_differs() is None


def test_a_client_tox_ini_lacks_fails_should_fail():
    extra = dataclasses.replace(ROWS[0], name="newclient")
    message = clients.tox_differs(rows=[*ROWS, extra])
    assert message == "tox.ini's client environments are not .ci/clients.tsv's: run python3 .ci/clients.py tox"
    edited = (ROOT / "tox.ini").read_text().replace("tests/test_maxtext.py {posargs}", "{posargs}")
    assert clients.tox_differs(tox=edited) == message


def test_tox_runs_each_client_through_its_script_as_ci_does_should_pass():
    tox = (ROOT / "tox.ini").read_text()
    for c in ROWS:
        section = tox.split(f"[testenv:{c.name}]\n", 1)[1].split("\n\n", 1)[0]
        assert f"commands_pre = bash {{toxinidir}}/.ci/{c.name}.sh env {{envdir}}" in section
        assert f".ci/{c.name}.sh run {{envpython}} pytest -p no:cacheprovider -n 0 {' '.join(c.tests)} {{posargs}}" in section
        assert f"basepython = python{c.python}" in section


@needs_bash
def test_ci_run_runs_the_tables_clients_should_pass():
    plan = subprocess.run(["bash", str(CI / "run"), "--plan"], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.splitlines()
    lanes = list(dict.fromkeys(c.lane for c in ROWS))
    expected = [f"stack {c.name}: bash .ci/{c.name}.sh stack {c.venv}" for c in ROWS]
    expected += [f"env {c.name}: bash .ci/{c.name}.sh env {c.venv}" for c in ROWS]
    expected += [f"tests lane {lane}, {c.name}: bash .ci/{c.name}.sh run {c.venv}/bin/python pytest -p no:cacheprovider "
                 f"-n 0 {' '.join(c.tests)}" for lane in lanes for c in ROWS if c.lane == lane]
    assert plan == expected


@needs_bash
def test_ci_lock_offers_the_tables_clients_should_pass():
    usage = subprocess.run(["bash", str(CI / "lock"), "no-such-client"], capture_output=True, text=True, cwd=ROOT)
    assert usage.returncode == 2
    assert usage.stderr.strip().endswith("CLIENT one of: " + " ".join(["bare", *(c.name for c in ROWS)]))


def test_a_malformed_row_is_one_line_naming_it_should_fail(tmp_path):
    table = tmp_path / "clients.tsv"
    header = "\t".join(clients.COLUMNS)
    table.write_text(f"# a comment\n{header}\nmaxtext\t3.12\t.venvmt\t1\ttests/test_maxtext.py\n")
    with pytest.raises(ValueError, match=r"^clients\.tsv:3: 6 non-empty tab-separated cells wanted, got 'maxtext"):
        clients.clients(table)
    row = "maxtext\t3.12\t.venvmt\t1\ttests/test_maxtext.py\tMaxText"
    table.write_text(f"{header}\n{row}\n{row}\n")
    with pytest.raises(ValueError, match=r"^clients\.tsv: a client named twice in \['maxtext', 'maxtext'\]$"):
        clients.clients(table)
    table.write_text(f"name\tvenv\n{row}\n")
    with pytest.raises(ValueError, match=r"^clients\.tsv:1: the header must be name<TAB>python"):
        clients.clients(table)
