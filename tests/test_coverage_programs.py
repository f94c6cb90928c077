"""The coverage map on what real programs hold: shard_map, custom_partitioning, remat, scan, cond, opaque kernels,
module paths, user stacks, lazy modules, and skip rules with their control."""

from __future__ import annotations

import importlib
import linecache
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import PartitionSpec as P

import qcheck
from qcheck import assert_quantized, coverage, format_coverage
from tests.helpers import import_extra

try:
    from jax import shard_map
except ImportError:  # jax 0.10 keeps it under experimental only
    from jax.experimental.shard_map import shard_map

E4M3 = jnp.float8_e4m3fn
_RNG = np.random.default_rng(0)
A = _RNG.normal(size=(8, 32)).astype(np.float32)
B = _RNG.normal(size=(32, 16)).astype(np.float32)


def _q(x):
    return x.astype(E4M3).astype(jnp.float32)


# -- higher-order primitives: each one with a quantized and a forgotten operand ------------

_MESH = jax.make_mesh((1,), ("x",))


def _in_shard_map(q_rhs):
    def f(a, b):
        body = lambda a, b: _q(a) @ (_q(b) if q_rhs else b)  # noqa: E731
        return shard_map(body, mesh=_MESH, in_specs=(P(), P()), out_specs=P())(a, b)
    return f


def _in_custom_partitioning(q_rhs):
    @custom_partitioning
    def mm(a, b):
        return a @ b

    mm.def_partition(
        partition=lambda mesh, args, result: (mesh, lambda a, b: a @ b, result.sharding,
                                              tuple(s.sharding for s in args)),
        sharding_rule="i k, k j -> i j")
    return lambda a, b: mm(_q(a), _q(b) if q_rhs else b)


def _in_remat(q_rhs):
    return lambda a, b: jax.checkpoint(lambda a, b: _q(a) @ (_q(b) if q_rhs else b))(a, b)


def _in_scan(q_rhs):
    def f(a, b):
        def body(carry, row):
            return carry + row @ (_q(b) if q_rhs else b), None
        return jax.lax.scan(body, jnp.zeros(b.shape[1]), _q(a))[0]
    return f


def _in_cond(q_rhs):
    return lambda a, b: jax.lax.cond(a.sum() > 0, lambda a, b: _q(a) @ (_q(b) if q_rhs else b),
                                     lambda a, b: _q(a) @ (_q(b) if q_rhs else b), a, b)


def _in_nested_jit(q_rhs):
    return lambda a, b: jax.jit(jax.jit(lambda a, b: _q(a) @ (_q(b) if q_rhs else b)))(a, b)


PROGRAMS = {"shard_map": _in_shard_map, "custom_partitioning": _in_custom_partitioning, "remat": _in_remat,
            "scan": _in_scan, "cond": _in_cond, "nested jit": _in_nested_jit}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_coverage_with_errors_runs_through_each_higher_order_primitive_should_pass(name):
    records = coverage(PROGRAMS[name](True), A, B, errors=True)
    assert records and all(r.quantized for r in records), format_coverage(records)
    for r in records:  # a figure, or the reason there is none
        assert (r.error is None) == (r.no_error is not None), r
    assert assert_quantized(PROGRAMS[name](True), A, B)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_coverage_through_each_higher_order_primitive_should_fail_on_a_forgotten_operand(name):
    # (a cond reports each branch's matmul)
    with pytest.raises(AssertionError, match=r"assert_quantized: (\d) of \1 matmuls reach full precision:\n  "
                                             r"dot_general at tests/test_coverage_programs.py:\d+ .*rhs \(32, 16\) "
                                             r"float32 \[full precision\]: rhs unquantized"):
        assert_quantized(PROGRAMS[name](False), A, B)


def test_a_matmul_inside_shard_map_has_its_error_figure():
    """The body runs per shard inside a shard_map of the walk's own, its figures and codes coming out per shard."""
    (record,) = coverage(_in_shard_map(True), A, B, errors=True)
    assert record.error > 0 and record.no_error is None and record.no_values is None
    (traced,) = coverage(_in_shard_map(True), A, B)  # without errors or a declaration: traced only, and it says so
    assert traced.error is None and traced.no_error == "not computed (errors=False)"
    (outside,) = coverage(_in_nested_jit(True), A, B, errors=True)
    assert outside.error > 0 and outside.no_error is None


def _kernel(a_ref, b_ref, o_ref):
    o_ref[...] = a_ref[...] @ b_ref[...]


def _pallas(quantized: bool):
    from jax.experimental import pallas as pl

    def f(a, b):
        a, b = (_q(a), _q(b)) if quantized else (a, b)
        return pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct((8, 16), jnp.float32), interpret=True)(a, b)
    return f


