"""Optional extras skip, never fail: a test needing AQT, qwix or MaxText skips, naming the extra, where it is missing."""

import json
import re
from pathlib import Path

import pytest

from tests import helpers

TESTS = Path(__file__).parent


@pytest.fixture
def fake_extras(monkeypatch):
    monkeypatch.setitem(helpers.EXTRAS, "absent", ("qcheck_no_such_module.sub", "pip install absent"))
    monkeypatch.setitem(helpers.EXTRAS, "present", ("json", "pip install present"))


def test_a_missing_extra_skips_naming_it_should_skip(fake_extras):
    with pytest.raises(pytest.skip.Exception, match=r"^needs the absent extra: pip install absent$"):
        helpers.import_extra("absent")
    mark = helpers.requires_extra("present", "absent")
    assert mark.args == (True,) and mark.kwargs["reason"] == "needs the absent extra: pip install absent"


def test_an_installed_extra_runs_should_pass(fake_extras):
    assert helpers.import_extra("present") is json
    assert helpers.requires_extra("present").args == (False,)


def test_the_extras_name_their_install_command():
    assert helpers.extra_skip_reason("qwix") == "needs the qwix extra: pip install 'qcheck-jax[qwix]'"
    assert helpers.extra_skip_reason("aqt") == "needs the aqt extra: pip install 'qcheck-jax[aqt]'"
    assert helpers.extra_skip_reason("maxtext").startswith("needs the maxtext extra: pip install maxtext")
    assert helpers.extra_skip_reason("gemma").startswith("needs the gemma extra: gemma 4.0.1 in its own environment: "
                                                         ".ci/gemma.sh env VENV")
    assert helpers.extra_skip_reason("tokamax").startswith("needs the tokamax extra: tokamax 0.0.17 with qwix 0.1.8 in "
                                                           "its own environment: .ci/tokamax.sh env VENV")
    assert helpers.extra_skip_reason("keras").startswith("needs the keras extra: keras 3.15.1 on its JAX backend in "
                                                         "its own environment: .ci/keras.sh env VENV")


def test_an_unknown_extra_lists_the_known_ones():
    known = ", ".join(sorted(helpers.EXTRAS))
    assert {"aqt", "gemma", "keras", "maxtext", "qwix", "tokamax"} <= set(helpers.EXTRAS)
    with pytest.raises(ValueError, match=rf"^extra: unknown extra 'aqtp'; known: {re.escape(known)}$"):
        helpers.requires_extra("aqtp")


def test_tests_skip_for_an_extra_only_through_the_helpers():
    """pytest.importorskip's own reason names a module, not the extra to install; the helpers name the extra."""
    direct = re.compile(r"importorskip\(\s*[\"'](aqt|qwix|maxtext|MaxText|gemma)")
    found = [p.name for p in TESTS.rglob("*.py") if p.name != "helpers.py" and direct.search(p.read_text())]
    assert found == [], f"use tests.helpers.import_extra / requires_extra in {found}"
