"""Time a reference commit against the working tree, interleaved (a benchmark, never a test).

    python bench/compare.py --ref main                                   # suite and matrix, 2 rounds
    python bench/compare.py --ref main --python python3.12 --rounds 3 --keep-envs ~/.cache/qcheck-bench \\
        --json bench/compare.local.json --markdown
    python bench/compare.py --ref HEAD~1 --only suite --pytest-args "tests/test_formats.py"
    python bench/compare.py --ref 17e2bd7 --warm-new                      # the tree with compilation free
    python bench/compare.py --ref d5f0783 --only userflow --rounds 3       # a user's project, from wheels

This machine's speed drifts by a third within an hour, so two figures taken
minutes apart say little about a change. This script checks REF out into a
temporary git worktree, gives it and the working tree a venv each (same
interpreter, ``pip install -e '.[test]'``), then runs every workload
ref, new, ref, new, ... and judges the change by the per-round ratios.

Workloads, each run cold in its own tree with its own venv (QCHECK_XLA_CACHE
unset and CI=true, which turns off the per-user compilation cache qcheck's own
processes otherwise keep; everything else the same for both sides):
  suite   pytest -n auto -p no:cacheprovider -q [--pytest-args]
  matrix  python -m qcheck
  userflow  a user's project from nothing, as .ci/wheel_flow.sh builds it: each side's
          wheel installed into its own venv (not editable: an editable checkout puts
          qcheck's own conftest above the suite it collects), a module registering two
          plug-in recipes (USER_RECIPES), their golden cases made by that side's
          `qcheck golden add` (untimed); timed: pytest -n auto -p no:cacheprovider -q
          --qcheck-recipes=my_recipes.py in that project

Per run: wall time, CPU time of the process tree (getrusage(RUSAGE_CHILDREN)
deltas), exit status, pytest's summary counts, and the XLA compilations of every
Python process, counted by bench/compile_counter.py (installed as
sitecustomize.py on PYTHONPATH), not by the code under test. A round's ratios
count only when both sides completed: exit 0, or for the suite, exit 1 with a
summary line (tests failed, but the session ran to the end).

--warm-new asks what the working tree costs when XLA compiles nothing: before
the rounds, one untimed run of each workload fills a compilation cache, and
every timed run of the new side then reads its programs from it
(QCHECK_XLA_CACHE=DIR). The programs are still traced and lowered; only
their compilation is free. The ref side stays cold. The ratio is then a
floor: no change to compile time alone can bring the tree below it.

--warm-only NAME[,NAME] (with --warm-new) serves only those jitted functions'
programs from the filled cache (entries named jit_NAME-...) and compiles the
rest: what the tree would cost if those programs were free, e.g. a bound on
merging one program into another. Each timed run gets the kept entries afresh
at the same path (JAX's cache keys depend on it), so what one run compiles
does not warm the next.

Stdlib only: this process imports neither qcheck nor jax.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = ("suite", "matrix", "userflow")
#: The user's project of the userflow workload: two plug-in recipes, as a quantization engineer writes them.
USER_RECIPES = """import qcheck

