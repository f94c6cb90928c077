"""JAX's own block-scaled dot (``jax.nn.scaled_dot_general``) as qcheck recipes: ``jax_mxfp8`` and ``jax_nvfp4``.

Each call site runs ``jnp.einsum`` with ``jax.nn.scaled_dot_general`` as its
dot_general, configured by ``jax.nn.get_scaled_dot_general_config("mxfp8" |
"nvfp4")``. What JAX computes (read from jax/_src/cudnn/scaled_matmul_stablehlo.py,
the same rule for float32 in jax 0.10.2 and 0.12.0.1; held bitwise to qcheck's
referees by tests/test_jax_formats.py):

- operands reshaped to (batch, rows, contraction) and quantized in blocks along
  the flattened contraction axes, taken in axis order;
- mxfp8: block scale amax / 448 rounded *up* to a power of two (OCP MX v1.0
  takes 2^(floor(log2 amax) - 8), which saturates a block whose amax significand
  exceeds 1.75), e4m3fn codes clipped to ±448: qcheck's ``mxfp8_jax``;
- nvfp4: the operand divided by its global scale, e4m3fn block scales amax / 6
  clipped to 448, e2m1 codes x / scale clipped to ±6; the product is multiplied
  by both global scales. JAX takes the global scale from the caller (default 1,
  one level); these recipes pass the power of two at or above NVIDIA's amax /
  2688 (:func:`qcheck.formats.jax_nvfp4_global_scale`), so that rescaling is
  exact: qcheck's ``nvfp4_jax``;
- backward (its ``custom_vjp``): mxfp8 quantizes the output gradient and the
  *original* other operand again in MXFP8 along the gradient matmul's
  contraction; nvfp4 multiplies the full-precision output gradient by the
  original operands, zeroing gradients where |x| > global · 6 · 448 (never, with
  these global scales).

jax 0.10.2 has no CPU lowering for the ``scaled_matmul`` primitive
("MLIR translation rule for primitive 'scaled_matmul' not found for platform
cpu"); jax 0.12 lowers it on CPU to a dequantize and a float32 dot.
:func:`scaled_dot_general_runs` says whether this backend runs it, and
:func:`qcheck.adapters.installed_recipes` offers the recipes only where it does.

The sparse path has no scaled ragged_dot in JAX: each grouped matmul runs
every row against every group through the same einsum
(:func:`qcheck.adapters.ragged_dot_from_einsum`), so the whole weight is
quantized as on the dense path.
"""

from __future__ import annotations

import dataclasses

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from qcheck import formats
from qcheck.adapters._ragged import ragged_dot_from_einsum
from qcheck.recipes import (DEFAULT_RECIPE_MAX_GRAD_REL_NORM, NVFP4_MAX_GRAD_REL_NORM, NVFP4_MAX_REL_NORM, Expect,
                            KnownDefect, Recipe)

#: The ``get_scaled_dot_general_config`` modes these recipes run, and the qcheck format each computes.
JAX_MODES = {"mxfp8": "mxfp8_jax", "nvfp4": "nvfp4_jax"}

# The built-in recipes' bounds (qcheck.recipes): measured against `none` over the case table (seed 0, jax
# 0.12.0.1), jax_mxfp8 reaches 0.077 (outputs) and 0.093 (gradients), jax_nvfp4 0.30 and 0.36 (Mixtral
# with dropping; its gradients are full precision, but taken through NVFP4 activations).
_MAX_REL_NORM = {"mxfp8": 0.22, "nvfp4": NVFP4_MAX_REL_NORM}
_MAX_GRAD_REL_NORM = {"mxfp8": DEFAULT_RECIPE_MAX_GRAD_REL_NORM, "nvfp4": NVFP4_MAX_GRAD_REL_NORM}


def scaled_dot_configs(mode: str, lhs: jax.Array, rhs: jax.Array) -> list:
    """The ``configs`` of ``jax.nn.scaled_dot_general`` for ``lhs``, ``rhs`` and the output gradient.

    nvfp4's global scales come from the operands as the site receives them:
    the whole tensor's amax, whatever einsum transposes.
    """
    get = jax.nn.get_scaled_dot_general_config
    if mode == "mxfp8":
        return [get("mxfp8")] * 3
    # The output gradient's config never quantizes in nvfp4's backward (full precision there).
    return [get("nvfp4", formats.jax_nvfp4_global_scale(lhs)), get("nvfp4", formats.jax_nvfp4_global_scale(rhs)),
            get("nvfp4")]


