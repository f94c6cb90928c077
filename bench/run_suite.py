"""Time the whole test suite and record the figures (a benchmark, never a test).

    python bench/run_suite.py                     # pytest -n auto, once
    python bench/run_suite.py --workers auto 2 1 --repeat 2 --out bench/local.json

Each run is a fresh pytest process with the cache provider off, so every run is
cold as far as pytest is concerned (JAX's persistent compilation cache is off
unless you enable it yourself). Prints a table and, with --out, writes JSON with
the machine, versions and every run's wall time and outcome counts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "ml_dtypes", "numpy", "pytest", "pytest-xdist"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def _run(workers: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", tail)}
    return {"workers": workers, "wall_s": round(wall, 2), "exit": done.returncode, "counts": counts,
            "summary": tail}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", nargs="+", default=["auto"], help="xdist worker counts to try")
    p.add_argument("--repeat", type=int, default=1, help="runs per worker count")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    p.add_argument("pytest_args", nargs="*", help="extra arguments for pytest (after --)")
    args = p.parse_args(argv)

    runs = [_run(w, args.pytest_args) for w in args.workers for _ in range(args.repeat)]
    print(f"{'workers':>8}  {'wall s':>7}  exit  summary")
    for r in runs:
        print(f"{r['workers']:>8}  {r['wall_s']:>7.2f}  {r['exit']:>4}  {r['summary']}")
    if args.out:
        record = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "versions": _versions(),
            "runs": runs,
        }
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    return 0 if all(r["exit"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
