"""Same seed, same bits: across fresh processes, and for the matrix run twice."""

import hashlib
import os
import subprocess
import sys

import jax
import numpy as np

from qcheck import cases, matrix, step

# A layer that draws random bits (NVFP4's stochastic rounding in the backward
# pass), hashed after a train step, which also returns the forward output.
CASE = cases.Case("nvfp4", cases.Variant("mixtral", "sparse", False))
SCRIPT = f"""
import hashlib, numpy as np, jax
from qcheck import cases, step
case = cases.Case("{CASE.recipe}", cases.Variant("{CASE.variant.model}", "{CASE.variant.path}", False))
out = step.train_step(cases.layer(case), cases.layer_input("{CASE.variant.model}"))
leaves = jax.tree.leaves((out.output, out.loss, out.grads, out.fp8_meta))
print(hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in leaves)).hexdigest())
"""


def _digest(out: step.StepOutput) -> str:
    leaves = jax.tree.leaves((out.output, out.loss, out.grads, out.fp8_meta))
    return hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in leaves)).hexdigest()


def test_same_seed_same_bits_in_this_process_and_a_fresh_one():
    layer, x = cases.layer(CASE), cases.layer_input(CASE.variant.model)
    here = _digest(step.train_step(layer, x))
    assert here == _digest(step.train_step(layer, x))
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
