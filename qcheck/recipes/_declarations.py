"""What a recipe declares beside its quantization: how the referee computes, and what the suite expects.

A recipe's sites say how it quantizes; these two records say what qcheck
should hold the sites to. :class:`Reference` is read by the referees (the
``exact`` and ``backward`` checks), :class:`Expect` by the suite (bounds,
which cases and checks run, what a library refuses or gets wrong). Both are
frozen and check every field when built, so a bad declaration fails where it
is written, not in the middle of a suite run.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from qcheck._choices import require_choice
from qcheck.hardware import FP8_TARGETS
from qcheck.recipes._unsupported import PATHS, KnownDefect, Unsupported
from qcheck.referees import MATMUL_MODES

#: Which operands a site's gradient matmuls may take (:attr:`Reference.grad_operands`).
GRAD_OPERANDS = ("quantized", "original")

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


def _paths(arg: str, value: object, *, empty: bool) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (tuple, list)) or not (value or empty):
        kind = "a tuple" if empty else "a non-empty tuple"
        raise TypeError(f"{arg} must be {kind} of {', '.join(PATHS)}, got {value!r}")
    for path in value:
        require_choice("path", path, PATHS)
    return tuple(value)


def _declared(arg: str, value: object, cls: type) -> tuple:
    if isinstance(value, str) or not isinstance(value, (tuple, list)) or not all(isinstance(v, cls) for v in value):
        raise TypeError(f"{arg} must be a tuple of qcheck.recipes.{cls.__name__}, got {value!r}")
    return tuple(value)


def _bound(arg: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < 1.0:
        raise ValueError(f"{arg} must lie in (0, 1), got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Reference:
    """How the referee computes what a site must equal, bitwise.

    Attributes:
      matmul: how a site multiplies its quantized operands, which the ``exact``
        reference follows: "float" (the float32 matmul of dequantized operands)
        or "integer" (int8 codes in integer arithmetic, scales applied after, as
        AQT and qwix do).
      grad_operands: which operands the gradient matmuls take, which the
        ``backward`` reference follows: "quantized" (g against the operands as
        the forward pass quantized them: fp8 recipes, straight-through
        quantizers) or "original" (g against the operands as the site received
        them, as qwix's QAT keeps them for its backward pass).
      cast_dtype: the fp8 element type a freshly built site casts both operands
        to at scale 1 (delayed-scaling fp8); when set, the suite pins every site
        bitwise against that cast.
    """

    matmul: str = "float"
    grad_operands: str = "quantized"
    cast_dtype: np.dtype | None = None

    def __post_init__(self):
        require_choice("matmul", self.matmul, MATMUL_MODES)
        if self.grad_operands not in GRAD_OPERANDS:
            raise ValueError(f"grad_operands must be one of {', '.join(GRAD_OPERANDS)}, got {self.grad_operands!r}")
        if self.cast_dtype is not None:
            try:
                dtype = np.dtype(self.cast_dtype)
            except TypeError:
                raise TypeError(f"cast_dtype must be a numpy or ml_dtypes dtype, got {self.cast_dtype!r}") from None
            object.__setattr__(self, "cast_dtype", dtype)  # frozen: normalise once, here


@dataclasses.dataclass(frozen=True)
class Expect:
    """What the suite expects of a recipe: its bounds, the cases and checks it runs, its library's known failures.

    Attributes:
      max_rel_norm: the bound ``tracks`` holds the layer to against the
        ``none`` twin (0.22 fits fp8-class formats).
      max_grad_rel_norm: the bound on each parameter's gradient (one train
        step) against the twin's, which ``grads`` uses; the default is measured
        in :data:`DEFAULT_RECIPE_MAX_GRAD_REL_NORM`.
      fp8_target: the hardware family the recipe's fp8 matmuls are for (a key
        of :data:`qcheck.hardware.FP8_TARGETS`: "nvidia", "mi300"); None for a
        recipe without fp8 types. ``coverage`` then holds every fp8 type the
        layer casts its matmul operands to, forward and backward, and every
        declared format, to that hardware's native types: an intent independent
        of the formats, so a flavour wrong in declaration and site alike fails.
      paths: the layer paths the suite's cases run the recipe on. A recipe
        that differs from another only on one path narrows it, so the suite
        does not run the other path's cases twice (qcheck.adapters.aqt_int8_ragged).
      backward_paths: the paths on which ``backward`` holds the sites'
        gradients bitwise to a reference; a recipe narrows it where no exact
        reference exists, saying why (qcheck.adapters' library recipes).
        ``grads`` runs on every path.
      unsupported: what the recipe's library refuses by design
        (:class:`qcheck.recipes.Unsupported`): the suite runs none of those
        checks there, the matrix names the reason, and pytest asserts the
        library still refuses.
      known_defects: library defects a check catches
        (:class:`qcheck.recipes.KnownDefect`): the check runs there and must
        fail with the declared message.
    """

    max_rel_norm: float = 0.22
    max_grad_rel_norm: float = DEFAULT_RECIPE_MAX_GRAD_REL_NORM
    fp8_target: str | None = None
    paths: tuple[str, ...] = ("dense", "sparse")
    backward_paths: tuple[str, ...] = ("dense", "sparse")
    unsupported: tuple[Unsupported, ...] = ()
    known_defects: tuple[KnownDefect, ...] = ()

    def __post_init__(self):
        set_ = lambda field, value: object.__setattr__(self, field, value)  # noqa: E731 - frozen: normalise here
        set_("max_rel_norm", _bound("max_rel_norm", self.max_rel_norm))
        set_("max_grad_rel_norm", _bound("max_grad_rel_norm", self.max_grad_rel_norm))
        if self.fp8_target is not None:
            require_choice("fp8_target", self.fp8_target, FP8_TARGETS)
        set_("paths", _paths("paths", self.paths, empty=False))
        set_("backward_paths", _paths("backward_paths", self.backward_paths, empty=True))
        set_("unsupported", _declared("unsupported", self.unsupported, Unsupported))
        set_("known_defects", _declared("known_defects", self.known_defects, KnownDefect))

    def narrow_backward(self, paths: tuple[str, ...]) -> Expect:
        """This, with ``backward_paths`` kept only where also in ``paths``.

        What a library's recipe applies to whatever ``expect=`` its caller
        gives: on the other paths no exact gradient reference exists, and a
        caller's bounds should not switch one on.
        """
        _paths("paths", paths, empty=True)
        return dataclasses.replace(self, backward_paths=tuple(p for p in self.backward_paths if p in paths))
