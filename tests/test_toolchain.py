"""What qcheck assumes of the toolchain it runs on, pinned per jax release: the next release that moves one is one
clear red line naming what moved, not a hundred failing bitwise checks.

Two facts, measured on each jax the suite is tested on (XLA's CPU backend):

- ``jax.random``'s bits for a fixed key. qcheck's layers and inputs draw from numpy (so no golden case moves
  with jax), but stochastic rounding draws ``jax.random.uniform`` and ``bits``; ``normal`` is pinned too, since
  a user's own draws move with it (0.12.1 changed it).
- the form XLA computes an int8 quantizer's two divisions in (``qcheck.referees.FORMS``): ``amax / 127`` by a
  constant, ``x / scale`` by a broadcast operand. Every form is admissible to the referee (each rewrite is
  legal on its own), so a change of form turns no check red; this test says which release changed it.

A jax newer than the table is compared with the newest row before it: the facts carry over until a release
moves them, and then this test names the fact, the release, and what to update.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
import sys

import pytest

from qcheck import formats, referees
from qcheck._versions import parse_version
from qcheck.suite._toolchain import division_forms


#: sha256 (first 16 hex digits) of 1000 draws from jax.random.key(0), by jax release.
_RANDOM_0_10 = {"bits": "93070a12a1970232", "uniform": "e8d77b0cfbf8528c", "normal": "8fd4d579ee0cce16"}
RANDOM = {
    "0.10.2": _RANDOM_0_10,
    "0.11.2": _RANDOM_0_10,
    "0.12.0.1": _RANDOM_0_10,
    "0.12.1": {**_RANDOM_0_10, "normal": "1c6d48bee96646d1"},
}
#: The form of an int8 quantizer's divisions XLA computes, eager and under jit, by jax release.
FORMS = {
    "0.10.2": {"eager": "all by reciprocal", "jit": "all by reciprocal"},
    "0.11.2": {"eager": "all by reciprocal", "jit": "all by reciprocal"},
    "0.12.0.1": {"eager": "all by reciprocal", "jit": "all by reciprocal"},
    "0.12.1": {"eager": "as written", "jit": "constant by reciprocal"},
}

JAX = importlib.metadata.version("jax")


def _row(table: dict[str, dict[str, str]]) -> tuple[str, dict[str, str]]:
    """The table's row for the installed jax: its own, else the newest release before it."""
    have = parse_version(JAX, "installed jax")
    known = sorted((parse_version(v, "table"), v) for v in table)
    older = [v for parsed, v in known if parsed <= have]
    release = older[-1] if older else known[0][1]
    return release, table[release]


_DRAWS = """
import hashlib, jax, jax.numpy as jnp, numpy as np
key = jax.random.key(0)
for kind, draw in (("bits", lambda: jax.random.bits(key, (1000,), jnp.uint32)),
                   ("uniform", lambda: jax.random.uniform(key, (1000,))), ("normal", lambda: jax.random.normal(key, (1000,)))):
    print(kind, hashlib.sha256(np.asarray(draw()).tobytes()).hexdigest()[:16])
"""


@functools.cache
def _all_draws() -> dict[str, str]:
    # In a fresh process with JAX's defaults: qcheck's own test processes set XLA flags (qcheck.suite._process) that
    # move normal's transcendental math, and a user's process has JAX's defaults.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _DRAWS], capture_output=True, text=True, env=env, check=True)
    return dict(line.split() for line in done.stdout.splitlines())


def _draws(kind: str) -> str:
    return _all_draws()[kind]


def observed_form(run: str) -> list[str]:
    return list(division_forms(jit=run == "jit"))


@pytest.mark.parametrize("kind", ["bits", "uniform", "normal"])
def test_jax_random_draws_as_recorded(kind):
    release, row = _row(RANDOM)
    got = _draws(kind)
    assert got == row[kind], (
        f"jax {JAX}: jax.random.{kind}(key(0)) hashes {got}, where jax {release} gave {row[kind]}: this release "
        f"changed jax.random's {kind}. qcheck's layers draw from numpy, so golden cases stay; stochastic rounding "
        "and users' own draws move. Record the new hash for this release in tests/test_toolchain.py's RANDOM.")


@pytest.mark.parametrize("run", ["eager", "jit"])
def test_xla_division_form_as_recorded(run):
    release, row = _row(FORMS)
    found = observed_form(run)
    admissible = formats.get_format("int8").forms
    assert found and set(found) <= set(admissible), (
        f"jax {JAX} ({run}): qcheck's int8 quantizer matches the referee in no admissible form "
        f"({', '.join(admissible)}): XLA computes its divisions in a form the referee does not know")
    assert found == [row[run]], (
        f"jax {JAX} ({run}): XLA computes int8's divisions {' or '.join(found)}, where jax {release} computed them "
        f"{row[run]}: this release changed XLA's division rewrites. Checks stay green (every form is admissible); "
        "record the new form for this release in tests/test_toolchain.py's FORMS.")


def test_the_table_names_each_jax_the_suite_is_tested_on():
    # The README's tested versions are the table's rows.
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for release in FORMS:
        assert release in readme, f"README.md does not name jax {release}, a release tests/test_toolchain.py pins"
    assert set(FORMS) == set(RANDOM)


def test_a_moved_form_is_one_red_line_naming_the_release(monkeypatch):
    # Should-fail: were this jax recorded with another form, the test names the release and both forms.
    release, row = _row(FORMS)
    other = next(f for f in referees.FORMS if f != row["jit"])
    monkeypatch.setitem(FORMS, release, {**row, "jit": other})
    with pytest.raises(AssertionError, match=rf"jax {JAX} \(jit\): XLA computes int8's divisions .*, where jax "
                                             rf"{release} computed them {other}: this release changed"):
        test_xla_division_form_as_recorded("jit")


def test_moved_random_bits_are_one_red_line_naming_the_release(monkeypatch):
    release, row = _row(RANDOM)
    monkeypatch.setitem(RANDOM, release, {**row, "bits": "0" * 16})
    with pytest.raises(AssertionError, match=rf"jax {JAX}: jax.random.bits\(key\(0\)\) hashes [0-9a-f]{{16}}, where "
                                             rf"jax {release} gave 0{{16}}: this release changed jax.random's bits"):
        test_jax_random_draws_as_recorded("bits")


def test_a_newer_jax_is_held_to_the_newest_row_before_it(monkeypatch):
    import tests.test_toolchain as t

    monkeypatch.setattr(t, "JAX", "99.0.0")
    newest = max(FORMS, key=lambda v: parse_version(v, "table"))
    assert _row(FORMS) == (newest, FORMS[newest])
