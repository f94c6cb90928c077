"""bench/compare.py's pure parts, and its compile counter in a real subprocess (no venvs are made here)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load_compare():
    spec = importlib.util.spec_from_file_location("bench_compare", _BENCH / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare = _load_compare()


@pytest.mark.parametrize(
    ("ref", "new", "ratio", "ratio_min", "ratio_max"),
    [
        ([10.0], [8.0], 0.8, 0.8, 0.8),
        ([10.0, 20.0], [10.0, 10.0], 10.0 / 15.0, 0.5, 1.0),
        # Medians, not means: one slow round does not move the ratio; the spread shows it.
        ([10.0, 10.0, 40.0], [5.0, 20.0, 20.0], 2.0, 0.5, 2.0),
    ],
)
def test_ratio_stats(ref, new, ratio, ratio_min, ratio_max):
    stats = compare.ratio_stats(ref, new)
    assert stats["ratio"] == pytest.approx(ratio, rel=1e-12)
    assert (stats["ratio_min"], stats["ratio_max"]) == pytest.approx((ratio_min, ratio_max), rel=1e-12)


@pytest.mark.parametrize(
    ("ref", "new", "match"),
    [
        ([1.0, 2.0], [1.0], "must pair up by round, got 2 and 1"),
        ([], [], "no rounds to compare"),
        ([0.0], [1.0], "ref times must be positive"),
    ],
)
def test_ratio_stats_rejects(ref, new, match):
    with pytest.raises(ValueError, match=match):
        compare.ratio_stats(ref, new)


@pytest.mark.parametrize(
    ("output", "line", "counts"),
    [
        ("....\n4 passed in 2.54s\n", "4 passed in 2.54s", {"passed": 4}),
        ("FAILED tests/test_a.py::test_x - assert 1\n1 failed, 3 passed, 2 skipped, 1 warning in 65.32s (0:01:05)",
         "1 failed, 3 passed, 2 skipped, 1 warning in 65.32s (0:01:05)",
         {"failed": 1, "passed": 3, "skipped": 2, "warnings": 1}),
        ("==== 2 passed, 1 error in 0.50s ====\n", "2 passed, 1 error in 0.50s", {"passed": 2, "errors": 1}),
        ("no tests ran in 0.01s\n", "no tests ran in 0.01s", {}),
        ("1 xfailed, 3 deselected in 1.00s", "1 xfailed, 3 deselected in 1.00s", {"xfailed": 1, "deselected": 3}),
    ],
)
def test_parse_pytest_summary(output, line, counts):
    assert compare.parse_pytest_summary(output) == (line, counts)


@pytest.mark.parametrize("output", ["", "Traceback (most recent call last):\nImportError: no qcheck\n",
                                    "collected 3 items in the 2 files\n"])
def test_parse_pytest_summary_none_without_a_summary(output):
    assert compare.parse_pytest_summary(output) is None


def _run(workload, side, rnd, wall, exit=0, summary="1 passed in 1s", compiles=7):
    return {"workload": workload, "side": side, "round": rnd, "wall_s": wall, "cpu_s": 2 * wall, "exit": exit,
            "summary": summary, "counts": {"passed": 1} if summary else {}, "compiles": compiles}


def test_summarize_pairs_rounds_and_skips_a_failed_one():
    records = [_run("suite", "ref", 1, 10.0), _run("suite", "new", 1, 5.0),
               _run("suite", "ref", 2, 10.0), _run("suite", "new", 2, 99.0, exit=2, summary=None, compiles=3)]
    row = compare.summarize(records, "suite")
    assert row["rounds_compared"] == 1
    assert row["wall_s"]["ratio"] == 0.5 and row["cpu_s"]["ratio"] == 0.5
    assert row["new_failed_runs"] == ["round 2: exit 2"] and row["new_compiles"] == [3, 7]
    assert compare.table_rows([row])[1][4:6] == ["0.500", "0.500-0.500"]


def test_summarize_marks_a_workload_failed_when_no_round_completed():
    # A tree without `python -m qcheck`: a row saying so, not a crash.
    records = [_run("matrix", "ref", 1, 0.1, exit=1, summary=None), _run("matrix", "new", 1, 30.0)]
    cells = compare.table_rows([compare.summarize(records, "matrix")])
    assert cells[1][:2] == ["matrix", "FAILED"] and cells[1][5] == "ref: round 1: exit 1"
    assert compare.format_markdown(cells).splitlines()[2].startswith("| matrix | FAILED |")


def test_runs_are_cold_unless_warm_new_names_a_cache(tmp_path, monkeypatch):
    # A cache the caller's shell names must not warm either side; --warm-new's must reach the run.
    monkeypatch.setenv("QCHECK_XLA_CACHE", str(tmp_path / "callers"))
    cold = compare.run_env(tmp_path / "venv", tmp_path / "site", tmp_path / "counts")
    warm = compare.run_env(tmp_path / "venv", tmp_path / "site", tmp_path / "counts", tmp_path / "filled")
    assert "QCHECK_XLA_CACHE" not in cold and cold["CI"] == "true"
    assert warm["QCHECK_XLA_CACHE"] == str(tmp_path / "filled") and warm["CI"] == "true"


def test_warm_only_keeps_the_named_programs_entries_and_no_other(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    names = ["jit_train_step_program-ab12-cache", "jit__program-cd34-cache", "jit_train_step_program_b-ef56-cache",
             "jit__apply-0011-cache", "jit_train_step_program-ab12-atime"]
    for name in names:
        (cache / name).write_bytes(name.encode())
    assert compare.keep_programs(cache, tmp_path / "kept", ["train_step_program", "_program"]) == 3
    assert sorted(e.name for e in (tmp_path / "kept").iterdir()) == sorted(names[i] for i in (0, 1, 4))
    assert (tmp_path / "kept" / names[0]).read_bytes() == names[0].encode()


def test_warm_only_refuses_a_name_the_cache_holds_no_program_of(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("jit_train_step_program-ab12-cache", "jit__apply-0011-cache"):
        (cache / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"^--warm-only: the filled cache holds no program of train_step; "
                                         r"it holds programs of: _apply, train_step_program$"):
        compare.keep_programs(cache, tmp_path / "kept", ["train_step_program", "train_step"])
    assert not (tmp_path / "kept").exists()


@pytest.mark.parametrize(("argv", "match"), [
    (["--ref", "main", "--only", "suite,bogus"], r"unknown workload\(s\) \['bogus'\]; valid: suite, matrix, userflow"),
    (["--ref", "main", "--rounds", "0"], r"--rounds takes a positive integer, got '0'"),
    (["--ref", "main", "--warm-new", "--warm-only", "jit(train)"], r"--warm-only takes jitted functions' names"),
])
def test_bad_arguments_are_named(argv, match, capsys):
    with pytest.raises(SystemExit):
        compare._parser().parse_args(argv)
    assert re.search(match, capsys.readouterr().err)


def test_warm_only_without_warm_new_is_refused(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--ref", "HEAD", "--warm-only", "train_step_program"])
    assert "--warm-only needs --warm-new" in capsys.readouterr().err


# Two programs from numpy inputs: nothing else (no jnp.arange, whose iota is a program too) compiles.
_TWO_PROGRAMS = """
import numpy as np
import jax
x = np.ones(4, np.float32)
jax.jit(lambda a: a * 2)(x).block_until_ready()
jax.jit(lambda a: a + 1)(x).block_until_ready()
"""


def _counted(tmp_path: Path, script: str, **extra_env: str) -> tuple[list[dict], str]:
    site, out = tmp_path / "site", tmp_path / "out"
    site.mkdir()
    out.mkdir()
    shutil.copy(_BENCH / "compile_counter.py", site / "sitecustomize.py")
    env = {**os.environ, "PYTHONPATH": str(site), compare.COMPILE_DIR_ENV: str(out), "JAX_PLATFORMS": "cpu",
           **extra_env}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(p.read_text()) for p in out.glob("*.json")], done.stderr


def test_compile_counter_counts_what_jax_logs(tmp_path):
    tallies, log = _counted(tmp_path, _TWO_PROGRAMS, JAX_LOG_COMPILES="1")
    assert [t["compiles"] for t in tallies] == [2]
    assert log.count("Finished XLA compilation of jit(<lambda>)") == 2  # JAX's own account agrees


def test_compile_counter_writes_zero_without_jax(tmp_path):
    tallies, _ = _counted(tmp_path, "print('no jax here')")
    assert tallies == [{"compiles": 0, "compile_s": 0, "argv": ["-c"], "jax_imported": False}]


def test_compile_counter_is_off_without_its_directory(tmp_path):
    tallies, _ = _counted(tmp_path, "print('off')", **{compare.COMPILE_DIR_ENV: ""})
    assert tallies == []


# A process that never runs its exit handlers (os._exit, a killed xdist worker): two
# compilations a second apart, each written as it happens.
_EXITS_ABRUPTLY = """
import os, time
import numpy as np
{setup}
import jax
jax.jit(lambda a: a + 1)(np.ones(2, np.float32)).block_until_ready()
time.sleep(1.05)
jax.jit(lambda a: a * 3)(np.ones(2, np.float32)).block_until_ready()
os._exit(0)
"""


def test_compile_counter_keeps_the_count_of_a_process_that_skips_its_exit_handlers(tmp_path):
    tallies, _ = _counted(tmp_path, _EXITS_ABRUPTLY.format(setup=""))
    assert [t["compiles"] for t in tallies] == [2]


def test_compile_counter_writing_only_at_exit_loses_that_count(tmp_path):
    # The control: with the writes while compiling held off, nothing is left.
    hold = "import sitecustomize; sitecustomize.FLUSH_EVERY_S = float('inf'); sitecustomize._last_flush[0] = 0.0"
    tallies, _ = _counted(tmp_path, _EXITS_ABRUPTLY.format(setup=hold))
    assert tallies == []


# The matrix's workers are spawned processes: each must leave its own count.
_SPAWNED = """
import multiprocessing
import numpy as np

