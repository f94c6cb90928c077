"""qcheck's pytest plugin: the invariant suite in any repository, hardware markers, golden cases, fixtures.

Registered through the ``pytest11`` entry point, so it is active wherever
qcheck is installed. It imports nothing heavy at import time: JAX is first
touched when recipes are selected or a test uses a fixture.

``pytest --qcheck-recipes=my_recipes.py`` (or ``--qcheck-recipe=NAME``) runs
qcheck's whole invariant suite (:mod:`qcheck.suite.tests`) on those recipes,
with ``none`` as their unquantized twin, against the golden cases in
``./golden`` (qcheck's own recipes' cases ship with qcheck).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from qcheck.hardware import MARKERS

#: The invariant test modules the plugin collects when recipes are selected.
SUITE_DIR = Path(__file__).resolve().parent / "tests"
SUITE_MODULES = ("test_invariants.py", "test_golden_cases.py")
_SELECTED = pytest.StashKey[tuple[str, ...] | None]()
_CASE_FIXTURES = ("qcheck_case", "qcheck_golden", "qcheck_paths", "qcheck_declared")
GOLDEN_ENV = "QCHECK_GOLDEN_DIR"  # qcheck.suite.golden.ENV, without importing JAX here


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("qcheck", "qcheck: quantized-layer invariants")
    group.addoption(
        "--qcheck-recipes",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this recipe module (a dotted name or a .py path) and run qcheck's invariant suite on its "
        "recipes; repeatable. Write --qcheck-recipes=PATH: pytest takes a separate path argument into account "
        "when it picks the root directory",
    )
    group.addoption(
        "--qcheck-recipe",
        action="append",
        default=[],
        metavar="NAME",
        help="run qcheck's invariant suite on this registered recipe (a built-in such as fp8, or one an "
        "installed package provides); 'all' for every registered recipe; repeatable",
    )
    group.addoption(
        "--golden-dir",
        default=None,
        metavar="DIR",
        help="your recipes' golden cases (default: $QCHECK_GOLDEN_DIR, else <rootdir>/golden); qcheck's own "
        "recipes' cases ship with qcheck",
    )
    group.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite golden cases from this run instead of checking them, and summarize what changed",
    )
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


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config):
    """With recipes selected and workers asked for (``-n``) but no ``--dist``, the run steals work (``worksteal``).

    pytest-xdist's default, ``load``, starts each worker on a quarter of its
    share and then hands out items a couple at a time as workers free up, so
    later cases are split between workers and both trace their programs.
    ``worksteal`` gives each worker one contiguous share of the items, whole
    cases in :func:`order_by_case`'s order, and moves items only to a worker
    that has run dry. A ``--dist`` the user gave stands.
    A wrapper, so it runs before pytest-xdist's own hook turns an unset
    ``--dist`` into ``load``.
    """
    if (getattr(config.option, "dist", None) == "no" and not getattr(config.option, "distload", False)
            and config.getoption("numprocesses", None)
            and (config.getoption("--qcheck-recipes") or config.getoption("--qcheck-recipe"))):
        config.option.dist = "worksteal"
    return (yield)


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(config.getoption("numprocesses", None))


def pytest_configure(config: pytest.Config) -> None:
    for name, needs in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: needs {needs}; skipped elsewhere")
    config.addinivalue_line(
        "markers", "qcheck_invariant(name): parametrize qcheck_case over the cases the invariant `name` applies to"
    )
    required_hardware(config)  # a bad marker name stops the run here, before anything is collected
    if config.getoption("--update-golden") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_GoldenSummary(), "qcheck-golden-summary")
    _check_golden_dir(config)
    config.stash[_SELECTED] = _select(config)


def _select(config: pytest.Config) -> tuple[str, ...] | None:
    """The recipes the flags select (``None``: none named, every registered recipe); usage errors on bad names."""
    modules, names = config.getoption("--qcheck-recipes"), config.getoption("--qcheck-recipe")
    if not modules and not names:
        return None
    from qcheck.suite import _process

    if _is_xdist_controller(config):
        _process.configure()  # the workers inherit it; no backend needed here
        _process.start_run_cache()
    else:
        _process.setup(cache_dir=_process.run_cache_dir())  # before a recipe module starts JAX
    from qcheck.recipes import get_recipe, import_recipes, recipe_names

    chosen: list[str] = []
    for spec in modules:
        try:
            chosen += import_recipes(spec)
        except Exception as e:  # noqa: BLE001 - any import failure is a usage error here
            if spec in recipe_names() and not spec.endswith(".py"):
                raise pytest.UsageError(f"--qcheck-recipes takes a module; {spec!r} is a recipe: select it with "
                                        f"--qcheck-recipe={spec}") from None
            raise pytest.UsageError(f"--qcheck-recipes {spec}: {type(e).__name__}: {e}") from None
    for name in names:
        if name == "all":
            chosen += recipe_names()
            continue
        try:
            chosen.append(get_recipe(name).name)
        except ValueError as e:
            raise pytest.UsageError(f"--qcheck-recipe: {e}") from None
    return tuple(dict.fromkeys(chosen))


def selected_recipes(config: pytest.Config) -> tuple[str, ...] | None:
    """The recipes this run's suite covers; ``None`` when no flag selected any (every registered recipe)."""
    return config.stash.get(_SELECTED, None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    """With recipes selected, collect the invariant suite too, unless the command line already reaches it."""
    config = session.config
    if selected_recipes(config) is None:
        return
    here = config.invocation_params.dir
    reached = [(here / a.split("::")[0]).resolve() for a in config.args]
    if any(p == SUITE_DIR or p in SUITE_DIR.parents or p.parent == SUITE_DIR for p in reached):
        return
    config.args[:] = [*config.args, *(str(SUITE_DIR / m) for m in SUITE_MODULES)]


def golden_root(config: pytest.Config) -> Path:
    """Where this run's user recipes keep their golden cases: --golden-dir, $QCHECK_GOLDEN_DIR, <rootdir>/golden."""
    named = config.getoption("--golden-dir") or os.environ.get(GOLDEN_ENV)
    return Path(named) if named else config.rootpath / "golden"


def _check_golden_dir(config: pytest.Config) -> None:
    """A golden directory named on purpose must exist (unless this run writes it): one line, before collecting."""
    named, source = config.getoption("--golden-dir"), "--golden-dir"
    if not named and (named := os.environ.get(GOLDEN_ENV)):
        source = f"${GOLDEN_ENV}"
    if named and not config.getoption("--update-golden") and not Path(named).is_dir():
        what = "is not a directory" if Path(named).exists() else "does not exist"
        raise pytest.UsageError(f"golden directory {named} ({source}) {what}")


def pytest_unconfigure(config: pytest.Config) -> None:
    from qcheck.suite import _process

    _process.end_run_cache()


def _case_key(item: pytest.Item) -> tuple[tuple, str] | None:
    """(variant, recipe) of an item over one of qcheck's cases; ``None`` for any other item."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    case = params.get("qcheck_case") or params.get("qcheck_declared", (None,))[0]
    if case is not None:
        return (case.variant.model, case.variant.path, case.variant.dropping), case.recipe
    golden = params.get("qcheck_golden", (None,))[0]
    if hasattr(golden, "recipe"):
        return (golden.model, golden.path, golden.dropping), golden.recipe
    return None


def order_by_case(items: list[pytest.Item]) -> None:
    """Put the suite's items over one case next to each other, and a variant's cases next to each other.

    A case's invariants read the same cached programs (its layer's site
    program, its train step) and the cases of one variant share their
    unquantized twin; pytest-xdist hands each worker runs of consecutive
    items, so in this order a worker compiles a case's programs for all of
    its checks, not each worker for some. Other items keep their places.
    """
    slots = [i for i, item in enumerate(items) if _case_key(item) is not None]
    variants: dict[tuple, int] = {}
    for i in slots:
        variants.setdefault(_case_key(items[i])[0], len(variants))

    def key(item: pytest.Item) -> tuple[int, str]:
        variant, recipe = _case_key(item)
        return variants[variant], recipe

    for i, item in zip(slots, sorted((items[i] for i in slots), key=key)):
        items[i] = item


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The suite's items in case order (:func:`order_by_case`); a test whose hardware this host lacks is skipped at
    its own line, with its marker in the reason."""
    order_by_case(items)
    required = required_hardware(config)
    for item in items:
        for marker in item.iter_markers():
            if marker.name not in MARKERS or marker.name in required:
                continue
            from qcheck.hardware import missing

            if (reason := missing(marker.name)) is not None:
                item.add_marker(pytest.mark.skip(reason=f"@pytest.mark.{marker.name}: {reason}"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    from qcheck.hardware import missing

    required = required_hardware(item.config)
    for marker in item.iter_markers():
        if marker.name in required and (reason := missing(marker.name)) is not None:
            pytest.fail(f"--require-hardware: @pytest.mark.{marker.name}: {reason}", pytrace=False)


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


def _params(config: pytest.Config, fixture: str, function) -> list:
    """The parameters of one of qcheck's parametrized fixtures for ``function``."""
    from qcheck.recipes import get_recipe
    from qcheck.suite.cases import cases
    from qcheck.suite.invariants import INVARIANTS

    selected = selected_recipes(config)
    if fixture == "qcheck_paths":
        if selected is not None and "none" not in selected:
            return []
        from qcheck.layers.moe import MODELS

        return [pytest.param((m, d), id=f"{m}-{'drop' if d else 'no-drop'}") for m in MODELS for d in (False, True)]
    if fixture == "qcheck_golden":
        from qcheck.suite.golden import collect

        found = collect(golden_root(config), selected)
        return ([pytest.param((c, root), id=c.id) for c, root in found.cases]
                + [pytest.param(("unloaded", path, recipe), id=f"not-loaded-{recipe}-{path.stem}")
                   for path, recipe in found.unloaded]
                + [pytest.param(("stray", e), id=f"unknown-file-{e.path.parent.name}-{e.path.stem}")
                   for e in found.strays])
    chosen = cases(selected)
    from qcheck.suite._declared_cells import declared

    if fixture == "qcheck_declared":  # the cells recipes declare: each checked, none skipped (golden's: its items)
        return [pytest.param((c, inv.name), id=f"{c.id}-{inv.name}") for c in chosen for inv in INVARIANTS
                if inv.name != "golden" and declared(get_recipe(c.recipe), c.variant, inv.name) is not None]
    marker = next((m for m in getattr(function, "pytestmark", []) if m.name == "qcheck_invariant"), None)
    if marker is not None:
        by_name = {inv.name: inv for inv in INVARIANTS}
        (name,) = marker.args
        if name not in by_name:
            raise pytest.UsageError(f"unknown qcheck_invariant {name!r}; known invariants: {', '.join(by_name)}")
        chosen = [c for c in chosen if by_name[name].applies(get_recipe(c.recipe), c.variant)
                  and declared(get_recipe(c.recipe), c.variant, name) is None]
    return [pytest.param(c, id=c.id) for c in chosen]


def _qcheck_fixtures(function) -> list[str]:
    import inspect

    try:
        names = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return []
    return [f for f in _CASE_FIXTURES if f in names]


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name: str, obj):
    """A test over qcheck's cases that no selected case applies to is not collected (not an empty-set skip)."""
    if not (collector.funcnamefilter(name) and callable(obj)):
        return None
    fixtures = _qcheck_fixtures(obj)
    if fixtures and any(not _params(collector.config, f, obj) for f in fixtures):
        return []
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``qcheck_case`` over the case table, ``qcheck_golden`` over the golden cases, ``qcheck_paths``.

    ``@pytest.mark.qcheck_invariant("name")`` keeps only the cases that invariant applies to.
    """
    for fixture in _CASE_FIXTURES:
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, _params(metafunc.config, fixture, metafunc.function), indirect=True)


@pytest.fixture
def qcheck_case(request: pytest.FixtureRequest):
    """A :class:`qcheck.suite.cases.Case` (recipe, model, path, dropping): the plugin parametrizes a test that asks
    for it over the case table of this run's recipes; ``@pytest.mark.qcheck_invariant("name")`` keeps the cases that
    invariant applies to. Its id reads ``fp8-mixtral-dense``."""
    return request.param


@pytest.fixture
def qcheck_declared(request: pytest.FixtureRequest):
    """``(case, invariant)`` of a cell its recipe declares (a library refusal or known defect); ids read
    ``aqt_int8_ragged-mixtral-sparse-grads``."""
    return request.param


@pytest.fixture
def qcheck_paths(request: pytest.FixtureRequest) -> tuple[str, bool]:
    """``(model, dropping)`` for the dense == sparse comparison of the unquantized layer (when ``none`` is selected)."""
    return request.param


@pytest.fixture
def qcheck_recipes(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The recipe names this run's suite covers (the flags' selection, else every registered recipe)."""
    from qcheck.recipes import recipe_names

    return selected_recipes(request.config) or recipe_names()


@pytest.fixture
def qcheck_layer(qcheck_case):
    """The fresh layer of ``qcheck_case`` (a :class:`qcheck.suite.cases.Case`), built once per process."""
    from qcheck.suite.cases import layer

    return layer(qcheck_case)


@pytest.fixture(scope="session")
def qcheck_env(request: pytest.FixtureRequest):
    """The :class:`qcheck.suite.invariants.RunEnv` of this run, built once: where its user golden cases live, and
    ``qcheck_env.invariants``, every invariant as this run runs it (``inv.run(case)``)."""
    from qcheck.suite.invariants import RunEnv

    return RunEnv(golden_root(request.config))


@pytest.fixture
def qcheck_golden(request: pytest.FixtureRequest) -> Callable[[], str]:
    """Run this item's golden case: check it, or with ``--update-golden`` rewrite it.

    Returns ``"match"`` after a passing check; with ``--update-golden``, the
    one-line summary of what was written (recorded for the end-of-run summary),
    after checking the case against the file just written, so an update that
    wrote nothing, or other values than this run's, fails. A file of a recipe
    this run did not load, or one no recipe could own, is reported as a skip.
    """
    from qcheck.suite import golden

    param = request.param

    def run() -> str:
        __tracebackhide__ = True
        if param[0] == "unloaded":
            pytest.skip(f"{param[1]} is a case of recipe {param[2]!r}, which this run did not load")
        if param[0] == "stray":
            pytest.skip(f"{param[1]}: not checked")
        case, root = param
        if not request.config.getoption("--update-golden"):
            from qcheck.suite._declared_cells import check_golden_case

            return check_golden_case(case, root)  # a declared library defect must still show, as declared
        if not golden.writable_here(case.recipe, request.config.rootpath):
            pytest.fail(f"{case.id}: qcheck's own golden cases ship with qcheck ({root}) and are rewritten only "
                        "from qcheck's own checkout", pytrace=False)
        line = golden.write_case(case, root, overwrite=True)
        request.node.user_properties.append(("qcheck_golden", line))
        golden.assert_case_matches(case, root)
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
        from qcheck.suite.golden import summarize

        lines = sorted(self.lines)
        terminalreporter.section("qcheck golden update")
        for line in lines:
            if not line.endswith(": unchanged"):
                terminalreporter.write_line(line)
        terminalreporter.write_line(summarize(lines))

