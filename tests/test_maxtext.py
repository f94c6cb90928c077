"""MaxText 0.2.5's real ``RoutedMoE`` as a pinned client of qcheck (tests/maxtext_cells.py builds the cells).

Runs in MaxText's own environment (.ci/maxtext.sh, ``tox -e maxtext``, the
MaxText stage of .ci/run); skipped where MaxText is not installed. For every
MaxText quantization (int8, fp8, nanoo_fp8) on both paths, ``coverage`` with
error figures runs; ``check_layer`` passes on the dense path and fails on the
sparse one (megablox off), naming MaxText's ``jax.lax.ragged_dot`` line: a known
defect of maxtext 0.2.5 (docs/libraries.md), asserted with the version checked,
so a new MaxText makes these tests say "recheck" rather than pass or fail silently.
With megablox on (fp8, int8; its tiles shrunk to the block), the expert matmuls are
Pallas kernels, read by their roles from qcheck's table, and ``check_layer`` passes.
The unquantized blocks themselves, ``RoutedMoE`` and the DeepSeek block's
``RoutedAndSharedMoE``, on every path, are held to the float64 MoE referee.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

import qcheck
from tests import maxtext_cells
from tests.helpers import QWIX_WARNS, import_extra

pytestmark = [
    # aqtp 0.9.0 passes arrays to jnp.promote_types (docs/libraries.md), and MaxText's int8 router calls AQT
    # eagerly while it builds (GateLogit.__init__ traces itself on dummy inputs).
    pytest.mark.filterwarnings("ignore:Implicit conversion of an array to a dtype:DeprecationWarning"),
    # MaxText's sparse path sows intermediates outside nnx.capture(), which flax 0.12.12 deprecates.
    pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside of 'nnx.capture\\(\\)':DeprecationWarning"),
    # flax's fp8 ops warn that they set the precision themselves (nanoo_fp8's einsums, every call).
    pytest.mark.filterwarnings("ignore:The function dot_general_with_precision:UserWarning"),
]

#: The named scope of MaxText's combine (``jnp.einsum`` of the expert outputs and
#: the routing weights, on both paths), meant to stay in full precision; its
#: router is quantized like the experts.
COMBINE_SCOPE = "weight_sum"
PATHS = {"dense": False, "sparse": True}
CELLS = [(q, p) for q in maxtext_cells.QUANTIZATIONS for p in PATHS]


@pytest.fixture(scope="module", autouse=True)
def _maxtext():
    if importlib.util.find_spec("maxtext") is not None:
        missing = [v for v in maxtext_cells.ENVIRONMENT if not os.environ.get(v)]
        assert not missing, (f"maxtext is installed but {', '.join(missing)} unset: run these tests through "
                             f".ci/maxtext.sh run PYTHON pytest ... (it sets them)")
    import_extra("maxtext")


@pytest.fixture(scope="module")
def cells():
    """Each cell built once: MaxText builds a block in seconds, and no check changes it."""
    built = {}

    def get(quantization: str, path: str):
        if (quantization, path) not in built:
            built[quantization, path] = maxtext_cells.cell(quantization, PATHS[path])
        return built[quantization, path]

    return get


@pytest.fixture(scope="module")
def x():
    return maxtext_cells.inputs()


def _params(module) -> dict[str, np.ndarray]:
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in flat}


def _pinned() -> None:
    installed = importlib.metadata.version("maxtext")
    if installed != maxtext_cells.MAXTEXT_VERSION:
        pytest.fail(f"maxtext {installed} is installed; this known defect was checked on maxtext "
                    f"{maxtext_cells.MAXTEXT_VERSION}: recheck it on {installed}, then update this test and the "
                    f"MaxText row of docs/libraries.md")


def _ragged_dot_line() -> str:
    """``file:line`` of the ``jax.lax.ragged_dot`` call in MaxText's ``jax_ragged_dot_gmm``, read from the source."""
    from maxtext.layers import moe

    lines, start = inspect.getsourcelines(moe.RoutedMoE.sparse_matmul)
    (offset,) = [i for i, line in enumerate(lines) if "= jax.lax.ragged_dot(" in line]
    return f"maxtext/layers/moe.py:{start + offset}"


def _location(record) -> str:
    return record.location.replace(os.sep, "/")


# -- the cells ----------------------------------------------------------------------------------

@pytest.mark.parametrize("quantization, path", CELLS)
def test_cell_twin_holds_the_layers_weights(cells, quantization, path):
    layer, twin = cells(quantization, path)
    mine, theirs = _params(layer), _params(twin)
    assert sorted(mine) == sorted(theirs) == ["gate/kernel", "wi_0", "wi_1", "wo"]
    assert all(np.array_equal(mine[k], theirs[k]) for k in mine)


def test_cell_same_seed_gives_the_twin_other_weights_so_they_are_copied():
    # Should-fail of the one above: MaxText's quantizers draw from the block's Rngs first.
    layer = maxtext_cells.build("fp8", False)
    twin = maxtext_cells.build("", False)
    assert not all(np.array_equal(a, b) for a, b in zip(_params(layer).values(), _params(twin).values()))


# -- coverage -------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantization, path", CELLS)
def test_coverage_with_errors_runs_on_every_cell(cells, x, quantization, path):
    layer, _ = cells(quantization, path)
    records = qcheck.coverage(layer, x, errors=True)
    # Router, three expert matmuls, combine: once each (int8's AQT einsums, made on the first call, too).
    assert len(records) == 5, qcheck.format_coverage(records)
    full = [r for r in records if not r.quantized]
    if path == "dense":
        assert [_location(r) for r in full] == [_location(records[-1])], qcheck.format_coverage(records)
    else:
        ragged = [r for r in full if r.primitive.startswith("ragged_dot")]
        assert len(ragged) == 3 and all(_location(r).endswith(_ragged_dot_line()) for r in ragged), (
            qcheck.format_coverage(records))


# -- check_layer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("quantization", maxtext_cells.QUANTIZATIONS)
def test_check_layer_passes_maxtext_dense_path(cells, x, quantization):
    # Held to the declaration read from MaxText's config: the flavour of every fp8 cast, and the codes
    # bitwise against the referee's (fp8 at a fresh layer's scale 1; int8 as AQT's absmax/127.5 codes).
    layer, twin = cells(quantization, "dense")
    before = _params(layer), _params(twin)
    figures = qcheck.check_layer(layer, twin, x, output=0, skip=qcheck.skip_modules(COMBINE_SCOPE), declared=True)
    assert 0 < figures.rel_norm <= 0.22
    assert figures.declared.source == f"MaxText config.quantization={quantization!r}"
    held = [r for r in figures.coverage if not r.skipped_by]
    assert len(held) == 4 and all(r.lhs_declared and r.rhs_declared and not r.findings for r in held), (
        qcheck.format_coverage(figures.coverage))
    after = _params(layer), _params(twin)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(before, after) for k in a), "check_layer changed a module"


