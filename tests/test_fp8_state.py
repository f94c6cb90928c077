"""qcheck.fp8_state and qcheck.assert_fp8_state_matches: should-pass / should-fail pairs, bad input,
Flax's reuse sum pinned (flax 0.12.8 and 0.12.12), and docs/checking-your-training-loop.md run as written.

The user's loops live in tests/fp8_loops.py; the catalogue (tests/test_catalogue.py)
feeds the check each broken loop beside its correct one.
"""

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax.linen import fp8_ops

import qcheck
from qcheck import checks
from qcheck.checks import harness
from qcheck.layers import step
from qcheck.suite import cases
from tests import fp8_loops as loops

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
DOC = (Path(__file__).parent.parent / "docs" / "checking-your-training-loop.md").read_text()
FP8_LEAVES = ("input_amax_history", "input_scale", "kernel_amax_history", "kernel_scale",
              "output_grad_amax_history", "output_grad_scale")


@functools.cache
def mlp_state():
    """A TrainState after one step, so its histories hold an entry and the next step's scales move."""
    return loops.warm(loops.new_state(loops.Mlp()))


# -- fp8_state: where the state lives ------------------------------------------------------


def test_fp8_state_names_each_leaf_of_a_linen_variable_dict_and_a_train_state_by_path():
    state = mlp_state()
    in_dict = qcheck.fp8_state(state.params)
    assert sorted(in_dict) == [f"{OWG}/Dense_{i}/Fp8DirectDotGeneralOp_0/{leaf}" for i in (0, 1) for leaf in FP8_LEAVES]
    in_state = qcheck.fp8_state(state)
    assert sorted(in_state) == sorted(f"params/{k}" for k in in_dict)
    assert all(np.array_equal(in_state[f"params/{k}"], v) for k, v in in_dict.items())
    assert in_dict[f"{OWG}/Dense_0/Fp8DirectDotGeneralOp_0/input_amax_history"].shape == (1024,)


def test_fp8_state_finds_flax_fp8_variables_in_an_nnx_module_and_state():
    from flax import nnx

    model = loops.nnx_model()
    found = qcheck.fp8_state(model)
    assert sorted(found) == [f"Dense_{i}/Fp8DirectDotGeneralOp_0/{leaf}" for i in (0, 1) for leaf in FP8_LEAVES]
    assert sorted(qcheck.fp8_state(nnx.state(model))) == sorted(found)


def test_fp8_state_finds_qcheck_recipes_state_in_a_layer_and_its_step():
    case = cases.Case("fp8", cases.Variant("mixtral", "dense", False))
    found = qcheck.fp8_state(cases.layer(case))
    assert sorted(found) == [f"sites/{s}/{leaf}" for s in ("wi_0", "wi_1", "wo") for leaf in FP8_LEAVES]
    after = qcheck.fp8_state(cases.layer_step(case).fp8_meta)
    assert sorted(after) == sorted(found) and after["sites/wo/input_amax_history"][0] > 0


def test_fp8_state_reads_state_kept_in_flax_fp32_max_grad_as_float32():
    kept = jax.jit(lambda: {OWG: {"input_scale": jax.lax.convert_element_type(jnp.ones(1), fp8_ops.fp32_max_grad)}})()
    assert str(kept[OWG]["input_scale"].dtype) == "fp8_meta32"
    found = qcheck.fp8_state(kept)
    assert found[f"{OWG}/input_scale"].dtype == np.float32 and found[f"{OWG}/input_scale"][0] == 1.0


def test_fp8_state_without_any_is_an_error_naming_what_was_searched():
    int8 = cases.layer(cases.Case("int8", cases.Variant("mixtral", "dense", False)))
    with pytest.raises(ValueError, match=r"^fp8_state: found no fp8 scaling state in an NNX module \(MoE\); "
                       r"searched Linen's '_overwrite_with_gradient' collection at any depth .*NNX variables"):
        qcheck.fp8_state(int8)
    params_only = {"params": mlp_state().params["params"]}
    with pytest.raises(ValueError, match=r"in a dict with keys \['params'\]"):
        qcheck.fp8_state(params_only)
    assert qcheck.fp8_state(params_only, required=False) == {}


# -- assert_fp8_state_matches: pairs ---------------------------------------------------------


