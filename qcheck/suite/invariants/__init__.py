"""The suite's invariants over the case table: one module each, run alike by the matrix, the pytest plugin and
``qcheck.testing`` (:func:`qcheck.suite.cells.run_cell`).

Each invariant's module has ``doc`` (what it holds, in one line: the CLI's help
and the README's table show it), ``applies(recipe, variant)`` and ``run(case)``,
which raises ``AssertionError`` (prefixed with the case id and, where it
applies, the call site) when the invariant is broken and returns the figure it
measured. :data:`INVARIANTS` is their table, in the matrix's column order, and
``run_<name>`` each one's ``run``; :data:`PATHS` (dense == sparse) compares two
cases, so it is a row of its own, run through :func:`~qcheck.suite.cells.run_cell` as the columns are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

from qcheck.recipes import Recipe
from qcheck.suite._layer_matches import assert_layer_matches_referee
from qcheck.suite._sharded import (SHARDED_ATOL, SHARDED_RTOL, assert_layer_sharded,
                                   assert_layer_sharded_matches, assert_sharded_matches)
from qcheck.suite.cases import Case, Variant, grad_leaves, train_step_runs
from qcheck.suite.invariants import (backward, coverage, edges, exact, golden, grads, referee, rng, sharded, sites,
                                     state, tracks, train)
from qcheck.suite.invariants._programs import case_site_runs, site_runs
from qcheck.suite.invariants.backward import assert_sites_backward_exact
from qcheck.suite.invariants.coverage import assert_layer_fp8_native, assert_layer_quantized
from qcheck.suite.invariants.edges import assert_layer_edges
from qcheck.suite.invariants.exact import assert_sites_exact
from qcheck.suite.invariants.grads import assert_grads_track
from qcheck.suite.invariants import paths
from qcheck.suite.invariants.paths import PATHS_ATOL, PATHS_MAX_ABS, PATHS_RTOL, assert_paths_agree, paths_case
from qcheck.suite.invariants.rng import (RNG_CONTROL_DEPTHS, RNG_DEPTHS, RNG_MODELS, assert_rng_state_grows,
                                         assert_rng_state_matches_twin, rng_entry_params, rng_states)
from qcheck.suite.invariants.sites import assert_sites_carry_no_rng_stream, assert_sites_independent
from qcheck.suite.invariants.state import assert_fp8_state_moves_only_in_backward, fp8_meta_leaves
from qcheck.suite.invariants.train import (TRAIN_MAX_NORM, TRAIN_MICROBATCHES, TRAIN_RTOL, assert_layer_trains,
                                           output_rows_differ)

__all__ = [
    "INVARIANTS",
    "Invariant",
    "PATHS",
    "PATHS_ATOL",
    "PATHS_MAX_ABS",
    "PATHS_RTOL",
    "RNG_CONTROL_DEPTHS",
    "RNG_DEPTHS",
    "RNG_MODELS",
    "RunEnv",
    "SHARDED_ATOL",
    "SHARDED_RTOL",
    "TRAIN_MAX_NORM",
    "TRAIN_MICROBATCHES",
    "TRAIN_RTOL",
    "assert_fp8_state_moves_only_in_backward",
    "assert_grads_track",
    "assert_layer_edges",
    "assert_layer_fp8_native",
    "assert_layer_matches_referee",
    "assert_layer_quantized",
    "assert_layer_sharded",
    "assert_layer_sharded_matches",
    "assert_layer_trains",
    "assert_paths_agree",
    "assert_rng_state_grows",
    "assert_rng_state_matches_twin",
    "assert_sharded_matches",
    "assert_sites_backward_exact",
    "assert_sites_carry_no_rng_stream",
    "assert_sites_exact",
    "assert_sites_independent",
    "case_site_runs",
    "fp8_meta_leaves",
    "grad_leaves",
    "output_rows_differ",
    "paths_case",
    "rng_entry_params",
    "rng_states",
    "run_backward",
    "run_coverage",
    "run_edges",
    "run_exact",
    "run_golden",
    "run_grads",
    "run_referee",
    "run_rng",
    "run_sharded",
    "run_sites",
    "run_state",
    "run_tracks",
    "run_train",
    "site_runs",
    "train_step_runs",
]

run_sites, run_coverage, run_exact, run_backward = sites.run, coverage.run, exact.run, backward.run
run_tracks, run_grads, run_state, run_train = tracks.run, grads.run, state.run, train.run
run_rng, run_sharded, run_referee, run_golden = rng.run, sharded.run, referee.run, golden.run
run_edges = edges.run


@dataclasses.dataclass(frozen=True)
class Invariant:
    """A per-case check, the cases it applies to, and what it holds (``doc``, one line)."""

    name: str
    applies: Callable[[Recipe, Variant], bool]
    run: Callable[[Case], float | None]
    doc: str = ""


#: One module per invariant, in the matrix's column order.
_MODULES = (sites, coverage, exact, backward, tracks, grads, edges, state, train, rng, sharded, referee, golden)

INVARIANTS: tuple[Invariant, ...] = tuple(
    Invariant(m.__name__.rsplit(".", 1)[1], m.applies, m.run, m.doc) for m in _MODULES)


#: Dense == sparse: the unquantized layer's two paths compared, a row of its own beside the columns.
PATHS = Invariant("paths", paths.applies, paths.run, paths.doc)


@dataclasses.dataclass(frozen=True)
class RunEnv:
    """One run of the suite, built once: what its invariants need besides the case.

    That is where the user's golden cases live, and ``golden`` is the one
    invariant that reads it: :attr:`invariants` is :data:`INVARIANTS` with
    that directory bound, so every other check keeps taking the case alone.
    """

    golden_root: Path = Path("golden")

    @property
    def invariants(self) -> tuple[Invariant, ...]:
        """:data:`INVARIANTS` (as it stands when asked) as this run runs them."""
        return tuple(self.bind(inv) for inv in INVARIANTS)

    def bind(self, invariant: Invariant) -> Invariant:
        """``invariant`` as this run runs it: the golden check against :attr:`golden_root`, others as they are."""
        if invariant.run is golden.run:
            return dataclasses.replace(invariant, run=functools.partial(golden.run, golden_root=self.golden_root))
        return invariant