qcheck.register_recipe(qcheck.Recipe("my_e5m2", lhs="e5m2_current", rhs="e5m2_current"))
qcheck.register_recipe(qcheck.Recipe("my_e4m3", lhs="e4m3fn_current", rhs="e4m3fn_current"))
"""
USER_RECIPE_NAMES = ("my_e5m2", "my_e4m3")
SIDES = ("ref", "new")
COMPILE_DIR_ENV = "QCHECK_BENCH_COMPILE_DIR"
# Variables that would make one side's runs differ from the other's or warm: the
# persistent compilation cache and the run-scoped cache of a pytest controller.
_DROPPED_ENV = ("QCHECK_XLA_CACHE", "QCHECK_RUN_XLA_CACHE", "PYTHONHOME", "VIRTUAL_ENV")

# "1 failed, 3 passed, 2 skipped, 1 warning in 3.10s" (pytest -q), also inside "=== ... ===".
_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+|no tests ran) in [\d.]+s\b.*$")
_COUNT = re.compile(r"(\d+) (\w+)")
_PLURAL = {"error": "errors", "warning": "warnings"}


# ----------------------------------------------------------------- pure parts


def parse_pytest_summary(output: str) -> tuple[str, dict[str, int]] | None:
    """pytest's final summary line in ``output`` and its counts (``errors``/``warnings`` always plural).

    None when there is no summary line: pytest did not get to the end of a session.
    """
    for line in reversed(output.strip().splitlines()):
        m = _SUMMARY.match(line.strip())
        if m:
            counts = {_PLURAL.get(k, k): int(n) for n, k in _COUNT.findall(m.group(1))}
            return line.strip().strip("= "), counts
    return None


def ratio_stats(ref: list[float], new: list[float]) -> dict[str, float]:
    """Medians per side, the ratio new/ref of the medians, and its spread: min and max of new_i / ref_i.

    ``ref[i]`` and ``new[i]`` are round i's paired runs.
    """
    if len(ref) != len(new):
        raise ValueError(f"ratio_stats: ref and new must pair up by round, got {len(ref)} and {len(new)} runs")
    if not ref:
        raise ValueError("ratio_stats: no rounds to compare (ref and new are empty)")
    if min(ref) <= 0:
        raise ValueError(f"ratio_stats: ref times must be positive, got {ref}")
    per_round = [n / r for r, n in zip(ref, new)]
    ref_median, new_median = statistics.median(ref), statistics.median(new)
    return {"ref_median": ref_median, "new_median": new_median, "ratio": new_median / ref_median,
            "ratio_min": min(per_round), "ratio_max": max(per_round)}


def completed(record: dict) -> bool:
    """Whether a run's time means something: it ran to the end (see the module docstring)."""
    if record["exit"] == 0:
        return True
    return record["workload"] in ("suite", "userflow") and record["exit"] == 1 and record.get("summary") is not None


def summarize(records: list[dict], workload: str) -> dict:
    """One workload's row of the table from its per-round records of both sides."""
    by = {side: sorted((r for r in records if r["workload"] == workload and r["side"] == side),
                       key=lambda r: r["round"]) for side in SIDES}
    pairs = [(a, b) for a, b in zip(by["ref"], by["new"]) if completed(a) and completed(b)]
    row: dict = {"workload": workload, "rounds": len(by["ref"]), "rounds_compared": len(pairs)}
    for side in SIDES:
        runs = by[side]
        row[f"{side}_failed_runs"] = [f"round {r['round']}: exit {r['exit']}" for r in runs if not completed(r)]
        compiles = sorted({r["compiles"] for r in runs if r["compiles"] is not None})
        row[f"{side}_compiles"] = compiles
        tests = [r["counts"] for r in runs if r.get("counts")]
        row[f"{side}_tests"] = tests[-1] if tests else {}
    if pairs:
        for figure in ("wall_s", "cpu_s"):
            stats = ratio_stats([a[figure] for a, _ in pairs], [b[figure] for _, b in pairs])
            row[figure] = {k: round(v, 3) for k, v in stats.items()}
    return row


def _compiles_text(values: list[int]) -> str:
    return "-" if not values else str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _tests_text(counts: dict[str, int]) -> str:
    keys = ("passed", "failed", "errors", "skipped", "xfailed")
    return " ".join(f"{counts[k]}{k[0] if k != 'errors' else 'E'}" for k in keys if counts.get(k)) or "-"


def table_rows(rows: list[dict]) -> list[list[str]]:
    """The table as text cells, a header first (shared by the plain and the markdown output)."""
    out = [["workload", "figure", "ref median", "new median", "new/ref", "spread", "ref compiles",
            "new compiles", "ref tests", "new tests"]]
    for row in rows:
        tail = [_compiles_text(row["ref_compiles"]), _compiles_text(row["new_compiles"]),
                _tests_text(row["ref_tests"]), _tests_text(row["new_tests"])]
        if "wall_s" not in row:
            why = "; ".join(f"{s}: {', '.join(row[f'{s}_failed_runs'])}" for s in SIDES if row[f"{s}_failed_runs"])
            out.append([row["workload"], "FAILED", "-", "-", "-", why or "no completed round", *tail])
            continue
        for figure in ("wall_s", "cpu_s"):
            s = row[figure]
            out.append([row["workload"], figure, f"{s['ref_median']:.2f}", f"{s['new_median']:.2f}",
                        f"{s['ratio']:.3f}", f"{s['ratio_min']:.3f}-{s['ratio_max']:.3f}", *tail])
    return out


