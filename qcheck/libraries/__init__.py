"""The libraries qcheck reads a stack through: one :class:`Library` record each, and their registry.

A library is what qcheck must know to read a stack built on it: the reader of
its users' configuration (a layer's :class:`Declaration`), the weights it
keeps as codes, its machinery and plumbing (whose frames are never a user's
line) and the opaque kernels it ships. qcheck's own (JAX, Flax, AQT, Equinox,
MaxText, gemma, haliax, qwix, Keras, tokamax, EasyDeL) are one module each here; a
user's is registered with :func:`register_library` or an entry point of the
``qcheck.libraries`` group, with no edit of qcheck. A layer may also declare
itself: a method ``qcheck_declaration(self)`` is read before any library.
"""

from __future__ import annotations

from qcheck.libraries._declaration import Declaration, RoleFormat, Stored, as_declaration, block_of, role_key
from qcheck.libraries._kernel import KernelRoles, KnownKernel
from qcheck.libraries._library import Library
from qcheck.libraries._registry import (ENTRY_POINT_GROUP, known_kernels, machinery, plumbing, register_library,
                                        registered, registered_libraries)

__all__ = [
    "Declaration",
    "ENTRY_POINT_GROUP",
    "KernelRoles",
    "KnownKernel",
    "Library",
    "RoleFormat",
    "Stored",
    "as_declaration",
    "block_of",
    "known_kernels",
    "machinery",
    "plumbing",
    "register_library",
    "registered",
    "registered_libraries",
    "role_key",
]
