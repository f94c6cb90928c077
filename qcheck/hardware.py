"""What this host can run natively, and the markers that say what a test needs.

Kept free of module-level JAX imports so the pytest plugin can register the
markers without initializing a backend.
"""

from __future__ import annotations

import functools

__all__ = ["MARKERS", "fp8_gemm_dtypes", "missing"]

#: marker name -> what a test carrying it needs (the skip reason names it).
MARKERS: dict[str, str] = {
    "gpu": "a GPU",
    "tpu": "a TPU",
    "fp8_gpu": "a GPU with native fp8 matmuls (NVIDIA sm_89 or newer, or AMD MI300)",
    "blackwell": "an NVIDIA Blackwell GPU (sm_100 or newer) for native block-scaled (MXFP8, NVFP4) matmuls",
}


def _devices(platform: str) -> list:
    import jax

    try:
        return jax.devices(platform)
    except RuntimeError:  # jax raises this when no backend of that kind exists
        return []


def _cuda_capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def _has(marker: str) -> bool:
    gpus = _devices("gpu")
    if marker == "gpu":
        return bool(gpus)
    if marker == "tpu":
        return bool(_devices("tpu"))
    if marker == "fp8_gpu":
        return bool(fp8_gemm_dtypes())
    if marker == "blackwell":
        return any((c := _cuda_capability(d)) is not None and c >= (10, 0) for d in gpus)
    raise ValueError(f"unknown hardware marker {marker!r}; known markers: {', '.join(MARKERS)}")


def _is_amd_fp8(device) -> bool:
    return "MI3" in str(getattr(device, "device_kind", ""))


@functools.cache
def fp8_gemm_dtypes() -> frozenset[str]:
    """The fp8 element types this host's GPUs multiply natively (ml_dtypes names); empty without such a GPU.

    NVIDIA's fp8 tensor cores (sm_89 and newer) take the OCP types e4m3fn and
    e5m2; AMD MI300's take the fnuz types.
    """
    gpus = _devices("gpu")
    out: set[str] = set()
    if any(_is_amd_fp8(d) for d in gpus):
        out |= {"float8_e4m3fnuz", "float8_e5m2fnuz"}
    if any((c := _cuda_capability(d)) is not None and c >= (8, 9) for d in gpus):
        out |= {"float8_e4m3fn", "float8_e5m2"}
    return frozenset(out)


@functools.cache
def missing(marker: str) -> str | None:
    """None if this host has what ``marker`` needs, else a reason naming what is missing."""
    if _has(marker):
        return None
    import jax

    seen = ", ".join(sorted({f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in jax.devices()}))
    return f"needs {MARKERS[marker]}; this host has {seen}"
