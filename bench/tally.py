"""Per test file: XLA programs compiled, compile seconds, CPU and wall seconds (a benchmark, never a test).

    python bench/tally.py                                   # every test file of qcheck's suite, one at a time
    python bench/tally.py tests/test_formats.py tests/test_referees.py --rounds 2
    python bench/tally.py tests/test_formats.py --json bench/tally.local.json

Each file runs alone, cold (``CI=true``: no persistent compilation cache) and
in one process (``pytest -n 0``), with this interpreter, so a file is charged
every program it needs, also those another file would have compiled first in a
shared worker. Programs are counted in every Python process the file starts
(its subprocesses and spawned workers too) by bench/compile_counter.py,
installed as ``sitecustomize.py`` on PYTHONPATH, not by the code under test.
With ``--rounds N`` the files run round-robin N times; the table shows medians.

Stdlib only: this process imports neither qcheck nor jax.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUITE = ("tests", "qcheck/suite/tests")
_DROPPED_ENV = ("QCHECK_XLA_CACHE", "QCHECK_RUN_XLA_CACHE", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")


def suite_files() -> list[str]:
    return [str(p.relative_to(ROOT)) for d in SUITE for p in sorted((ROOT / d).glob("test_*.py"))]


def run_file(path: str, python: str, site_dir: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="qcheck-tally-") as counts:
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        env.update(CI="true", PYTHONPATH=str(site_dir), QCHECK_BENCH_COMPILE_DIR=counts)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run([python, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q", path],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        tallies = [json.loads(p.read_text()) for p in Path(counts).glob("*.json")]
    lines = done.stdout.strip().splitlines()
    return {"file": path, "exit": done.returncode, "summary": lines[-1] if lines else "",
            "compiles": sum(t["compiles"] for t in tallies),
            "compile_s": round(sum(t["compile_s"] for t in tallies), 2),
            "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 2),
            "wall_s": round(wall, 2), "processes_with_jax": sum(t["jax_imported"] for t in tallies)}


def table(records: list[dict]) -> str:
    by_file: dict[str, list[dict]] = {}
    for r in records:
        by_file.setdefault(r["file"], []).append(r)
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    rows = sorted(by_file.items(), key=lambda kv: -med(kv[1], "compiles"))
    out = [f"{'file':<40} {'programs':>8} {'compile s':>9} {'cpu s':>7} {'wall s':>7} {'procs':>5}  outcome"]
    for name, rs in rows:
        outcome = rs[-1]["summary"] if all(r["exit"] in (0, 5) for r in rs) else f"EXIT {rs[-1]['exit']}: " \
            + rs[-1]["summary"]
        out.append(f"{name:<40} {med(rs, 'compiles'):>8g} {med(rs, 'compile_s'):>9.1f} {med(rs, 'cpu_s'):>7.1f} "
                   f"{med(rs, 'wall_s'):>7.1f} {rs[-1]['processes_with_jax']:>5}  {outcome[:60]}")
    total = {k: sum(med(rs, k) for _, rs in rows) for k in ("compiles", "compile_s", "cpu_s", "wall_s")}
    out.append(f"{'total':<40} {total['compiles']:>8g} {total['compile_s']:>9.1f} {total['cpu_s']:>7.1f} "
               f"{total['wall_s']:>7.1f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="test files (default: every test file of the suite)")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose venv runs the tests")
    p.add_argument("--rounds", type=int, default=1, help="round-robin runs of every file (default: 1)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write every run here")
    args = p.parse_args(argv)
    files = args.files or suite_files()
    if missing := [f for f in files if not (ROOT / f).is_file()]:
        raise SystemExit(f"[tally] files: not found under {ROOT}: {', '.join(missing)}")
    site_dir = Path(tempfile.mkdtemp(prefix="qcheck-tally-site-"))
    records = []
    try:
        shutil.copy(HERE / "compile_counter.py", site_dir / "sitecustomize.py")
        for rnd in range(args.rounds):
            for f in files:
                records.append(run_file(f, args.python, site_dir) | {"round": rnd + 1})
                r = records[-1]
                print(f"[tally] {f} round {rnd + 1}: {r['compiles']} programs, {r['cpu_s']} s CPU, "
                      f"{r['wall_s']} s wall", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(site_dir, ignore_errors=True)
    print(table(records))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0 if all(r["exit"] in (0, 5) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
