"""The Recipe type and the ApplyRngs modes."""

from __future__ import annotations

import enum
import re

from flax import linen as nn

from qcheck import formats
from qcheck._choices import require_choice
from qcheck.recipes._declarations import Expect, Reference
from qcheck.recipes._sites import FormatSite


class ApplyRngs(enum.Enum):
    """How a recipe's call sites use random numbers.

    NONE: the recipe never draws, so its sites carry no RNG stream at all.
    SHARED: it draws, but folds a per-site hash into what it draws, so every site
      can use the caller's stream; the compiled step pays for RNG state once.
    PRIVATE: each site keeps its own forked stream, which an unrolled model pays
      for once per site per layer (AQT's behaviour upstream).
    """

    NONE = "none"
    SHARED = "shared"
    PRIVATE = "private"


class Recipe:
    """A quantization recipe: what every einsum call site of a layer does, and what qcheck should hold it to.

    Declarative (the common case)::

        qcheck.Recipe("fp8_current", lhs="e4m3fn_current", rhs="e4m3fn_current",
                      grad="e5m2_current", expect=qcheck.Expect(fp8_target="nvidia"))

    fake-quantizes both operands in formats :mod:`qcheck.formats` knows (along
    the contraction axes of each matmul) and, if ``grad`` is given, the output
    gradient of each gradient matmul; without ``grad`` gradients pass straight
    through. For anything stateful, subclass and override :meth:`site_module`,
    which returns a Linen module with ``__call__(eqn, lhs, rhs)`` and
    ``ragged_dot(lhs, rhs, group_sizes)`` (inherit
    :class:`qcheck.recipes.SiteOps` to get both from one ``matmul``). qcheck
    bridges one instance per call site into NNX, so no two sites share state.

    The quantization is the constructor's; beside it a recipe carries two
    declarations: ``reference`` (:class:`qcheck.Reference`: how the referee
    computes what its sites must equal) and ``expect`` (:class:`qcheck.Expect`:
    the suite's bounds, the paths it runs, what the recipe's library refuses or
    gets wrong). A subclass may set either as a class attribute; an argument
    given here replaces it.

    Attributes:
      name: registry key, also the golden directory name.
      lhs, rhs, grad: format names; on a subclass, ``lhs``/``rhs`` say what a
        fresh site does to the operands, which the golden cases record as codes.
      apply_rngs: how the sites use random numbers (:class:`ApplyRngs`).
      materialize_at_build: create the site's state when the layer is built, from
        a canonical operand pair (fixed-shape state such as fp8 scales and amax
        histories), rather than on first use.
      reference: what the ``exact`` and ``backward`` referees follow.
      expect: what the suite expects.
    """

    reference: Reference = Reference()
    expect: Expect = Expect()

    def __init__(
        self,
        name: str,
        *,
        lhs: str | None = None,
        rhs: str | None = None,
        grad: str | None = None,
        apply_rngs: ApplyRngs = ApplyRngs.NONE,
        materialize_at_build: bool = False,
        reference: Reference | None = None,
        expect: Expect | None = None,
    ):
        if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            raise ValueError(f"recipe name must match [a-z][a-z0-9_]*, got {name!r}")
        if not isinstance(apply_rngs, ApplyRngs):
            raise TypeError(f"apply_rngs must be an ApplyRngs, got {apply_rngs!r}")
        for arg, fmt in (("lhs", lhs), ("rhs", rhs), ("grad", grad)):
            if fmt is not None:
                require_choice(f"{arg} format", fmt, formats.format_names())
        if (lhs is None) != (rhs is None):
            raise TypeError(f"Recipe {name!r}: give both lhs= and rhs=, or neither")
        if lhs is None and type(self).site_module is Recipe.site_module:
            raise TypeError(
                f"Recipe {name!r} needs lhs= and rhs= formats (one of {', '.join(formats.format_names())}), "
                "or a subclass that defines site_module(name)"
            )
        if grad is not None and lhs is None:
            raise TypeError(f"Recipe {name!r}: grad= needs lhs= and rhs= too")
        reference = type(self).reference if reference is None else reference
        expect = type(self).expect if expect is None else expect
        if not isinstance(reference, Reference):
            raise TypeError(f"reference must be a qcheck.Reference, got {reference!r}")
        if not isinstance(expect, Expect):
            raise TypeError(f"expect must be a qcheck.Expect, got {expect!r}")
        self.name = name
        self.lhs, self.rhs, self.grad = lhs, rhs, grad
        self.apply_rngs = apply_rngs
        self.materialize_at_build = materialize_at_build
        self.reference = reference
        self.expect = expect

    @property
    def quantized(self) -> bool:
        """False only for the unquantized reference recipe."""
        return True

    def site_module(self, name: str) -> nn.Module:
        """A new Linen module for the call site called ``name``."""
        return FormatSite(lhs=self.lhs, rhs=self.rhs, grad=self.grad)

    def __repr__(self) -> str:
        if type(self).site_module is Recipe.site_module:
            grad = "" if self.grad is None else f", grad={self.grad!r}"
            return f"Recipe({self.name!r}, lhs={self.lhs!r}, rhs={self.rhs!r}{grad})"
        return f"{type(self).__name__}({self.name!r})"
