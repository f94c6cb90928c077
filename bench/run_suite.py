"""Time the whole test suite and record the figures (a benchmark, never a test).

    python bench/run_suite.py                                  # -n auto, cold; compare with bench/baseline.json
    python bench/run_suite.py --runs auto 2 1 auto:warm --out bench/results-py311.json
    python bench/run_suite.py --runs auto --write-baseline     # make this machine's figures the baseline

Each run is a fresh pytest process with the cache provider off. A run named
``W`` is cold (no persistent compilation cache; the xdist workers share one for
the run only); ``W:warm`` first fills a persistent cache (QCHECK_XLA_CACHE) with
one run, then times a second. For every run it reports wall time, the XLA
compile requests every process made (counted from JAX's compile log, so cache
hits count too) and how many the persistent cache served, the slowest tests, and
whether any test's outcome differs between runs (worker count and order must
not change a result). Wall times depend on the machine's speed, so a fixed
compile workload is timed first (the calibration) and comparisons with the
baseline are scaled by it.
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


def _outcomes(junit: Path) -> tuple[dict[str, str], dict[str, float]]:
    """Each test's outcome and duration, from pytest's JUnit XML."""
    outcomes, durations = {}, {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcomes[name] = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        durations[name] = float(case.get("time", 0.0))
    return outcomes, durations


def _run(spec: str, extra: list[str]) -> dict:
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
        requests, hits = 0, 0
        for f in counts.glob("*.json"):
            record = json.loads(f.read_text())
            requests += sum(record["requests"].values())
            hits += record["cache_hits"]
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    found = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", tail)}
    slowest = dict(sorted(durations.items(), key=lambda kv: -kv[1])[:15])
    return {"run": spec, "wall_s": round(wall, 2), "exit": done.returncode, "counts": found,
            "compile_requests": requests, "persistent_cache_hits": hits, "summary": tail,
            "slowest": slowest, "outcomes": outcomes}


def _differences(runs: list[dict]) -> list[str]:
    """Tests whose outcome differs between runs (worker count and order must not matter)."""
    base = runs[0]["outcomes"]
    diffs = []
    for r in runs[1:]:
        for test in sorted(set(base) | set(r["outcomes"])):
            a, b = base.get(test, "absent"), r["outcomes"].get(test, "absent")
            if a != b:
                diffs.append(f"{test}: {a} in run {runs[0]['run']}, {b} in run {r['run']}")
    return diffs


def _slower(runs: list[dict], calibration: float, baseline: dict) -> list[str]:
    """What got slower than the baseline, after scaling by the two calibrations (10% and 0.5 s of slack)."""
    scale = baseline["machine"]["calibration_s"] / calibration
    base_runs = {r["run"]: r for r in baseline["runs"]}
    out = []
    for r in runs:
        b = base_runs.get(r["run"])
        if b is None:
            continue
        wall = r["wall_s"] * scale
        if wall > b["wall_s"] * 1.1:
            out.append(f"run {r['run']}: {wall:.1f} s (scaled) against {b['wall_s']:.1f} s")
        if r["compile_requests"] > b.get("compile_requests", r["compile_requests"]):
            out.append(f"run {r['run']}: {r['compile_requests']} compile requests against {b['compile_requests']}")
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

    calibration = _calibrate()
    runs = [_run(spec, args.pytest_args) for spec in args.runs]
    print(f"calibration (fixed compile workload): {calibration} s")
    print(f"{'run':>8}  {'wall s':>7}  {'compiles':>8}  {'cache hits':>10}  exit  summary")
    for r in runs:
        print(f"{r['run']:>8}  {r['wall_s']:>7.2f}  {r['compile_requests']:>8}  "
              f"{r['persistent_cache_hits']:>10}  {r['exit']:>4}  {r['summary']}")
    print("slowest tests (first run):")
    for test, t in runs[0]["slowest"].items():
        print(f"  {t:6.2f} s  {test}")
    diffs = _differences(runs)
    if len(runs) > 1:
        print(f"outcomes identical across runs: {not diffs}")
        for d in diffs:
            print(f"  {d}")
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "calibration_s": calibration},
        "versions": _versions(),
        "runs": [{k: v for k, v in r.items() if k != "outcomes"} for r in runs],
        "outcome_differences": diffs,
    }
    slower = []
    if args.baseline.exists() and not args.write_baseline:
        slower = _slower(runs, calibration, json.loads(args.baseline.read_text()))
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
