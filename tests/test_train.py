"""qcheck.train, the reference trainer: its docs example runs, it leaves its module alone, bad input is one line.

The trainer's fp8 handling is held on every fp8 case by the suite's ``train``
invariant (qcheck/suite/tests/test_invariants.py) and shown failing on planted
sites in tests/test_catalogue.py.
"""

import re
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck.suite import cases, invariants

DOC = (Path(__file__).parent.parent / "docs" / "checking-your-training-loop.md").read_text()
CASE = cases.Case("fp8", cases.Variant("mixtral", "dense", False))


def test_the_docs_trainer_example_runs_as_written(capsys):
    (block,) = re.findall(r"<!-- training-loop: trainer -->\n```python\n(.*?)```", DOC, re.S)
    exec(compile(block, "docs/checking-your-training-loop.md[trainer]", "exec"), {})
    newest, oldest = map(float, capsys.readouterr().out.split())
    assert newest > 0 and oldest > 0


def test_train_returns_a_trained_copy_and_leaves_the_module_alone():
    layer, x = cases.layer(CASE), cases.layer_input("mixtral")
    before = {k: np.array(v) for k, v in nnx.to_flat_state(nnx.state(layer))}
    trained = qcheck.train(layer, x)
    after = {k: np.array(v) for k, v in nnx.to_flat_state(nnx.state(layer))}
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    fp8 = qcheck.fp8_state(trained)
    assert len(fp8) == len(qcheck.fp8_state(layer)) and fp8["sites/wo/input_amax_history"][0] > 0
    moved = invariants.grad_leaves(nnx.state(trained, nnx.Param))
    assert all(not np.array_equal(v, before[tuple(k.split("."))]) for k, v in moved.items())


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, r"^train: steps must be a positive integer, got 0$"),
    ({"microbatches": 2.0}, r"^train: microbatches must be a positive integer, got 2\.0$"),
    ({"microbatches": 3}, r"^train: batch's first axis \(2\) does not split into microbatches=3 equal parts$"),
    ({"max_norm": 0.0}, r"^train: max_norm must be positive or None, got 0\.0$"),
])
def test_train_bad_input_is_one_line_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        qcheck.train(cases.layer(CASE), cases.layer_input("mixtral"), **kwargs)


def test_train_takes_an_nnx_module():
    with pytest.raises(TypeError, match=r"^train: module must be an nnx\.Module, got dict$"):
        qcheck.train({}, np.zeros((2, 3), np.float32))


@pytest.mark.parametrize("eqn, lhs_shape, swapped", [("BSM,EMH->BSEH", (2, 4, 8), False),
                                                    ("BSEH,EHM->BSEM", (2, 4, 3, 8), True)])
def test_flax_fp8einsum_records_the_weight_as_input_where_jnp_einsum_swaps_the_operands(eqn, lhs_shape, swapped):
    # Why `train` holds a site's two histories to its operands' amaxes as a pair (flax 0.12.8, 0.12.12): the
    # dense path's wo equation reaches Fp8Einsum's dot_general with the weight first. Numerics are unaffected
    # (both operands e4m3, each with its own delayed scale); the names are not what they say.
    import jax
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    op, lhs, rhs = fp8_ops.Fp8Einsum(), jnp.full(lhs_shape, 5.0), jnp.full((3, 8, 6), 0.5)
    variables = op.init(jax.random.key(0), eqn, lhs, rhs)
    new = jax.grad(lambda v: op.apply(v, eqn, lhs, rhs).sum())(variables)[fp8_ops.OVERWRITE_WITH_GRADIENT]
    recorded = (float(new["input_amax_history"][0]), float(new["kernel_amax_history"][0]))
    assert recorded == ((0.5, 5.0) if swapped else (5.0, 0.5))