def child():
    import jax
    jax.jit(lambda a: a - 1)(np.ones(2, np.float32)).block_until_ready()

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child)
    p.start()
    p.join()
    assert p.exitcode == 0
"""


def test_compile_counter_counts_in_spawned_workers(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(_SPAWNED)
    tallies, _ = _counted(tmp_path, f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    # The parent, the worker, and multiprocessing's resource tracker: only the worker imported jax.
    assert [t["compiles"] for t in tallies if t["jax_imported"]] == [1]
    assert sum(t["compiles"] for t in tallies) == 1 and len(tallies) >= 2


def test_a_run_that_cannot_start_is_a_failed_record(tmp_path):
    record = compare.run_once("matrix", "ref", 1, tmp_path, tmp_path / "no-venv", tmp_path, [])
    assert record["exit"] is None and record["error"].startswith("could not start: ")
    assert not compare.completed(record)


def test_the_userflow_runs_the_suite_on_the_users_two_recipes_from_their_project(tmp_path):
    cmd = compare.command("userflow", tmp_path / "venv", ["-x"])
    assert cmd[:3] == [str(tmp_path / "venv" / "bin" / "python"), "-m", "pytest"] and "-n" in cmd
    assert "--qcheck-recipes=my_recipes.py" in cmd and cmd[-1] == "-x"
    registered = re.findall(r'Recipe\("(\w+)"', compare.USER_RECIPES)
    assert tuple(registered) == compare.USER_RECIPE_NAMES and len(registered) == 2


def test_a_kept_env_is_reused_without_running_pip(tmp_path):
    venv = tmp_path / "ref-abc-py3.11.7"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / ".bench-ready").write_text("{}")
    assert compare.ensure_env(venv, tmp_path, "/nonexistent/python") is True


# -- bench/tally.py: the per-file tally ---------------------------------------------------------


def _load_bench(name: str):
    """A bench/ script as a module (bench/ is no package: its scripts run as files)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", _BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_tally():
    return _load_bench("tally")