def scaled_dot_general(configs: list, lhs: jax.Array, rhs: jax.Array, dimension_numbers, *_, **__) -> jax.Array:
    """``jax.nn.scaled_dot_general`` with ``configs``, float32 out, with a ``lax.dot_general`` signature for einsum."""
    return jax.nn.scaled_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=np.dtype(np.float32),
                                     configs=configs)


@functools.cache
def scaled_dot_general_runs() -> bool:
    """Whether ``jax.nn.scaled_dot_general`` lowers on JAX's default backend.

    Lowering only, on abstract operands: nothing is compiled or run.
    """
    if not hasattr(jax.nn, "scaled_dot_general"):
        return False
    spec = jax.ShapeDtypeStruct((1, 1, 32), jnp.float32)
    dims = (((2,), (2,)), ((0,), (0,)))
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    fn = jax.jit(functools.partial(scaled_dot_general, configs, dimension_numbers=dims))
    try:
        fn.lower(spec, spec)
    except NotImplementedError:  # jax 0.10.2 on CPU: no lowering rule for 'scaled_matmul'
        return False
    return True


def einsum_dimension_numbers(eqn: str) -> tuple[tuple, tuple[int, ...]]:
    """``(dimension_numbers, out_perm)`` of a two-operand einsum as one dot_general, then a transpose.

    Every index must appear in the output or in both operands (no index summed
    within one operand), as in every matmul of a qcheck layer.
    """
    ins, out = eqn.replace(" ", "").split("->")
    a, b = ins.split(",")
    if bad := [i for i in a + b if i not in out and not (i in a and i in b)]:
        raise ValueError(f"einsum {eqn!r}: index {bad[0]!r} is summed within one operand; not one dot_general")
    contract = [i for i in a if i in b and i not in out]
    batch = [i for i in a if i in b and i in out]
    dims = ((tuple(a.index(i) for i in contract), tuple(b.index(i) for i in contract)),
            (tuple(a.index(i) for i in batch), tuple(b.index(i) for i in batch)))
    produced = batch + [i for i in a if i not in b] + [i for i in b if i not in a]
    return dims, tuple(produced.index(i) for i in out)


