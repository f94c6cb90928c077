"""Time the whole test suite and the matrix, and record the figures (a benchmark, never a test).

    python bench/run_suite.py                                  # -n auto, cold; compare with bench/baseline.json
    python bench/run_suite.py --runs auto 2 1 auto:warm matrix matrix:1 --out bench/results-py311.json
    python bench/run_suite.py --runs auto matrix --write-baseline   # this machine's figures become the baseline

Each pytest run is a fresh process with the cache provider off. A run named
``W`` is cold (no persistent compilation cache; the xdist workers share one for
the run only); ``W:warm`` first fills a persistent cache (QCHECK_XLA_CACHE) with
one run, then times a second. ``matrix`` times ``python -m qcheck`` (its default
worker processes), ``matrix:J`` with ``--jobs J``, always cold. For every run it
reports wall time, the XLA compilations every process made (through
jax.monitoring, so counting costs nothing; persistent-cache hits count too, and
how many the cache served), the slowest tests, and whether any test's outcome
differs between runs (worker count and order must not change a result). This
machine's speed drifts, so a fixed workload of plain JAX programs is timed
before and after every run (the calibration), and comparisons with the baseline
are scaled by it.
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


# A fixed workload, to tell a slower suite from a slower machine (this one's
# speed drifts by a third within an hour): plain JAX programs, independent of
# qcheck's code and XLA settings, each traced, lowered, compiled and run, as the
# suite's are.
# Timed before and after every run; the run is scaled by the mean.
CALIBRATION = """
import os, time
# Fixed flags, not qcheck's: a change to qcheck's XLA settings must show in the
# run it speeds up, not in the yardstick too. These are the settings the
# baseline's calibration ran with.
os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp
start = time.perf_counter()
x = jnp.ones((64, 64))
for n in range(8):
    def f(a, n=n):
        for k in range(30 + n):
            a = jnp.tanh(a) @ a * 0.5 + k
        return a
    jax.jit(f)(x).block_until_ready()
