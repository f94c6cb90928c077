"""XLA settings for qcheck's own processes (the test suite and the CLI), applied before JAX starts.

qcheck's programs are tiny, so what costs time is compiling them, not running
them. ``--xla_backend_optimization_level=0`` skips LLVM passes that buy no run
time here: the matrix went from 63 s to 44 s on one process of a 2-core machine.

``--xla_cpu_parallel_codegen_split_count=1`` compiles each program's kernels as
one LLVM module instead of 32 parts compiled in parallel: the parts cost more
CPU than they save wall time on programs this small, and two workers already
fill two cores. Compiling 20 layer programs took 4.0-5.0 s of CPU instead of
5.8-7.0 s, with bitwise-identical outputs; the suite under ``-n auto`` went from
86 / 88 s to 78 / 84 s in interleaved runs.

``--xla_cpu_use_fusion_emitters=false`` halves compile time again on jaxlib
0.10.2, but as a flag it would apply to every program, and those emitters
convert wrongly to fnuz and e2m1 types (nanoo_fp8 layers output NaN; jaxlib
0.12 aborts on the flag as unknown): qcheck's layer programs ask for it one by
one, where it is exact (:mod:`qcheck._fast_jit`).

On a host whose default JAX backend is an accelerator, :func:`default_to_cpu`
keeps qcheck's computations on the CPU: the invariants and golden cases are CPU
numerics, and the hardware-marked tests put their arrays on the accelerator
themselves.

Outputs are deterministic under a fixed setting, but not bitwise identical
across settings; a flag the user already set in ``XLA_FLAGS`` wins. Under
pytest-xdist each worker gets one intra-op thread, so ``-n auto`` does not
oversubscribe the cores. Worker processes inherit the controller's setting.
"""

from __future__ import annotations

import os
from importlib import metadata

#: Opt-in persistent compilation cache shared by every qcheck process and run.
PERSISTENT_CACHE_ENV = "QCHECK_XLA_CACHE"

_ALWAYS = {
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_parallel_codegen_split_count": "1",
    # Eight host CPU devices, so sharded layers run on a real ("data", "expert")
    # mesh in the ordinary run; everything else keeps running on device 0.
    "--xla_force_host_platform_device_count": "8",
}
#: jaxlib version prefix -> flags only that version accepts (an unknown flag aborts).
_BY_JAXLIB: dict[str, dict[str, str]] = {}


def _jaxlib_version() -> str:
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return ""


def flags_for(jaxlib_version: str) -> dict[str, str]:
    """The compile-speed flags qcheck adds for this jaxlib version."""
    extra = dict(_ALWAYS)
    for prefix, flags in _BY_JAXLIB.items():
        if jaxlib_version.startswith(prefix):
            extra.update(flags)
    return extra


def configure(environ=os.environ, *, one_thread: bool | None = None) -> None:
    """Add qcheck's XLA flags to ``environ['XLA_FLAGS']`` unless already named there.

    ``one_thread``: one intra-op thread, for one of several worker processes
    (default: under pytest-xdist).
    """
    flags = environ.get("XLA_FLAGS", "")
    extra = [f"{k}={v}" for k, v in flags_for(_jaxlib_version()).items() if k not in flags]
    if one_thread is None:
        one_thread = bool(environ.get("PYTEST_XDIST_WORKER"))
    if one_thread and "xla_cpu_multi_thread_eigen" not in flags:
        extra += ["--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1"]
    if extra:
        environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def use_compilation_cache(path: str) -> None:
    """Cache every compiled program under ``path`` (JAX's persistent cache), however small or fast.

    Call after importing JAX, before compiling. qcheck's programs each compile
    in well under JAX's default one-second threshold, so the threshold is 0.
    """
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def default_to_cpu() -> None:
    """Run uncommitted computations on the CPU even where an accelerator is JAX's default backend.

    The invariants compare bitwise with host references and golden bits were
    written on the CPU; on a GPU a float32 matmul may use TF32 and fusions round
    differently, so nothing may move there silently. Call after configuring
    XLA, before building layers; a no-op on a CPU-only host.
    """
    import jax

    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_device", jax.devices("cpu")[0])


def default_platform() -> str:
    """The platform uncommitted computations run on: the default device's where one is set, else the backend's."""
    import jax

    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform
