"""The Recipe type, the ApplyRngs modes and the recipe registry."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable

import jax
import numpy as np
from flax import linen as nn

__all__ = ["ApplyRngs", "Recipe", "get_recipe", "recipe_names", "register_recipe"]


class ApplyRngs(enum.Enum):
    """How a recipe's call sites use random numbers.

    NONE: the recipe never draws, so its sites carry no RNG stream at all.
    SHARED: it draws, but folds a per-site hash into what it draws, so every site
      can use the caller's stream; the compiled step pays for RNG state once.
    PRIVATE: each site keeps its own forked stream, which an unrolled model pays
      for once per site per layer. The default for a recipe that does not say.
    """

    NONE = "none"
    SHARED = "shared"
    PRIVATE = "private"


class Recipe:
    """A quantization recipe: what every einsum call site of a layer does.

    A subclass supplies :meth:`site_module`, which returns a Linen module with
    ``__call__(eqn, lhs, rhs)`` and ``ragged_dot(lhs, rhs, group_sizes)``. qcheck
    bridges one instance per call site into NNX, so no two sites share state.

    Attributes:
      name: registry key, also the golden directory name.
      max_rel_norm: the bound ``assert_tracks`` uses against the ``none`` twin.
      apply_rngs: how the sites use random numbers (:class:`ApplyRngs`).
      cast_dtype: the fp8 element type a freshly built site casts both operands
        to at scale 1; when set, the suite pins every site bitwise against it.
      materialize_at_build: create the site's state when the layer is built, from
        a canonical operand pair (fixed-shape state such as fp8 scales and amax
        histories), rather than on first use.
    """

    def __init__(
        self,
        name: str,
        *,
        max_rel_norm: float = 0.22,
        apply_rngs: ApplyRngs = ApplyRngs.PRIVATE,
        cast_dtype: np.dtype | type | None = None,
        materialize_at_build: bool = False,
    ):
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            raise ValueError(f"recipe name must match [a-z][a-z0-9_]*, got {name!r}")
        if not 0.0 < max_rel_norm < 1.0:
            raise ValueError(f"max_rel_norm must lie in (0, 1), got {max_rel_norm}")
        if not isinstance(apply_rngs, ApplyRngs):
            raise TypeError(f"apply_rngs must be an ApplyRngs, got {apply_rngs!r}")
        self.name = name
        self.max_rel_norm = float(max_rel_norm)
        self.apply_rngs = apply_rngs
        self.cast_dtype = None if cast_dtype is None else np.dtype(cast_dtype)
        self.materialize_at_build = materialize_at_build

    @property
    def quantized(self) -> bool:
        """False only for the unquantized reference recipe."""
        return True

    def site_module(self, name: str) -> nn.Module:
        """A new Linen module for the call site called ``name``."""
        raise NotImplementedError(f"{type(self).__name__} must define site_module(name)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


_REGISTRY: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to the registry; a name already taken is a ValueError."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"register_recipe expects a qcheck.Recipe, got {type(recipe).__name__}")
    if recipe.name in _REGISTRY:
        raise ValueError(f"a recipe named {recipe.name!r} is already registered")
    _REGISTRY[recipe.name] = recipe
    return recipe


def recipe_names() -> tuple[str, ...]:
    """Registered recipe names, in registration order."""
    return tuple(_REGISTRY)


def get_recipe(name: str | Recipe) -> Recipe:
    """The registered recipe called ``name`` (a Recipe passes through)."""
    if isinstance(name, Recipe):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown recipe {name!r}; registered recipes: {', '.join(_REGISTRY)}"
        ) from None


@dataclasses.dataclass(frozen=True)
class MatmulAxes:
    """Contraction axes of a two-operand matmul, forward and backward.

    ``lhs``/``rhs``: the operands' contracted axes. ``dgrad``/``wgrad``: the
    axes of the output gradient contracted to form the lhs and rhs gradients.
    """

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    dgrad: tuple[int, ...]
    wgrad: tuple[int, ...]


#: ragged_dot(lhs[m, k], rhs[g, k, n]) -> [m, n].
RAGGED_AXES = MatmulAxes(lhs=(1,), rhs=(1,), dgrad=(1,), wgrad=(0,))


def einsum_axes(eqn: str, lhs_ndim: int, rhs_ndim: int) -> MatmulAxes:
    """The :class:`MatmulAxes` of an explicit two-operand einsum ``eqn``."""
    if "->" not in eqn or "..." in eqn:
        raise ValueError(f"einsum equation must be explicit ('ab,bc->ac') without '...', got {eqn!r}")
    inputs, out = eqn.replace(" ", "").split("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        raise ValueError(f"einsum equation must have two operands, got {eqn!r}")
    lhs, rhs = parts
    if (len(lhs), len(rhs)) != (lhs_ndim, rhs_ndim):
        raise ValueError(
            f"einsum {eqn!r} expects operands of rank {len(lhs)} and {len(rhs)}, "
            f"got rank {lhs_ndim} and {rhs_ndim}"
        )
    contracted = [c for c in lhs if c in rhs and c not in out]
    return MatmulAxes(
        lhs=tuple(lhs.index(c) for c in contracted),
        rhs=tuple(rhs.index(c) for c in contracted),
        dgrad=tuple(i for i, c in enumerate(out) if c in rhs and c not in lhs),
        wgrad=tuple(i for i, c in enumerate(out) if c in lhs and c not in rhs),
    )


def straight_through(quantize: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``quantize`` in the forward pass, identity in the backward pass, bit for bit."""

    @jax.custom_vjp
    def f(x):
        return quantize(x)

    f.defvjp(lambda x: (quantize(x), None), lambda _, g: (g,))
    return f
