"""What the persistent compilation cache buys the matrix: warm against cold, interleaved (a benchmark, never a test).

    python bench/cache_warm_cold.py .venv/bin/python --recipe int8 --recipe fp8 --model mixtral --jobs 1

Runs ``PYTHON -m qcheck ARGS`` once to fill a fresh cache directory, then cold
(``QCHECK_XLA_CACHE=0``), warm (the filled directory), warm, cold, and prints a
JSON line per run (wall and CPU seconds of the process tree) and the cache's
size. Stdlib only.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(python: str, args: list[str], label: str, cache: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "QCHECK_XLA_CACHE")}
    env["QCHECK_XLA_CACHE"] = cache
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([python, "-m", "qcheck", *args], env=env, capture_output=True, text=True, cwd=ROOT)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    print(json.dumps({"run": label, "exit": done.returncode, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}),
          flush=True)


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: cache_warm_cold.py PYTHON [qcheck arguments...]")
    python, args = argv[0], argv[1:]
    cache = tempfile.mkdtemp(prefix="qcheck-bench-cache-")
    try:
        _run(python, args, "fill", cache)
        for label in ("cold", "warm", "warm", "cold"):
            _run(python, args, label, cache if label == "warm" else "0")
        files = [Path(d, f) for d, _, fs in os.walk(cache) for f in fs]
        print(json.dumps({"cache_mb": round(sum(p.stat().st_size for p in files) / 2**20, 1),
                          "entries": len(os.listdir(cache))}))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