def test_fp8_state_matches_should_pass_on_a_batch_and_its_microbatches_merged_by_max():
    found = qcheck.assert_fp8_state_matches(loops.whole_batch, loops.accumulated("max"), mlp_state(), loops.batch())
    assert len(found) == 12 and all(v[0] > 0 for k, v in found.items() if k.endswith("history"))


def test_fp8_state_matches_should_fail_on_a_history_rolled_once_per_microbatch():
    # Each microbatch a step of its own: the amax is right (a max over the history), the history rolled twice.
    def sequential(state, batch):
        for xm, ym in zip(*(np.split(b, loops.MICROBATCHES) for b in batch)):
            state = loops.whole_batch(state, (xm, ym))
        return state

    with pytest.raises(AssertionError, match=r"Dense_0/Fp8DirectDotGeneralOp_0/input_amax_history\[0\]: "
                       r"step_a [\d.]+, step_b [\d.]+, ratio [\d.]+: step_a rolled it 1 time\(s\), step_b 2: "
                       r"history rolled 2 times in one step"):
        qcheck.assert_fp8_state_matches(loops.whole_batch, sequential, mlp_state(), loops.batch())


def test_fp8_state_matches_should_pass_and_fail_on_an_nnx_model_stepped_in_place():
    model = loops.nnx_model()
    loops.nnx_accumulated("max")(model, loops.batch(1))
    qcheck.assert_fp8_state_matches(loops.nnx_accumulated("max"), loops.nnx_accumulated("max"), model, loops.batch())
    with pytest.raises(AssertionError, match=r"Dense_0/Fp8DirectDotGeneralOp_0/kernel_amax_history\[0\]: step_a "
                       r"[\d.]+, step_b [\d.]+, ratio 2: a ratio of 2: summed across 2 microbatches"):
        qcheck.assert_fp8_state_matches(loops.nnx_accumulated("max"), loops.nnx_accumulated("sum"), model,
                                        loops.batch())


def _nudged(state, batch):
    # One amax one float32 ulp up: what another rounding of the same values could do.
    new = loops.whole_batch(state, batch)
    fp8 = new.params[OWG]
    op = fp8["Dense_1"]["Fp8DirectDotGeneralOp_0"]
    history = op["input_amax_history"]
    op = {**op, "input_amax_history": history.at[0].set(jnp.nextafter(history[0], jnp.inf))}
    return new.replace(params={**new.params, OWG: {**fp8, "Dense_1": {"Fp8DirectDotGeneralOp_0": op}}})


def test_fp8_state_matches_should_fail_bitwise_and_pass_within_a_declared_rtol():
    state, batch = mlp_state(), loops.batch()
    with pytest.raises(AssertionError, match=r"(?s)1 of 12 fp8 leaves differ between step_a and step_b \(bitwise\); "
                                             r"likely cause: every differing leaf is step_a's times 1\.00000\d+: "
                                             r"rounding, no bug's factor.*ratio 1\.00000\d+$"):
        qcheck.assert_fp8_state_matches(loops.whole_batch, _nudged, state, batch)
    qcheck.assert_fp8_state_matches(loops.whole_batch, _nudged, state, batch, rtol=1e-6)


def test_fp8_state_matches_should_fail_on_a_step_that_moves_no_parameter():
    def frozen(state, batch):  # writes the fp8 state, forgets the update
        x, y = batch
        return state.replace(params={**state.params, OWG: loops.grads(state, x, y, len(x))[OWG]})

    with pytest.raises(AssertionError, match=r"step_b moved no parameter \(4 leaves\): a step that changes nothing "
                       r"passes nothing"):
        qcheck.assert_fp8_state_matches(loops.whole_batch, frozen, mlp_state(), loops.batch())


def test_fp8_state_matches_should_fail_on_a_step_that_drops_the_fp8_state():
    def dropped(state, batch):
        new = loops.whole_batch(state, batch)
        return new.replace(params={**new.params, OWG: state.params[OWG]})

    with pytest.raises(AssertionError, match=r"step_a left all 12 fp8 leaves as they were: the fp8 state was not "
                       r"written back"):
        qcheck.assert_fp8_state_matches(dropped, loops.whole_batch, mlp_state(), loops.batch())


