"""Same seed, same bits: across fresh processes, and for the matrix run twice."""

import hashlib
import os
import subprocess
import sys

import numpy as np

from qcheck import cases, matrix, step

# A layer that draws random bits (NVFP4's stochastic rounding in the backward
# pass), with token dropping, hashed after a forward pass and a train step.
SCRIPT = """
import hashlib, numpy as np, jax
from qcheck import cases, step
h = hashlib.sha256()
case = cases.Case("nvfp4", cases.Variant("mixtral", "dense", True))
out = step.train_step(cases.layer(case), cases.layer_input("mixtral"))
for leaf in jax.tree.leaves((out.output, out.loss, out.grads)):
    h.update(np.asarray(leaf).tobytes())
print(h.hexdigest())
"""


def test_same_layer_in_two_fresh_processes_gives_the_same_bits():
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    results = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]
    first, second = (out.strip() for out, _ in results)
    assert len(first) == 64 and first == second


def test_matrix_prints_the_same_table_twice():
    subset = dict(models=("mixtral",), paths=("sparse",))
    first = matrix.format_table(matrix.run_matrix(("int8", "nvfp4"), **subset))
    second = matrix.format_table(matrix.run_matrix(("int8", "nvfp4"), **subset))
    assert first == second and "pass" in first


def test_a_train_step_repeated_in_one_process_gives_the_same_bits():
    layer = cases.layer(cases.Case("nvfp4", cases.Variant("mixtral", "sparse", False)))
    x = cases.layer_input("mixtral")
    a, b = step.train_step(layer, x), step.train_step(layer, x)
    digest = lambda out: hashlib.sha256(np.asarray(out.grads["wi_0"][...]).tobytes()).hexdigest()  # noqa: E731
    assert digest(a) == digest(b)