def format_plain(cells: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def format_markdown(cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in cells[1:]]
    return "\n".join(lines)


# ------------------------------------------------------------ trees and envs


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def _python_version(python: str) -> str:
    run = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                         capture_output=True, text=True)
    if run.returncode:  # a pyenv shim for a version that is not selected is on PATH, and exits 127
        said = run.stderr.strip().splitlines() or [f"exit {run.returncode}"]
        raise SystemExit(f"[compare] --python: {python} does not run: {said[0]}")
    return run.stdout.strip()


_VERSIONS = """
import json, platform
from importlib import metadata
out = {"python": platform.python_version()}
for pkg in ("jax", "jaxlib", "flax", "ml_dtypes", "numpy", "pytest", "pytest-xdist"):
    try:
        out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
        out[pkg] = "absent"
print(json.dumps(out))
"""


def env_versions(venv: Path) -> dict[str, str]:
    """Package versions of a venv, from its metadata (nothing is imported)."""
    done = subprocess.run([str(venv / "bin" / "python"), "-c", _VERSIONS], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()[-300:]}


def ensure_env(venv: Path, tree: Path, python: str, extras: str = "test") -> bool:
    """A venv at ``venv`` with ``tree`` installed editable with ``extras``; True when reused.

    An extra the tree does not define (an older commit's) is ignored by pip with a warning.
    """
    ready = venv / ".bench-ready"
    if ready.exists() and (venv / "bin" / "python").exists():
        return True
    shutil.rmtree(venv, ignore_errors=True)
    print(f"[compare] creating {venv} for {tree} ...", flush=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-e", f".[{extras}]"],
                          cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"[compare] pip install -e '.[{extras}]' failed in {tree}:\n{done.stderr[-2000:]}")
    ready.write_text(json.dumps({"tree": str(tree), "python": python}))
    return False


