"""Bridging one recipe's Linen site module into NNX, one wrapper per call site.

The seed bug: a Linen einsum built inside an NNX module has no Linen scope to
bind to. Here every call site is a :class:`QuantSite`, an ``nnx.bridge.ToNNX``
wrapper built in the parent's ``__init__``. Fixed-shape state (fp8 scales and
amax histories) is materialized right there from a canonical operand pair, so
nothing is created under a trace or inside a scanned layer loop; the wrapper
then accepts operands of any shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import variablelib
from flax.linen import fp8_ops

from qcheck.recipes import ApplyRngs, Recipe

__all__ = ["Fp8Meta", "QuantSite"]

#: The NNX variable type of Flax's ``_overwrite_with_gradient`` collection: fp8
#: scales and amax histories, whose "gradient" is their next value.
Fp8Meta = variablelib.variable_type_from_name(fp8_ops.OVERWRITE_WITH_GRADIENT, allow_register=True)

_CANONICAL_EQN = "ab,bc->ac"


class QuantSite(nnx.bridge.ToNNX):
    """One quantized call site: ``site(eqn, lhs, rhs)`` or ``site.ragged_dot(lhs, rhs, group_sizes)``.

    Construction forks the caller's streams exactly as ``ToNNX`` does, whatever
    the recipe, so parameter initialization never depends on the recipe's RNG
    mode; the mode is applied afterwards.
    """

    def __init__(
        self,
        recipe: Recipe,
        name: str,
        *,
        rngs: nnx.Rngs | jax.Array | None,
        apply_rngs: ApplyRngs | None = None,
        dtype: jnp.dtype = jnp.float32,
    ):
        super().__init__(recipe.site_module(name), rngs=rngs)
        # ToNNX turns every attribute not prefixed "to_nnx__" into Linen variables.
        self.to_nnx__site_name = name
        self.to_nnx__recipe_name = recipe.name
        mode = recipe.apply_rngs if apply_rngs is None else apply_rngs
        self.to_nnx__apply_rngs = mode
        if mode is ApplyRngs.NONE:
            self.to_nnx__rngs = None
        elif mode is ApplyRngs.SHARED:
            self.share_rngs(rngs)
        if recipe.materialize_at_build:
            _materialize(self, jnp.ones((1, 1), dtype))

    @property
    def site_name(self) -> str:
        return self.to_nnx__site_name

    def share_rngs(self, rngs: nnx.Rngs | jax.Array | None) -> None:
        """Replace this site's forked stream with the caller's own.

        Accepts what construction accepts. NNX stores a shared ``Rngs`` once
        however many modules reference it, so the compiled step carries one
        stream instead of one per site per layer.
        """
        if isinstance(rngs, jax.Array):
            rngs = nnx.Rngs(params=rngs)
        elif rngs is not None and not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"share_rngs expects nnx.Rngs, a key array or None, got {type(rngs).__name__}"
            )
        self.to_nnx__rngs = rngs


@nnx.jit
def _materialize(site: QuantSite, one: jax.Array) -> None:
    # Linen's init runs the site once on a canonical pair to create its state.
    # Jitted, that is one program per kind of site and 4 ms a site; eagerly it
    # was some twenty small programs compiled on the first site and 14 ms a site.
    site.lazy_init(_CANONICAL_EQN, one, one)
