"""Flax-style delayed-scaling fp8, with the e4m3/e5m2 flavours actually honoured.

``flax.linen.Fp8Einsum`` keeps ``e4m3_dtype`` as a field but its
``fp8_scaled_dot_general`` hard-codes ``float8_e4m3fn`` (flax 0.12.8 and
0.12.12), so NANOO fp8 cannot be built on it. This site reuses Flax's state
layout (``Fp8DotGeneralBase``: scales of shape (1,) initialised to 1, amax
histories of length 1024, in the ``_overwrite_with_gradient`` collection) and
Flax's own ``in_qdq``/``out_qdq`` custom-vjp primitives, which take the dtype as
an argument.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen import fp8_ops

from qcheck import formats
from qcheck.recipes._base import ApplyRngs, Recipe
from qcheck.recipes._declarations import Expect, Reference
from qcheck.recipes._sites import SiteOps


class DelayedScalingFp8Site(SiteOps, fp8_ops.Fp8DotGeneralBase):
    """Operands qdq'd to ``e4m3_dtype`` with delayed scales; the output gradient to ``e5m2_dtype``.

    In the forward pass the scales are recomputed from the amax history (all
    zeros on a fresh layer, which leaves them at 1); the new scales and histories
    come back only as the "gradients" of the ``_overwrite_with_gradient``
    variables, so only a backward pass moves them.
    """

    def quantize_operands(self, lhs, rhs, axes):
        dtype = rhs.dtype
        q_lhs = fp8_ops.in_qdq(
            dtype, self.e4m3_dtype, lhs, self.input_scale.value, self.input_amax_history.value
        )
        q_rhs = fp8_ops.in_qdq(
            dtype, self.e4m3_dtype, rhs, self.kernel_scale.value, self.kernel_amax_history.value
        )
        return q_lhs, q_rhs

    def quantize_output(self, y):
        return fp8_ops.out_qdq(
            y.dtype,
            self.e5m2_dtype,
            y,
            self.output_grad_scale.value,
            self.output_grad_amax_history.value,
        )


class DelayedScalingFp8(Recipe):
    """fp8 with Flax's delayed scaling, in a chosen e4m3 (forward) / e5m2 (gradient) flavour."""

    def __init__(self, name: str, *, e4m3_dtype, e5m2_dtype, amax_history_length: int = 1024,
                 expect: Expect | None = None):
        for arg, dtype in (("e4m3_dtype", e4m3_dtype), ("e5m2_dtype", e5m2_dtype)):
            if not _flax_takes(dtype):
                takes = ", ".join(t for t in formats.FP8_DTYPES if _flax_takes(t))
                raise ValueError(f"recipe {name!r}: {arg} {np.dtype(dtype).name} is not a type Flax's fp8 ops take "
                                 f"(flax.linen.fp8_ops.get_fp8_max asserts it is one of {takes})")
        # lhs/rhs: what a fresh site does (scale 1), which the golden codes record.
        fresh = formats.cast_format(e4m3_dtype, where=f"recipe {name!r}: e4m3_dtype").name
        super().__init__(
            name,
            lhs=fresh,
            rhs=fresh,
            apply_rngs=ApplyRngs.NONE,
            materialize_at_build=True,
            reference=Reference(cast_dtype=e4m3_dtype),
            expect=expect,
        )
        self.e4m3_dtype = np.dtype(e4m3_dtype)
        self.e5m2_dtype = np.dtype(e5m2_dtype)
        self.amax_history_length = amax_history_length

    def site_module(self, name: str) -> nn.Module:
        return DelayedScalingFp8Site(
            amax_history_length=self.amax_history_length,
            e4m3_dtype=self.e4m3_dtype,
            e5m2_dtype=self.e5m2_dtype,
        )


def _flax_takes(dtype) -> bool:
    # flax 0.12.8 fp8_ops.get_fp8_max (flax/linen/fp8_ops.py:125) asserts its type is one of four fp8 types:
    # asked, not listed here, so a Flax that takes more (e3m4, say) is taken at its word.
    try:
        fp8_ops.get_fp8_max(np.dtype(dtype), jnp.float32)
    except (AssertionError, TypeError):
        return False
    return True


def fp8() -> DelayedScalingFp8:
    return DelayedScalingFp8("fp8", e4m3_dtype=jnp.float8_e4m3fn, e5m2_dtype=jnp.float8_e5m2,
                             expect=Expect(fp8_target="nvidia"))


def nanoo_fp8() -> DelayedScalingFp8:
    # AMD MI300's fnuz flavours: no negative zero, no infinities, a different bias.
    return DelayedScalingFp8(
        "nanoo_fp8", e4m3_dtype=jnp.float8_e4m3fnuz, e5m2_dtype=jnp.float8_e5m2fnuz,
        expect=Expect(fp8_target="mi300"),
    )
