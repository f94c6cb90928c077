"""AQT v2 (pip ``aqtp``) as qcheck recipes: ``AqtEinsum`` at every call site, on both paths by default.

Facts this adapter is built around (aqtp 0.9.0 on jax 0.10.2 and 0.12.0.1):
``aqt_ragged_dot.ragged_dot`` has no backward pass (``jax.grad`` raises), its
default ``cfg`` is one object built at import time which every call mutates
(``cfg.fwd.dot_general = RaggedDot(group_sizes)``), and it calibrates the
weight over the expert axis too, so all experts share one weight scale. Each
site here gets its own config from the factory, never AQT's shared default.

So the sparse path runs through the site's ``AqtEinsum`` by default
(``ragged="einsum"``): a recipe must survive every invariant, and qcheck's
golden cases and train step take a gradient. ``ragged="aqt"`` runs AQT's own
ragged_dot, for forward-only use (registered as ``aqt_int8_ragged``): the
recipe declares the missing gradient (:data:`AQT_RAGGED_NO_GRADIENT`, the
suite asserts AQT still refuses it) and the shared weight scale, which the
``exact`` check catches (:data:`AQT_RAGGED_SHARED_SCALE`, its failure
asserted). Its defects are also pinned in qcheck's tests/test_adapters.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from flax import linen as nn

try:
    from aqt.jax.v2 import aqt_dot_general, aqt_ragged_dot
    from aqt.jax.v2 import config as aqt_config
    from aqt.jax.v2.flax import aqt_flax
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "qcheck.adapters' AQT recipes need AQT v2: pip install 'qcheck[aqt]' (the aqtp package)"
    ) from e

from qcheck._choices import require_choice
from qcheck.adapters._ragged import ragged_dot_from_einsum
from qcheck.recipes import ApplyRngs, Expect, KnownDefect, Recipe, Reference, Unsupported

#: How an AQT recipe's sparse-path (ragged_dot) sites multiply.
#: "aqt": AQT's own aqt_ragged_dot.ragged_dot (forward only, one weight scale across experts).
#: "einsum": every row against its own group through the site's AqtEinsum (per-expert scales, has a backward).
AQT_RAGGED = ("aqt", "einsum")

ConfigFactory = Callable[[], "aqt_dot_general.DotGeneral"]


def _grad_through_aqt_ragged_dot() -> None:
    # The smallest case: jitted, as a train step runs it (eager, aqtp 0.9.0 also warns on jax 0.10).
    def loss(lhs, rhs, group_sizes):
        return aqt_ragged_dot.ragged_dot(lhs, rhs, group_sizes, cfg=aqt_config.config_v4()).sum()

    jax.jit(jax.grad(loss, argnums=(0, 1)))(
        jax.numpy.ones((3, 4)), jax.numpy.ones((2, 4, 5)), jax.numpy.asarray([1, 2], jax.numpy.int32))


#: AQT's ragged_dot has no backward pass: its docstring says "Currently only forward pass is supported",
#: and jax.grad through it raises an IndexError while tracing.
AQT_RAGGED_NO_GRADIENT = Unsupported(
    library="aqtp",
    kind="gradient",
    paths=("sparse",),
    reason="aqt_ragged_dot.ragged_dot has no backward pass (\"Currently only forward pass is supported\")",
    reproduce=_grad_through_aqt_ragged_dot,
    raises=IndexError,
    match="out of bounds",
)

#: AQT's ragged_dot calibrates the weight over [experts, contraction] (its source: "We want to use the same
#: scale for all the experts in the rhs"), so the `exact` check, which scales per expert, fails naming it.
AQT_RAGGED_SHARED_SCALE = KnownDefect(
    library="aqtp",
    invariant="exact",
    paths=("sparse",),
    reason="aqt_ragged_dot.ragged_dot shares one weight scale across all experts",
    match=r"equals rhs with one weight scale shared across groups .* bitwise",
)
#: The same defect, seen by the coverage map holding each site to the recipe's declared int8_aqt codes.
AQT_RAGGED_SHARED_SCALE_CODES = dataclasses.replace(
    AQT_RAGGED_SHARED_SCALE, invariant="coverage",
    match=r"rhs \(weight\): codes are not int8_aqt's: .* they match one scale shared across axis 0")


class AqtSite(nn.Module):
    """One call site: an ``AqtEinsum`` with its own config; ``ragged_dot`` as ``ragged`` says.

    The site holds the config factory, not a config: AQT configs are mutable
    and unhashable, and a Linen module's fields must hash for the layer's
    graph definition to be a static jit argument (as qcheck's train step uses it).
    """

    config_factory: ConfigFactory
    ragged: str

    def setup(self):
        self.einsum = aqt_flax.AqtEinsum(cfg=self.config_factory())

    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return self.einsum(eqn, lhs, rhs)

    def ragged_dot(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        if self.ragged == "einsum":
            return ragged_dot_from_einsum(self.einsum, lhs, rhs, group_sizes)
        # AQT's ragged_dot writes the group sizes into the config it is given
        # (its default is one module-level object): a new config per call.
        return aqt_ragged_dot.ragged_dot(lhs, rhs, group_sizes, cfg=self.config_factory())


class AqtRecipe(Recipe):
    """Every call site runs AQT v2 with a fresh config from ``config_factory``."""

    # config_v4's forward: int8 codes multiplied with an int32 accumulator,
    # the lhs scale applied to the float32 sum, then the rhs scale
    # (aqt_dot_general._qtensor_dot_general, QTensor.dequant).
    reference = Reference(matmul="integer")

    def __init__(
        self,
        name: str,
        config_factory: ConfigFactory = aqt_config.config_v4,
        *,
        ragged: str = "einsum",
        lhs: str | None = None,
        rhs: str | None = None,
        expect: Expect | None = None,
    ):
        if not callable(config_factory):
            raise TypeError(
                f"config_factory must be a callable returning an AQT DotGeneral config, got {config_factory!r}"
            )
        probe = config_factory()
        if not isinstance(probe, aqt_dot_general.DotGeneral):
            raise TypeError(
                f"config_factory must return an aqt.jax.v2 DotGeneral config, got {type(probe).__name__}"
            )
        # PRIVATE: AQT draws its gradient stochastic rounding from the "params"
        # stream of each module, which upstream forks per module.
        super().__init__(name, lhs=lhs, rhs=rhs, apply_rngs=ApplyRngs.PRIVATE, expect=expect)
        self.config_factory = config_factory
        self.ragged = require_choice("ragged", ragged, AQT_RAGGED)
        # AQT quantizes gradients its own way (config_v4: dlhs in int8 with
        # stochastic rounding from its own RNG), which no qcheck referee models:
        # no exact backward check. `grads` still holds them to the none twin's.
        self.expect = self.expect.narrow_backward(())
        if self.ragged == "aqt":
            refused = (AQT_RAGGED_NO_GRADIENT,)
            # What the exact check sees only where formats are declared.
            defects = (AQT_RAGGED_SHARED_SCALE, AQT_RAGGED_SHARED_SCALE_CODES) if lhs == rhs == "int8_aqt" else ()
            self.expect = dataclasses.replace(self.expect, unsupported=self.expect.unsupported + refused,
                                              known_defects=self.expect.known_defects + defects)

    def site_module(self, name: str) -> nn.Module:
        return AqtSite(config_factory=self.config_factory, ragged=self.ragged)

    def __repr__(self) -> str:
        factory = getattr(self.config_factory, "__name__", repr(self.config_factory))
        return f"AqtRecipe({self.name!r}, {factory}, ragged={self.ragged!r})"


def aqt_recipe(
    name: str,
    config_factory: ConfigFactory = aqt_config.config_v4,
    *,
    ragged: str = "einsum",
    lhs: str | None = None,
    rhs: str | None = None,
    expect: Expect | None = None,
) -> AqtRecipe:
    """A recipe running ``AqtEinsum(cfg=config_factory())`` at every einsum call site.

    ``ragged`` picks the sparse path's grouped matmul (:data:`AQT_RAGGED`): the
    default ``"einsum"`` has a backward pass and per-expert weight scales;
    ``"aqt"`` (AQT's ragged_dot) has neither, and declares
    :data:`AQT_RAGGED_NO_GRADIENT`. ``lhs``/``rhs``: the qcheck formats the
    config's forward quantizes to, if any (``int8_aqt`` for ``config_v4``),
    which turns on the ``exact`` check in integer arithmetic. ``expect``
    (:class:`qcheck.Expect`): the bounds and paths; the library's limits (no
    backward reference, the refusals of ``"aqt"``) are added to it.
    """
    return AqtRecipe(name, config_factory, ragged=ragged, lhs=lhs, rhs=rhs, expect=expect)


def aqt_int8() -> AqtRecipe:
    """AQT v2's default int8 (``config_v4``: absmax/127.5 scales, stochastic rounding of dlhs), AqtEinsum on both paths."""
    return aqt_recipe("aqt_int8", lhs="int8_aqt", rhs="int8_aqt")


def aqt_int8_ragged() -> AqtRecipe:
    """:func:`aqt_int8` with AQT's own ``ragged_dot`` on the sparse path: forward only, one weight scale."""
    # Only the sparse path: its dense path is aqt_int8's, the same AqtEinsum, the same cases.
    return aqt_recipe("aqt_int8_ragged", ragged="aqt", lhs="int8_aqt", rhs="int8_aqt", expect=Expect(paths=("sparse",)))