def test_fp8_state_matches_refuses_bad_input():
    state, batch = mlp_state(), loops.batch()
    with pytest.raises(TypeError, match=r"step_b must be a callable step\(state, batch\) -> new_state, got str"):
        qcheck.assert_fp8_state_matches(loops.whole_batch, "whole", state, batch)
    with pytest.raises(ValueError, match=r"rtol must be a number in \[0, 0.001\], got 0.5"):
        qcheck.assert_fp8_state_matches(loops.whole_batch, loops.whole_batch, state, batch, rtol=0.5)
    with pytest.raises(ValueError, match=r"^assert_fp8_state_matches: state: fp8_state: found no fp8 scaling state"):
        qcheck.assert_fp8_state_matches(loops.whole_batch, loops.whole_batch, {"params": {"w": np.ones(2)}}, batch)
    with pytest.raises(AssertionError, match=r"step_b's new state holds other fp8 leaves than the state it was given "
                       r"\(missing \['params/_overwrite_with_gradient/Dense_0/"):
        qcheck.assert_fp8_state_matches(loops.whole_batch, lambda s, b: {"params": {"w": np.ones(2)}}, state, batch)


def test_fp8_state_matches_is_offered_by_qcheck_checks():
    assert checks.assert_fp8_state_matches is qcheck.assert_fp8_state_matches
    assert checks.fp8_state is qcheck.fp8_state and step.StepOutput  # the recipes' state: see above


# -- Flax's reuse sum: a library defect, pinned ---------------------------------------------------

_DEPRECATED = pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning")
FLAX_OPS = [fp8_ops.Fp8DirectDotGeneralOp, pytest.param(fp8_ops.Fp8DotGeneralOp, marks=_DEPRECATED),
            fp8_ops.Fp8Einsum]


class OneOp(nn.Module):
    """One Flax fp8 op, applied to the whole input (``uses=1``) or to each of its halves (``uses=2``)."""

    op: type
    uses: int = 1

    @nn.compact
    def __call__(self, x):
        op = self.op()
        kernel = self.param("kernel", nn.initializers.constant(0.5), (4, 4))
        if self.op is fp8_ops.Fp8Einsum:
            matmul = lambda a: op("ab,bc->ac", a, kernel)  # noqa: E731
        else:
            matmul = lambda a: op(a, kernel, (((1,), (0,)), ((), ())))  # noqa: E731
        return jnp.concatenate([matmul(part) for part in jnp.split(x, self.uses)])


#: An input of amax 2, then one of amax 3 (the reused op sees them one at a time).
REUSE_X = np.concatenate([np.full((2, 4), 2.0, np.float32), np.full((2, 4), 3.0, np.float32)])


@functools.cache
def _reuse_step(op: type, uses: int, max_grad: bool):
    model = OneOp(op, uses)

    @jax.jit
    def sgd(variables, x):
        def loss(v):
            if max_grad:  # Flax's opt-in dtype: autodiff takes the max of fp8 "gradients"
                v = {**v, OWG: jax.tree.map(lambda a: jax.lax.convert_element_type(a, fp8_ops.fp32_max_grad), v[OWG])}
            return jnp.sum(model.apply(v, x))

        g = jax.grad(loss)(variables)
        return {"params": jax.tree.map(lambda p, d: p - 0.1 * d, variables["params"], g["params"]), OWG: g[OWG]}

    return sgd


def _reuse_state(op):
    return jax.jit(OneOp(op).init)(jax.random.key(0), REUSE_X)


@pytest.mark.parametrize("op", FLAX_OPS, ids=lambda op: op.__name__)
def test_flax_fp8_op_used_twice_sums_its_amax_and_scales(op):
    """Flax 0.12.8 and 0.12.12: one fp8 op used twice *adds* what travels in its gradient channel (Flax PR #3623).

    Inputs of amax 2 and 3 record 5 (their max is 3), the kernel's amax 0.5 doubles, every scale is 2 instead of 1.
    """
    with pytest.raises(AssertionError) as info:
        qcheck.assert_fp8_state_matches(_reuse_step(op, 1, False), _reuse_step(op, 2, False), _reuse_state(op), REUSE_X)
    message = str(info.value)
    name = op.__name__
    assert message.startswith("assert_fp8_state_matches: 6 of 6 fp8 leaves differ between step_a and step_b")
    assert f"{OWG}/{name}_0/input_amax_history[0]: step_a 3, step_b 5, ratio 1.666667: larger" in message
    assert f"{OWG}/{name}_0/kernel_amax_history[0]: step_a 0.5, step_b 1, ratio 2: a ratio of 2: summed across 2 " \
           "microbatches or uses" in message
    for scale in ("input_scale", "kernel_scale", "output_grad_scale"):
        assert f"{OWG}/{name}_0/{scale}: step_a 1, step_b 2, ratio 2: " in message


