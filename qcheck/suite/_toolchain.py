"""The toolchain qcheck runs on, as its numerics see it: versions, and the form XLA computes a quantizer's
divisions in (``qcheck.referees.FORMS``), measured, since a jax release may change it (0.12.1 did).

Golden cases are kept per form (:mod:`qcheck.suite.golden.store`), ``qcheck --version`` prints it, and
tests/test_toolchain.py pins it per jax release.
"""

from __future__ import annotations

import functools
import importlib.metadata

import numpy as np

#: Rows on which the forms part: amax 190.875 parts ``amax / 127``'s two forms; on the second row ``x / scale`` is
#: within an ulp of a half, so its two forms round to other codes.
_ROWS = ([190.875, -3.0, 0.5], [112.12789, -95.794304, 0.5])
_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "ml_dtypes", "numpy")


def division_forms(jit: bool = True) -> tuple[str, ...]:
    """The forms in which the referee gives, bit for bit, what qcheck's int8 quantizer computes on rows that part
    them (jitted, or op by op): one name on every toolchain seen, none if XLA computes a form the referee does not
    know."""
    import jax

    from qcheck import formats, referees

    quantize = jax.jit(lambda v: formats.quantize(v, "int8")) if jit else (lambda v: formats.quantize(v, "int8"))
    found = list(referees.FORMS)
    for row in _ROWS:
        x = np.zeros((4, 64), np.float32)
        x[:, : len(row)] = row
        q = quantize(x)
        codes, scale = np.asarray(q.codes), np.asarray(q.scales["slice"]).view(np.uint32)
        found = [form for form in found
                 if (r := referees.reference_quantize(x, "int8", ftz=jax.default_backend() == "cpu",
                                                      xla_reciprocal=form))
                 and np.array_equal(r[0], codes) and np.array_equal(r[1]["slice"].view(np.uint32), scale)]
    return tuple(found)


@functools.cache
def division_form() -> str:
    """The form of this toolchain's jitted divisions (what the suite's programs compute), one name; "unknown" where
    the referee knows none that matches."""
    found = division_forms(jit=True)
    return found[0] if len(found) == 1 else "unknown"


def versions() -> dict[str, str]:
    """The installed versions of what qcheck's numerics depend on."""
    out = {}
    for dist in _DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def describe() -> str:
    """One line: the versions, the backend, and the form of XLA's divisions (``qcheck --version``)."""
    import jax

    parts = ", ".join(f"{k} {v}" for k, v in versions().items())
    return f"{parts}; backend {jax.default_backend()}; XLA divisions {division_form()} (jitted)"
