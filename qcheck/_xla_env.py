"""XLA settings for qcheck's own processes (the test suite and the CLI), applied before JAX starts.

qcheck's programs are tiny: LLVM's optimization passes buy no run time and
cost about 40% of every compilation on CPU (63 s -> 44 s for the matrix on a
2-core machine), so the backend optimization level is 0. Outputs are
deterministic under a fixed setting; a user who sets the flag themselves wins.
Under pytest-xdist each worker gets one intra-op thread, so ``-n auto`` does not
oversubscribe the cores.
"""

from __future__ import annotations

import os

_OPT_FLAG = "--xla_backend_optimization_level"


def configure(environ: os._Environ | dict = os.environ) -> None:
    flags = environ.get("XLA_FLAGS", "")
    extra = []
    if _OPT_FLAG not in flags:
        extra.append(f"{_OPT_FLAG}=0")
    if environ.get("PYTEST_XDIST_WORKER") and "xla_cpu_multi_thread_eigen" not in flags:
        extra += ["--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1"]
    if extra:
        environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
