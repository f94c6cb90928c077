"""The record of one number format: what it stores, how it scales, and what a bug would compute instead."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Literal

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import Array

from qcheck.formats._quantized import Codes, Quantized

#: ``cast``: the element type at scale 1; ``int``: integer codes, one scale per slice along the
#: contraction axes; ``current``: one scale per tensor from its own amax; ``block``: one scale per
#: block of elements along the contraction axes (and, for some, one per tensor).
Kind = Literal["cast", "int", "current", "block"]


#: The forms of a format with no division a compiler could rewrite on its own (or none at all): as written, and
#: with every division by its reciprocal.
TWO_FORMS = ("as written", "all by reciprocal")
#: Every form of a quantizer that divides by a constant (its scale) and by a broadcast operand (its input by the
#: scale): each rewrite alone is legal too.
ALL_FORMS = ("all by reciprocal", "constant by reciprocal", "as written", "scale by reciprocal")


@dataclasses.dataclass(frozen=True, eq=False)
class Format:
    """One number format qcheck knows, as :func:`~qcheck.formats.quantize` computes it.

    ``element`` is the type the codes are stored in; ``block`` the elements per
    block scale along the contraction axes (None: no block scale); ``scales``
    the scales :class:`~qcheck.formats.Quantized` holds, by name, in their
    storage types (a ``slice`` scale widens to float64 for a float64 ``x``), and
    ``scale_rule`` how they are computed, in words. ``siblings`` are the
    formats a wrong-variant bug computes instead (the wrong fnuz flavour, the
    other library's int8, the standard a library's rule departs from): the
    checks' probes must tell each apart. ``quantize(x, axes, format, rng)``
    returns the codes (nvfp4's as float32 values, stored as e2m1 by
    :func:`~qcheck.formats.quantize`) and scales; ``dequantize(q, format)``
    maps them back. ``stochastic``: whether it takes ``rng``. ``divides``: its stored scale is an encode
    scale, x ≈ codes / scale (Keras's int8), where the others' ``slice`` scale multiplies.
    ``grad``: for a cast format, the e5m2-class format an fp8-class recipe casting to it quantizes its
    output gradient to (Flax's delayed scaling: e4m3fn -> e5m2, e4m3fnuz -> e5m2fnuz); None: such a recipe
    has no gradient flavour. ``decode_ulps``: how far XLA may move its dequantized values under jit by
    computing its decode in another order (nvfp4's ``code · (1 / (s_enc / s_block))`` as
    ``code · (s_block / s_enc)``: 2 ulps); 0: its decode has one order, or every order is exact.
    ``parting_binade``: ``(lo, hi)`` where a cast format parts from its sibling only in [2^lo, 2^hi), outside
    the checks' probes' magnitudes (e5m2 and e5m2fnuz), which then fill some contraction fibres from it.
    ``probe_spread``: the probes must spread their block amaxes over many binades (a power-of-two scale
    rounded up, as ``mxfp8_jax``'s, comes out the same for every block of values that all reach about 2^10).
    ``forms``: the forms a compiler may legally compute its divisions in (names of ``qcheck.referees.FORMS``):
    XLA may compute ``amax / 127.5`` as ``amax · fl(1/127.5)`` and ``x / scale`` as ``x · fl(1/scale)``, each
    on its own (jax 0.10.2 to 0.12.0.1 rewrote both, 0.12.1 the first only). A site is held bitwise when its
    codes are the referee's under one of them, applied to the whole tensor.
    ``parameters``: what its rule takes beside the tensor that a layer's config sets (``block``: the group size,
    ``block`` its default; ``int4_keras_grouped``, Keras's ``Int4QuantizationConfig(block_size=...)``). A
    declaration names another value as ``{"format": NAME, "block": 64}``; the referee takes it as ``block=``.
    ``guarded_below``: the smallest guarded amax, below which (of the tensor, slice or block a scale covers) its
    scale rule, on every backend, guards the scale: flushes the codes, replaces, caps or clamps the scale (nvfp4:
    ``NVFP4_MIN_AMAX``, below which the tensor scale 6 · 448 / amax would overflow float32); a backend that flushes
    subnormals may guard from higher up. None: no scale, or one guarded only at zero. The edge checks' whole
    tensor of tiny values sits below every format's, so that a per-tensor scale, which sees only the tensor's
    amax, reaches its guard.
    """

    name: str
    kind: Kind
    element: np.dtype
    block: int | None
    scales: Mapping[str, np.dtype]
    scale_rule: str
    siblings: tuple[str, ...]
    quantize: Callable[[Array, tuple[int, ...], Format, Array | None], Codes]
    dequantize: Callable[[Quantized, Format], Array]
    stochastic: bool = False
    divides: bool = False
    grad: str | None = None
    decode_ulps: int = 0
    parting_binade: tuple[int, int] | None = None
    probe_spread: bool = False
    forms: tuple[str, ...] = TWO_FORMS
    parameters: tuple[str, ...] = ()
    guarded_below: float | None = None

    @property
    def normal_range(self) -> tuple[float, float] | None:
        """The smallest normal and the largest finite magnitude of its element type; None for integer codes.

        The probes of a cast format stay inside it, so their reference never leans on how a backend casts to
        the type's subnormals.
        """
        # jax.numpy, not numpy: numpy reads ml_dtypes' int4 as no integer type (its kind is "V").
        if jnp.issubdtype(self.element, jnp.integer):
            return None
        info = ml_dtypes.finfo(self.element)
        return float(info.smallest_normal), float(info.max)

    @property
    def per_axis(self) -> bool:
        """Whether its quantization depends on the axes it runs along (a scale per slice or per block)."""
        return self.kind in ("int", "block")
