"""qcheck's XLA settings: added before JAX starts, never over a flag the user set."""

from pathlib import Path

import pytest

from qcheck.suite import _process

SPLIT = "--xla_cpu_parallel_codegen_split_count"


def _flags(env: dict[str, str]) -> dict[str, str]:
    return dict(f.split("=", 1) for f in env.get("XLA_FLAGS", "").split())


@pytest.mark.parametrize("version", ["0.10.2", "0.12.0.1"])  # the two jaxlibs the suite is run on
def test_both_jaxlibs_get_the_compile_speed_flags(version):
    extra = _process.flags_for(version)
    assert extra[SPLIT] == "1" and extra["--xla_backend_optimization_level"] == "0"


def test_configure_adds_the_flags_for_the_installed_jaxlib():
    env: dict[str, str] = {}
    _process.configure(env, one_thread=False)
    assert _flags(env).items() >= _process.flags_for(_process.jaxlib_version()).items()
    assert "--xla_cpu_multi_thread_eigen" not in _flags(env)


def test_a_flag_the_user_set_keeps_the_users_value():
    env = {"XLA_FLAGS": f"{SPLIT}=8"}
    _process.configure(env, one_thread=False)
    flags = env["XLA_FLAGS"].split()
    assert flags.count(f"{SPLIT}=8") == 1 and f"{SPLIT}=1" not in flags
    assert _flags(env)["--xla_backend_optimization_level"] == "0"  # the others still added


def test_an_xdist_worker_gets_one_intra_op_thread_unless_the_user_chose():
    env = {"PYTEST_XDIST_WORKER": "gw0"}
    _process.configure(env)
    assert _flags(env)["--xla_cpu_multi_thread_eigen"] == "false"
    mine = {"PYTEST_XDIST_WORKER": "gw0", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=true"}
    _process.configure(mine)
    assert _flags(mine)["--xla_cpu_multi_thread_eigen"] == "true"
    assert "intra_op_parallelism_threads=1" not in mine["XLA_FLAGS"]


def test_configure_twice_adds_nothing_the_second_time():
    env: dict[str, str] = {}
    _process.configure(env, one_thread=True)
    once = env["XLA_FLAGS"]
    _process.configure(env, one_thread=True)
    assert env["XLA_FLAGS"] == once


def test_an_accelerator_host_keeps_qcheck_on_the_cpu(monkeypatch):
    import jax

    assert _process.default_platform() == "cpu"  # this host: the default device is left alone
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # as on a GPU node
    try:
        assert _process.default_platform() == "gpu"  # what the layers would run on without it
        _process.default_to_cpu()
        assert jax.config.jax_default_device == jax.devices("cpu")[0]
        assert _process.default_platform() == "cpu"
        assert jax.jit(lambda x: x + 1)(1.0).devices() == {jax.devices("cpu")[0]}
    finally:
        jax.config.update("jax_default_device", None)


# -- the persistent compilation cache: on in qcheck's own processes, off where asked or under CI ---------------


@pytest.mark.parametrize("env, own, want", [
    ({}, True, "USER"),                                   # qcheck's own process, locally: the per-user cache
    ({}, False, None),                                    # the plugin in a user's run: none unless asked
    ({"CI": "true"}, True, None),                         # CI stays cold
    ({"CI": "1"}, True, None),
    ({"CI": "false"}, True, "USER"),
    ({"QCHECK_XLA_CACHE": "0"}, True, None),              # the one variable that turns it off
    ({"QCHECK_XLA_CACHE": "off"}, True, None),
    ({"QCHECK_XLA_CACHE": "/d"}, True, "/d"),             # ... or moves it, under CI too and for the plugin
    ({"QCHECK_XLA_CACHE": "/d", "CI": "true"}, True, "/d"),
    ({"QCHECK_XLA_CACHE": "/d"}, False, "/d"),
    ({"QCHECK_XLA_CACHE": "0"}, False, None),
])
def test_persistent_cache_dir(env, own, want, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path), **env}
    got = _process.persistent_cache_dir(env, default=own)
    assert got == (_process.user_cache_dir(env) if want == "USER" else want)


def test_the_user_cache_is_per_user_and_per_jaxlib(tmp_path):
    path = _process.user_cache_dir({"XDG_CACHE_HOME": str(tmp_path)})
    assert path == str(tmp_path / "qcheck" / "xla" / f"jaxlib-{_process.jaxlib_version()}")