#: Each fp8 quantization and the other family's, whose einsum a user's code may wire in by mistake.
OTHER_FP8 = {"fp8": ("NANOOFp8Quantization", "float8_e4m3fnuz", "e4m3fn"),
             "nanoo_fp8": ("Fp8Quantization", "float8_e4m3fn", "e4m3fnuz")}


@pytest.mark.parametrize("quantization", sorted(OTHER_FP8))
def test_check_layer_declared_names_an_einsum_wired_from_the_other_fp8_family(x, quantization):
    """The ``wo`` einsum built by the other fp8 quantization (MaxText's own ``create_fp8_einsum``): the
    output still tracks (an MI300 layer computing e4m3fn passes every other check), only the declaration
    read from ``config.quantization`` sees the flavour, and names the site: by default, the docs' three lines
    unchanged (no ``declared=``), and with ``declared=True``."""
    from flax import nnx
    from maxtext.layers import quantizations

    other, cast, declared = OTHER_FP8[quantization]
    layer, twin = maxtext_cells.cell(quantization, False)
    layer.quant_einsums["wo"] = quantizations.create_fp8_einsum(getattr(quantizations, other)(), layer.dtype,
                                                                nnx.Rngs(0))
    skip = qcheck.skip_modules(COMBINE_SCOPE)
    qcheck.check_layer(layer, twin, x, output=0, skip=skip, declared=False)  # the control: nothing held, it passes
    for asked in ({}, {"declared": True}):
        with pytest.raises(AssertionError) as failure:
            qcheck.check_layer(layer, twin, x, output=0, skip=skip, **asked)
        message = str(failure.value)
        assert message.startswith("check_layer: 1 check(s) failed:\n  coverage: ")
        assert "1 of 5 matmuls differ" in message
        site = message.split("differ from the declared quantization", 1)[1]
        assert " in wo/" in site and f"is cast to {cast}; declared {declared}" in site, message
        assert message.endswith(f"declared: read from the layer: MaxText config.quantization={quantization!r}")


def test_check_layer_declared_names_fewer_bits_than_config_declares(x):
    """A user's AQT config at 4 bits (one config object shared with another layer, say) under a config
    that declares int8: the records read int4 at every site, and the declaration names each."""
    import dataclasses

    import jax.numpy as jnp
    from aqt.jax.v2 import config as aqt_config
    from maxtext.layers import quantizations

    cfg = maxtext_cells.config("int8", False)
    int4 = aqt_config.config_v3(
        fwd_bits=4, dlhs_bits=8, drhs_bits=8, rng_type="jax.uniform", dlhs_local_aqt=None,
        drhs_local_aqt=aqt_config.LocalAqt(contraction_axis_shard_count=1), fwd_accumulator_dtype=jnp.int32,
        dlhs_accumulator_dtype=jnp.int32, drhs_accumulator_dtype=jnp.int32)
    quant = dataclasses.replace(quantizations.configure_quantization(cfg), quant_dg=int4)
    layer = maxtext_cells.build("int8", False, quant=quant)
    twin = qcheck.copy_params_into(layer, maxtext_cells.build("", False))
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(layer, twin, x, output=0, skip=qcheck.skip_modules(COMBINE_SCOPE), declared=True)
    coverage = str(failure.value).split("  coverage: ", 1)[1].split("\n  tracks", 1)[0]
    assert "4 of 5 matmuls differ from the declared quantization" in coverage
    assert coverage.count("is cast to int4; declared int8_aqt") == 8, coverage


@pytest.mark.parametrize("quantization", maxtext_cells.QUANTIZATIONS)
def test_check_layer_names_maxtext_unquantized_combine_without_a_skip(cells, x, quantization):
    # Should-fail of the dense pass: the combine is what the skip spares.
    layer, twin = cells(quantization, "dense")
    with pytest.raises(AssertionError, match=r"moe\.py:\d+") as failure:
        qcheck.check_layer(layer, twin, x, output=0)
    assert COMBINE_SCOPE in str(failure.value) or "RoutedMoE.dense_matmul" in str(failure.value)


@pytest.mark.parametrize("quantization", maxtext_cells.QUANTIZATIONS)
def test_maxtext_sparse_path_runs_expert_matmuls_through_plain_ragged_dot(cells, x, quantization):
    """maxtext 0.2.5, ``sparse_matmul=True, megablox=False``: the three expert matmuls run in full precision.

    ``RoutedMoE.sparse_matmul.<locals>.jax_ragged_dot_gmm`` calls
    ``jax.lax.ragged_dot`` on the float32 activations and kernels, which the
    quantizer never sees (it handles only an AQT ``QTensor`` kernel), for int8,
    fp8 and nanoo_fp8 alike; only the router is quantized, so the output still
    tracks the twin and only coverage sees it.
    """
    _pinned()
    layer, twin = cells(quantization, "sparse")
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(layer, twin, x, output=0, skip=qcheck.skip_modules(COMBINE_SCOPE))
    message = str(failure.value).replace(os.sep, "/")
    assert message.startswith("check_layer: ") and "ragged_dot" in message
    assert message.count(_ragged_dot_line()) == 3, message


@pytest.mark.parametrize("quantization", maxtext_cells.QUANTIZATIONS)
def test_check_layer_control_fails_a_skip_hiding_maxtext_dense_experts_in_the_twin(cells, x, quantization):
    # skip_at the function that runs the twin's expert einsums and its combine: in the layer the experts run
    # inside the quantizer, called from elsewhere, so the rule spares 1 matmul there and 4 in the twin.
    layer, twin = cells(quantization, "dense")
    rule = qcheck.skip_at("moe.py", "RoutedMoE.dense_matmul")
    with pytest.raises(AssertionError, match=r"spares 3 more matmul\(s\) in the unquantized control") as failure:
        qcheck.check_layer(layer, twin, x, output=0, skip=rule)
    hidden = str(failure.value).split("would pass unseen:", 1)[1]
    assert [scope for scope in ("wi_0/", "wi_1/", "wo/") if f" in {scope}" in hidden] == ["wi_0/", "wi_1/", "wo/"]



# -- megablox: the sparse path through MaxText's Pallas grouped matmul -----------------------------

#: The quantizations whose megablox path the tests run: each quantizes the kernels' lhs and rhs (MaxText
#: hands megablox a qwix rule of its dtype: per-row absmax codes and float32 scales).
MEGABLOX = {"fp8": "float8_e4m3fn", "int8": "int8"}


@pytest.fixture(scope="module")
def megablox_cells():
    built = {}

    def get(quantization: str):
        if quantization not in built:
            built[quantization] = maxtext_cells.cell(quantization, True, megablox=True)
        return built[quantization]

    return get