#: The roles of ``_kernel``: its inputs are lhs and rhs in that order (tests/test_kernel_roles.py: the rest).
ROLES = qcheck.KernelRoles("_kernel", lhs=0, rhs=1)


def test_an_opaque_kernel_is_one_record_at_its_call_should_pass_on_quantized_operands():
    (record,) = coverage(_pallas(True), A, B, errors=True, kernels=ROLES)
    assert (record.primitive, record.opaque, record.quantized) == ("pallas_call", True, True)
    assert (record.kernel, record.kernel_roles) == ("_kernel", "declared")
    assert record.location.startswith("tests/test_coverage_programs.py:")
    assert record.no_error == "an opaque kernel (pallas_call): its body is not walked"


def test_an_opaque_kernel_should_fail_on_full_precision_operands():
    with pytest.raises(AssertionError, match=r"pallas_call at tests/test_coverage_programs.py:\d+ .* lhs and rhs "
                                             r"unquantized \(opaque kernel _kernel; roles: declared\)"):
        assert_quantized(_pallas(False), A, B, kernels=ROLES)


# -- module paths, stacks and skip rules -------------------------------------------------

class Router(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (32, 4)))

    def __call__(self, x):
        return x @ self.kernel[...]


class Expert(nnx.Module):
    def __init__(self, quantized: bool, rngs: nnx.Rngs):
        self.quantized = quantized
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (32, 32)))

    def __call__(self, x):
        q = _q if self.quantized else (lambda v: v)
        return q(x) @ q(self.kernel[...])


class Block(nnx.Module):
    """A router, two experts, and a combine written inline: the shapes real MoE blocks have."""

    def __init__(self, quantized: bool = True, *, fallen_back: bool = False, rngs: nnx.Rngs):
        self.gate = Router(rngs)
        self.experts = nnx.List([Expert(quantized and not (fallen_back and i == 1), rngs) for i in range(2)])

    def mix(self, x):
        outs = jnp.stack([e(x) for e in self.experts], -1)
        weights = jax.nn.softmax(self.gate(x)[..., :2], -1)
        with jax.named_scope("combine"):
            return jnp.einsum("bfe,be->bf", outs, weights)

    def __call__(self, x):
        return self.mix(x)


X = jnp.asarray(_RNG.normal(size=(8, 32)), jnp.float32)


def test_records_carry_the_module_path_and_named_scopes():
    records = coverage(Block(rngs=nnx.Rngs(0)), X)
    # jnp.einsum opens a scope of its own, named by its equation
    assert [r.scope for r in records] == ["experts/0", "experts/1", "gate", "combine/bfe,be->bf"], \
        format_coverage(records)
    assert "scope" in format_coverage(records).splitlines()[0]


def test_records_keep_the_users_stack_innermost_first():
    records = coverage(Block(rngs=nnx.Rngs(0)), X)
    functions = [fn for _, fn in records[0].stack]
    assert functions[:3] == ["Expert.__call__", "Block.mix.<locals>.<listcomp>", "Block.mix"] or \
        functions[:3] == ["Expert.__call__", "Block.mix", "Block.__call__"], functions
    shown = format_coverage(records, stack=True)
    assert re.search(r"\n    from tests/test_coverage_programs.py:\d+ \(Block.mix\)", shown), shown


# Each rule form: it spares the gate and combine of the quantized block (should pass) and, applied to a block
# whose second expert fell back, does not spare that expert (should fail, naming it).
_RULES = {
    "module path": [qcheck.skip_modules("gate"), qcheck.skip_modules("combine")],
    "function on the stack": [qcheck.skip_functions("Router.__call__"), qcheck.skip_modules("combine")],
    "file and function": [qcheck.skip_at("tests/test_coverage_programs.py", "Router.__call__"),
                          qcheck.skip_modules("combine")],
    "predicate": [qcheck.skip_where(lambda r: r.rhs_shape == (32, 4), "the router's (32, 4) kernel"),
                  qcheck.skip_where(lambda r: "combine" in r.scope, "the combine")],
}


@pytest.mark.parametrize("form", sorted(_RULES))
def test_each_skip_form_should_pass_sparing_what_it_names(form):
    records = assert_quantized(Block(rngs=nnx.Rngs(0)), X, skip=_RULES[form], control=Block(False, rngs=nnx.Rngs(0)))
    assert [r.skipped_by for r in records] == [None, None, _RULES[form][0].name, _RULES[form][1].name]
    assert "skipped: " + _RULES[form][0].name in format_coverage(records)


