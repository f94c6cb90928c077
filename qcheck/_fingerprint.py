"""What a traced program computes, as one key: its text and every constant's bits (inner programs' included).

A compiled program is reused only for an equal fingerprint, so code changed
between two checks (a monkeypatched helper, a rebuilt module) is never served
the program of the old code.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def program_consts(jaxpr: Any) -> list[Any]:
    """Every constant of a traced program, its inner programs' included (their values are not in its text)."""
    found = list(getattr(jaxpr, "consts", ()) or ())
    for eqn in getattr(getattr(jaxpr, "jaxpr", jaxpr), "eqns", ()):
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(sub, "eqns") or hasattr(sub, "consts"):
                    found += program_consts(sub)
    return found


def fingerprint(jaxpr: Any) -> str:
    """What the traced program computes: its text and its constants' bits."""
    digest = hashlib.blake2b(str(jaxpr).encode(), digest_size=16)
    for c in program_consts(jaxpr):
        a = np.asarray(jax.random.key_data(c) if jnp.issubdtype(getattr(c, "dtype", np.float32), jax.dtypes.prng_key)
                       else c)
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()
