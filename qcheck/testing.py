"""qcheck for absltest suites: the checks as assertion methods, and the invariant suite as a TestCase.

JAX, Flax and MaxText write their tests as ``absl.testing.absltest`` /
``parameterized`` classes. This module gives them qcheck in that style:

- :class:`QuantizationAssertions`, a mixin for ``absltest.TestCase`` (or
  ``parameterized.TestCase``): ``assertTracks``, ``assertQuantized``,
  ``assertFreshCastExact``,
  ``assertFormatMatchesReferee``. Each runs the check of the same name in
  :mod:`qcheck.checks`, fails through ``self.fail`` with the check's message
  (``msg=`` is added the unittest way: appended under ``longMessage``, the
  default, or instead of it when ``longMessage`` is False) and returns what
  the check returns (the figure, or the coverage records).
- :func:`case_parameters`: qcheck's case table as ``parameterized.named_parameters``
  rows named like ``fp8_mixtral_dense``, optionally only those one invariant
  applies to.
- :class:`InvariantTestCase`: subclass it to get qcheck's whole invariant suite
  (every invariant over every case it applies to, one named test each) in an
  absltest suite; class attributes select recipes, models, paths, invariants.

This is a test-support module on top of the library: unlike the rest of
``qcheck`` it reads the suite harness (:mod:`qcheck.suite.cases`,
:mod:`qcheck.suite.invariants`), lazily, when case parameters are asked for.
absl-py must be installed (it is in qcheck's ``test`` extra).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from absl.testing import parameterized

import qcheck
from qcheck import checks

if TYPE_CHECKING:
    from qcheck._coverage import MatmulRecord
    from qcheck.suite.cases import Case
    from qcheck.suite.invariants import Invariant

__all__ = ["InvariantTestCase", "QuantizationAssertions", "case_parameters", "testcase_name"]

#: The sharded invariant's mesh is 2 x 4 host CPU devices.
_MESH_DEVICES = 8


class QuantizationAssertions:
    """Mixin for ``unittest.TestCase`` subclasses: qcheck's checks as ``assert*`` methods.

    Use it beside ``absltest.TestCase`` or ``parameterized.TestCase``. Inputs
    that make a check meaningless still raise ``ValueError``/``TypeError`` (an
    error, not a failure), as the checks themselves do.

    ``assertLayerChecks(layer, reference, x, ...)`` is offered when the library
    has ``qcheck.check_layer`` (the invariants on any layer against its
    unquantized twin); it forwards its arguments to it and returns its result.
    With an older qcheck the method is absent, so ``hasattr`` tells.
    """

    # Set by unittest.TestCase; declared for readers and type checkers.
    longMessage: bool
    fail: Callable[[str], Any]
    _formatMessage: Callable[[str | None, str], str]

    def _qcheck(self, check: Callable[..., Any], args: tuple, kwargs: dict, msg: str | None) -> Any:
        __tracebackhide__ = True
        try:
            return check(*args, **kwargs)
        except AssertionError as e:
            failure = str(e)
        # Outside the except block, so the failure carries no "during handling" chain.
        self.fail(self._formatMessage(msg, failure))

    def assertTracks(self, actual: Any, reference: Any, max_rel_norm: float = 0.22, msg: str | None = None) -> float:
        """:func:`qcheck.checks.assert_tracks`: near the unquantized reference, not bitwise equal; returns rel-norm."""
        __tracebackhide__ = True
        return self._qcheck(checks.assert_tracks, (actual, reference), {"max_rel_norm": max_rel_norm}, msg)

    def assertQuantized(
        self,
        fn: Callable[..., Any],
        *args: Any,
        skip: Callable[[MatmulRecord], bool] | None = None,
        msg: str | None = None,
        **kwargs: Any,
    ) -> list[MatmulRecord]:
        """:func:`qcheck.assert_quantized`: every matmul of ``fn(*args, **kwargs)`` is quantized; returns the records.

        ``skip`` and ``msg`` are this method's own; every other keyword goes to ``fn``.
        """
        __tracebackhide__ = True
        return self._qcheck(checks.assert_quantized, (fn, *args), {"skip": skip, **kwargs}, msg)

    def assertFreshCastExact(
        self, op: Callable[..., Any], matmul: Any, lhs: Any, rhs: Any, *, cast_dtype: Any, msg: str | None = None
    ) -> None:
        """:func:`qcheck.checks.assert_fresh_cast_exact`: ``op`` equals the matmul of cast operands, bitwise.

        ``matmul`` is an einsum string (``op(eqn, lhs, rhs)``) or ``qcheck.checks.Ragged(group_sizes)``
        (``op(lhs, rhs, group_sizes)``).
        """
        __tracebackhide__ = True
        self._qcheck(checks.assert_fresh_cast_exact, (op, matmul, lhs, rhs), {"cast_dtype": cast_dtype}, msg)

    def assertFormatMatchesReferee(
        self,
        x: Any,
        fmt: str,
        *,
        axis: int | tuple[int, ...] = -1,
        rng: Any = None,
        jit: bool = True,
        msg: str | None = None,
    ) -> None:
        """:func:`qcheck.checks.assert_format_matches_referee`: quantize/qdq of ``x`` equal the numpy referee's bits."""
        __tracebackhide__ = True
        self._qcheck(checks.assert_format_matches_referee, (x, fmt), {"axis": axis, "rng": rng, "jit": jit}, msg)

    # Defined only where the library has it (hasattr on qcheck imports nothing for an unknown name).
    if hasattr(qcheck, "check_layer"):

        def assertLayerChecks(self, layer: Any, reference: Any, x: Any, *args: Any, msg: str | None = None,
                              **kwargs: Any) -> Any:
            """``qcheck.check_layer(layer, reference, x, ...)``; returns what it returns."""
            __tracebackhide__ = True
            return self._qcheck(qcheck.check_layer, (layer, reference, x, *args), kwargs, msg)


