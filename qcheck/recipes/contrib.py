"""Recipes added the way a user adds one (docs/adding-a-recipe.md).

Declared with the public :class:`qcheck.Recipe`, registered through this
package's ``qcheck.recipes`` entry points (pyproject.toml), golden cases from
``python -m qcheck golden add NAME``. Nothing in qcheck's core refers to them.
"""

from __future__ import annotations

import qcheck

__all__ = ["fp8_current", "mxfp8"]

#: Current scaling, as TransformerEngine's Float8CurrentScaling (HYBRID): each
#: tensor is scaled by its own amax, no history; e4m3 forward, e5m2 gradients.
fp8_current = qcheck.Recipe(
    "fp8_current", lhs="e4m3fn_current", rhs="e4m3fn_current", grad="e5m2_current",
    expect=qcheck.Expect(fp8_target="nvidia"),
)

#: OCP MX v1.0 MXFP8: blocks of 32 along each matmul's contraction axis, a
#: shared power-of-two (e8m0) scale per block, e4m3fn elements, gradients too.
mxfp8 = qcheck.Recipe("mxfp8", lhs="mxfp8", rhs="mxfp8", grad="mxfp8", expect=qcheck.Expect(fp8_target="nvidia"))
