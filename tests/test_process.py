"""qcheck's XLA settings: added before JAX starts, never over a flag the user set."""

import pytest

from qcheck import _process

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
    assert _flags(env).items() >= _process.flags_for(_process._jaxlib_version()).items()
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