@pytest.fixture
def cache_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(_process, "use_compilation_cache", calls.append)
    monkeypatch.setattr(_process, "default_to_cpu", lambda: None)
    return calls


def test_setup_of_an_own_process_keeps_the_user_cache_and_passes_it_on(cache_calls, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    _process.setup(own=True, worker=False, environ=env)
    assert cache_calls == [_process.user_cache_dir(env)]
    assert env["QCHECK_XLA_CACHE"] == _process.user_cache_dir(env)


def test_setup_under_ci_keeps_no_cache_and_tells_its_children_should_fail(cache_calls, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path), "CI": "true"}
    _process.setup(own=True, worker=False, environ=env)
    assert cache_calls == [] and env["QCHECK_XLA_CACHE"] == "0"
    _process.setup(own=True, worker=False, cache_dir="/run-cache", environ=env)  # a run's own cache still serves
    assert cache_calls == ["/run-cache"]


def test_setup_outside_qcheck_s_own_processes_leaves_the_cache_and_the_environment_alone(cache_calls, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    _process.setup(worker=False, environ=env)
    assert cache_calls == [] and "QCHECK_XLA_CACHE" not in env


@pytest.fixture
def gc_threshold():
    import gc

    before = gc.get_threshold()
    gc.set_threshold(*before[:2], 10)  # CPython's default, whatever this process was given
    yield gc.get_threshold
    gc.set_threshold(*before)


def test_an_own_process_collects_less_garbage(cache_calls, gc_threshold, tmp_path):
    _process.setup(own=True, worker=False, environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert gc_threshold()[2] == _process.FULL_COLLECTION_EVERY


def test_a_users_process_keeps_cpythons_garbage_collection(cache_calls, gc_threshold, tmp_path):
    _process.setup(worker=False, environ={"XDG_CACHE_HOME": str(tmp_path)})  # the plugin's run in a user's pytest
    assert gc_threshold()[2] == 10


def test_the_default_cache_fills_in_a_fresh_qcheck_process(tmp_path):
    """End to end, as the `qcheck` command sets itself up: a compiled program lands in the per-user directory."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("QCHECK_XLA_CACHE", "CI", "XLA_FLAGS")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    probe = ("from qcheck.suite import _process; _process.setup(own=True)\n"
             "import jax; jax.jit(lambda x: x * 3 + 1)(2.0).block_until_ready()\n"
             "print(_process.user_cache_dir())")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    cache = done.stdout.strip()
    assert cache.startswith(str(tmp_path)) and os.listdir(cache), done.stderr


# -- the run cache: a pytest-xdist controller's, for its workers, where no persistent cache is on ----------------


def test_a_controller_makes_a_run_cache_its_workers_read_and_it_removes(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path), "CI": "true"}
    _process.start_run_cache(env, own=True)
    path = env[_process.RUN_CACHE_ENV]
    assert Path(path).is_dir() and _process.run_cache_dir(env) is None  # the controller compiles nothing
    assert _process.run_cache_dir({**env, "PYTEST_XDIST_WORKER": "gw0"}) == path
    _process.end_run_cache(env)
    assert not Path(path).exists() and _process.RUN_CACHE_ENV not in env


def test_a_users_run_gets_a_run_cache_unless_a_persistent_one_is_asked_for(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}  # the plugin in a user's run keeps no persistent cache by default
    _process.start_run_cache(env)
    assert Path(env[_process.RUN_CACHE_ENV]).is_dir()
    _process.end_run_cache(env)
    asked = {"QCHECK_XLA_CACHE": str(tmp_path / "mine")}
    _process.start_run_cache(asked)
    own = {"XDG_CACHE_HOME": str(tmp_path)}  # qcheck's own local runs keep the per-user cache instead
    _process.start_run_cache(own, own=True)
    assert _process.RUN_CACHE_ENV not in asked and _process.RUN_CACHE_ENV not in own


def test_an_inner_run_leaves_the_outer_runs_cache_alone(tmp_path):
    outer = tmp_path / "outer"
    outer.mkdir()
    env = {"CI": "true", _process.RUN_CACHE_ENV: str(outer)}  # a pytester session inside a run
    _process.start_run_cache(env)
    _process.end_run_cache(env)
    assert env[_process.RUN_CACHE_ENV] == str(outer) and outer.is_dir()