def _gmm_line() -> str:
    """``file:line`` of the ``call_gmm(`` call in megablox's ``backend.gmm``, read from MaxText's source."""
    from maxtext.kernels.megablox import backend

    lines, start = inspect.getsourcelines(inspect.unwrap(backend.gmm))
    (offset,) = [i for i, line in enumerate(lines) if "= call_gmm(" in line]
    return f"maxtext/kernels/megablox/backend.py:{start + offset}"


@pytest.mark.parametrize("quantization", sorted(MEGABLOX))
def test_coverage_reads_maxtext_megablox_kernels_by_their_roles(megablox_cells, x, quantization):
    """The three expert matmuls are ``pallas_call``s whose first operands are scalar-prefetch metadata (the
    dynamic grid bound and group offsets, int32): read by their roles (lhs, rhs, each a QArray's codes and
    scale), they are quantized in the layer, and full precision in the unquantized twin."""
    layer, twin = megablox_cells(quantization)
    records = qcheck.coverage(layer, x)
    shown = qcheck.format_coverage(records)
    kernels = [r for r in records if r.opaque]
    assert len(records) == 5 and len(kernels) == 3, shown
    assert all(_location(r).endswith(_gmm_line()) and r.function == "gmm" for r in kernels), shown
    assert all((r.kernel, r.kernel_roles) == ("gmm", "MaxText megablox") for r in kernels), shown
    cast = MEGABLOX[quantization]
    assert all(r.quantized and (r.lhs.dtype, r.rhs.dtype) == (cast, cast) for r in kernels), shown
    assert all((r.lhs_role, r.rhs_role) == ("activation", "weight") for r in kernels), shown
    # The metadata is no operand: only the codes and their float32 scales are data.
    assert all([o.split(" [")[0].rsplit(" ", 1)[1] for o in r.operands] == [cast, "float32"] * 2 for r in kernels)
    # The control: the twin's kernels, the same pallas_calls on float32 operands, read full precision.
    plain = [r for r in qcheck.coverage(twin, x) if r.opaque]
    assert len(plain) == 3 and all(r.kernel_roles == "MaxText megablox" and not r.lhs.quantized
                                   and not r.rhs.quantized and (r.lhs_dtype, r.rhs_dtype) == ("float32", "float32")
                                   for r in plain), qcheck.format_coverage(plain)


@pytest.mark.parametrize("quantization", sorted(MEGABLOX))
def test_check_layer_passes_maxtext_megablox_path(megablox_cells, x, quantization):
    # The kernels' code inputs held bitwise to the declaration read from the config: e4m3fn; for int8, the
    # router's AQT int8_aqt and megablox's own qwix rule in its gmm (int8_qwix, one lhs scale per row, one rhs
    # scale per output column across the experts).
    layer, twin = megablox_cells(quantization)
    figures = qcheck.check_layer(layer, twin, x, output=0, skip=qcheck.skip_modules(COMBINE_SCOPE))
    assert 0 < figures.rel_norm <= 0.22
    assert figures.declared.source == (f"MaxText config.quantization={quantization!r}"
                                       + (", megablox" if quantization == "int8" else ""))
    held = [r for r in figures.coverage if not r.skipped_by]
    assert len(held) == 4 and sum(r.opaque for r in held) == 3, qcheck.format_coverage(figures.coverage)
    assert all(r.lhs_declared and r.rhs_declared and not r.findings for r in held), (
        qcheck.format_coverage(figures.coverage))
    assert all(h.bitwise for r in held for h in (r.lhs_hold, r.rhs_hold)), qcheck.format_coverage(figures.coverage)


def test_assert_quantized_names_maxtext_megablox_kernels_of_the_unquantized_twin(megablox_cells, x):
    # Should-fail of the pass above: the twin checked as the layer, its kernels named by line and role.
    _, twin = megablox_cells("fp8")
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(twin, x, skip=qcheck.skip_modules(COMBINE_SCOPE))
    message = str(failure.value).replace(os.sep, "/")
    assert "4 of 5 matmuls reach full precision" in message, message
    assert message.count(f"{_gmm_line()} (gmm): lhs ") == 3, message
    assert message.count("lhs and rhs unquantized (opaque kernel gmm; roles: MaxText megablox)") == 3, message


# -- the qwix path (use_qwix_quantization=True) -------------------------------------------------

#: MaxText's qwix quantizations the qwix-path tests build, and the format each one's rule declares
#: (qcheck's reader, ``MAXTEXT_QWIX``, reads the same from the model's config).
QWIX_DECLARED = {"fp8": "e4m3fn", "int8": "int8_qwix"}
#: What MaxText's qwix path leaves in full precision by design: attention's activation x activation products,
#: the combine, and the logits head (outside the rule's "decoder/.*layers.*"). The norms' scale einsums
#: (``RMSNorm``'s ``...k,k->...k``, normalizations.py:129) multiply elementwise: no matmul, nothing to spare.
QWIX_FULL_PRECISION_FUNCTIONS = ("AttentionOp.qk_product", "AttentionOp.wv_product")
QWIX_FULL_PRECISION_MODULES = (COMBINE_SCOPE, "logits_dense")
#: The functions on the stack of the matmuls MaxText's qwix rule does quantize: the router and attention's projections.
QWIX_QUANTIZED = ("GateLogit.__call__", "Attention.query_projection", "Attention.kv_projection",
                  "Attention.out_projection")


#: What qwix 0.1.8 and flax 0.12.12 warn while MaxText's qwix path builds and runs (deprecated flax APIs).
QWIX_PATH_WARNS = [*QWIX_WARNS,
                   pytest.mark.filterwarnings("ignore:'sharding' is deprecated, use 'out_sharding':DeprecationWarning"),
                   pytest.mark.filterwarnings("ignore:`flax.nnx.State` will be deprecated:DeprecationWarning")]


def _qwix_warns(test):
    for mark in QWIX_PATH_WARNS:
        test = mark(test)
    return test


def _qwix_path(test):
    return pytest.mark.parametrize("quantization", sorted(QWIX_DECLARED))(_qwix_warns(test))


def _expert_einsum_lines() -> dict[str, str]:
    """``file:line`` of the wi_0, wi_1 and wo einsum calls of ``RoutedMoE.dense_matmul``'s dropless branch
    (``capacity_factor=-1``: the last call of each in the function), read from MaxText's source."""
    from maxtext.layers import moe

    lines, start = inspect.getsourcelines(moe.RoutedMoE.dense_matmul)
    found = {}
    for name in ("WI_0", "WI_1", "WO"):
        *_, offset = [i for i, line in enumerate(lines) if f"einsum_name={name})(" in line]
        found[name.lower()] = f"maxtext/layers/moe.py:{start + offset}"
    return found


def _functions(record) -> set[str]:
    return {function for _, function in record.stack}


