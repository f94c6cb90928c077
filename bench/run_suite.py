"""Time the whole test suite and record the figures (a benchmark, never a test).

    python bench/run_suite.py                     # pytest -n auto, once
    python bench/run_suite.py --workers auto 2 1 --repeat 2 --out bench/local.json

With more than one run it also compares every test's outcome across runs
(worker count and order must not change a result) and fails on a difference.

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
import tempfile
import time
from importlib import metadata
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "ml_dtypes", "numpy", "pytest", "pytest-xdist"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


# A fixed compile workload, to tell a slower suite from a slower machine: the
# fp8 and nvfp4 forward and train programs of the mixtral variants.
CALIBRATION = """
import time, jax
from flax import nnx
from qcheck import _xla_env
_xla_env.configure()
from qcheck import cases, step
x = cases.layer_input("mixtral")
start = time.perf_counter()
for v in [v for v in cases.VARIANTS if v.model == "mixtral"]:
    for r in ("fp8", "nvfp4"):
        layer = cases.layer(cases.Case(r, v))
        graphdef, state = nnx.split(layer)
        step._apply.lower(graphdef, state, x).compile()
        graphdef, *parts = step.split_for_step(layer)
        step._train_step.lower(graphdef, *parts, x).compile()
print(round(time.perf_counter() - start, 2))
"""


def _calibrate() -> float:
    done = subprocess.run([sys.executable, "-c", CALIBRATION], cwd=ROOT, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else float("nan")


def _outcomes(junit: Path) -> dict[str, str]:
    out = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        verdict = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        out[f"{case.get('classname')}::{case.get('name')}"] = verdict
    return out


def _run(workers: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers,
               f"--junitxml={junit}", *extra]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        outcomes = _outcomes(junit) if junit.exists() else {}
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", tail)}
    return {"workers": workers, "wall_s": round(wall, 2), "exit": done.returncode, "counts": counts,
            "summary": tail, "outcomes": outcomes}


def _differences(runs: list[dict]) -> list[str]:
    """Tests whose outcome differs between runs (worker count or order must not matter)."""
    base = runs[0]["outcomes"]
    diffs = []
    for r in runs[1:]:
        for test in sorted(set(base) | set(r["outcomes"])):
            a, b = base.get(test, "absent"), r["outcomes"].get(test, "absent")
            if a != b:
                diffs.append(f"{test}: {a} with -n {runs[0]['workers']}, {b} with -n {r['workers']}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", nargs="+", default=["auto"], help="xdist worker counts to try")
    p.add_argument("--repeat", type=int, default=1, help="runs per worker count")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    p.add_argument("pytest_args", nargs="*", help="extra arguments for pytest (after --)")
    args = p.parse_args(argv)

    calibration = _calibrate()
    runs = [_run(w, args.pytest_args) for w in args.workers for _ in range(args.repeat)]
    print(f"calibration (fixed compile workload): {calibration} s")
    print(f"{'workers':>8}  {'wall s':>7}  exit  summary")
    for r in runs:
        print(f"{r['workers']:>8}  {r['wall_s']:>7.2f}  {r['exit']:>4}  {r['summary']}")
    diffs = _differences(runs)
    if len(runs) > 1:
        print(f"outcomes identical across runs: {not diffs}")
        for d in diffs:
            print(f"  {d}")
    if args.out:
        record = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "calibration_s": calibration},
            "versions": _versions(),
            "runs": [{k: v for k, v in r.items() if k != "outcomes"} for r in runs],
            "outcome_differences": diffs,
        }
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    return 0 if all(r["exit"] == 0 for r in runs) and not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
