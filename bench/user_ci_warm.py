"""A user's CI run with the compilation cache kept between runs, against one without (a benchmark, never a test).

    python bench/user_ci_warm.py .venv/bin/python [--rounds 2]

Builds the user's project of ``bench/compare.py``'s userflow workload (two plug-in
recipes and their golden cases) in a temporary directory, then runs its suite,
``pytest -n auto --qcheck-recipes=my_recipes.py``, as a CI job would:

* ``first``: with ``QCHECK_XLA_CACHE=DIR`` on an empty DIR (a CI cache miss: the
  first run of a lockfile), which fills DIR;
* then per round a cold run (``CI=true``, no cache asked: the plugin keeps none)
  and a warm one (the filled DIR restored), in alternating order;
* ``truncated``: every file of a copy of DIR cut to half its length, the run that
  must still pass (JAX compiles what it cannot read).

Prints one JSON line per run (wall and CPU seconds of the process tree, pytest's
summary) and the warm/cold ratios of the medians. Stdlib only.
"""

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402 - the userflow workload's project and pytest's summary line


def _run(python: str, project: Path, label: str, cache: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("QCHECK_XLA_CACHE", "QCHECK_RUN_XLA_CACHE")}
    env["CI"] = "true"
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
    if cache is not None:
        env["QCHECK_XLA_CACHE"] = str(cache)
    cmd = [python, "-m", "pytest", "-n", "auto", "-p", "no:cacheprovider", "-q", "--qcheck-recipes=my_recipes.py"]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    found = compare.parse_pytest_summary(done.stdout)
    record = {"run": label, "exit": done.returncode, "wall_s": round(wall, 1),
              "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
              "summary": found[0] if found else done.stdout[-300:]}
    print(json.dumps(record), flush=True)
    return record


def _truncated_copy(cache: Path, into: Path) -> int:
    shutil.copytree(cache, into)
    files = [p for p in into.rglob("*") if p.is_file()]
    for p in files:
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
    return len(files)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("python", help="the Python of a venv with qcheck-jax[test] installed")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    python = str(Path(args.python).absolute())
    work = Path(tempfile.mkdtemp(prefix="qcheck-user-ci-"))
    try:
        project, cache = work / "project", work / "cache"
        compare.user_project(project, Path(python).parent.parent)
        runs = [_run(python, project, "first", cache)]
        cold, warm = [], []
        for rnd in range(args.rounds):
            order = ("cold", "warm") if rnd % 2 == 0 else ("warm", "cold")
            for side in order:
                r = _run(python, project, f"{side} {rnd}", cache if side == "warm" else None)
                runs.append(r)
                (cold if side == "cold" else warm).append(r)
        n = _truncated_copy(cache, work / "truncated")
        runs.append(_run(python, project, f"truncated ({n} files cut to half)", work / "truncated"))
        size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
        summary = {"cache_mb": round(size / 2**20, 1), "all_passed": all(r["exit"] == 0 for r in runs)}
        for key in ("wall_s", "cpu_s"):
            summary[f"warm/cold {key[:-2]}"] = round(statistics.median(r[key] for r in warm)
                                                     / statistics.median(r[key] for r in cold), 2)
        print(json.dumps(summary), flush=True)
        return 0 if summary["all_passed"] else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
