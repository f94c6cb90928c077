"""The one table of cases — recipe × model × path (× token dropping) — and its cached layers.

pytest parametrization, the CLI matrix and golden discovery all read this
table. Layers and their outputs are built once per process and reused; nothing
here mutates a cached layer (steps are functional), so every reader sees a
fresh layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from qcheck import formats
from qcheck.layers import step
from qcheck._choices import require_choice
from qcheck.layers.decoder import Decoder, build_decoder
from qcheck.layers.moe import MESH_AXES, MODELS, PATHS, MoE, build_moe, capacity, draw_normal
from qcheck.recipes import ApplyRngs, Recipe, get_recipe, recipe_names

__all__ = [
    "BATCH",
    "DROP_CAPACITY_FACTOR",
    "DROP_MODELS",
    "REFEREE_ATOL",
    "REFEREE_RTOL",
    "SEED",
    "SEQ",
    "VARIANTS",
    "Case",
    "Variant",
    "cases",
    "decoder",
    "layer",
    "layer_input",
    "layer_output",
    "forward_output",
    "grad_leaves",
    "gradient_tiles",
    "has_gradients",
    "train_step_runs",
    "layer_step",
    "mesh",
    "sharded_layer",
]

SEED = 0
BATCH, SEQ = 2, 32
#: Capacity factor of the token-dropping variants: tight enough that uneven
#: routing drops tokens on both models at the default seed.
DROP_CAPACITY_FACTOR = 1.0
#: The unquantized layer against the float64 referee (the ``referee`` invariant), per token:
#: ||layer - referee|| <= atol + rtol ||referee|| over its output vector. Measured (jax 0.10.2, CPU,
#: seed 0) on both models, both paths, with and without dropping: at most 5.0e-7 of a token's norm
#: (float32 rounding of emb-32, mlp-64 sums); a token whose every expert is dropped is 0 in both.
REFEREE_RTOL, REFEREE_ATOL = 1e-5, 1e-6


@dataclasses.dataclass(frozen=True, order=True)
class Variant:
    """One layer shape: model, path and whether tokens are dropped."""

    model: str
    path: str
    dropping: bool

    @property
    def capacity_factor(self) -> float:
        return DROP_CAPACITY_FACTOR if self.dropping else -1.0

    @property
    def id(self) -> str:
        return f"{self.model}-{self.path}" + ("-drop" if self.dropping else "")

    @property
    def referee_tolerance(self) -> tuple[float, float]:
        """``(rtol, atol)`` of this shape's unquantized layer against the float64 referee: the same on every row."""
        return REFEREE_RTOL, REFEREE_ATOL


#: Token dropping on the dense path adds the dispatch and combine call sites.
#: Their operands differ between the two models in the expert count alone (the
#: capacity is 8 slots on both), so the table drops tokens on Mixtral only:
#: seven more layers to compile would add coverage of one axis length. Dropping
#: on the sparse path only zeroes some combine weights, with the sparse path's
#: call sites. Both still run, on both models, for ``none``: dense dropping
#: against sparse dropping (invariants.PATHS).
DROP_MODELS = ("mixtral",)
VARIANTS: tuple[Variant, ...] = tuple(
    Variant(m, p, d)
    for m in MODELS
    for p, d in (("dense", False), ("dense", True), ("sparse", False))
    if not d or m in DROP_MODELS
)


@dataclasses.dataclass(frozen=True, order=True)
class Case:
    """A recipe on a variant: one cell of the matrix."""

    recipe: str
    variant: Variant

    @property
    def id(self) -> str:
        return f"{self.recipe}-{self.variant.id}"

    @property
    def reference(self) -> Case:
        """The unquantized twin: same variant, same seed, recipe ``none``."""
        return Case("none", self.variant)


def cases(
    recipes: tuple[str, ...] | None = None,
    *,
    models: tuple[str, ...] | None = None,
    paths: tuple[str, ...] | None = None,
) -> list[Case]:
    """Every case for ``recipes`` (default: all registered), optionally only some models and paths."""
    names = recipe_names() if recipes is None else recipes
    for name in names:
        get_recipe(name)  # unknown names fail here with the list of valid ones
    for kind, chosen, valid in (("model", models, MODELS), ("path", paths, PATHS)):
        for value in chosen or ():
            require_choice(kind, value, valid)
    return [
        Case(r, v)
        for r in names
        for v in VARIANTS
        if v.path in get_recipe(r).expect.paths
        and (models is None or v.model in models) and (paths is None or v.path in paths)
    ]