def test_flax_delayed_scaling_takes_scale_0_from_a_tiny_amax_history_and_divides_the_next_step_by_it():
    """Flax 0.12.8 and 0.12.12, ``fp8_ops.compute_scale``: the scale is 1 / (448 / amax), and below an amax of
    448 / float32's max (1.3e-36) 448 / amax overflows, 1 / inf = 0 (from 448 · 2^-126, 5.3e-36, on XLA's CPU,
    which flushes the subnormal scale). The next step's ``quantize`` divides by it: values saturate to ±448, times
    the scale 0 come back 0, and a 0 is 0 / 0 = NaN. The edges' whole tensor of tiny values records such an amax in
    one step, and no edge runs the next step, where the scale is taken."""
    amax = np.float32(448 / np.finfo(np.float32).max / 2)
    scale = fp8_ops.compute_scale(jnp.float32(amax), jnp.float32(1.0), jnp.float32(448.0))
    assert float(scale) == 0.0
    out = np.asarray(fp8_ops.qdq(jnp.array([1.0, -2.0, 0.0]), jnp.float8_e4m3fn, scale, jnp.float32))
    assert np.array_equal(out[:2], [0.0, 0.0]) and np.isnan(out[2])
    # qcheck's fp8 recipe (Flax's fp8_ops): a step on the tiny tensor leaves its amax in the history; from that state
    # a normal batch comes out all zeros, finite, and the tiny tensor again NaN.
    case = cases.Case("fp8", cases.Variant("mixtral", "dense", False))
    layer, x = cases.layer(case), cases.layer_input("mixtral")
    tiny = harness.format_edge_rows(x, None, {"tiny_tensor": None})["tiny_tensor"]
    first = step.train_step(layer, tiny)
    history = cases.grad_leaves(first.fp8_meta)["sites.wi_0.input_amax_history"]
    assert history.max() == np.abs(np.asarray(tiny)).max() < 448 / np.finfo(np.float32).max
    assert not np.any(np.asarray(step.train_step(layer, x, fp8_meta=first.fp8_meta).output))
    assert np.isnan(np.asarray(step.train_step(layer, tiny, fp8_meta=first.fp8_meta).output)).all()


@pytest.mark.parametrize("op", FLAX_OPS, ids=lambda op: op.__name__)
def test_flax_fp32_max_grad_takes_the_max_of_a_reused_op_should_pass(op):
    # The fix is opt-in: the fp8 state cast to fp8_ops.fp32_max_grad inside the loss.
    found = qcheck.assert_fp8_state_matches(_reuse_step(op, 1, False), _reuse_step(op, 2, True), _reuse_state(op),
                                            REUSE_X)
    assert found[f"{OWG}/{op.__name__}_0/input_amax_history"][0] == 3.0


# -- docs/checking-your-training-loop.md --------------------------------------------------------


def _doc_block(label: str) -> str:
    (block,) = re.findall(rf"<!-- training-loop: {label} -->\n```python\n(.*?)```", DOC, re.S)
    return block


def test_the_guide_example_fails_on_its_bug_and_passes_fixed(capsys):
    example, fix = _doc_block("example"), _doc_block("fix")
    assert len([line for line in example.splitlines() if line.strip()]) <= 22  # twenty-odd lines of code
    namespace = {"__name__": "doc_training_loop"}
    with pytest.raises(AssertionError) as info:
        exec(compile(example, "docs/checking-your-training-loop.md[example]", "exec"), namespace)
    shown = re.search(r"```text\n(assert_fp8_state_matches: .*?)\n```", DOC, re.S).group(1)
    assert str(info.value).startswith(shown.split("\n")[0])  # the doc shows the message's first line as it is
    for line in shown.split("\n")[1:]:
        if line.strip() != "...":
            assert line in str(info.value), line
    exec(compile(fix, "docs/checking-your-training-loop.md[fix]", "exec"), namespace)
    assert "passes" in capsys.readouterr().out
