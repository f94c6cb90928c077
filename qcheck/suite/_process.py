"""Setup of qcheck's own processes (the test suite, the CLI, the matrix workers, the plugin's suite runs).

Nothing here runs in a process that merely imports qcheck: the library
compiles with JAX's defaults. :func:`setup` is the one entry point; it must run
before JAX starts a backend.

- ``--xla_force_host_platform_device_count=8``: the sharded invariant runs every
  layer on a real ("data", "expert") = 2 x 4 mesh of host CPU devices.
- ``--xla_backend_optimization_level=0``: qcheck's programs are tiny, so what
  costs time is compiling them; LLVM's optimization passes buy no run time here.
- ``--xla_cpu_parallel_codegen_split_count=1``: one LLVM module per program
  instead of parts compiled in parallel, which cost more CPU than they save on
  programs this small when worker processes already fill the cores.
- one intra-op thread per worker process, so ``-n auto`` does not oversubscribe.
- on a host whose default backend is an accelerator, uncommitted computations
  stay on the CPU: the invariants and golden cases are CPU numerics, and the
  hardware-marked tests put their arrays on the accelerator themselves.
- fewer full garbage collections (:func:`collect_less`), in qcheck's own
  processes and the matrix's workers only: a long-lived qcheck process's heap
  grows to half a million objects and more (JAX's and Flax's caches, the
  cached layers), and CPython's default rescans all of it every tenth
  second-generation pass.
- JAX's persistent compilation cache: in qcheck's own processes (the ``qcheck``
  command and its workers, qcheck's own test suite) by default in a per-user
  directory, so a second local run compiles little; ``QCHECK_XLA_CACHE=0``
  turns it off, ``QCHECK_XLA_CACHE=DIR`` moves it, and it is off where
  ``CI=true`` (cold, as a clean clone runs). The pytest plugin in a user's
  run uses one only where ``QCHECK_XLA_CACHE=DIR`` asks for it. See
  docs/performance.md for what it buys.

All of these are public XLA flags and JAX options. Outputs are deterministic
under a fixed setting; a flag the user already set in ``XLA_FLAGS`` wins.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import metadata

#: The persistent compilation cache: a directory, or one of CACHE_OFF to turn it off.
PERSISTENT_CACHE_ENV = "QCHECK_XLA_CACHE"
CACHE_OFF = ("0", "off", "false", "no")

_ALWAYS = {
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_parallel_codegen_split_count": "1",
    # Eight host CPU devices, so sharded layers run on a real ("data", "expert")
    # mesh in the ordinary run; everything else keeps running on device 0.
    "--xla_force_host_platform_device_count": "8",
}
#: jaxlib version prefix -> flags only that version accepts (an unknown flag aborts).
_BY_JAXLIB: dict[str, dict[str, str]] = {}


def jaxlib_version() -> str:
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
    extra = [f"{k}={v}" for k, v in flags_for(jaxlib_version()).items() if k not in flags]
    if one_thread is None:
        one_thread = bool(environ.get("PYTEST_XDIST_WORKER"))
    if one_thread and "xla_cpu_multi_thread_eigen" not in flags:
        extra += ["--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1"]
    if extra:
        environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def user_cache_dir(environ=os.environ) -> str:
    """The per-user compilation cache: ``$XDG_CACHE_HOME/qcheck/xla/jaxlib-<version>`` (default ``~/.cache``).

    JAX keys each entry on the program, jaxlib, the backend and the XLA flags,
    so a stale entry is never used; the version in the path only lets an old
    JAX's entries be removed with their directory.
    """
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "qcheck", "xla", f"jaxlib-{jaxlib_version() or 'unknown'}")


def persistent_cache_dir(environ=os.environ, *, default: bool = True) -> str | None:
    """The compilation cache a qcheck process uses, or ``None`` for none.

    ``$QCHECK_XLA_CACHE``: a directory, or ``0``/``off`` for none. Unset: the
    per-user directory where ``default`` (qcheck's own processes), except where
    ``CI`` is true, whose runs stay cold; no cache where not ``default``.
    """
    value = environ.get(PERSISTENT_CACHE_ENV, "").strip()
    if value:
        return None if value.lower() in CACHE_OFF else value
    if not default or environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        return None
    return user_cache_dir(environ)


#: A compilation cache that lives as long as one pytest run: made by its xdist controller, shared by its workers.
RUN_CACHE_ENV = "QCHECK_RUN_XLA_CACHE"
_run_cache_made: list[str] = []


def start_run_cache(environ=os.environ, *, own: bool = False) -> None:
    """In a pytest-xdist controller: a compilation cache for this run's workers, where no persistent one is on.

    A program two workers both need (an unquantized twin, an eager op of the
    layers' construction) is then compiled by one and read by the other
    (docs/performance.md says what it saves). ``own`` as for
    :func:`setup`. The workers find the directory in ``$QCHECK_RUN_XLA_CACHE``
    (:func:`run_cache_dir`); :func:`end_run_cache` removes it.
    """
    if persistent_cache_dir(environ, default=own) is None and not environ.get(RUN_CACHE_ENV):
        environ[RUN_CACHE_ENV] = tempfile.mkdtemp(prefix="qcheck-xla-")
        _run_cache_made.append(environ[RUN_CACHE_ENV])


def run_cache_dir(environ=os.environ) -> str | None:
    """The run's shared compilation cache, in one of its xdist workers; ``None`` elsewhere."""
    return environ.get(RUN_CACHE_ENV) if environ.get("PYTEST_XDIST_WORKER") else None


def end_run_cache(environ=os.environ) -> None:
    """Remove the run cache this process made (a cache an outer run made is the outer run's to remove)."""
    while _run_cache_made:
        path = _run_cache_made.pop()
        if environ.get(RUN_CACHE_ENV) == path:
            del environ[RUN_CACHE_ENV]
        shutil.rmtree(path, ignore_errors=True)


#: CPython's third threshold: full collections per second-generation pass (default 10).
FULL_COLLECTION_EVERY = 100


def collect_less() -> None:
    """At most one full garbage collection per hundred second-generation passes (CPython's default: ten).

    The heap of a qcheck process (a matrix worker, a test worker) grows to
    half a million objects and more that live as long as it does, and each
    full pass rescans them all (docs/performance.md: what that cost). Young
    garbage is collected as before.
    """
    import gc

    gc.set_threshold(*gc.get_threshold()[:2], FULL_COLLECTION_EVERY)


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


def setup(*, worker: bool | None = None, cache_dir: str | None = None, own: bool = False,
          environ=os.environ) -> None:
    """Set up a qcheck process: XLA flags before JAX starts, then the CPU default and the compilation cache.

    ``worker``: one of several worker processes (one intra-op thread; default:
    under pytest-xdist). A process of qcheck's own (``own``) runs one intra-op
    thread too, worker or not: XLA's CPU dot may sum a contraction in as many
    partial sums as it has threads (jax 0.12.1 does, on NVFP4's stochastically
    rounded gradients of the dropping layer), and a case's bits must not depend
    on the worker count. ``cache_dir``: a compilation cache to use; without it,
    :func:`persistent_cache_dir`'s. ``own``: a process of qcheck's own (the
    ``qcheck`` command, qcheck's test suite), which keeps the per-user cache
    by default and collects less garbage (:func:`collect_less`); its cache
    choice goes into ``$QCHECK_XLA_CACHE`` for the processes it starts
    (``0`` where it keeps none).
    """
    configure(environ, one_thread=True if own else worker)
    if own:
        collect_less()
    persistent = persistent_cache_dir(environ, default=own)
    if own:  # the processes this one starts (the matrix's workers, a test's `qcheck`) make the same choice
        environ[PERSISTENT_CACHE_ENV] = persistent or CACHE_OFF[0]
    if cache := cache_dir or persistent:
        use_compilation_cache(cache)
    default_to_cpu()


def default_platform() -> str:
    """The platform uncommitted computations run on: the default device's where one is set, else the backend's."""
    import jax

    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform
