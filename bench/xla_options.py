"""Compile cost of representative qcheck programs under extra XLA flags (a benchmark, never a test).

    XLA_FLAGS="--xla_cpu_use_fusion_emitters=false" python bench/xla_options.py --xla_cpu_use_fusion_emitters=false

qcheck's own flags (qcheck.suite._process) are added to XLA_FLAGS first, as in
qcheck's processes. Compiles every format's qdq on a 64 x 64 operand and the
fp8, int8 and nvfp4 Mixtral layers on both paths (34 programs), then prints
one JSON line: the arguments (a label), programs compiled, backend compile
seconds, CPU seconds of the process, and a digest of every output's bits —
equal digests across flags are a first sign, the golden cases the proof.
Run each flag set in a fresh process, interleaved, more than once.
"""

import hashlib
import json
import sys
import time

from qcheck.suite import _process

_process.configure()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import monitoring  # noqa: E402

from qcheck import formats  # noqa: E402
from qcheck.suite import cases  # noqa: E402

_compiles = [0, 0.0]


def _on_duration(event: str, seconds: float, *args, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1
        _compiles[1] += seconds


def main() -> None:
    monitoring.register_event_duration_secs_listener(_on_duration)
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    bits = {}
    start = time.process_time()
    for fmt in formats.format_names():
        bits[fmt] = np.asarray(jax.jit(lambda v, fmt=fmt: formats.qdq(v, fmt))(x)).tobytes()
    for recipe in ("fp8", "int8", "nvfp4"):
        for path in ("dense", "sparse"):
            case = cases.Case(recipe, cases.Variant("mixtral", path, False))
            bits[case.id] = np.asarray(cases.layer_output(case)).tobytes()
    digest = hashlib.sha1(b"".join(bits[k] for k in sorted(bits))).hexdigest()[:12]
    print(json.dumps({"args": sys.argv[1:], "compiles": _compiles[0], "compile_s": round(_compiles[1], 2),
                      "cpu_s": round(time.process_time() - start, 2), "digest": digest}))


if __name__ == "__main__":
    main()
