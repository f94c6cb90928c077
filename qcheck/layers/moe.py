"""Tiny Mixtral- and Gemma-style MoE layers in Flax NNX, with quantized call sites.

Two routers (Mixtral: softmax over the top-k logits; Gemma: softmax over all
experts in float32, top-k, renormalize, per-expert output scale) and two
formulations of the same function: ``dense`` (einsums over every expert, with
optional capacity-based token dropping through dispatch/combine einsums) and
``sparse`` (tokens sorted by expert, grouped matmuls via ``jax.lax.ragged_dot``).
Every matmul that touches expert weights, and dispatch/combine when tokens are
dropped, goes through a named call site: a :class:`~qcheck.layers.bridge.QuantSite`, or for
the unquantized recipe a plain NNX module that interception libraries can walk.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qcheck._choices import require_choice
from qcheck.layers.bridge import QuantSite
from qcheck.libraries import Declaration, RoleFormat
from qcheck.recipes import (ApplyRngs, Einsum, InterceptRecipe, Matmul, Ragged, Recipe, UnquantizedSite,
                            get_recipe)

__all__ = ["MESH_AXES", "MODELS", "PATHS", "UNQUANTIZED_BY_DESIGN", "MoE", "MoEConfig", "SiteSpec", "build_moe",
           "draw_normal", "transform_layer"]

#: The mesh axes a sharded layer expects: tokens split over "data", experts over "expert".
MESH_AXES = ("data", "expert")

Path = Literal["dense", "sparse"]
PATHS: tuple[str, ...] = ("dense", "sparse")


def _generator(seed: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream])))


def draw_normal(seed: int, shape: tuple[int, ...], stream: int = 1) -> jax.Array:
    """Standard normal float32 values of ``shape``, from numpy's generator on ``(seed, stream)``.

    qcheck's layers and inputs draw from numpy, not ``jax.random``: a jax release changes
    ``jax.random.normal``'s bits for the same key (0.12.1 did), and every layer built from its seed,
    with every golden case, would move with it.
    """
    return jnp.asarray(_generator(seed, stream).standard_normal(shape, dtype=np.float32))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of a tiny MoE layer."""

    model: str
    emb: int
    mlp: int
    num_experts: int
    top_k: int
    router: Literal["mixtral", "gemma"]
    activation: Literal["silu", "gelu"]


# Small enough to build and compile in well under a second, large enough that
# top-k routing is uneven and a block format has whole blocks (emb, mlp and the
# token count per row are multiples of 32).
MODELS: dict[str, MoEConfig] = {
    "mixtral": MoEConfig("mixtral", emb=32, mlp=64, num_experts=8, top_k=2,
                         router="mixtral", activation="silu"),
    "gemma": MoEConfig("gemma", emb=32, mlp=32, num_experts=16, top_k=4,
                       router="gemma", activation="gelu"),
}


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """What one call site computes for a given input: its matmul (a ragged_dot's groups split evenly) and operand
    shapes."""

    matmul: Matmul
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]


# Einsum letters: B batch, S seq, M emb, H mlp, E experts, C capacity.
_DENSE_EQNS = {"wi": "BSM,EMH->BSEH", "wo": "BSEH,EHM->BSEM"}
_DROP_EQNS = {
    "dispatch": "BSM,BSEC->EBCM",
    "wi": "EBCM,EMH->EBCH",
    "wo": "EBCH,EHM->EBCM",
    "combine": "EBCM,BSEC->BSM",
}


