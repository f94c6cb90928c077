"""Flax: its fp8 ops and its Linen/NNX bridge are machinery, never a user's line."""

from __future__ import annotations

from qcheck.libraries._library import Library

LIBRARY = Library("Flax", machinery=("flax",))