class JaxScaledDotSite(nn.Module):
    """One call site: the einsum as one ``jax.nn.scaled_dot_general`` in ``mode``, then a transpose.

    Not ``jnp.einsum(..., _dot_general=...)``: einsum traces its dot_general
    under a jit of its own, and nvfp4's global scales (arrays inside
    ``configs``, which JAX's custom_vjp keeps as a non-differentiable
    argument its backward pass closes over) would leak from that trace when
    the layer is differentiated under jit.
    """

    mode: str

    def _einsum(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        dtype = jnp.result_type(lhs, rhs)
        lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
        dims, perm = einsum_dimension_numbers(eqn)
        out = scaled_dot_general(scaled_dot_configs(self.mode, lhs, rhs), lhs, rhs, dims)
        return jnp.transpose(out, perm)

    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return self._einsum(eqn, lhs, rhs)

    def ragged_dot(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return ragged_dot_from_einsum(self._einsum, lhs, rhs, group_sizes)


#: jax 0.12.0.1 on CPU, Mixtral's token-dropping dense layer: the dispatch and combine sites' all-zero blocks (the
#: dropped tokens) read NaN codes where the referee gives 0. JAX's MXFP8 quantizer guards a zero scale with
#: 2^-127 (``jnp.where(scale == 0, 5.877e-39, scale)``), a float32 subnormal, which XLA's CPU backend flushes to
#: zero: 0 / 0. Seen in the program qcheck compiles to read each site's codes; the layer's own output stays
#: finite (``tracks`` passes), so the compiled layer may fold the guard otherwise.
JAX_MXFP8_ZERO_BLOCKS = KnownDefect(
    library="jax", invariant="coverage", paths=("dense",), dropping=True, seen=("0.11.2", "0.12.0.1", "0.12.1"),
    reason="an all-zero MXFP8 block's scale is guarded with 2^-127, a subnormal XLA's CPU backend flushes: codes "
           "0 / 0 = NaN",
    match=r"codes are not mxfp8_jax's: \d+ of \d+ codes differ from the referee's; first at .*: nan where the "
          r"referee gives 0 \(input 0\)",
)

#: jax 0.11.2 and 0.12.0.1, Mixtral's token-dropping dense layer: the dropped tokens' all-zero NVFP4 blocks take
#: the block scale clip(amax / 6, 0, 448) = 0, and JAX's quantizer divides by it (``scaled_x = x /
#: scales_q``, jax/_src/cudnn/scaled_matmul_stablehlo.py ``quantize``): 0 / 0, whose cast to e2m1 is whatever
#: the backend makes of a NaN (-0 on CPU). The block decodes to 0 all the same (its scale is 0), so the output
#: stays finite; the coverage check holds every scale finite and nonzero. Shown on JAX's own call by
#: ``test_jax_nvfp4_divides_an_all_zero_block_by_its_zero_scale`` (tests/test_adapters.py).
JAX_NVFP4_ZERO_BLOCKS = KnownDefect(
    library="jax", invariant="coverage", paths=("dense",), dropping=True, seen=("0.11.2", "0.12.0.1", "0.12.1"),
    reason="an all-zero NVFP4 block's scale is 0 and JAX's quantizer divides by it: codes 0 / 0",
    match=r"its scale is 0 at \d+ of \d+ scale values \(codes NaN\)",
)

#: jax 0.11.2 and 0.12.0.1 on CPU, every layer: a block of tiny values (amax below 2^-119: the ``edges``
#: invariant's token row of tiny values, and its whole tensor of them) takes the e8m0 scale code 0, 2^-127, with
#: codes that stand for it (8 for 2^-124, as the referee's). ``scaled_matmul``'s CPU lowering then casts the scale
#: to float32, a subnormal XLA's CPU backend flushes to zero: the whole block multiplies as 0 (the referee's
#: products, about 1e-38, come out 0), the shape of the E8M0 code-0 decode that zeroed TransformerEngine's MXFP8
#: blocks. On the dropping layer the dispatch quantizes the tiny row with the rest of its block, and only the whole
#: tensor's blocks are tiny. Shown on JAX's own call by
#: ``test_jax_scaled_matmul_on_cpu_zeroes_a_block_whose_e8m0_scale_is_code_0`` (tests/test_adapters.py).
JAX_MXFP8_TINY_BLOCKS = KnownDefect(
    library="jax", invariant="edges", paths=("dense", "sparse"), seen=("0.11.2", "0.12.0.1"),
    reason="on CPU, scaled_matmul decodes the e8m0 scale code 0 (2^-127) as a float32 subnormal, which XLA's CPU "
           "backend flushes: a block of tiny values multiplies as 0",
    match=r"(token row|whole tensor) of tiny values .*: site '\w+' (einsum '[A-Z,>-]+'|ragged_dot) \(mxfp8_jax x "
          r"mxfp8_jax\): differs from the referee-quantized reference at \d+ of \d+ elements, first at .*: got "
          r"np\.float32\(0\.0\), expected np\.float32\(-?[\d.]+e-3\d\)",
)


#: jax 0.11.2, 0.12.0.1 and 0.12.1 on CPU, every layer: ``scaled_dot_general`` in nvfp4 rescales the product by
#: both operands' global scales multiplied together first (``out *= (configs[0].global_scale *
#: configs[1].global_scale)``, jax/_src/cudnn/scaled_matmul_stablehlo.py, ``scaled_dot_impl``). On the ``edges``
#: invariant's whole tensor of tiny values (amax 3.5e-37) the activation's global scale is 2^-126, and times the
#: weight's (2^-12) the factor is 2^-138, a float32 subnormal that XLA's CPU backend flushes to zero: the product
#: is 0 where the referee's, of the dequantized operands, is a normal float32 of about 1e-37. Any global scales
#: whose product is that small do so (the product of two tiny operands' amaxes over 2688² is). Shown on JAX's own
#: call by ``test_jax_nvfp4_on_cpu_flushes_the_product_of_the_two_global_scales`` (tests/test_adapters.py).
JAX_NVFP4_TINY_TENSOR = KnownDefect(
    library="jax", invariant="edges", paths=("dense", "sparse"), seen=("0.11.2", "0.12.0.1", "0.12.1"),
    reason="on CPU, scaled_dot_general rescales an nvfp4 product by its two global scales multiplied first: for a "
           "tensor of tiny values that factor is a subnormal XLA's CPU backend flushes, and the product is 0",
    match=r"whole tensor of tiny values .*: site '\w+' (einsum '[A-Z,>-]+'|ragged_dot) \(nvfp4_jax x nvfp4_jax\): "
          r"differs from the referee-quantized reference at \d+ of \d+ elements, first at .*: got "
          r"np\.float32\(-?0\.0\), expected np\.float32\(-?[\d.]+e-3\d\)",
)


#: jax 0.12.1 on CPU: the guard above now reaches every program. JAX's MXFP8 quantizer divides x by its block
#: scale; up to 0.12.0.1 XLA computed that as x · (1 / scale), and 1 / 2^-127 = 2^127 is a normal float32, so a
#: zero block came out 0 wherever the scale was not read on its own. 0.12.1 keeps the division, and the flushed
#: 2^-127 makes it 0 / 0: every all-zero (or tiny) block of 32 quantizes to NaN, in the forward pass (the dropped
#: tokens' dispatch rows, an edge row of zeros) and in the backward pass (the output gradient of a token an expert
#: did not see), so every gradient of the layer is NaN. Plain JAX shows it: ``jax.nn.scaled_dot_general`` with
#: ``get_scaled_dot_general_config("mxfp8")`` on an operand with an all-zero row is NaN there
#: (``test_jax_mxfp8_divides_an_all_zero_block_by_a_flushed_scale``, tests/test_adapters.py).
JAX_MXFP8_FLUSHED_DIVISION = ("from jax 0.12.1 on CPU, JAX's MXFP8 quantizer divides an all-zero or tiny block by "
                              "its guard 2^-127, a subnormal XLA's CPU backend flushes: 0 / 0 = NaN codes, NaN "
                              "outputs and gradients")


#: Seen on jax 0.9.2 too (EasyDeL 0.3.0's pin, where qcheck's window starts): qcheck's ``mxfp8_jax`` codec, JAX's
#: own quantizer, makes an all-zero block of 32 NaN there (``scaled_dot_general`` itself has no CPU lowering on 0.9.2,
#: so no layer cell runs it).
def _flushed_division(invariant: str, paths: tuple[str, ...], match: str, dropping: bool | None = None) -> KnownDefect:
    return KnownDefect(library="jax", invariant=invariant, paths=paths, dropping=dropping, seen=("0.9.2", "0.12.1"),
                       reason=JAX_MXFP8_FLUSHED_DIVISION, match=match)


JAX_MXFP8_NAN_GRADIENTS = _flushed_division(  # the dropping layer does not train under mxfp8 (blocks of 32)
    "grads", ("dense", "sparse"), r"assert_grads_track: gradient of \w+ \(float32\) has \d+ non-finite values",
    dropping=False)
JAX_MXFP8_NAN_DISPATCH = _flushed_division(
    "exact", ("dense",), r"site 'dispatch' einsum .*: differs from the referee-quantized reference at \d+ of \d+ "
                         r"elements, first at .*: got np\.float32\(nan\), expected np\.float32\(0\.0\)", dropping=True)
JAX_MXFP8_NAN_OUTPUT = _flushed_division(
    "tracks", ("dense",), r"assert_tracks: actual has \d+ non-finite values", dropping=True)
JAX_MXFP8_NAN_EDGES = _flushed_division(  # dropping: the NaN dispatch feeds the expert sites' operands
    "edges", ("dense", "sparse"), r"token row of zeros: (not finite: the output|site '\w+' .*got np\.float32\(nan\))")
JAX_MXFP8_NAN_GOLDEN = _flushed_division(
    "golden", ("dense", "sparse"), r"(grads\['\w+'\]|output): \d+ of \d+ (sampled )?values outside rtol .*got "
                                   r"np\.float32\(nan\)")


class JaxScaledDotRecipe(Recipe):
    """A recipe whose every call site runs ``jax.nn.scaled_dot_general`` in ``mode`` ("mxfp8" or "nvfp4").

    Its declared formats (``lhs``/``rhs``) are JAX's rule as qcheck names it
    (``mxfp8_jax``, ``nvfp4_jax``), along each matmul's contraction axes, so
    ``exact`` holds every site bit for bit to the referee of that rule.
    Without ``expect``, the mode's measured bounds; with any, no backward paths.
    """

    def __init__(self, name: str, mode: str, *, expect: Expect | None = None):
        if mode not in JAX_MODES:
            raise ValueError(f"mode must be one of {', '.join(JAX_MODES)}, got {mode!r}")
        fmt = JAX_MODES[mode]
        # mxfp8's vjp quantizes the output gradient in MXFP8 (so gradients never equal the twin's, and a
        # gradient matmul over fewer than 32 tokens cannot run); nvfp4's multiplies it in full precision.
        if expect is None:
            expect = Expect(max_rel_norm=_MAX_REL_NORM[mode], max_grad_rel_norm=_MAX_GRAD_REL_NORM[mode],
                            fp8_target="nvidia")
        super().__init__(name, lhs=fmt, rhs=fmt, grad=fmt if mode == "mxfp8" else None, expect=expect)
        # No exact gradient reference (the ``backward`` invariant; ``grads`` still runs). mxfp8's vjp
        # quantizes the output gradient and re-quantizes the *original* other operand along the gradient
        # matmul's contraction, which no qcheck referee's gradient models (``grad_operands`` is "quantized" or
        # "original", never "re-quantized"). nvfp4's is the full-precision matmul of g and the original
        # operands (``grad_operands="original"``), bitwise the referee's on Mixtral's dense layer (jax
        # 0.12.0.1), but summed by ``jnp.matmul`` over JAX's (batch, rows, contraction) reshape: on the
        # dropping layer's dispatch (g contracts two axes) and through the sparse path's einsum, in another
        # order than the referee's einsum vjp (1 ulp at 101 of 2048 dispatch DGRAD elements).
        self.expect = self.expect.narrow_backward(())
        if mode == "nvfp4":
            # The tiny tensor's defect is the CPU backend's flush of the global scales' product.
            cpu = (JAX_NVFP4_TINY_TENSOR,) if jax.default_backend() == "cpu" else ()
            self.expect = dataclasses.replace(self.expect, known_defects=self.expect.known_defects
                                              + (JAX_NVFP4_ZERO_BLOCKS, *cpu))
        if mode == "mxfp8":
            # The tiny blocks' defect is the CPU lowering's cast of the scale; a GPU's kernel applies it.
            cpu = (JAX_MXFP8_NAN_GRADIENTS, JAX_MXFP8_NAN_DISPATCH, JAX_MXFP8_NAN_OUTPUT, JAX_MXFP8_NAN_EDGES,
                   JAX_MXFP8_NAN_GOLDEN, JAX_MXFP8_TINY_BLOCKS) if jax.default_backend() == "cpu" else ()
            self.expect = dataclasses.replace(
                self.expect, known_defects=self.expect.known_defects + (JAX_MXFP8_ZERO_BLOCKS, *cpu))
        self.mode = mode

    def site_module(self, name: str) -> nn.Module:
        return JaxScaledDotSite(mode=self.mode)

    def __repr__(self) -> str:
        return f"JaxScaledDotRecipe({self.name!r}, {self.mode!r})"


def jax_mxfp8(name: str = "jax_mxfp8") -> JaxScaledDotRecipe:
    """``jax.nn.scaled_dot_general`` with ``get_scaled_dot_general_config("mxfp8")`` for lhs, rhs and gradients."""
    return JaxScaledDotRecipe(name, "mxfp8")


def jax_nvfp4(name: str = "jax_nvfp4") -> JaxScaledDotRecipe:
    """``jax.nn.scaled_dot_general`` with ``get_scaled_dot_general_config("nvfp4", global_scale)`` per operand."""
    return JaxScaledDotRecipe(name, "nvfp4")
