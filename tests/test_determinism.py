"""Same seed, same bits: across fresh processes, and for the matrix run twice."""

import hashlib
import os
import subprocess
import sys

import numpy as np

from qcheck import cases, matrix, step

# The layer is rebuilt from its seed in a fresh process and run forward; the
# hash must match this process's (cached) output. Per-key determinism of the
# stochastic rounding is pinned in test_rng.py.
CASE = cases.Case("int8", cases.Variant("mixtral", "dense", True))
SCRIPT = f"""
import hashlib, numpy as np
from qcheck import cases
case = cases.Case("{CASE.recipe}", cases.Variant("{CASE.variant.model}", "{CASE.variant.path}", True))
print(hashlib.sha256(cases.layer_output(case).tobytes()).hexdigest())
"""


def test_same_layer_in_a_fresh_process_gives_the_same_bits():
    here = hashlib.sha256(cases.layer_output(CASE).tobytes()).hexdigest()
    again = np.asarray(step.apply(cases.layer(CASE), cases.layer_input(CASE.variant.model))[0])
    assert hashlib.sha256(again.tobytes()).hexdigest() == here
    # The fresh process inherits this one's XLA_FLAGS, so only the process differs.
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env={**os.environ, "PYTHONHASHSEED": "random"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == here


def test_matrix_prints_the_same_table_twice():
    subset = dict(models=("mixtral",), paths=("sparse",))
    first = matrix.format_table(matrix.run_matrix(("int8", "nvfp4"), **subset))
    second = matrix.format_table(matrix.run_matrix(("int8", "nvfp4"), **subset))
    assert first == second and "pass" in first