def ensure_wheel_env(venv: Path, tree: Path, python: str, extras: str = "test") -> bool:
    """A venv at ``venv`` with ``tree`` installed as users get it, from a wheel; True when the venv was reused.

    qcheck itself is rebuilt and reinstalled on every call (the working tree may have changed since the venv
    was made); its dependencies are installed once.
    """
    ready = venv / ".bench-ready"
    reused = ready.exists() and (venv / "bin" / "python").exists()
    if not reused:
        shutil.rmtree(venv, ignore_errors=True)
        print(f"[compare] creating {venv} for a wheel of {tree} ...", flush=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    for args in ([] if reused else [f"{tree}[{extras}]"], ["--no-deps", "--force-reinstall", str(tree)]):
        if not args:
            continue
        done = subprocess.run([*pip, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"[compare] pip install {shlex.join(args)} failed:\n{done.stderr[-2000:]}")
    ready.write_text(json.dumps({"tree": str(tree), "python": python, "wheel": True}))
    return reused


def user_project(project: Path, venv: Path) -> None:
    """The userflow workload's project at ``project``: USER_RECIPES and golden cases made by ``venv``'s qcheck."""
    shutil.rmtree(project, ignore_errors=True)
    project.mkdir(parents=True)
    (project / "my_recipes.py").write_text(USER_RECIPES)
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    for name in USER_RECIPE_NAMES:
        done = subprocess.run([str(venv / "bin" / "qcheck"), "golden", "add", name, "--recipes", "my_recipes.py"],
                              cwd=project, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"[compare] qcheck golden add {name} failed in {project}:\n{done.stderr[-2000:]}")


def _remove_worktree(root: Path, path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=root, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=root, capture_output=True)


def machine() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"nproc": usable, "cpu_count": os.cpu_count(), "cpu_model": model, "system": platform.platform()}


# -------------------------------------------------------------------- runs


def run_env(venv: Path, site_dir: Path, count_dir: Path, cache_dir: Path | None = None) -> dict[str, str]:
    """The environment of one run: cold, unless ``cache_dir`` names a compilation cache to read (--warm-new)."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env["PYTHONPATH"] = str(site_dir)  # the compile counter only; nothing of either tree
    env[COMPILE_DIR_ENV] = str(count_dir)
    env["VIRTUAL_ENV"] = str(venv)
    # Cold: a tree with the per-user compilation cache turns it off under CI (QCHECK_XLA_CACHE=0 would too, but
    # an older tree would take "0" for a directory and keep a warm cache in it).
    env["CI"] = "true"
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if cache_dir is not None:  # an explicit directory wins over CI=true in every tree that knows the variable
        env["QCHECK_XLA_CACHE"] = str(cache_dir)
    return env


def command(workload: str, venv: Path, pytest_args: list[str]) -> list[str]:
    python = str(venv / "bin" / "python")
    if workload == "suite":
        return [python, "-m", "pytest", "-n", "auto", "-p", "no:cacheprovider", "-q", *pytest_args]
    if workload == "userflow":
        return [python, "-m", "pytest", "-n", "auto", "-p", "no:cacheprovider", "-q", "--qcheck-recipes=my_recipes.py",
                *pytest_args]
    return [python, "-m", "qcheck"]


def run_once(workload: str, side: str, rnd: int, tree: Path, venv: Path, site_dir: Path,
             pytest_args: list[str], cache_dir: Path | None = None) -> dict:
    """One timed run in ``tree`` with ``venv``, cold unless ``cache_dir``; a run that cannot start is a record."""
    record: dict = {"workload": workload, "side": side, "round": rnd, "exit": None, "wall_s": None,
                    "cpu_s": None, "summary": None, "counts": {}, "compiles": None, "processes": 0,
                    "warm": cache_dir is not None}
    with tempfile.TemporaryDirectory(prefix="qcheck-bench-counts-") as count_dir:
        cmd = command(workload, venv, pytest_args)
        record["command"] = shlex.join(cmd)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=tree, env=run_env(venv, site_dir, Path(count_dir), cache_dir),
                                  capture_output=True, text=True)
        except OSError as e:
            record["error"] = f"could not start: {e}"
            return record
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        tallies = [json.loads(p.read_text()) for p in Path(count_dir).glob("*.json")]
    record.update(exit=done.returncode, wall_s=round(wall, 3),
                  cpu_s=round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 3),
                  compiles=sum(t["compiles"] for t in tallies),
                  compile_s=round(sum(t["compile_s"] for t in tallies), 2),
                  processes=len(tallies), processes_with_jax=sum(t["jax_imported"] for t in tallies))
    text = done.stdout + "\n" + done.stderr
    if workload in ("suite", "userflow") and (found := parse_pytest_summary(done.stdout)):
        record["summary"], record["counts"] = found
    elif workload == "matrix":
        record["summary"] = (done.stdout.strip().splitlines() or [""])[-1][:200]
    if done.returncode != 0:
        record["output_tail"] = text.strip()[-1500:]
    return record


def _progress(r: dict) -> str:
    if r["wall_s"] is None:
        return f"[compare] round {r['round']} {r['workload']:6} {r['side']}: FAILED, {r.get('error')}"
    status = "ok" if completed(r) else f"FAILED (exit {r['exit']})"
    return (f"[compare] round {r['round']} {r['workload']:6} {r['side']}: wall {r['wall_s']:.2f} s, "
            f"cpu {r['cpu_s']:.2f} s, {r['compiles']} compiles in {r['processes']} processes, {status}"
            f"{', ' + r['summary'] if r['summary'] else ''}")


# -------------------------------------------------------------------- main


def _only(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--only: unknown workload(s) {unknown or [text]}; valid: {', '.join(WORKLOADS)}")
    return names


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names):
        raise argparse.ArgumentTypeError(f"--warm-only takes jitted functions' names, comma-separated, got {text!r}")
    return names


def keep_programs(cache: Path, kept: Path, names: list[str]) -> int:
    """Copy the entries of the compilation cache ``cache`` that hold programs of jitted ``names`` to ``kept``.

    A name no entry holds is a ValueError naming the functions the cache does hold: a misspelt name would
    otherwise time a cold run as if it were the bound asked for.
    """
    held = {e.name.removeprefix("jit_").split("-")[0] for e in cache.iterdir() if e.name.startswith("jit_")}
    if missing := [n for n in names if n not in held]:
        raise ValueError(f"--warm-only: the filled cache holds no program of {', '.join(missing)}; "
                         f"it holds programs of: {', '.join(sorted(held))}")
    kept.mkdir(parents=True)
    entries = [e for e in cache.iterdir() if any(e.name.startswith(f"jit_{n}-") for n in names)]
    for entry in entries:
        (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, kept / entry.name)
    return len(entries)


def _restore(kept: Path, cache: Path) -> None:
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(kept, cache)


def _rounds(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--rounds takes a positive integer, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", required=True, help="the reference: any commit-ish (main, HEAD~1, a sha)")
    p.add_argument("--python", default="python3", help="interpreter for both venvs (default: python3)")
    p.add_argument("--rounds", type=_rounds, default=2, help="rounds of ref, new (default: 2)")
    p.add_argument("--only", type=_only, default=list(WORKLOADS), metavar="W[,W]",
                   help=f"workloads to run (default: {','.join(WORKLOADS)})")
    p.add_argument("--extras", default="test", metavar="E[,E]",
                   help="extras installed on both sides (default: test); e.g. test,aqt,qwix")
    p.add_argument("--pytest-args", default="", metavar="ARGS", help="extra pytest arguments, one shell-quoted string")
    p.add_argument("--keep-envs", type=Path, metavar="DIR",
                   help="keep the venvs here, keyed by commit (the tree's: by path) and python, to reuse them")
    p.add_argument("--json", type=Path, metavar="FILE", help="write runs, table, versions and machine here")
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    p.add_argument("--warm-new", action="store_true",
                   help="time the working tree with every program read from a compilation cache filled first")
    p.add_argument("--warm-only", type=_names, metavar="NAME[,NAME]",
                   help="with --warm-new: only these jitted functions' programs come from the cache")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.warm_only and not args.warm_new:
        parser.error("--warm-only needs --warm-new")
    root = Path(_git(HERE, "rev-parse", "--show-toplevel"))
    try:
        ref_sha = _git(root, "rev-parse", "--verify", f"{args.ref}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"[compare] --ref: {args.ref!r} is not a commit in {root}")
    python = shutil.which(args.python)
    if python is None:
        raise SystemExit(f"[compare] --python: {args.python!r} not found on PATH")
    py_version = _python_version(python)
    pytest_args = shlex.split(args.pytest_args)

    scratch = Path(tempfile.mkdtemp(prefix="qcheck-bench-"))
    envs = args.keep_envs.expanduser().resolve() if args.keep_envs else scratch / "envs"
    envs.mkdir(parents=True, exist_ok=True)
    # Under --keep-envs the ref's checkout has a fixed path per commit: its reused
    # venv's editable install points there.
    ref_tree = envs / f"src-{ref_sha[:12]}" if args.keep_envs else scratch / "ref"
    tree_key = hashlib.sha1(str(root).encode()).hexdigest()[:10]
    # The tree's pyproject is in the key: a changed entry point needs a fresh install.
    pyproject = hashlib.sha1((root / "pyproject.toml").read_bytes()).hexdigest()[:8]
    extras_key = args.extras.replace(",", "+")
    venvs = {"ref": envs / f"ref-{ref_sha[:12]}-py{py_version}-{extras_key}",
             "new": envs / f"tree-{tree_key}-{pyproject}-py{py_version}-{extras_key}"}
    trees = {"ref": ref_tree, "new": root}
    site_dir = scratch / "site"
    site_dir.mkdir()
    shutil.copy(HERE / "compile_counter.py", site_dir / "sitecustomize.py")
    records: list[dict] = []
    fills: list[dict] = []
    try:
        _remove_worktree(root, ref_tree)  # a checkout left by an interrupted run
        _git(root, "worktree", "add", "--detach", str(ref_tree), ref_sha)
        # Where each workload runs on each side: a checkout with its editable venv, or a user's project.
        where: dict[tuple[str, str], tuple[Path, Path]] = {}
        versions: dict[str, dict] = {}
        for side in SIDES:
            if set(args.only) - {"userflow"}:
                reused = ensure_env(venvs[side], trees[side], python, args.extras)
                versions[side] = env_versions(venvs[side])
                print(f"[compare] {side}: {trees[side]}, venv {venvs[side]} ({'reused' if reused else 'new'}), "
                      f"{versions[side]}", flush=True)
                where.update({(w, side): (trees[side], venvs[side]) for w in args.only if w != "userflow"})
            if "userflow" in args.only:
                wheel_venv = venvs[side].with_name("wheel-" + venvs[side].name)
                reused = ensure_wheel_env(wheel_venv, trees[side], python, args.extras)
                project = scratch / f"project-{side}"
                user_project(project, wheel_venv)
                versions[f"{side} wheel"] = env_versions(wheel_venv)
                print(f"[compare] {side}: a project at {project}, a wheel of {trees[side]} in {wheel_venv} "
                      f"({'reused' if reused else 'new'}), {versions[f'{side} wheel']}", flush=True)
                where["userflow", side] = (project, wheel_venv)
        warm = {"ref": None, "new": scratch / "warm-cache" if args.warm_new else None}
        for workload in args.only if args.warm_new else ():
            fills.append(run_once(workload, "new", 0, *where[workload, "new"], site_dir, pytest_args, warm["new"]))
            print(_progress(fills[-1]).replace("round 0", "filling the cache,"), flush=True)
        kept = scratch / "warm-kept" if args.warm_only else None
        if kept is not None:
            try:
                count = keep_programs(warm["new"], kept, args.warm_only)
            except ValueError as e:
                raise SystemExit(f"[compare] {e}") from None
            print(f"[compare] the cache serves {count} programs of {', '.join(args.warm_only)}", flush=True)
        for rnd in range(1, args.rounds + 1):
            for workload in args.only:
                for side in SIDES:
                    if side == "new" and kept is not None:
                        _restore(kept, warm["new"])
                    records.append(run_once(workload, side, rnd, *where[workload, side], site_dir, pytest_args,
                                            warm[side]))
                    print(_progress(records[-1]), flush=True)
    finally:
        _remove_worktree(root, ref_tree)
        shutil.rmtree(scratch, ignore_errors=True)

    rows = [summarize(records, w) for w in args.only]
    cells = table_rows(rows)
    new_is = ("working tree, its compilations read from a filled cache" if args.warm_new else "working tree") + (
        f" (only {', '.join(args.warm_only)})" if args.warm_only else "")
    print(f"\nref {args.ref} ({ref_sha[:12]}) vs {new_is}, {args.rounds} round(s), Python {py_version}; "
          "new/ref: ratio of medians, spread: min-max of per-round ratios")
    print(format_plain(cells))
    if args.markdown:
        print("\n" + format_markdown(cells))
    if args.json:
        head = _git(root, "rev-parse", "HEAD")
        dirty = bool(_git(root, "status", "--porcelain"))
        report = {"ref": {"arg": args.ref, "commit": ref_sha}, "new": {"path": str(root), "head": head, "dirty": dirty},
                  "python": python, "rounds": args.rounds, "pytest_args": pytest_args, "machine": machine(),
                  "versions": versions, "warm_new": args.warm_new, "warm_only": args.warm_only, "summary": rows,
                  "runs": records, "fills": fills}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"[compare] wrote {args.json}")
    return 0 if all("wall_s" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
