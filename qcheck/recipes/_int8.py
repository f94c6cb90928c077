"""int8 as AQT quantizes by default: symmetric, per-slice absmax over the contraction axes."""

from __future__ import annotations

from flax import linen as nn

from qcheck import formats
from qcheck.recipes._base import ApplyRngs, Recipe, straight_through
from qcheck.recipes._sites import SiteOps


class Int8Site(SiteOps, nn.Module):
    """Both operands fake-quantized to int8; gradients pass straight through.

    The site owns no variables: its scales are shaped after the operands and
    recomputed every call, so there is nothing to materialize at build time.
    """

    def quantize_operands(self, lhs, rhs, axes):
        q_lhs = straight_through(lambda x: formats.qdq(x, "int8", axis=axes.lhs))
        q_rhs = straight_through(lambda x: formats.qdq(x, "int8", axis=axes.rhs))
        return q_lhs(lhs), q_rhs(rhs)


class Int8(Recipe):
    def __init__(self, name: str = "int8"):
        # PRIVATE, as AQT is upstream: each bridged site keeps its own forked stream.
        super().__init__(name, apply_rngs=ApplyRngs.PRIVATE)

    def site_module(self, name: str) -> nn.Module:
        return Int8Site()