def has_gradients(recipe: Recipe, variant: Variant) -> bool:
    """Whether the case's layer has gradients to take: a quantized case trains where it has (``grads``, gradients in
    golden).

    Not where the recipe's library refuses gradients on the path (a declared
    cell, :mod:`qcheck.suite._declared_cells`), nor where the gradient format's blocks
    cannot tile the weight gradient's contraction: on the dropping layer that
    runs over batch x capacity tokens per expert (2 x 8 = 16), fewer than
    MXFP8's 32.
    """
    if any(u.kind == "gradient" and variant.path in u.paths for u in recipe.expect.unsupported):
        return False
    return gradient_tiles(recipe, variant)


def gradient_tiles(recipe: Recipe, variant: Variant) -> bool:
    """Whether the recipe's gradient blocks tile the variant's gradient matmuls, so a backward pass traces."""
    block = formats.block_size(recipe.grad) if recipe.grad else None
    if block is None or not variant.dropping:
        return True
    return (BATCH * capacity(MODELS[variant.model], variant.capacity_factor, SEQ)) % block == 0


def train_step_runs(recipe: Recipe, variant: Variant) -> bool:
    """Whether the case's train step runs: ``none`` always, quantized recipes where ``grads`` applies."""
    return not recipe.quantized or has_gradients(recipe, variant)


@functools.cache
def layer(case: Case) -> MoE:
    """The fresh layer for ``case``, built once per process."""
    v = case.variant
    return build_moe(v.model, case.recipe, path=v.path, capacity_factor=v.capacity_factor, seed=SEED)


@functools.cache
def layer_input(model: str) -> jax.Array:
    """The fixed ``[BATCH, SEQ, emb]`` input every case of ``model`` is run on."""
    emb = MODELS[model].emb
    return draw_normal(SEED + 1, (BATCH, SEQ, emb))


@functools.cache
def layer_step(case: Case) -> step.StepOutput:
    """One train step of the fresh layer on :func:`layer_input`."""
    return step.train_step(layer(case), layer_input(case.variant.model))


def grad_leaves(grads: nnx.State) -> dict[str, np.ndarray]:
    """Each Param's gradient in a train step's ``grads``, by dotted path."""
    return {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}


@functools.cache
def layer_output(case: Case) -> np.ndarray:
    """The fresh layer's forward output on :func:`layer_input`, as a host array.

    Where the case's train step runs (:func:`train_step_runs`) the ``grads``
    invariant and golden compile it anyway, so the output is the forward pass
    inside it: one program per case, not a forward program beside it.
    """
    if train_step_runs(get_recipe(case.recipe), case.variant):
        return np.asarray(layer_step(case).output)
    return forward_output(case)


@functools.cache
def forward_output(case: Case) -> np.ndarray:
    """The fresh layer's output from the forward program alone (for fp8-class recipes, not the train step)."""
    return np.asarray(step.apply(layer(case), layer_input(case.variant.model))[0])


@functools.cache
def mesh() -> Mesh:
    """The suite's device mesh: eight host CPU devices as ("data", "expert") = (2, 4), on any host."""
    devices = jax.devices("cpu")
    if len(devices) < 8:
        raise RuntimeError(
            f"the sharded cases need 8 CPU devices, found {len(devices)}; qcheck.suite._process.configure() "
            "asks the host platform for 8, but only if it runs before JAX starts"
        )
    return Mesh(np.array(devices[:8]).reshape(2, 4), MESH_AXES)


def sharded_layer(case: Case, mesh: Mesh) -> MoE:
    """The case's layer built on ``mesh`` (not cached: the ``sharded`` check builds its twin itself)."""
    v = case.variant
    return build_moe(v.model, case.recipe, path=v.path, capacity_factor=v.capacity_factor, seed=SEED, mesh=mesh)


@functools.cache
def decoder(model: str, recipe: str, layers: int, *, scan: bool = False,
            apply_rngs: ApplyRngs | None = None) -> Decoder:
    """A fresh decoder stack, built once per process."""
    return build_decoder(model, recipe, layers=layers, scan=scan, seed=SEED, apply_rngs=apply_rngs)