def _even_groups(rows: int, groups: int) -> Ragged:
    sizes = [rows // groups] * groups
    sizes[-1] += rows - sum(sizes)
    return Ragged(sizes)


def capacity(config: MoEConfig, capacity_factor: float, seq: int) -> int:
    """Slots per expert per batch row of a token-dropping layer: ``ceil(seq * top_k * capacity_factor / experts)``."""
    return max(1, math.ceil(seq * config.top_k * capacity_factor / config.num_experts))


#: The layer's matmuls that stay in full precision by design (router, combine, dropping masks): the
#: ``skip`` for :func:`qcheck.assert_quantized`, as ``qcheck.skip_functions(*UNQUANTIZED_BY_DESIGN)``.
UNQUANTIZED_BY_DESIGN = ("MoE.route", "MoE.combine", "MoE.dropping_masks")


class MoE(nnx.Module):
    """A routed MoE feed-forward layer mapping ``[batch, seq, emb]`` to ``[batch, seq, emb]``."""

    def __init__(
        self,
        config: MoEConfig,
        recipe: Recipe,
        *,
        path: Path = "dense",
        capacity_factor: float = -1.0,
        rngs: nnx.Rngs,
        dtype: jnp.dtype = jnp.float32,
        apply_rngs: ApplyRngs | None = None,
        mesh: Mesh | None = None,
        seed: int | None = None,
    ):
        self.config = config
        self.mesh = _check_mesh(mesh, config)
        self.recipe_name = recipe.name
        self.recipe_formats = recipe_formats(recipe)
        self.path = require_choice("path", path, PATHS)
        self.capacity_factor = float(capacity_factor)
        self.dtype = jnp.dtype(dtype)
        e, m, h = config.num_experts, config.emb, config.mlp

        # Weights are drawn before any site forks the streams, in a fixed order,
        # so the same seed gives the same weights whatever the recipe or path.
        # With a seed (build_moe's) they come from numpy's generator, which no jax
        # release moves, scaled in numpy (XLA may compute a division by a constant
        # as a product with its reciprocal); from the stream where there is none
        # (a scanned decoder builds its layers under nnx.vmap, one draw per layer).
        # On a mesh, expert weights are split over "expert", the router replicated.
        gen = None if seed is None else _generator(seed, 0)

        def param(w, *spec):
            return nnx.Param(w if mesh is None else jax.device_put(w, self._sharding(*spec)))

        def init(shape, fan_in, *spec):
            if gen is None:
                return param(jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in), *spec)
            w = gen.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(fan_in))
            return param(jnp.asarray(w.astype(np.float32)), *spec)

        self.gate = init((m, e), m)
        self.wi_0 = init((e, m, h), m, "expert")
        self.wi_1 = init((e, m, h), m, "expert")
        self.wo = init((e, h, m), h, "expert")
        if config.router == "gemma":
            # Drawn around 1, not 1: at 1 a layer that drops the scale computes the same function.
            if gen is None:
                scale = 1 + jax.random.uniform(rngs.params(), (e,), jnp.float32, minval=-0.5, maxval=0.5)
            else:
                scale = jnp.asarray((np.float32(0.5) + gen.random((e,), dtype=np.float32)).astype(np.float32))
            self.per_expert_scale = param(scale, "expert")

        names = ["wi_0", "wi_1", "wo"]
        if self.dropping and self.path == "dense":
            names = ["dispatch", *names, "combine"]
        self.sites = nnx.Dict({n: _site(recipe, n, rngs, apply_rngs, self.dtype) for n in names})

    def qcheck_declaration(self) -> Declaration | None:
        """What this layer declares, read by ``check_layer`` and ``coverage`` by default: the formats of the
        recipe it was built with (None where the recipe names none: a library's own configuration)."""
        quantized, lhs, rhs, grad = self.recipe_formats
        source = f"the layer's recipe {self.recipe_name!r}"
        if not quantized:
            return Declaration({"weights": None, "activations": None}, source)
        if lhs is None or rhs is None:
            return None
        roles = {"activations": RoleFormat(lhs), "weights": RoleFormat(rhs)}
        if grad is not None:
            roles["grads"] = RoleFormat(grad)
        return Declaration(roles, source)

    def _sharding(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, P(*spec))

    def _constrain(self, x: jax.Array, *spec) -> jax.Array:
        """Pin ``x``'s layout on the mesh (tokens over "data", experts over "expert"); a no-op without one."""
        return x if self.mesh is None else jax.lax.with_sharding_constraint(x, self._sharding(*spec))

    @property
    def dropping(self) -> bool:
        return self.capacity_factor > 0

    def site_names(self) -> tuple[str, ...]:
        return tuple(self.sites.keys())

    def get_einsum(self, name: str) -> QuantSite | UnquantizedSite:
        """The quantized callable ``(eqn, lhs, rhs) -> array`` used at call site ``name``."""
        # By its keys: flax 0.12.3's nnx.Dict raises AttributeError for a missing key, which `in` does not catch.
        if name not in list(self.sites):
            raise ValueError(
                f"einsum name {name!r} is not registered on this layer; "
                f"registered names: {', '.join(self.sites.keys())}"
            )
        return self.sites[name]

    def capacity(self, seq: int) -> int:
        """Slots per expert per batch row when dropping."""
        return capacity(self.config, self.capacity_factor, seq)

    def site_specs(self, batch: int, seq: int) -> dict[str, SiteSpec]:
        """The operand shapes each call site sees for an input of shape ``[batch, seq, emb]``."""
        c = self.config
        b, s, m, h, e = batch, seq, c.emb, c.mlp, c.num_experts
        if self.path == "sparse":
            t = b * s * c.top_k
            return {
                "wi_0": SiteSpec(_even_groups(t, e), (t, m), (e, m, h)),
                "wi_1": SiteSpec(_even_groups(t, e), (t, m), (e, m, h)),
                "wo": SiteSpec(_even_groups(t, e), (t, h), (e, h, m)),
            }
        if not self.dropping:
            return {
                "wi_0": SiteSpec(Einsum(_DENSE_EQNS["wi"]), (b, s, m), (e, m, h)),
                "wi_1": SiteSpec(Einsum(_DENSE_EQNS["wi"]), (b, s, m), (e, m, h)),
                "wo": SiteSpec(Einsum(_DENSE_EQNS["wo"]), (b, s, e, h), (e, h, m)),
            }
        cap = self.capacity(s)
        return {
            "dispatch": SiteSpec(Einsum(_DROP_EQNS["dispatch"]), (b, s, m), (b, s, e, cap)),
            "wi_0": SiteSpec(Einsum(_DROP_EQNS["wi"]), (e, b, cap, m), (e, m, h)),
            "wi_1": SiteSpec(Einsum(_DROP_EQNS["wi"]), (e, b, cap, m), (e, m, h)),
            "wo": SiteSpec(Einsum(_DROP_EQNS["wo"]), (e, b, cap, h), (e, h, m)),
            "combine": SiteSpec(Einsum(_DROP_EQNS["combine"]), (e, b, cap, m), (b, s, e, cap)),
        }

    # -- routing -----------------------------------------------------------

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-token expert weights ``[B, S, k]`` (float32) and expert indices ``[B, S, k]``."""
        c = self.config
        logits = jnp.einsum("BSM,ME->BSE", x.astype(jnp.float32), self.gate[...])
        if c.router == "mixtral":
            top, idx = jax.lax.top_k(logits, c.top_k)
            return jax.nn.softmax(top, axis=-1), idx
        probs = jax.nn.softmax(logits, axis=-1)
        _, idx = jax.lax.top_k(logits, c.top_k)
        w = jnp.take_along_axis(probs, idx, axis=-1)
        w = w / jnp.sum(w, axis=-1, keepdims=True)
        return w * self.per_expert_scale[...][idx], idx

    def assignment_slots(self, idx: jax.Array) -> jax.Array:
        """For each (token, choice), its position in its expert's queue within the batch row.

        Tokens claim slots in sequence order, first choice before second, as in
        MaxText's capacity dropping; a position >= capacity means dropped.
        """
        b, s, k = idx.shape
        onehot = jax.nn.one_hot(idx.reshape(b, s * k), self.config.num_experts, dtype=jnp.int32)
        pos = jnp.cumsum(onehot, axis=1) - 1
        return jnp.sum(pos * onehot, axis=-1).reshape(b, s, k)

    # -- the two formulations ---------------------------------------------

    def _act(self, h0: jax.Array, h1: jax.Array) -> jax.Array:
        if self.config.activation == "silu":
            return jax.nn.silu(h0) * h1
        return jax.nn.gelu(h0, approximate=True) * h1

    def _weights(self):
        return tuple(w[...].astype(self.dtype) for w in (self.wi_0, self.wi_1, self.wo))

    def _dense(self, x, weights, idx):
        wi_0, wi_1, wo = self._weights()
        s = self.sites
        by_expert = ("data", None, "expert")  # [B, S, E, ...]
        h = self._act(self._constrain(s["wi_0"](_DENSE_EQNS["wi"], x, wi_0), *by_expert),
                      self._constrain(s["wi_1"](_DENSE_EQNS["wi"], x, wi_1), *by_expert))
        out = self._constrain(s["wo"](_DENSE_EQNS["wo"], h, wo), *by_expert)
        # The combine sums over experts. Summed shard by shard and then across
        # shards, Gemma's output moved by an ulp in 1 value of 6; gathering the
        # experts first keeps the single-device order (bitwise on jax 0.10.2).
        out = self._constrain(out, "data")
        combine = jnp.sum(jax.nn.one_hot(idx, self.config.num_experts) * weights[..., None], axis=2)
        return self.combine("BSEM,BSE->BSM", out, combine)

    def combine(self, eqn: str, out: jax.Array, weights: jax.Array) -> jax.Array:
        """The experts' outputs summed with the router's weights: a matmul that stays in full precision by design."""
        return jnp.einsum(eqn, out, weights.astype(self.dtype))

    def dropping_masks(self, idx: jax.Array, weights: jax.Array, seq: int) -> tuple[jax.Array, jax.Array]:
        """The one-hot dispatch ``[B, S, E, C]`` and weighted combine masks of token dropping (full precision)."""
        slot = jax.nn.one_hot(self.assignment_slots(idx), self.capacity(seq))  # out-of-range slot -> all zeros
        expert = jax.nn.one_hot(idx, self.config.num_experts)
        dispatch = jnp.einsum("BSKE,BSKC->BSEC", expert, slot).astype(self.dtype)
        combine = jnp.einsum("BSKE,BSKC,BSK->BSEC", expert, slot, weights).astype(self.dtype)
        return dispatch, combine

    def _dense_dropping(self, x, weights, idx):
        wi_0, wi_1, wo = self._weights()
        s = self.sites
        dispatch, combine = self.dropping_masks(idx, weights, x.shape[1])
        xe = self._constrain(s["dispatch"](_DROP_EQNS["dispatch"], x, dispatch), "expert", "data")
        # One call site per line, so a coverage map's location names exactly one.
        h0 = s["wi_0"](_DROP_EQNS["wi"], xe, wi_0)
        h1 = s["wi_1"](_DROP_EQNS["wi"], xe, wi_1)
        h = self._act(h0, h1)
        out = s["wo"](_DROP_EQNS["wo"], h, wo)
        return s["combine"](_DROP_EQNS["combine"], out, combine)

    def _sparse(self, x, weights, idx):
        wi_0, wi_1, wo = self._weights()
        s = self.sites
        b, sq, m = x.shape
        k, e = self.config.top_k, self.config.num_experts
        if self.dropping:
            weights = jnp.where(self.assignment_slots(idx) < self.capacity(sq), weights, 0.0)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        xs = x.reshape(b * sq, m)[order // k]
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        h0 = s["wi_0"].ragged_dot(xs, wi_0, sizes)
        h1 = s["wi_1"].ragged_dot(xs, wi_1, sizes)
        h = self._act(h0, h1)
        out = jnp.zeros((b * sq * k, m), self.dtype).at[order].set(s["wo"].ragged_dot(h, wo, sizes))
        y = self.combine("TKM,TK->TM", out.reshape(b * sq, k, m), weights.reshape(b * sq, k))
        return y.reshape(b, sq, m)

    def __call__(self, x: jax.Array) -> jax.Array:
        emb = self.config.emb
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"MoE input x must have shape [batch, seq, emb={emb}], got shape {jnp.shape(x)}")
        if x.shape[-1] != emb:
            raise ValueError(
                f"MoE input x has last axis {x.shape[-1]}, but the layer's embedding width is {emb}"
            )
        x = self._constrain(x.astype(self.dtype), "data")
        weights, idx = self.route(x)
        if self.path == "sparse":
            return self._sparse(x, weights, idx)
        if self.dropping:
            return self._dense_dropping(x, weights, idx)
        return self._dense(x, weights, idx)


def build_moe(
    model: str,
    recipe: str | Recipe,
    *,
    path: Path = "dense",
    capacity_factor: float = -1.0,
    seed: int = 0,
    dtype: jnp.dtype = jnp.float32,
    mesh: Mesh | None = None,
) -> MoE:
    """Build a tiny MoE layer; the same ``seed`` gives the same weights for every recipe and path.

    With a ``mesh`` (axes ``("data", "expert")``) the expert weights are split
    over "expert" and the layer pins tokens to "data" and its per-expert
    activations to both; XLA's SPMD partitioner does the rest, ragged matmuls
    included. The function computed is the same as without one.
    """
    config = MODELS[require_choice("model", model, tuple(MODELS))]
    recipe = get_recipe(recipe)
    intercept = isinstance(recipe, InterceptRecipe)
    layer = MoE(
        config,
        get_recipe("none") if intercept else recipe,
        path=path,
        capacity_factor=capacity_factor,
        rngs=nnx.Rngs(seed),
        dtype=dtype,
        mesh=mesh,
        seed=seed,
    )
    return transform_layer(layer, recipe) if intercept else layer


def recipe_formats(recipe: Recipe) -> tuple[bool, str | None, str | None, str | None]:
    """What a layer built with ``recipe`` declares, as it keeps it (hashable, for its graph definition):
    whether it quantizes, and its lhs (activation), rhs (weight) and output-gradient formats."""
    return bool(recipe.quantized), recipe.lhs, recipe.rhs, recipe.grad


def transform_layer(layer: MoE, recipe: InterceptRecipe) -> MoE:
    """An interception recipe's layer: ``recipe.transform`` of a freshly built ``none`` layer."""
    layer.recipe_name = recipe.name
    layer.recipe_formats = recipe_formats(recipe)
    # Libraries that initialize by running the model get a fixed sample; its values do not matter to them.
    sample = draw_normal(0, (1, 8, layer.config.emb))
    return recipe.transform(layer, sample)


def _site(recipe: Recipe, name: str, rngs: nnx.Rngs, apply_rngs: ApplyRngs | None, dtype) -> nnx.Module:
    # The unquantized layer's sites are plain NNX modules (not ToNNX), so
    # interception libraries (qwix) can walk it (qcheck.recipes.UnquantizedSite).
    if not recipe.quantized:
        return UnquantizedSite(name, rngs=rngs)
    return QuantSite(recipe, name, rngs=rngs, apply_rngs=apply_rngs, dtype=dtype)


def _check_mesh(mesh: Mesh | None, config: MoEConfig) -> Mesh | None:
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh must have axes {MESH_AXES}, got {tuple(mesh.axis_names)}")
    if config.num_experts % mesh.shape["expert"]:
        raise ValueError(
            f"mesh axis 'expert' has {mesh.shape['expert']} devices, which does not divide "
            f"{config.model}'s {config.num_experts} experts"
        )
    return mesh
