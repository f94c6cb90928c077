"""Equinox: machinery (its ``filter_jit`` wrapper would otherwise be the innermost frame of every matmul haliax's
``hax.dot`` traces). How an Equinox module is called and split is a layer form (``qcheck/checks/_layer_forms.py``)."""

from __future__ import annotations

import sys
from typing import Any

from qcheck.libraries._library import Library


def equinox_of(layer: Any) -> Any:
    """The ``equinox`` package where ``layer`` is an Equinox module, else None.

    Never imports it: Equinox is no dependency of qcheck's, and an Equinox
    module exists only once its package is loaded.
    """
    eqx = sys.modules.get("equinox")
    return eqx if eqx is not None and isinstance(layer, eqx.Module) else None

LIBRARY = Library("Equinox", machinery=("equinox",))
