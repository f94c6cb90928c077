"""The Recipe type and the ApplyRngs modes."""

from __future__ import annotations

import enum
import re

import numpy as np
from flax import linen as nn

from qcheck import formats
from qcheck._choices import check_choice
from qcheck.recipes._sites import FormatSite

__all__ = ["DEFAULT_RECIPE_MAX_GRAD_REL_NORM", "ApplyRngs", "Recipe"]

# Each Param's gradient after one train step on the case table's input, against
# the `none` twin's (relative norm; seed 0, jax 0.10.2, CPU), worst over the
# table's variants and leaves: int8 0.023 (wo, dropping), fp8 0.146 and
# nanoo_fp8 0.147 (wi_0, dropping), fp8_current 0.123 (wo, dropping), mxfp8
# 0.113 (wo; it cannot train on the dropping variant). Seeds 1 and 2 (Mixtral
# dense with and without dropping, Gemma dense): at most 0.025 (int8), 0.154
# (mxfp8's gate, seed 2), 0.136 (fp8-class). Gradients sit 1.3-1.5x
# further from the twin than outputs (0.10 against 0.067 for fp8 without
# dropping), and dropping adds the dispatch and combine gradients. 0.3 is about twice
# the worst of those; the bug it is for, an output gradient cast to e4m3 at
# scale 1 (most of it flushed to 0), measures 0.73. The library recipes, same
# measure: flax_fp8 0.103 (wo, sparse), aqt_int8 0.048 and qwix_int8 0.045
# (gate, dropping); AQT with 2-bit gradient matmuls measures 0.76.
DEFAULT_RECIPE_MAX_GRAD_REL_NORM = 0.3


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
    """A quantization recipe: what every einsum call site of a layer does.

    Declarative (the common case)::

        qcheck.Recipe("fp8_current", lhs="e4m3fn_current", rhs="e4m3fn_current",
                      grad="e5m2_current")

    fake-quantizes both operands in formats :mod:`qcheck.formats` knows (along
    the contraction axes of each matmul) and, if ``grad`` is given, the output
    gradient of each gradient matmul; without ``grad`` gradients pass straight
    through. For anything stateful, subclass and override :meth:`site_module`,
    which returns a Linen module with ``__call__(eqn, lhs, rhs)`` and
    ``ragged_dot(lhs, rhs, group_sizes)`` (inherit
    :class:`qcheck.recipes.SiteOps` to get both from one ``matmul``). qcheck
    bridges one instance per call site into NNX, so no two sites share state.

    Attributes:
      name: registry key, also the golden directory name.
      lhs, rhs, grad: format names; on a subclass, ``lhs``/``rhs`` say what a
        fresh site does to the operands, which the golden cases record as codes.
      max_rel_norm: the bound ``assert_tracks`` uses against the ``none`` twin.
      max_grad_rel_norm: the bound on each parameter's gradient (one train step)
        against the ``none`` twin's, which the ``grads`` invariant uses; the
        default is measured in :data:`DEFAULT_RECIPE_MAX_GRAD_REL_NORM`.
      apply_rngs: how the sites use random numbers (:class:`ApplyRngs`).
      cast_dtype: the fp8 element type a freshly built site casts both operands
        to at scale 1; when set, the suite pins every site bitwise against it.
      materialize_at_build: create the site's state when the layer is built, from
        a canonical operand pair (fixed-shape state such as fp8 scales and amax
        histories), rather than on first use.
      fp8_target: the hardware family whose fp8 matmuls the recipe is for (a key
        of :data:`qcheck.hardware.FP8_TARGETS`: "nvidia", "mi300"); None for a
        recipe without fp8 types. The ``coverage`` invariant holds every fp8
        type the layer casts its matmul operands to, forward and backward, and
        every declared format, to that hardware's native types
        (:func:`qcheck.checks.assert_fp8_dtypes_native`): an intent independent
        of the formats, so a flavour wrong in declaration and site alike fails.
    """

    def __init__(
        self,
        name: str,
        *,
        lhs: str | None = None,
        rhs: str | None = None,
        grad: str | None = None,
        apply_rngs: ApplyRngs = ApplyRngs.NONE,
        max_rel_norm: float = 0.22,
        max_grad_rel_norm: float | None = None,
        cast_dtype: np.dtype | type | None = None,
        materialize_at_build: bool = False,
        fp8_target: str | None = None,
    ):
        if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            raise ValueError(f"recipe name must match [a-z][a-z0-9_]*, got {name!r}")
        if not 0.0 < max_rel_norm < 1.0:
            raise ValueError(f"max_rel_norm must lie in (0, 1), got {max_rel_norm}")
        if max_grad_rel_norm is None:
            max_grad_rel_norm = DEFAULT_RECIPE_MAX_GRAD_REL_NORM
        if not 0.0 < max_grad_rel_norm < 1.0:
            raise ValueError(f"max_grad_rel_norm must lie in (0, 1), got {max_grad_rel_norm}")
        if not isinstance(apply_rngs, ApplyRngs):
            raise TypeError(f"apply_rngs must be an ApplyRngs, got {apply_rngs!r}")
        for arg, fmt in (("lhs", lhs), ("rhs", rhs), ("grad", grad)):
            if fmt is not None:
                check_choice(f"{arg} format", fmt, formats.format_names())
        if (lhs is None) != (rhs is None):
            raise TypeError(f"Recipe {name!r}: give both lhs= and rhs=, or neither")
        if lhs is None and type(self).site_module is Recipe.site_module:
            raise TypeError(
                f"Recipe {name!r} needs lhs= and rhs= formats (one of {', '.join(formats.format_names())}), "
                "or a subclass that defines site_module(name)"
            )
        if grad is not None and lhs is None:
            raise TypeError(f"Recipe {name!r}: grad= needs lhs= and rhs= too")
        self.name = name
        self.lhs, self.rhs, self.grad = lhs, rhs, grad
        self.max_rel_norm = float(max_rel_norm)
        self.max_grad_rel_norm = float(max_grad_rel_norm)
        self.apply_rngs = apply_rngs
        self.cast_dtype = None if cast_dtype is None else np.dtype(cast_dtype)
        self.materialize_at_build = materialize_at_build
        if fp8_target is not None:
            from qcheck.hardware import FP8_TARGETS

            check_choice("fp8_target", fp8_target, FP8_TARGETS)
        self.fp8_target = fp8_target

    #: The layer paths the suite's cases run this recipe on. A recipe that
    #: differs from another only on one path narrows it, so the suite does not
    #: run the other path's cases twice (qcheck.adapters.aqt_int8_ragged).
    paths: tuple[str, ...] = ("dense", "sparse")

    #: The paths on which the suite holds the sites' gradients bitwise to a
    #: reference (the ``backward`` invariant). A recipe narrows it where no
    #: exact reference exists, saying why (qcheck.adapters' library recipes);
    #: ``grads`` (the gradients against the none twin's) runs on every path.
    backward_paths: tuple[str, ...] = ("dense", "sparse")

    #: Which operands the gradient matmuls of a site take, which the ``backward``
    #: reference follows: "quantized" (g against the operands as the forward
    #: pass quantized them: fp8 recipes, and straight-through quantizers) or
    #: "original" (g against the operands as the site received them, as qwix's
    #: QAT keeps them for its backward pass).
    grad_operands: str = "quantized"

    #: How a site multiplies its quantized operands, which the ``exact``
    #: reference follows: "float" (the float32 matmul of dequantized operands)
    #: or "integer" (int8 codes in integer arithmetic, scales applied after, as
    #: AQT does: :mod:`qcheck.referees._integer`).
    matmul: str = "float"

    #: What the recipe's library refuses by design (:class:`qcheck.recipes.Unsupported`):
    #: the suite runs none of those checks there, the matrix names the reason,
    #: and pytest asserts the library still refuses.
    unsupported: tuple = ()
    #: Library defects a check of the suite catches (:class:`qcheck.recipes.KnownDefect`):
    #: the check runs there and must fail with the declared message.
    known_defects: tuple = ()

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
