"""Same seed, same bits: in fresh processes, and for the matrix in one process or several."""

import gc
import hashlib

import numpy as np

from qcheck import get_recipe
from qcheck.layers import step
from qcheck.suite import cases, invariants, matrix
from qcheck.recipes import recipe_names

# Per-key determinism of the stochastic rounding is pinned in test_rng.py.
CASE = cases.Case("int8", cases.Variant("mixtral", "dense", True))


def output_digest(case: cases.Case) -> str:
    """The hash of ``case``'s layer output, built from its seed in whatever process runs this."""
    return hashlib.sha256(cases.layer_output(case).tobytes()).hexdigest()


def test_same_layer_in_this_and_in_fresh_processes_gives_the_same_bits_and_the_same_matrix(tmp_path):
    here = output_digest(CASE)
    again = np.asarray(step.apply(cases.layer(CASE), cases.layer_input(CASE.variant.model))[0])
    assert hashlib.sha256(again.tobytes()).hexdigest() == here  # a second run of the same program
    subset = dict(paths=("sparse",))  # two cases: one per worker
    table = matrix.format_table(matrix.run_matrix(("int8",), **subset))
    # Spawned workers are fresh interpreters (their own hash seed, no layer built
    # yet) and inherit this process's XLA flags, so only the process differs.
    module = tmp_path / "elsewhere.py"  # the CLI's --recipes reaches every worker
    module.write_text('import qcheck\nqcheck.register_recipe(qcheck.Recipe("det_e5m2", lhs="e5m2", rhs="e5m2"))\n')
    with matrix.worker_pool(2, recipe_modules=(str(module),)) as pool:
        assert "det_e5m2" in pool.submit(recipe_names).result() and "det_e5m2" not in recipe_names()
        # The only matrix workers the suite starts: they collect garbage as this qcheck process does
        # (tests/test_process.py: less often than CPython's default).
        assert pool.submit(gc.get_threshold).result() == gc.get_threshold()
        there = pool.submit(output_digest, CASE)
        worker_table = matrix.format_table(matrix.run_matrix(("int8",), executor=pool, **subset))
        assert there.result() == here
    passing = sum(inv.applies(get_recipe("int8"), case.variant) for case in cases.cases(("int8",), **subset)
                  for inv in invariants.INVARIANTS)
    assert worker_table == table and table.count("pass") == passing
