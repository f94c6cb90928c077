"""qcheck's pytest plugin: hardware markers, the --require-hardware option, suite fixtures.

Registered through the ``pytest11`` entry point. It imports nothing heavy at
import time: JAX is first touched when a marked test asks what the host has.
"""

from __future__ import annotations

import pytest

from qcheck.hardware import MARKERS


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("qcheck", "qcheck: quantized-layer invariants")
    group.addoption(
        "--require-hardware",
        action="store_true",
        default=False,
        help="fail, instead of skip, tests whose hardware marker this host does not satisfy "
        "(for GPU/TPU nodes that are supposed to have it)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, needs in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: needs {needs}; skipped elsewhere")
    config.addinivalue_line(
        "markers", "qcheck_invariant(name): parametrize qcheck_case over the cases `name` applies to"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    from qcheck.hardware import missing

    for marker in item.iter_markers():
        if marker.name not in MARKERS:
            continue
        reason = missing(marker.name)
        if reason is None:
            continue
        if item.config.getoption("--require-hardware"):
            pytest.fail(f"--require-hardware: {reason}", pytrace=False)
        pytest.skip(reason)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``qcheck_case`` over the case table.

    ``@pytest.mark.qcheck_invariant("name")`` keeps only the cases that invariant
    applies to.
    """
    if "qcheck_case" not in metafunc.fixturenames:
        return
    from qcheck.cases import cases
    from qcheck.invariants import INVARIANTS
    from qcheck.recipes import get_recipe

    selected = cases()
    marker = metafunc.definition.get_closest_marker("qcheck_invariant")
    if marker is not None:
        by_name = {inv.name: inv for inv in INVARIANTS}
        (name,) = marker.args
        if name not in by_name:
            raise pytest.UsageError(
                f"unknown qcheck_invariant {name!r}; known invariants: {', '.join(by_name)}"
            )
        selected = [c for c in selected if by_name[name].applies(get_recipe(c.recipe), c.variant)]
    metafunc.parametrize(
        "qcheck_case",
        [pytest.param(c, id=c.id) for c in selected],
    )


@pytest.fixture
def qcheck_layer(qcheck_case):
    """The fresh layer of ``qcheck_case``, built once per process and shared by every test."""
    from qcheck.cases import layer

    return layer(qcheck_case)