def testcase_name(case: Case) -> str:
    """The absltest name of a case: its id as an identifier, e.g. ``fp8_mixtral_dense_drop``."""
    return re.sub(r"\W", "_", case.id.replace("-", "_"))


def _names(what: str, value: Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError(f"{what} must be a sequence of names, not the string {value!r} (write ({value!r},))")
    return tuple(value)


def _invariant(name: str) -> Invariant:
    from qcheck._choices import require_choice
    from qcheck.suite.invariants import INVARIANTS

    by_name = {inv.name: inv for inv in INVARIANTS}
    return by_name[require_choice("invariant", name, by_name)]


def case_parameters(
    invariant: str | None = None,
    *,
    recipes: Iterable[str] | None = None,
    models: Iterable[str] | None = None,
    paths: Iterable[str] | None = None,
) -> list[dict[str, Any]]:
    """qcheck's cases as ``parameterized.named_parameters`` rows: ``{"testcase_name": ..., "case": Case}``.

    ``recipes`` (default: every registered recipe), ``models`` and ``paths``
    narrow the table; with ``invariant`` only the cases it applies to remain.
    Unknown names raise ``ValueError`` listing the valid ones. Names are
    :func:`testcase_name`, so ``test_tracks`` becomes ``test_tracks_fp8_mixtral_dense``.
    """
    from qcheck.recipes import get_recipe
    from qcheck.suite.cases import cases

    inv = None if invariant is None else _invariant(invariant)
    chosen = cases(_names("recipes", recipes), models=_names("models", models), paths=_names("paths", paths))
    if inv is not None:
        chosen = [c for c in chosen if inv.applies(get_recipe(c.recipe), c.variant)]
    rows: dict[str, Case] = {}
    for case in chosen:
        name = testcase_name(case)
        if name in rows:
            raise ValueError(f"cases {rows[name].id!r} and {case.id!r} both make the test name {name!r}; "
                             "rename one of the recipes")
        rows[name] = case
    return [{"testcase_name": name, "case": case} for name, case in rows.items()]


def _make_test(invariant: Invariant, case: Case, declared: Any) -> Callable[[InvariantTestCase], Any]:
    def test(self: InvariantTestCase) -> None:  # a test returning a value is deprecated in unittest
        __tracebackhide__ = True
        self.run_invariant(invariant, case)

    test.__doc__ = f"qcheck invariant {invariant.name!r} on {case.id}."
    if declared is not None:
        test.__doc__ = f"qcheck invariant {invariant.name!r} on {case.id}, declared ({declared.text()}): it must hold."
    return test


def _cells(invariant: Invariant, recipes: Iterable[str] | None, models: Iterable[str] | None,
           paths: Iterable[str] | None) -> list[tuple[str, Case, Any]]:
    """``(name, case, declaration)`` of every cell of ``invariant`` with a verdict: it applies, or it is declared."""
    from qcheck.recipes import get_recipe
    from qcheck.suite.cells import declared

    rows = []
    for row in case_parameters(recipes=recipes, models=models, paths=paths):
        case, recipe = row["case"], get_recipe(row["case"].recipe)
        found = declared(recipe, case.variant, invariant.name)
        if found is not None or invariant.applies(recipe, case.variant):
            rows.append((row["testcase_name"], case, found))
    return rows


def _make_paths_test(model: str, dropping: bool) -> Callable[[InvariantTestCase], Any]:
    def test(self: InvariantTestCase) -> None:
        __tracebackhide__ = True
        from qcheck.suite import invariants

        from qcheck.suite.cells import run_cell

        self._qcheck(lambda: run_cell(invariants.paths_case(model, dropping), invariants.PATHS).raise_failure(), (),
                     {}, None)

    drop = "with" if dropping else "no"
    test.__doc__ = f"qcheck: dense and sparse compute the same function ({model}, {drop} dropping)."
    return test


class InvariantTestCase(QuantizationAssertions, parameterized.TestCase):
    """qcheck's invariant suite as an absltest TestCase: subclass it in your test module.

    Each subclass gets one test per invariant and case it applies to, named
    ``test_<invariant>_<case>`` (``test_exact_fp8_mixtral_dense``), plus
    ``test_paths_agree_<model>[_drop]`` (dense == sparse, checked on ``none``)
    when ``none`` is selected. This class itself has no tests. Select with
    class attributes (``None``: all)::

        class Fp8Suite(qcheck.testing.InvariantTestCase):
            qcheck_recipes = ("fp8", "my_recipe")
            qcheck_models = ("mixtral",)

    ``qcheck_invariants`` names invariants (``qcheck.suite.invariants.INVARIANTS``,
    and ``"paths"``); ``qcheck_golden_dir`` is where your recipes' golden cases
    live (default ``$QCHECK_GOLDEN_DIR``, else ``./golden``; qcheck's own
    recipes' cases ship with it). Recipes must be registered when the subclass
    is defined. The ``sharded`` tests skip, saying why, in a process with fewer
    than 8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``
    before JAX starts gives them).
    """

    qcheck_recipes: tuple[str, ...] | None = None
    qcheck_models: tuple[str, ...] | None = None
    qcheck_paths: tuple[str, ...] | None = None
    qcheck_invariants: tuple[str, ...] | None = None
    qcheck_golden_dir: str | os.PathLike[str] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        from qcheck.layers.moe import MODELS
        from qcheck.suite.invariants import INVARIANTS

        names = [inv.name for inv in INVARIANTS]
        wanted = _names("qcheck_invariants", cls.qcheck_invariants)
        if wanted is not None:
            from qcheck._choices import require_choice

            for name in wanted:
                require_choice("invariant", name, [*names, "paths"])
        tests: dict[str, Callable[..., Any]] = {}
        for inv in INVARIANTS:
            if wanted is None or inv.name in wanted:
                for name, case, found in _cells(inv, cls.qcheck_recipes, cls.qcheck_models, cls.qcheck_paths):
                    tests[f"test_{inv.name}_{name}"] = _make_test(inv, case, found)
        recipes = _names("qcheck_recipes", cls.qcheck_recipes)
        if (wanted is None or "paths" in wanted) and (recipes is None or "none" in recipes):
            for model in _names("qcheck_models", cls.qcheck_models) or MODELS:
                for dropping in (False, True):
                    tests[f"test_paths_agree_{model}" + ("_drop" if dropping else "")] = _make_paths_test(
                        model, dropping)
        # A subclass of a suite narrows it: tests its parent generated for other cases go away.
        for name in dir(cls):
            if name.startswith("test_") and getattr(getattr(cls, name), "_qcheck_generated", False):
                if name not in tests:
                    setattr(cls, name, None)
        for name, test in tests.items():
            test.__name__ = name
            test.__qualname__ = f"{cls.__qualname__}.{name}"
            test._qcheck_generated = True  # type: ignore[attr-defined]
            setattr(cls, name, test)

    def golden_dir(self) -> Path:
        """Where this suite's user golden cases live."""
        from qcheck.suite.golden import ENV

        named = self.qcheck_golden_dir or os.environ.get(ENV)
        return Path(named) if named else Path("golden")

    def run_invariant(self, invariant: Invariant, case: Case) -> Any:
        """Run one cell as the matrix and the pytest plugin do, failing through ``self.fail``; returns its figure.

        A cell its recipe declares passes while the declaration holds (the
        library still refuses it, or the invariant still fails as declared),
        and fails, saying to drop it, once it does not.
        """
        __tracebackhide__ = True
        from qcheck.suite.cells import run_cell
        from qcheck.suite.invariants import RunEnv

        if invariant.name == "sharded":
            import jax

            if (n := len(jax.devices("cpu"))) < _MESH_DEVICES:
                self.skipTest(f"the sharded invariant needs {_MESH_DEVICES} CPU devices, this process has {n}: "
                              f"set XLA_FLAGS=--xla_force_host_platform_device_count={_MESH_DEVICES} before "
                              "JAX starts")
        verdict = run_cell(case, RunEnv(self.golden_dir()).bind(invariant))
        if isinstance(verdict.error, AssertionError):
            self.fail(self._formatMessage(None, str(verdict.error)))
        verdict.raise_failure()  # an error, not a failure
        return verdict.figure
