"""JAX: its frames (jax, jaxlib) are machinery, never a user's line."""

from __future__ import annotations

from qcheck.libraries._library import Library

LIBRARY = Library("JAX", machinery=("jax", "jaxlib"))