def _qwix_declared(quantization: str) -> dict[str, str]:
    return {"weights": QWIX_DECLARED[quantization], "activations": QWIX_DECLARED[quantization]}


def _qwix_skips():
    return [qcheck.skip_functions(*QWIX_FULL_PRECISION_FUNCTIONS), qcheck.skip_modules(*QWIX_FULL_PRECISION_MODULES)]


@_qwix_path
def test_maxtext_qwix_path_leaves_moe_expert_einsums_unquantized(quantization):
    """maxtext 0.2.5, ``use_qwix_quantization=True`` (the path MaxText's deprecation warning for AQT points to):
    the MoE expert einsums wi_0, wi_1 and wo run float32 x float32 under fp8 and int8.

    MaxText's qwix rules carry ``op_names=("dot_general",)`` (quantizations.py:1165-1181); ``RoutedMoE``
    multiplies its experts by ``jnp.einsum``, which qwix intercepts as its own op "einsum" (no rule matches)
    and inside which it switches interception off, so the einsum's dot_general is never quantized. The
    router and attention's projections (``DenseGeneral``'s dot_general) are. A whole 1-layer Mixtral built
    as MaxText builds it (``from_config`` -> ``create_model`` -> ``maybe_quantize_model``).
    """
    _pinned()
    forward, inputs, _ = maxtext_cells.qwix_model(quantization)
    declared = _qwix_declared(quantization)
    records = qcheck.coverage(forward, *inputs, declared=declared)
    shown = qcheck.format_coverage(records)
    spared = [r for r in records if _functions(r) & set(QWIX_FULL_PRECISION_FUNCTIONS)
              or any(m in r.scope.split("/") for m in QWIX_FULL_PRECISION_MODULES)]
    held = [r for r in records if r not in spared]
    failing = [r for r in held if r.findings]
    experts = _expert_einsum_lines()
    # Exactly the three expert einsums fail, each with both operands in full precision, in MaxText's order.
    assert [_location(r).rsplit("site-packages/", 1)[-1] for r in failing] == list(experts.values()), shown
    assert [r.scope.rsplit("/", 2)[-2] for r in failing] == list(experts), shown
    assert all(not r.quantized and {r.lhs_dtype, r.rhs_dtype} == {"float32"} and len(r.findings) == 2
               and all("reaches the matmul in full precision" in f for f in r.findings) for r in failing), shown
    # The router and the four attention projections pass the declaration (the rest of `held`).
    passing = [r for r in held if not r.findings]
    assert sorted(next(f for f in QWIX_QUANTIZED if f in _functions(r)) for r in passing) == sorted(
        ["GateLogit.__call__", "Attention.query_projection", "Attention.kv_projection", "Attention.kv_projection",
         "Attention.out_projection"]), shown
    # assert_quantized, skipping what MaxText keeps in full precision by design, names the three sites, and no other.
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(forward, *inputs, declared=declared, skip=_qwix_skips())
    message = str(failure.value).replace(os.sep, "/")
    assert f"3 of {len(records)} matmuls differ from the declared quantization" in message, message
    assert all(message.count(line) == 1 for line in experts.values()), message
    assert message.count("moe.py:") == 3 and "linears.py" not in message, message


@_qwix_path
def test_maxtext_qwix_path_router_is_quantized_as_declared(quantization):
    """The control of the test above: on the same model the router's matmul is quantized, both operands cast
    to the rule's type (e4m3fn; int8 on qwix's grid, codes bitwise), so the check measures something; held to
    the other fp8 flavour (e4m3fnuz) or to AQT's int8 grid instead, the same site fails."""
    forward, inputs, _ = maxtext_cells.qwix_model(quantization)
    records = qcheck.coverage(forward, *inputs, declared=_qwix_declared(quantization))
    (router,) = [r for r in records if "GateLogit.__call__" in _functions(r)]
    cast = {"fp8": "float8_e4m3fn", "int8": "int8"}[quantization]
    assert router.quantized and router.lhs_casts == router.rhs_casts == frozenset({cast}), (
        qcheck.format_coverage(records))
    assert router.lhs_declared == router.rhs_declared == QWIX_DECLARED[quantization] and not router.findings
    assert router.rhs_shape == (maxtext_cells.EMB, maxtext_cells.EXPERTS) and router.rhs_role == "weight"
    other = {"fp8": "e4m3fnuz", "int8": "int8_aqt"}[quantization]
    records = qcheck.coverage(forward, *inputs, declared={"weights": other, "activations": other})
    (router,) = [r for r in records if "GateLogit.__call__" in _functions(r)]
    assert router.findings and all(other in f for f in router.findings), router.findings


@_qwix_path
def test_maxtext_qwix_declaration_is_read_from_the_config(quantization):
    """``declared=True``'s reader on the qwix path: the rule's format, from ``config.quantization`` with
    ``use_qwix_quantization`` on, on the model ``qwix.quantize_model`` hands back (a subclass it makes).
    Should pass: the router and attention's projections hold to it. Should fail: the expert einsums."""
    from qcheck._coverage._readers import read_declaration

    forward, inputs, model = maxtext_cells.qwix_model(quantization)
    assert type(model).__module__ != "maxtext.models.models"  # qwix's subclass: what the reader must see through
    declaration = read_declaration(model)
    fmt = QWIX_DECLARED[quantization]
    assert declaration is not None and declaration.source == (
        f"MaxText config.quantization={quantization!r}, use_qwix_quantization (qwix rule: {fmt})")
    assert {k: v.format for k, v in declaration.roles.items()} == {"activations": fmt, "weights": fmt}
    records = qcheck.coverage(forward, *inputs, declared=declaration)
    by_function = {f: [r for r in records if f in _functions(r)] for f in QWIX_QUANTIZED + ("RoutedMoE.dense_matmul",)}
    assert all(not r.findings for f in QWIX_QUANTIZED for r in by_function[f])  # should pass
    expert = [r for r in by_function["RoutedMoE.dense_matmul"] if COMBINE_SCOPE not in r.scope]
    assert len(expert) == 3 and all(r.findings for r in expert)  # should fail


#: The layer counts the RNG tests build MaxText's tiny Mixtral at (unrolled; about 5 s a layer count on CPU).
RNG_LAYERS = (1, 2, 4)


def _rng_state_flat(quantization: str, qwix: bool = True, **kwargs):
    """``assert_rng_state_flat`` on MaxText's tiny Mixtral, as a user runs it: the whole model jitted by
    ``nnx.jit``, which takes its state in and hands it back updated."""
    from flax import nnx

    @nnx.jit
    def forward(model, tokens, positions, segments):
        return model(tokens, positions, segments)

    inputs = maxtext_cells.qwix_model(quantization, qwix=qwix)[1]
    return qcheck.assert_rng_state_flat(lambda n: maxtext_cells.qwix_model(quantization, n, qwix)[0], forward,
                                        *inputs, layers=RNG_LAYERS, **kwargs)


