"""What this host can run natively, and the markers that say what a test needs.

Kept free of module-level JAX imports so the pytest plugin can register the
markers without initializing a backend.
"""

from __future__ import annotations

import functools

__all__ = ["FP8_TARGETS", "MARKERS", "fp8_gemm_dtypes", "fp8_target_dtypes", "missing"]

#: Hardware families a recipe can target -> the fp8 element types their matmuls
#: take natively (ml_dtypes names). NVIDIA's fp8 tensor cores (sm_89 Ada,
#: Hopper, Blackwell) take the OCP types; AMD MI300's (CDNA3) the fnuz ones,
#: which is what NANOO fp8 is.
FP8_TARGETS: dict[str, frozenset[str]] = {
    "nvidia": frozenset({"float8_e4m3fn", "float8_e5m2"}),
    "mi300": frozenset({"float8_e4m3fnuz", "float8_e5m2fnuz"}),
}


def fp8_target_dtypes(target: str) -> frozenset[str]:
    """The fp8 element types ``target`` (a key of :data:`FP8_TARGETS`) multiplies natively."""
    if not isinstance(target, str) or target not in FP8_TARGETS:
        raise ValueError(f"unknown fp8 target {target!r}; valid targets: {', '.join(FP8_TARGETS)}")
    return FP8_TARGETS[target]

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
        out |= FP8_TARGETS["mi300"]
    if any((c := _cuda_capability(d)) is not None and c >= (8, 9) for d in gpus):
        out |= FP8_TARGETS["nvidia"]
    return frozenset(out)


@functools.cache
def missing(marker: str) -> str | None:
    """None if this host has what ``marker`` needs, else a reason naming what is missing."""
    if _has(marker):
        return None
    import jax

    seen = ", ".join(sorted({f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in jax.devices()}))
    return f"needs {MARKERS[marker]}; this host has {seen}"