print(round(time.perf_counter() - start, 2))
"""


def _calibrate() -> float:
    done = subprocess.run([sys.executable, "-c", CALIBRATION], cwd=ROOT, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else float("nan")


def _outcomes(junit: Path) -> tuple[dict[str, str], dict[str, float]]:
    """Each test's outcome and duration, from pytest's JUnit XML."""
    outcomes, durations = {}, {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcomes[name] = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        durations[name] = float(case.get("time", 0.0))
    return outcomes, durations


def _run(spec: str, extra: list[str]) -> dict:
    """One timed run, between two calibrations: ``W`` / ``W:warm`` for pytest, ``matrix[:J]`` for the CLI."""
    before = _calibrate()
    record = _run_matrix(spec) if spec.startswith("matrix") else _run_pytest(spec, extra)
    after = _calibrate()
    record["calibration_s"] = round((before + after) / 2, 2)
    record["calibration_before_after_s"] = [before, after]
    return record


def _run_matrix(spec: str) -> dict:
    _, _, jobs = spec.partition(":")
    cmd = [sys.executable, "-m", "qcheck", *(["--jobs", jobs] if jobs else [])]
    env = {k: v for k, v in os.environ.items() if k != "QCHECK_XLA_CACHE"}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-200:]
    return {"run": spec, "wall_s": round(wall, 2), "exit": done.returncode, "counts": {}, "compiles": None,
            "persistent_cache_hits": None, "summary": tail, "slowest": {}, "outcomes": {}}


def _run_pytest(spec: str, extra: list[str]) -> dict:
    workers, _, mode = spec.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        junit, counts = tmp / "junit.xml", tmp / "counts"
        counts.mkdir()
        env = {**os.environ, "QCHECK_COUNT_COMPILES": str(counts)}
        env.pop("QCHECK_XLA_CACHE", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers,
               f"--junitxml={junit}", *extra]
        if mode == "warm":
            env["QCHECK_XLA_CACHE"] = str(tmp / "xla-cache")
            subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)  # fills the cache
            for f in counts.iterdir():
                f.unlink()
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        outcomes, durations = _outcomes(junit) if junit.exists() else ({}, {})
        tallies = [json.loads(f.read_text()) for f in counts.glob("*.json")]
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    found = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", tail)}
    slowest = dict(sorted(durations.items(), key=lambda kv: -kv[1])[:15])
    return {"run": spec, "wall_s": round(wall, 2), "exit": done.returncode, "counts": found,
            "compiles": sum(t["compiles"] for t in tallies),
            "compile_s": round(sum(t["seconds"] for t in tallies), 1),
            "persistent_cache_hits": sum(t["cache_hits"] for t in tallies), "summary": tail,
            "slowest": slowest, "outcomes": outcomes}


def _differences(runs: list[dict]) -> list[str]:
    """Tests whose outcome differs between runs (worker count and order must not matter)."""
    if not runs:
        return []
    base = runs[0]["outcomes"]
    diffs = []
    for r in runs[1:]:
        for test in sorted(set(base) | set(r["outcomes"])):
            a, b = base.get(test, "absent"), r["outcomes"].get(test, "absent")
            if a != b:
                diffs.append(f"{test}: {a} in run {runs[0]['run']}, {b} in run {r['run']}")
    return diffs


def _slower(runs: list[dict], baseline: dict) -> list[str]:
    """What got slower than the baseline, each run scaled by its own and the baseline's calibration.

    Slack: 10% of a run's time, and 50% + 0.5 s of a test's (a single test's
    time depends on which worker built the layers it shares).
    """
    base_runs = {r["run"]: r for r in baseline["runs"]}
    out = []
    for r in runs:
        b = base_runs.get(r["run"])
        if b is None or "calibration_s" not in b:
            continue
        scale = b["calibration_s"] / r["calibration_s"]
        wall = r["wall_s"] * scale
        if wall > b["wall_s"] * 1.1:
            out.append(f"run {r['run']}: {wall:.1f} s (scaled) against {b['wall_s']:.1f} s")
        if (r.get("compiles") or 0) > (b.get("compiles") or r.get("compiles") or 0):
            out.append(f"run {r['run']}: {r['compiles']} compilations against {b['compiles']}")
        for test, t in r["slowest"].items():
            was = b.get("slowest", {}).get(test)
            if was is not None and t * scale > was * 1.5 + 0.5:
                out.append(f"{test}: {t * scale:.1f} s (scaled) against {was:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=["auto"], metavar="W[:warm]",
                   help="xdist worker counts to time, each cold or :warm (default: auto)")
    p.add_argument("--baseline", type=Path, default=ROOT / "bench" / "baseline.json")
    p.add_argument("--write-baseline", action="store_true", help="write this run as the new baseline")
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    p.add_argument("pytest_args", nargs="*", help="extra arguments for pytest (after --)")
    args = p.parse_args(argv)

    runs = [_run(spec, args.pytest_args) for spec in args.runs]
    print(f"{'run':>8}  {'wall s':>7}  {'calib. s':>8}  {'compiles':>8}  {'cache hits':>10}  exit  summary")
    for r in runs:
        print(f"{r['run']:>8}  {r['wall_s']:>7.2f}  {r['calibration_s']:>8.2f}  {r['compiles'] or '-':>8}  "
              f"{r['persistent_cache_hits'] if r['persistent_cache_hits'] is not None else '-':>10}  "
              f"{r['exit']:>4}  {r['summary']}")
    print("slowest tests (first run):")
    for test, t in runs[0]["slowest"].items():
        print(f"  {t:6.2f} s  {test}")
    diffs = _differences([r for r in runs if r["outcomes"]])
    if len(runs) > 1:
        print(f"outcomes identical across runs: {not diffs}")
        for d in diffs:
            print(f"  {d}")
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": _versions(),
        "runs": [{k: v for k, v in r.items() if k != "outcomes"} for r in runs],
        "outcome_differences": diffs,
    }
    slower = []
    if args.baseline.exists() and not args.write_baseline:
        slower = _slower(runs, json.loads(args.baseline.read_text()))
        print(f"against {args.baseline.relative_to(ROOT)}: " + ("nothing slower" if not slower else "slower:"))
        for line in slower:
            print(f"  {line}")
    for path in [args.out] + ([args.baseline] if args.write_baseline else []):
        if path is not None:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            tmp.replace(path)
            print(f"wrote {path}")
    return 0 if all(r["exit"] == 0 for r in runs) and not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