@pytest.mark.parametrize("form", sorted(_RULES))
def test_each_skip_form_should_fail_on_a_fallen_back_expert(form):
    with pytest.raises(AssertionError, match=r"1 of 4 matmuls reach full precision:\n  dot_general at "
                                             r"tests/test_coverage_programs.py:\d+ \(Expert.__call__\).* in experts/1\ndeclared: "):
        assert_quantized(Block(fallen_back=True, rngs=nnx.Rngs(0)), X, skip=_RULES[form])


def test_a_skip_rule_that_spares_nothing_fails_naming_it():
    with pytest.raises(AssertionError, match=r"skip rule skip_modules\('router'\) spares none of the 4 matmuls "
                                             r"\(it matches none\): drop it or fix it"):
        assert_quantized(Block(rngs=nnx.Rngs(0)), X, skip=[*_RULES["module path"], qcheck.skip_modules("router")])
    with pytest.raises(AssertionError, match=r"skip rule skip_modules\('experts'\) spares none of the 4 matmuls "
                                             r"\(it matches only quantized ones\)"):
        assert_quantized(Block(rngs=nnx.Rngs(0)), X, skip=[*_RULES["module path"], qcheck.skip_modules("experts")])


def test_the_skip_control_should_pass_when_the_twin_spares_the_same_matmuls():
    assert assert_quantized(Block(rngs=nnx.Rngs(0)), X, skip=_RULES["file and function"],
                            control=Block(False, rngs=nnx.Rngs(0)))


def test_the_skip_control_should_fail_on_a_rule_that_hides_more_in_the_twin():
    # skip_functions("Block.mix") spares the combine in the layer, and every expert matmul of the unquantized twin:
    # had an expert fallen back, this rule would have spared it.
    broad = [qcheck.skip_functions("Block.mix"), qcheck.skip_modules("gate")]
    assert assert_quantized(Block(rngs=nnx.Rngs(0)), X, skip=broad)  # without the control it passes
    with pytest.raises(AssertionError) as info:
        assert_quantized(Block(rngs=nnx.Rngs(0)), X, skip=broad, control=Block(False, rngs=nnx.Rngs(0)))
    message = str(info.value)
    assert message.startswith("assert_quantized: skip rule skip_functions('Block.mix') spares 2 more matmul(s) in "
                              "the unquantized control than in the layer"), message
    assert re.search(r"\n  #0: dot_general at tests/test_coverage_programs.py:\d+ \(Expert.__call__\) in experts/0: ",
                     message), message
    assert "#1: " in message and "#2: " not in message and "#3: " not in message


@pytest.mark.parametrize("call, error", [
    (lambda: qcheck.skip_modules(), r"skip_modules needs one or more module paths or scope names, got \(\)"),
    (lambda: qcheck.skip_at(""), r"skip_at needs one or more file paths"),
    (lambda: qcheck.skip_where("gate", "the gate"), r"skip_where: predicate must be a callable"),
    (lambda: qcheck.skip_where(lambda r: True, ""), r"skip_where needs one or more descriptions"),
    (lambda: assert_quantized(lambda a, b: a @ b, A, B, skip=["gate"]), r"assert_quantized: skip must be a callable"),
    (lambda: coverage(lambda a, b: a @ b, A, B, machinery="aqt"), r"coverage: machinery must be a sequence"),
])
def test_bad_skip_input_names_the_argument(call, error):
    with pytest.raises((TypeError, ValueError), match=error):
        call()


# -- lazy modules ---------------------------------------------------------------------------

class LazyBlock(nnx.Module):
    """Creates its quantized projection on the first call, as MaxText's AQT einsums are created."""

    def __init__(self, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (32, 16)))
        self.rngs = rngs

    def __call__(self, x):
        if not hasattr(self, "proj"):
            self.proj = Expert(True, self.rngs)
            _ = self.proj(x)  # an initializing call, as Linen's init inside ToNNX makes
        return self.proj(x) @ _q(self.kernel[...])


def test_a_lazy_module_is_traced_as_it_runs_after_its_first_call():
    layer = LazyBlock(nnx.Rngs(0))
    records = coverage(layer, X, errors=True)
    assert len(records) == 2 and [r.scope for r in records] == ["proj", ""], format_coverage(records)
    assert not hasattr(layer, "proj")  # the warm-up ran on a copy


def test_a_module_that_is_not_lazy_is_traced_without_a_warm_up():
    layer = Block(rngs=nnx.Rngs(0))
    assert qcheck.warmed_up(layer, X) is layer


# -- locations at the caller of the quantization libraries ----------------------------------

def _line(record: qcheck.MatmulRecord) -> str:
    path, line = record.location.rsplit(":", 1)
    return linecache.getline(path, int(line))


