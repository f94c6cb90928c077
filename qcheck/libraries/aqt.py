"""AQT v2: machinery, and its int8 numerics as qcheck's formats (read by the libraries that configure AQT:
haliax's ``Int8DotGeneralOp``)."""

from __future__ import annotations

from typing import Any

from qcheck.libraries._library import Library


def int8_format(numerics: Any) -> str | None:
    """AQT's ``IntSymmetric`` numerics of 8 bits as qcheck's format: absmax/127 (``preserve_max_val``) or /127.5."""
    if type(numerics).__name__ != "IntSymmetric" or getattr(numerics, "bits", None) != 8:
        return None
    return "int8" if getattr(numerics, "preserve_max_val", False) else "int8_aqt"  # absmax/127 or /127.5


LIBRARY = Library("AQT", machinery=("aqt",))
