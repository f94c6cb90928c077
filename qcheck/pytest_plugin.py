"""qcheck's pytest plugin: hardware markers, recipe modules, golden cases, suite fixtures.

Registered through the ``pytest11`` entry point. It imports nothing heavy at
import time: JAX is first touched when a recipe module is imported or a marked
test asks what the host has.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from qcheck.hardware import MARKERS


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("qcheck", "qcheck: quantized-layer invariants")
    group.addoption(
        "--require-hardware",
        nargs="?",
        const="all",
        default=None,
        metavar="MARKERS",
        help="fail, instead of skip, tests whose hardware marker this host does not satisfy (for GPU/TPU "
        f"nodes that are supposed to have it): all markers, or only the comma-separated ones given with "
        f"'=' ({', '.join(MARKERS)}), e.g. --require-hardware=gpu,fp8_gpu on a Hopper node",
    )
    group.addoption(
        "--qcheck-recipes",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this recipe module (a dotted name or a .py path) before collecting, so its "
        "recipes get the whole suite; repeatable. Write --qcheck-recipes=PATH: pytest takes a "
        "separate path argument into account when it picks the root directory",
    )
    group.addoption(
        "--golden-dir",
        default=None,
        metavar="DIR",
        help="golden cases directory (default: $QCHECK_GOLDEN_DIR, else <rootdir>/golden)",
    )
    group.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite golden cases from this run instead of checking them, and summarize what changed",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, needs in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: needs {needs}; skipped elsewhere")
    config.addinivalue_line(
        "markers", "qcheck_invariant(name): parametrize qcheck_case over the cases `name` applies to"
    )
    required_hardware(config)  # a bad marker name stops the run here, before anything is collected
    if config.getoption("--update-golden") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_GoldenSummary(), "qcheck-golden-summary")
    if modules := config.getoption("--qcheck-recipes"):
        from qcheck import _xla_env

        _xla_env.configure()  # before the recipe module starts JAX
        from qcheck.recipes import import_recipes

        for spec in modules:
            try:
                import_recipes(spec)
            except Exception as e:  # noqa: BLE001 - any import failure is a usage error here
                raise pytest.UsageError(f"--qcheck-recipes {spec}: {type(e).__name__}: {e}") from e


def golden_root(config: pytest.Config) -> Path:
    """The golden directory this run uses."""
    from qcheck.golden import golden_dir

    return golden_dir(config.getoption("--golden-dir"), default=config.rootpath / "golden")


def pytest_runtest_setup(item: pytest.Item) -> None:
    from qcheck.hardware import missing

    for marker in item.iter_markers():
        if marker.name not in MARKERS:
            continue
        reason = missing(marker.name)
        if reason is None:
            continue
        if marker.name in required_hardware(item.config):
            pytest.fail(f"--require-hardware: {reason}", pytrace=False)
        pytest.skip(reason)


def required_hardware(config: pytest.Config) -> frozenset[str]:
    """The markers whose hardware ``--require-hardware`` demands: none, all, or those it names."""
    value = config.getoption("--require-hardware")
    if value is None:
        return frozenset()
    if value == "all":
        return frozenset(MARKERS)
    names = {n.strip() for n in value.split(",") if n.strip()}
    if unknown := sorted(names - set(MARKERS)):
        raise pytest.UsageError(
            f"--require-hardware: unknown marker {', '.join(map(repr, unknown))}; known markers: "
            f"{', '.join(MARKERS)} (a test path right after the flag is read as its value: write "
            "--require-hardware=MARKERS, or put the path first)")
    return frozenset(names)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``qcheck_case`` over the case table, ``qcheck_golden`` over the golden directory.

    ``@pytest.mark.qcheck_invariant("name")`` keeps only the cases that invariant
    applies to.
    """
    if "qcheck_golden" in metafunc.fixturenames:
        from qcheck.golden import collect

        found, strays = collect(golden_root(metafunc.config))
        metafunc.parametrize(
            "qcheck_golden",
            [pytest.param(c, id=c.id) for c in found]
            + [pytest.param(e, id=f"unknown-file-{e.path.parent.name}-{e.path.stem}") for e in strays],
            indirect=True,
        )
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


@pytest.fixture
def qcheck_golden(request: pytest.FixtureRequest) -> Callable[[], str]:
    """Run this item's golden case: check it, or with ``--update-golden`` rewrite it.

    Returns ``"match"`` after a passing check, else the one-line summary of what
    was written (recorded for the end-of-run summary).
    """
    from qcheck import golden

    param, root = request.param, golden_root(request.config)

    def run() -> str:
        if isinstance(param, golden.GoldenFileError):
            raise param
        if not request.config.getoption("--update-golden"):
            golden.check_case(param, root)
            return "match"
        line = golden.write_case(param, root, overwrite=True)
        request.node.user_properties.append(("qcheck_golden", line))
        return line

    return run


class _GoldenSummary:
    """Collects what --update-golden wrote (from xdist workers too: user_properties travel with reports)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.lines += [v for k, v in report.user_properties if k == "qcheck_golden"]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        from qcheck.golden import summarize

        lines = sorted(self.lines)
        terminalreporter.section("qcheck golden update")
        for line in lines:
            if not line.endswith(": unchanged"):
                terminalreporter.write_line(line)
        terminalreporter.write_line(summarize(lines))
