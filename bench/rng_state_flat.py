"""assert_rng_state_flat's first call against compiling the user's step at each layer count, interleaved (a benchmark,
never a test).

    PYTHONPATH=. python bench/rng_state_flat.py [ROUNDS]

Each run is a fresh process (no trace or compilation cache is shared, the persistent cache off), timed from
after the imports: ``check`` is ``qcheck.assert_rng_state_flat(build, step, x)`` at 1, 2 and 8 layers, ``compile``
builds the same models and compiles the same step on each (``step.lower(...).compile()``), what a user pays to
run their step once at each depth. The model is qcheck's unrolled Mixtral decoder under ``nvfp4`` (its sites
share the caller's stream) and the step ``tests.helpers.module_train_step`` (``nnx.jit``, loss and gradients).
Runs alternate check, compile, check, ... and print a JSON line each.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = (1, 2, 8)


def _one(kind: str) -> None:
    import qcheck
    from qcheck.suite import cases
    from tests.helpers import decoder_at, module_train_step

    x = cases.layer_input("mixtral")
    build = decoder_at("nvfp4")
    start = time.perf_counter()
    if kind == "check":
        qcheck.assert_rng_state_flat(build, module_train_step, x, layers=LAYERS)
    else:
        for n in LAYERS:
            module_train_step.lower(build(n), x).compile()
    print(json.dumps({"run": kind, "wall_s": round(time.perf_counter() - start, 2)}), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        _one(argv[1])
        return 0
    rounds = int(argv[0]) if argv else 3
    env = {**os.environ, "QCHECK_XLA_CACHE": "0", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    for _ in range(rounds):
        for kind in ("check", "compile"):
            done = subprocess.run([sys.executable, __file__, "--one", kind], env=env, cwd=ROOT, capture_output=True,
                                  text=True)
            print(done.stdout.strip() or json.dumps({"run": kind, "exit": done.returncode,
                                                     "stderr": done.stderr[-400:]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