@_qwix_warns
def test_maxtext_rng_state_flat_passes_the_unquantized_model_should_pass():
    """The unquantized model (``quantization=""``): the model's three streams (params, dropout, aqt), a key and a
    count each, held once by the decoder however many layers use them."""
    figures = _rng_state_flat("")
    assert (figures.u32, figures.rng_leaves) == (6, 6)


@_qwix_path
def test_maxtext_rng_state_flat_catches_the_qwix_path_copying_the_streams_per_layer_should_fail(quantization):
    """maxtext 0.2.5, ``use_qwix_quantization=True`` with qwix's ``QtProvider`` (``fp8``, ``int8``): the model
    ``qwix.quantize_model`` hands back holds a copy of the caller's three streams in every MoE block (the
    unquantized model shares one ``nnx.Rngs`` across its layers), so each layer adds 6 u32 entry parameters."""
    _pinned()
    with pytest.raises(AssertionError, match=(
            r"(?s)^assert_rng_state_flat: RNG state grows with the layers: u32 entry parameters of the step by "
            r"layer count \{1: 12, 2: 18, 4: 30\}, RNG state leaves \{1: 12, 2: 18, 4: 30\}; .*\n"
            r"  model/decoder/layers_\*/MoeBlock_\*/rngs \(aqt, dropout, params\): \{1: 6, 2: 12, 4: 24\} "
            r"\(e\.g\. model/decoder/layers_3/MoeBlock_0/rngs\)$")):
        _rng_state_flat(quantization)


#: The modules under each decoder layer whose ``dot_general`` the ``fp8_gpu`` path wraps in a ``ToNNX`` of its own.
FP8_GPU_WRAPPED = ("MoeBlock_*/gate", "self_attention/key", "self_attention/out", "self_attention/query",
                   "self_attention/value")


@_qwix_warns
def test_maxtext_rng_state_flat_catches_the_fp8_gpu_path_forking_a_stream_per_wrapper_should_fail():
    """maxtext 0.2.5, ``quantization="fp8_gpu"`` (``NvidaFp8Provider``): ``_apply_linen_module_in_nnx``
    (layers/quantizations.py:979-997) wraps each Flax fp8 op in a ``ToNNX`` holding ``parent_rngs.fork()``,
    the seed's shape (MaxText #5160): 5 wrappers a layer, a key and a count each, beside the qwix path's
    copies of the streams. Lowered on CPU: no GPU is needed to count what enters the step."""
    _pinned()
    wrappers = "".join(
        rf".*\n  model/decoder/layers_\*/{re.escape(m)}/_qwix_fp8_gpu_dot_general0/to_nnx__rngs \(default\): "
        rf"\{{1: 2, 2: 4, 4: 8\}}" for m in FP8_GPU_WRAPPED)
    with pytest.raises(AssertionError, match=(
            r"(?s)^assert_rng_state_flat: RNG state grows with the layers: u32 entry parameters of the step by "
            r"layer count \{1: 22, 2: 38, 4: 70\}, RNG state leaves \{1: 22, 2: 38, 4: 70\}" + wrappers)):
        _rng_state_flat("fp8_gpu")


@_qwix_warns
@pytest.mark.filterwarnings("ignore:AQT quantization is deprecated:UserWarning")
def test_maxtext_rng_state_flat_names_the_aqt_int8_model_that_cannot_take_its_first_call():
    """maxtext 0.2.5, ``quantization="int8"`` on AQT (``use_qwix_quantization=False``): the whole model's first
    call fails inside MaxText's unrolled decoder, whose ``nnx.update(layer, new_state)`` (nnx_decoders.py:2264)
    assigns the state AQT's einsums create at that call to a static attribute of ``RoutedMoE``. The check
    gives no verdict: it names the step whose code raised. (``RoutedMoE`` alone runs: the cells above.)"""
    _pinned()
    with pytest.raises(qcheck.UserCodeError, match=(
            r"^assert_rng_state_flat: step could not be traced and run on cpu: ValueError: Found data on value of "
            r"type '<class 'flax\.nnx\.statelib\.State'>' assigned to static attribute 'quant_einsum_wi_0' of "
            r"Pytree type '<class 'maxtext\.layers\.moe\.RoutedMoE'>'")):
        _rng_state_flat("int8", qwix=False)


#: The guide's skip table, row by row, on fp8: (path, the rules, what check_layer's failure then says).
GUIDE_SKIPS = [
    # The sparse combine by file and function: only the three ragged_dots are left.
    ("sparse", lambda: qcheck.skip_at("moe.py", "RoutedMoE.unpermute"), r"^check_layer: 1 check\(s\) failed:\n"
     r"  coverage: assert_quantized: 3 of 5 matmuls differ from the declared quantization .*:\n"
     r"(    ragged_dot_general at .*\n(      .*reaches the matmul in full precision.*\n){2}){3}declared: "),
    # MaxText quantizes its router: a rule for it matches only quantized matmuls of the layer, and is refused.
    ("dense", lambda: [qcheck.skip_modules(COMBINE_SCOPE), qcheck.skip_modules("gate")],
     r"skip_modules\('gate'\) spares none of the 5 matmuls"),
]


@pytest.mark.parametrize("path, rules, says", GUIDE_SKIPS, ids=["unpermute", "gate"])
def test_guide_skip_rules_spare_what_it_says(cells, x, path, rules, says):
    layer, twin = cells("fp8", path)
    with pytest.raises(AssertionError) as failure:
        qcheck.check_layer(layer, twin, x, output=0, skip=rules())
    assert re.search(says, str(failure.value)), str(failure.value)


# -- docs/checking-your-layer.md ----------------------------------------------------------------

GUIDE = (Path(__file__).parent.parent / "docs" / "checking-your-layer.md").read_text()
SCRIPT = (Path(__file__).parent.parent / ".ci" / "maxtext.sh").read_text()


def _guide_blocks() -> dict[str, str]:
    return dict(re.findall(r"<!-- maxtext: (\w+) -->\n```\w+\n(.*?)```", GUIDE, re.S))


def test_guide_environment_is_what_ci_builds():
    shell = _guide_blocks()["environment"]
    (pattern,) = re.findall(r"grep -Ev '([^']+)'", shell)
    assert re.findall(r"grep -Ev '([^']+)'", SCRIPT) == [pattern]
    assert f"maxtext=={maxtext_cells.MAXTEXT_VERSION}" in shell
    assert f"MAXTEXT_VERSION={maxtext_cells.MAXTEXT_VERSION}" in SCRIPT
    (exported,) = re.findall(r"^export (.*)$", shell, re.M)
    assert [v.split("=")[0] for v in exported.split()] == list(maxtext_cells.ENVIRONMENT)
    assert all(f"{v}=" in SCRIPT for v in maxtext_cells.ENVIRONMENT)


