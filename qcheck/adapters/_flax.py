"""Flax's own fp8 modules (flax.linen.fp8_ops) as qcheck recipes, unchanged.

qcheck's built-in ``fp8``/``nanoo_fp8`` re-implement Flax's delayed scaling
with the flavours honoured. These recipes run the module a user actually ships,
so its defects show up in qcheck's checks: ``Fp8Einsum`` and
``Fp8DirectDotGeneralOp`` cast to e4m3fn/e5m2 whatever dtypes they are given
(flax 0.12.8 and 0.12.12), which the exact check reports as the wrong fp8
flavour when the recipe asks for fnuz.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen import fp8_ops

from qcheck.adapters._ragged import ragged_dot_from_einsum
from qcheck.recipes import DelayedScalingFp8, Expect

#: The Flax fp8 modules this adapter knows how to call, by name.
FLAX_FP8_MODULES: dict[str, type[fp8_ops.Fp8DotGeneralBase]] = {
    cls.__name__: cls
    for cls in (fp8_ops.Fp8Einsum, fp8_ops.Fp8DirectDotGeneralOp, fp8_ops.NANOOFp8DotGeneralOp)
}
_E4M3 = ("float8_e4m3fn", "float8_e4m3fnuz")
_E5M2 = ("float8_e5m2", "float8_e5m2fnuz")


def _fp8_arg(arg: str, value, allowed: tuple[str, ...]) -> np.dtype:
    try:
        dt = np.dtype(value)
    except TypeError:
        dt = None
    if dt is None or dt.name not in allowed:
        raise ValueError(f"{arg} must be one of {', '.join(allowed)}, got {value!r}")
    return dt


class FlaxFp8Site(nn.Module):
    """One call site running a Flax fp8 module: ``__call__(eqn, lhs, rhs)`` and ``ragged_dot``."""

    module_cls: type
    e4m3_dtype: np.dtype
    e5m2_dtype: np.dtype
    amax_history_length: int

    def setup(self):
        self.op = self.module_cls(
            amax_history_length=self.amax_history_length,
            e4m3_dtype=self.e4m3_dtype,
            e5m2_dtype=self.e5m2_dtype,
        )

    def _einsum(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        dtype = jnp.result_type(lhs, rhs)
        lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
        if issubclass(self.module_cls, fp8_ops.Fp8Einsum):
            return self.op(eqn, lhs, rhs)
        # jnp.einsum traces its dot_general under an inner jit: the module's
        # variables must exist before, or their creation leaks a tracer.
        self.op.input_scale  # noqa: B018 (runs the module's setup)
        # The dot_general modules take exactly (lhs, rhs, dimension_numbers);
        # jnp.einsum also passes precision positionally.
        dot_general = lambda a, b, dims, *_, **__: self.op(a, b, dims)  # noqa: E731
        return jnp.einsum(eqn, lhs, rhs, _dot_general=dot_general)

    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return self._einsum(eqn, lhs, rhs)

    def ragged_dot(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        # Flax has no fp8 ragged_dot: the grouped matmul runs through the module's einsum.
        dtype = jnp.result_type(lhs, rhs)
        return ragged_dot_from_einsum(
            self._einsum, jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), group_sizes
        )


class FlaxFp8Recipe(DelayedScalingFp8):
    """A recipe whose every call site is a fresh instance of a Flax fp8 module class.

    ``reference.cast_dtype`` (what qcheck's exact check expects a fresh site to
    cast to) is the ``e4m3_dtype`` asked for, so a module that ignores it fails
    that check.
    """

    def __init__(
        self,
        name: str,
        module_cls: type[fp8_ops.Fp8DotGeneralBase],
        *,
        e4m3_dtype,
        e5m2_dtype,
        amax_history_length: int = 1024,
        expect: Expect | None = None,
    ):
        if not (isinstance(module_cls, type) and issubclass(module_cls, fp8_ops.Fp8DotGeneralBase)):
            raise TypeError(
                "module_cls must be a flax.linen fp8 module class (a subclass of Fp8DotGeneralBase: "
                f"{', '.join(FLAX_FP8_MODULES)}), got {module_cls!r}"
            )
        if module_cls is fp8_ops.Fp8DotGeneralOp:
            raise ValueError(
                "module_cls Fp8DotGeneralOp is deprecated by Flax (it warns on construction); "
                f"use one of {', '.join(FLAX_FP8_MODULES)}"
            )
        e4m3 = _fp8_arg("e4m3_dtype", e4m3_dtype, _E4M3)
        e5m2 = _fp8_arg("e5m2_dtype", e5m2_dtype, _E5M2)
        if not (isinstance(amax_history_length, int) and amax_history_length > 0):
            raise ValueError(f"amax_history_length must be a positive int, got {amax_history_length!r}")
        super().__init__(name, e4m3_dtype=e4m3, e5m2_dtype=e5m2, amax_history_length=amax_history_length,
                         expect=expect)
        # Flax has no fp8 ragged_dot: the sparse path runs one einsum over every
        # group (ragged_dot_from_einsum), whose forward equals jax.lax.ragged_dot
        # bitwise but whose gradient matmuls sum in another order (1 ulp on CPU,
        # jax 0.10.2), so only the dense path's gradients have an exact reference.
        self.expect = self.expect.narrow_backward(("dense",))
        self.module_cls = module_cls

    def site_module(self, name: str) -> nn.Module:
        return FlaxFp8Site(
            module_cls=self.module_cls,
            e4m3_dtype=self.e4m3_dtype,
            e5m2_dtype=self.e5m2_dtype,
            amax_history_length=self.amax_history_length,
        )

    def __repr__(self) -> str:
        return (f"FlaxFp8Recipe({self.name!r}, {self.module_cls.__name__}, e4m3_dtype={self.e4m3_dtype.name}, "
                f"e5m2_dtype={self.e5m2_dtype.name})")


def flax_fp8_recipe(
    name: str,
    module_cls: type[fp8_ops.Fp8DotGeneralBase],
    *,
    e4m3_dtype,
    e5m2_dtype,
    amax_history_length: int = 1024,
    expect: Expect | None = None,
) -> FlaxFp8Recipe:
    """A qcheck recipe running ``module_cls`` (a flax.linen fp8 module class) at every call site.

    Example: the NANOO flavour requested from ``Fp8Einsum``, which qcheck's exact
    check then reports as the wrong fp8 flavour::

        flax_fp8_recipe("flax_einsum_fnuz", flax.linen.Fp8Einsum,
                        e4m3_dtype=jnp.float8_e4m3fnuz, e5m2_dtype=jnp.float8_e5m2fnuz,
                        expect=qcheck.Expect(fp8_target="mi300"))

    ``expect`` (:class:`qcheck.Expect`) declares the bounds and ``fp8_target``,
    the hardware the recipe is for ("nvidia", "mi300"); with it the ``coverage``
    invariant reads the fp8 types the module really casts to, forward and
    backward, against that hardware's (which ``Fp8Einsum`` asked for fnuz
    fails). Its ``backward_paths`` keep the dense path at most (no exact
    gradient reference on the sparse one).

    Einsum call sites call the module (an ``Fp8Einsum``) or run ``jnp.einsum``
    with the module as its dot_general; ragged_dot call sites run every row
    against its own group through that same einsum.
    """
    return FlaxFp8Recipe(name, module_cls, e4m3_dtype=e4m3_dtype, e5m2_dtype=e5m2_dtype,
                         amax_history_length=amax_history_length, expect=expect)


flax_fp8 = partial(
    flax_fp8_recipe, "flax_fp8", fp8_ops.Fp8Einsum,
    e4m3_dtype=jnp.float8_e4m3fn, e5m2_dtype=jnp.float8_e5m2, expect=Expect(fp8_target="nvidia"),
)
flax_fp8.__doc__ = "``flax.linen.Fp8Einsum`` in its default flavours (e4m3fn forward, e5m2 gradients)."

flax_nanoo_fp8 = partial(
    flax_fp8_recipe, "flax_nanoo_fp8", fp8_ops.NANOOFp8DotGeneralOp,
    e4m3_dtype=jnp.float8_e4m3fnuz, e5m2_dtype=jnp.float8_e5m2fnuz, expect=Expect(fp8_target="mi300"),
)
flax_nanoo_fp8.__doc__ = "``flax.linen.NANOOFp8DotGeneralOp``: AMD's fnuz flavours, which it honours."