class FlaxFp8(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(16, dot_general_cls=linen.Fp8DirectDotGeneralOp)(x)  # the caller's line


def test_a_flax_fp8_matmul_is_located_at_the_callers_line():
    model = FlaxFp8()
    variables = model.init(jax.random.key(0), X)
    records = coverage(lambda v, x: model.apply(v, x), variables, X)
    (record,) = [r for r in records if not r.backward]
    assert record.quantized and record.function == "FlaxFp8.__call__", format_coverage(records)
    assert "the caller's line" in _line(record)


_TEAM_LIBRARY = """
import jax.numpy as jnp


def quantized_matmul(a, b):
    q = lambda t: t.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return q(a) @ q(b)  # the team library's line
"""


@pytest.mark.parametrize("named_as", ["package", "path"])
def test_a_package_named_as_machinery_moves_the_location_to_its_caller(tmp_path, monkeypatch, named_as):
    # A team's own quantization library: its matmul is located at the line of the layer that called it, the
    # way Flax's and AQT's are, once the library is named as machinery, by package or by path.
    name = f"team_quant_{named_as}"  # one module per case: a second import would find the first in sys.modules
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text(_TEAM_LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    team_quant = importlib.import_module(name)

    def layer(a, b):
        return team_quant.quantized_matmul(a, b) * 2.0  # the layer's line

    named = name if named_as == "package" else str(tmp_path / name)
    (outer,) = coverage(layer, A, B, machinery=[named])
    assert outer.quantized and "the layer's line" in _line(outer), outer.location
    # The control: without it, the library's own line is where the matmul is.
    (inner,) = coverage(layer, A, B)
    assert "the team library's line" in _line(inner), inner.location


def test_an_aqt_int8_matmul_is_located_at_the_callers_line():
    import_extra("aqt")
    from aqt.jax.v2 import config
    from aqt.jax.v2.flax import aqt_flax

    class AqtModel(linen.Module):
        @linen.compact
        def __call__(self, x):
            w = self.param("w", linen.initializers.normal(), (32, 16))
            return aqt_flax.AqtEinsum(cfg=config.config_v4())("bi,io->bo", x, w)  # the caller's line

    model = AqtModel()
    variables = jax.jit(model.init)(jax.random.key(0), X)
    records = coverage(lambda v, x: model.apply(v, x, rngs={"params": jax.random.key(1)}), variables, X)
    assert records and all(r.function == "test_an_aqt_int8_matmul_is_located_at_the_callers_line.<locals>."
                           "AqtModel.__call__" for r in records), format_coverage(records)
    assert "the caller's line" in _line(records[0])
    assert all(r.quantized for r in records)


# -- qcheck's own layer inside each higher-order primitive -----------------------------------

def _layer_under(kind: str, layer: nnx.Module):
    graphdef, state = nnx.split(layer)

    def run(x):
        return nnx.merge(graphdef, state)(x)

    if kind == "shard_map":
        return lambda x: shard_map(run, mesh=_MESH, in_specs=P(), out_specs=P())(x)
    if kind == "remat":
        return jax.checkpoint(run)
    if kind == "cond":
        return lambda x: jax.lax.cond(x.sum() > -1e30, run, lambda x: run(x) * 0, x)
    assert kind == "scan"
    return lambda x: jax.lax.scan(lambda c, xi: (c, run(xi[None])[0]), 0.0, x)[1]


LX = jnp.asarray(_RNG.normal(size=(2, 32, 32)), jnp.float32)


# (custom_partitioning: the hand-written programs above; its body cannot close over a layer's state)
@pytest.mark.parametrize("kind", ["shard_map", "remat", "cond", "scan"])
def test_check_layer_and_coverage_run_on_qcheck_layers_inside_each_higher_order_primitive(kind):
    layer = qcheck.build_moe("mixtral", "fp8", path="sparse")
    twin = qcheck.build_moe("mixtral", "none", path="sparse")
    records = coverage(_layer_under(kind, layer), LX, errors=True)
    # a cond reports both branches' matmuls
    assert sum(r.quantized for r in records) == 3 * (2 if kind == "cond" else 1), format_coverage(records)
    figures = qcheck.check_layer(_layer_under(kind, layer), _layer_under(kind, twin), LX,
                                 skip=qcheck.skip_functions(*qcheck.layers.moe.UNQUANTIZED_BY_DESIGN))
    assert 0 < figures.rel_norm <= 0.22
    with pytest.raises(AssertionError, match=r"coverage: assert_quantized: (3 of 5|6 of 10) matmuls reach full "
                                             r"precision"):
        qcheck.check_layer(_layer_under(kind, twin), _layer_under(kind, twin), LX,
                           skip=qcheck.skip_functions(*qcheck.layers.moe.UNQUANTIZED_BY_DESIGN))