def test_guide_runs_on_maxtext_routed_moe(capsys):
    blocks = _guide_blocks()
    assert list(blocks) == ["environment", "build", "coverage", "check", "declared", "sparse"]
    namespace = {"__name__": "checking_your_layer"}

    def run(label: str) -> str:
        exec(compile(blocks[label], f"docs/checking-your-layer.md[{label}]", "exec"), namespace)
        return capsys.readouterr().out.replace(os.sep, "/")

    run("build")
    assert _params(namespace["layer"]).keys() == _params(namespace["twin"]).keys()
    assert all(np.array_equal(a, b) for a, b in zip(_params(namespace["layer"]).values(),
                                                     _params(namespace["twin"]).values()))
    shown = run("coverage")
    assert len(namespace["records"]) == 5 and [r.quantized for r in namespace["records"]] == [True] * 4 + [False]
    # Each located in MaxText, never inside AQT or Flax's fp8 ops.
    assert all("maxtext/layers/" in _location(r) for r in namespace["records"]), shown
    checked = run("check")
    assert re.fullmatch(r"forward 0\.\d{3}, worst gradient .+\nheld to .+\n", checked)
    # The declaration the prose quotes is the one the block prints.
    assert f"held to {namespace['figures'].declared}" in GUIDE.replace("\n", " "), checked
    # The figures the prose quotes are the ones the block prints.
    ((forward, param, grad),) = re.findall(
        r"fp8 prints `forward (0\.\d+), worst gradient \('([\w/]+)', (0\.\d+)\)`", GUIDE)
    figures = namespace["figures"]
    assert (f"{figures.rel_norm:.3f}", figures.worst_grad[0], f"{figures.worst_grad[1]:.3f}") == (forward, param, grad)
    planted = run("declared")
    quoted = GUIDE.split("<!-- maxtext: declared -->", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    # The failure the guide shows is the block's, line by line (the site's scope and path shortened).
    for line in quoted.splitlines():
        assert all(piece in planted for piece in line.split(" in wo/", 1)[0].split(".../")), (line, planted)
    failure = run("sparse")
    assert failure.count(_ragged_dot_line()) == 3, failure
    # The line the prose names is the line MaxText's source has.
    assert f"(moe.py:{_ragged_dot_line().rsplit(':', 1)[1]})" in GUIDE


# -- MaxText's scanned decoder layers (nnx_scan) ------------------------------------------------------

#: The full-precision matmuls of a scanned Mixtral layer, by module path: attention's two einsums (its
#: ``AttentionOp``) and the MoE block's combine.
SCANNED_SKIPS = ("self_attention/attention_op", f"MoeBlock_0/{COMBINE_SCOPE}")
#: Each matmul of one Mixtral decoder layer, in MaxText's order, by the first three parts of its scope.
SCANNED_MODULES = ["layers/self_attention/query", "layers/self_attention/key", "layers/self_attention/value",
                   "layers/self_attention/attention_op", "layers/self_attention/attention_op",
                   "layers/self_attention/out", "layers/MoeBlock_0/gate", "layers/MoeBlock_0/wi_0",
                   "layers/MoeBlock_0/wi_1", "layers/MoeBlock_0/wo", f"layers/MoeBlock_0/{COMBINE_SCOPE}"]


#: What flax 0.12.12 deprecates in MaxText's nnx_scan (Rngs.fork(split=...), Variable.value, sharding_names)
#: and in its Attention (sharding=...), while the layers are built, stacked and applied.
SCANNED_WARNS = [pytest.mark.filterwarnings(f"ignore:{message}:DeprecationWarning") for message in (
    "The 'split' argument of 'fork' is deprecated", "'.value' access is now deprecated",
    "'sharding_names' is deprecated, use 'out_sharding'", "'sharding' is deprecated, use 'out_sharding'")]


def _scanned_path(test):
    for mark in SCANNED_WARNS:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def scanned_fp8():
    """(layer, twin): fp8 scanned decoder layers and unquantized ones holding their weights (about 20 s)."""
    layer = maxtext_cells.scanned("fp8")
    return layer, qcheck.copy_params_into(layer, maxtext_cells.scanned(""))


def _module(record) -> str:
    return "/".join(record.scope.split("/")[:3])


@_scanned_path
def test_maxtext_scanned_decoder_records_carry_module_paths_and_error_figures(scanned_fp8):
    """Inside ``apply_scanned_layers``' scan the layer is ``nnx.merge``d anew each trace, no module of the
    stack's graph: its matmuls still carry the stacked module's path, one record per matmul of the body
    (not one per layer), and with ``errors=True`` each quantized one its worst figure over the layers."""
    layer, _ = scanned_fp8
    records = qcheck.coverage(layer, maxtext_cells.scanned_inputs(), errors=True)
    shown = qcheck.format_coverage(records)
    assert [_module(r) for r in records] == SCANNED_MODULES, shown
    full = [r for r in records if not r.quantized]
    assert [_module(r) for r in full] == SCANNED_MODULES[3:5] + SCANNED_MODULES[-1:], shown
    # Both operands rounded onto e4m3's 3 mantissa bits (a relative error of at most 2^-4 each).
    assert all(r.no_error is None and 0 < r.error < 2 * 2 ** -4 for r in records if r.quantized), shown
    assert all(r.error is None and r.no_error == "full-precision operands" for r in full), shown


@_scanned_path
def test_maxtext_scanned_decoder_skip_modules_spares_attention_and_the_combine(scanned_fp8):
    layer, twin = scanned_fp8
    x = maxtext_cells.scanned_inputs()
    records = qcheck.assert_quantized(layer, x, skip=qcheck.skip_modules(*SCANNED_SKIPS), control=twin)
    assert [_module(r) for r in records if r.skipped_by] == SCANNED_MODULES[3:5] + SCANNED_MODULES[-1:]
    # Should fail: without the attention rule its two einsums are named, each by its module path.
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer, x, skip=qcheck.skip_modules(SCANNED_SKIPS[1]))
    message = str(failure.value)
    assert f"2 of {len(SCANNED_MODULES)} matmuls reach full precision" in message, message
    assert message.count(", in layers/self_attention/attention_op/") == 2, message
    # Should fail: the whole attention module spares its projections in the unquantized twin too.
    with pytest.raises(AssertionError, match=r"skip rule skip_modules\('self_attention', 'MoeBlock_0/weight_sum'\) "
                                             r"spares 4 more matmul\(s\) in the unquantized control"):
        qcheck.assert_quantized(layer, x, skip=qcheck.skip_modules("self_attention", SCANNED_SKIPS[1]), control=twin)