def test_tally_lists_every_test_file_of_the_suite():
    tally = _load_tally()
    files = tally.suite_files()
    assert "tests/test_bench_compare.py" in files and "qcheck/suite/tests/test_golden_cases.py" in files
    assert all(Path(f).name.startswith("test_") for f in files)


def test_tally_table_takes_medians_and_flags_a_failed_file():
    tally = _load_tally()
    run = dict(compile_s=1.0, cpu_s=2.0, wall_s=3.0, processes_with_jax=1, summary="3 passed in 1s")
    records = [dict(run, file="a", exit=0, compiles=10), dict(run, file="a", exit=0, compiles=30),
               dict(run, file="a", exit=0, compiles=14), dict(run, file="b", exit=1, compiles=5, summary="1 failed")]
    lines = tally.table(records).splitlines()
    assert lines[1].split()[:2] == ["a", "14"] and lines[1].endswith("3 passed in 1s")  # most programs first
    assert lines[2].split()[:2] == ["b", "5"] and "EXIT 1: 1 failed" in lines[2]
    assert lines[3].split()[:2] == ["total", "19"]


def test_tally_names_a_missing_file():
    with pytest.raises(SystemExit, match=r"\[tally\] files: not found under .*: tests/test_nothing\.py"):
        _load_tally().main(["tests/test_nothing.py"])


# -- bench/check_layer_floor.py: check_layer against the compile floor ---------------------------


def _load_floor():
    return _load_bench("check_layer_floor")


def test_floor_ratios_are_per_round_against_that_rounds_floor_and_skip_failed_runs():
    floor = _load_floor()
    runs = [("floor", 1, 2.0), ("new", 1, 3.0), ("floor", 2, 4.0), ("new", 2, 5.0), ("floor", 3, 1.0)]
    records = [dict(side=s, round=n, cell="c", seconds=t, compiles=2, traces=4) for s, n, t in runs]
    records.append(dict(side="new", round=3, cell="c", error="exit 1: boom"))  # a failed run: no ratio
    row = floor.summarize(records, "c", ["floor", "new"])
    assert row["new"]["ratios"] == [1.5, 1.25] and row["new"]["median_ratio"] == 1.375
    assert row["floor"]["median_s"] == 2.0 and row["new"]["failed"] == 1 and row["floor"]["failed"] == 0
    line = floor.table([row], ["floor", "new"]).splitlines()[1].split()
    assert line[:5] == ["c", "2.0", "1.375", "1.50", "1.25"]