@_scanned_path
def test_check_layer_passes_on_maxtext_scanned_decoder_with_per_parameter_gradients(scanned_fp8):
    layer, twin = scanned_fp8
    figures = qcheck.check_layer(layer, twin, maxtext_cells.scanned_inputs(), skip=qcheck.skip_modules(*SCANNED_SKIPS))
    assert 0 < figures.rel_norm < 0.22
    # One figure per stacked parameter (both layers' slices together), by its module path.
    assert {"layers/MoeBlock_0/gate/kernel", "layers/MoeBlock_0/wi_0", "layers/MoeBlock_0/wo",
            "layers/self_attention/query/kernel"} <= set(figures.grad_rel_norms), figures.grad_rel_norms


@_scanned_path
def test_maxtext_apply_scanned_layers_cannot_run_int8_decoder_layers(scanned_fp8):
    """maxtext 0.2.5: ``nnx_scan.apply_scanned_layers`` over int8 ``MixtralDecoderLayer``s raises on the
    layers' own call (no qcheck): AQT's einsums are bridged into NNX on a layer's first call
    (``quantizations.apply_einsum_in_nnx`` sets ``quant_einsum_wi_0`` on the ``RoutedMoE``), here inside the
    scan's body, and the ``nnx.update`` that writes the body's state back onto the stacked layers cannot
    set that new attribute (NNX takes it for a static one). MaxText's own decoder (``scan_layers=True``,
    built by ``from_config``) runs int8; a stack built from layers called once before stacking runs too.
    ``check_layer`` reports it as the layer's own error."""
    _pinned()
    layer = maxtext_cells.scanned("int8")
    x = maxtext_cells.scanned_inputs()
    with pytest.raises(ValueError, match=r"assigned to static attribute 'quant_einsum_wi_0'"):
        layer(x)
    with pytest.raises(qcheck.UserCodeError, match=r"^check_layer: layer could not be traced and run on cpu: "
                                                   r"ValueError: .* static attribute 'quant_einsum_wi_0'"):
        qcheck.check_layer(layer, scanned_fp8[1], x)


# -- the unquantized layers against the float64 referee (assert_moe_matches_referee) -------------------
# check_layer holds a quantized block to its unquantized twin, so a bug in code both run (the router's
# softmax, the renormalisation, the activation, the shared experts) is invisible there: the twin itself is
# held to qcheck.referees.reference_moe, numpy in float64, on its own weights.

#: MaxText's parameter paths by the referee's role: the router's kernel [emb, experts], the stacked experts
#: (wi_0 gated by the activation, wi_1 linear, ``mlp_activations`` ["silu", "linear"]), all [in, out].
REFEREE_ROLES = {"gate/kernel": "router", "wi_0": "gate", "wi_1": "up", "wo": "down"}
#: ``RoutedAndSharedMoE``'s: the routed block's under ``MoeBlock_0``, the shared experts' one ``MlpBlock``
#: (``shared_experts`` FFNs side by side on its hidden axis: their sum, one FFN to the referee).
SHARED_ROLES = {**{f"MoeBlock_0/{path}": role for path, role in REFEREE_ROLES.items()},
                "shared_experts/wi_0/kernel": "shared_gate", "shared_experts/wi_1/kernel": "shared_up",
                "shared_experts/wo/kernel": "shared_down"}
#: dense: ``dense_matmul``; sparse: ``sparse_matmul`` through ``jax.lax.ragged_dot`` (megablox off);
#: megablox: through its Pallas kernels, interpreted on CPU with shrunk tiles.
REFEREE_PATHS = ("dense", "sparse", "megablox")
#: The referee's expert output mix a plant leaves at the first failing token (_layer_mix's verdicts).
OTHER_EXPERTS = r"the layer's output there is the referee's experts \[\d+, \d+\] mixed with weights .*: other experts"
OTHER_WEIGHTS = (r"the layer's output there is the referee's experts \[\d+, \d+\] mixed with weights .*: the same "
                 r"experts, other weights$")
NO_MIX = r"the layer's output there is no mix of the referee's expert outputs"


@pytest.fixture(scope="module")
def unquantized(cells, megablox_cells):
    """MaxText's unquantized ``RoutedMoE`` on each path: the twins of the fp8 cells above (built once)."""
    return lambda path: megablox_cells("fp8")[1] if path == "megablox" else cells("fp8", path)[1]


@pytest.fixture(scope="module")
def routed_and_shared():
    built = {}

    def get(path: str):
        if path not in built:
            built[path] = maxtext_cells.routed_and_shared(path != "dense", megablox=path == "megablox")
        return built[path]

    return get


def _routed_options(cfg) -> dict:
    """The referee's options as the layer's config states them: SiLU-gated experts without biases
    (``jax.nn.silu``, MaxText's ``mlp_activations[0]``) and its top k."""
    assert list(cfg.mlp_activations) == ["silu", "linear"] and not cfg.mlp_bias
    return {"top_k": cfg.num_experts_per_tok, "activation": "silu", "output": 0}


@pytest.mark.parametrize("path", REFEREE_PATHS)
def test_maxtext_routed_moe_matches_the_mixtral_referee(unquantized, x, path):
    """``RoutedMoE.get_topk`` outside the DeepSeek, Llama 4 and Gemma 4 blocks takes the top k logits and the
    softmax over those k (the Mixtral decoder block's routing; ``norm_topk_prob``, off, would renormalise
    weights that already sum to 1): Mixtral's definition, on all three paths. Should fail, on the same layer:
    the referee asked for the top 1, or for DeepSeek's softmax over all experts, not renormalised."""
    layer = unquantized(path)
    options = _routed_options(layer.config)
    assert not layer.config.norm_topk_prob and layer.config.routed_score_func == "" and layer.config.capacity_factor < 0
    figures = qcheck.assert_moe_matches_referee(layer, x, REFEREE_ROLES, style="mixtral", **options)
    assert figures["tokens"] == np.prod(maxtext_cells.X_SHAPE[:-1]) and figures["max_rel"] < 1e-5, dict(figures)
    with pytest.raises(AssertionError, match=OTHER_EXPERTS):
        qcheck.assert_moe_matches_referee(layer, x, REFEREE_ROLES, style="mixtral", **{**options, "top_k": 1})
    with pytest.raises(AssertionError, match=OTHER_WEIGHTS):
        qcheck.assert_moe_matches_referee(layer, x, REFEREE_ROLES, style="deepseek", **options)


def test_maxtext_routed_moe_drops_tokens_as_the_referee_on_the_dense_path(x):
    """``capacity_factor`` > 0 drops on the dense path only (MaxText's moe_configuration.md: "Effective only
    when sparse_matmul is False"): ``generate_masks`` counts each expert's assignments in token order, then
    rank order (a cumsum over the sequence's flattened top-k), and zeroes the weights past capacity, leaving
    the others as they are. MaxText's slots, ceil(seq * k / experts) * factor = 4 * 0.5, are the referee's
    ceil(seq * k * factor / experts) = 2 here. Should fail: the same layer held to the dropless referee."""
    seq, factor = maxtext_cells.X_SHAPE[1], 0.5
    assert math.ceil(seq * maxtext_cells.TOP_K / maxtext_cells.EXPERTS) * factor == qcheck.referees.reference_capacity(
        seq, maxtext_cells.TOP_K, maxtext_cells.EXPERTS, factor)
    layer = maxtext_cells.build("", False, capacity_factor=factor)
    options = _routed_options(layer.config)
    figures = qcheck.assert_moe_matches_referee(layer, x, REFEREE_ROLES, style="mixtral", capacity_factor=factor,
                                                **options)
    assert figures["dropped"] > 0 and figures["max_rel"] < 1e-5, dict(figures)
    with pytest.raises(AssertionError, match=r"routes it to experts \[\d+, \d+\] with weights .*; the layer's output "
                                             r"there is the referee's experts \[\d+\] mixed .*: other experts"):
        qcheck.assert_moe_matches_referee(layer, x, REFEREE_ROLES, style="mixtral", **options)


@pytest.mark.parametrize("path", REFEREE_PATHS)
# flax 0.12.12 deprecates the ``sharding=`` the shared experts' MlpBlock gives its DenseGeneral kernels.
@pytest.mark.filterwarnings("ignore:'sharding' is deprecated, use 'out_sharding':DeprecationWarning")
def test_maxtext_routed_and_shared_moe_matches_the_deepseek_referee(routed_and_shared, x, path):
    """The DeepSeek block (``decoder_block="deepseek"``, ``routed_score_func="softmax"``, DeepSeek-V2's
    routing): the gate's softmax over all experts, the top k of it taken as they are, times
    ``routed_scaling_factor``, plus the shared experts' FFN with weight 1: DeepSeekMoE's definition, on all
    three paths. Should fail, on the same layer: the shared experts left out of the mapping, or the routed
    scaling factor left at 1."""
    layer = routed_and_shared(path)
    cfg = layer.config
    assert (cfg.shared_experts, cfg.routed_scaling_factor, cfg.routed_score_func, cfg.routed_bias) == (
        maxtext_cells.DEEPSEEK["shared_experts"], maxtext_cells.DEEPSEEK["routed_scaling_factor"], "softmax", False)
    assert cfg.capacity_factor < 0 and cfg.n_routing_groups == -1
    options = {**_routed_options(cfg), "style": "deepseek", "routed_scaling_factor": cfg.routed_scaling_factor}
    figures = qcheck.assert_moe_matches_referee(layer, x, SHARED_ROLES, **options)
    assert figures["tokens"] == np.prod(maxtext_cells.X_SHAPE[:-1]) and figures["max_rel"] < 1e-5, dict(figures)
    routed_only = {p: r for p, r in SHARED_ROLES.items() if not r.startswith("shared_")}
    with pytest.raises(AssertionError, match=NO_MIX):
        qcheck.assert_moe_matches_referee(layer, x, routed_only, **options)
    with pytest.raises(AssertionError, match=OTHER_WEIGHTS):
        qcheck.assert_moe_matches_referee(layer, x, SHARED_ROLES, **{**options, "routed_scaling_factor": 1.0})


def test_guide_quotes_the_roles_maxtext_passes_the_referee_with():
    # The referee section's MaxText bullet: the mapping as the tests above pass it, the shared experts' paths
    # after the first without their "shared_experts/".
    quoted = " ".join(GUIDE.split())
    assert f"`{json.dumps(REFEREE_ROLES)}`" in quoted
    first, *rest = [path for path, role in SHARED_ROLES.items() if role.startswith("shared_")]
    assert f"`{first}`" in quoted and all(f"`{path.split('/', 1)[1]}`" in quoted for path in rest)


# -- a user's int8 ragged_dot in MaxText's sparse-path fallback, inside its shard_map ----------------

def _user_int8_ragged_dot(shared: bool):
    """A user's int8 grouped matmul (a custom_vjp, AQT's default int8 op for op: absmax / 127.5, reciprocal,
    clip, round) where MaxText 0.2.5's sparse path with megablox off calls ``jax.lax.ragged_dot`` (moe.py:2195,
    inside ``sparse_matmul``'s shard_map): the weight scale per expert and output column, or (the plant) one
    shared by all experts."""
    import jax
    import jax.numpy as jnp

    plain = jax.lax.ragged_dot

    def int8(v, axes):
        amax = jnp.max(jnp.abs(v), axis=axes, keepdims=True)
        scale = jnp.where(amax == 0, jnp.ones_like(amax), amax) / 127.5
        codes = jax.lax.round(jnp.clip(v * jax.lax.reciprocal(scale), -127, 127),
                              jax.lax.RoundingMethod.TO_NEAREST_EVEN)
        return codes.astype(jnp.int8).astype(v.dtype) * scale

    @jax.custom_vjp
    def ragged(lhs, rhs, group_sizes):
        return plain(int8(lhs, (1,)), int8(rhs, (0, 1) if shared else (1,)), group_sizes)

    def fwd(lhs, rhs, group_sizes):
        return ragged(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def bwd(res, g):  # straight through
        lhs, rhs, group_sizes = res
        return (*jax.vjp(lambda a, b: plain(a, b, group_sizes), lhs, rhs)[1](g), None)

    ragged.defvjp(fwd, bwd)
    return lambda lhs, rhs, group_sizes, preferred_element_type=None, **kwargs: ragged(lhs, rhs, group_sizes)


@pytest.mark.parametrize("shared", [False, True], ids=["per expert", "shared across experts"])
def test_user_int8_ragged_dot_inside_maxtexts_shard_map_is_held_bitwise(cells, x, monkeypatch, shared):
    """Read from ``config.quantization='int8'`` (int8_aqt), the user's expert matmuls are held bitwise inside
    MaxText's shard_map, its body run per shard: the per-expert scale passes (the control), one scale shared by
    all experts fails naming the site and the shard."""
    import jax

    layer, _ = cells("int8", "sparse")
    monkeypatch.setattr(jax.lax, "ragged_dot", _user_int8_ragged_dot(shared))
    skip = qcheck.skip_modules(COMBINE_SCOPE)
    if not shared:
        records = qcheck.assert_quantized(layer, x, skip=skip)
        experts = [r for r in records if r.primitive == "ragged_dot_general"]
        assert len(experts) == 3 and all(h.bitwise for r in experts for h in (r.lhs_hold, r.rhs_hold)), (
            qcheck.format_coverage(records))
        assert records.declared_from == "read from the fn: MaxText config.quantization='int8'"
        return
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(layer, x, skip=skip)
    message = str(failure.value)
    assert "3 of 5 matmuls differ from the declared quantization" in message, message
    assert message.count("rhs (weight) (shard 0): codes are not int8_aqt's") == 3, message
    assert message.count("they match one scale shared across axis 0 (size 4)") == 3, message
