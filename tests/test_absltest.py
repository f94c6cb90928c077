"""qcheck.testing in an absltest suite: assertion methods, named case parameters, the invariant TestCase.

The classes are absltest TestCases, collected by pytest as any unittest class
is, and runnable on their own (``python -m tests.test_absltest``), as JAX's,
Flax's and MaxText's suites run. The plain functions at the end check those
two ways of running from the pytest suite.
"""

if __name__ == "__main__":  # qcheck's own process: XLA flags (8 host devices) and its compilation cache
    from qcheck.suite import _process

    _process.setup(own=True)

import os
import re
import subprocess
import sys
import unittest
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from qcheck import checks, testing
from qcheck.recipes import get_recipe
from qcheck.suite import cases

ROOT = Path(__file__).resolve().parents[1]
EQN = "ij,jk->ik"
_RNG = np.random.default_rng(0)
A = _RNG.normal(size=(8, 32)).astype(np.float32)
B = _RNG.normal(size=(32, 16)).astype(np.float32)
LHS, RHS = checks.probe_operands(0, (8, 32), (32, 16))


def _cast(x, dtype):
    bound = float(ml_dtypes.finfo(dtype).max)
    return jnp.clip(x, -bound, bound).astype(dtype).astype(x.dtype)


def _e4m3fn_site(eqn, a, b):
    return jnp.einsum(eqn, _cast(a, jnp.float8_e4m3fn), _cast(b, jnp.float8_e4m3fn))


def _e4m3fnuz_site(eqn, a, b):  # the wrong flavour for an e4m3fn recipe
    return jnp.einsum(eqn, _cast(a, jnp.float8_e4m3fnuz), _cast(b, jnp.float8_e4m3fnuz))


def _int8(x):
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8).astype(jnp.float32) * scale


def _quantized_matmul(a, b):
    return _int8(a) @ _int8(b.T).T


def _plain_matmul(a, b):
    return a @ b


class AssertionsTest(testing.QuantizationAssertions, absltest.TestCase):
    """Each assertion method: should pass, should fail on its bug with the check's message, msg= the unittest way."""

    def test_tracks_should_pass(self):
        noisy = A * (1 + 0.01 * _RNG.standard_normal(A.shape).astype(np.float32))
        figure = self.assertTracks(noisy, A)
        self.assertBetween(figure, 1e-3, 0.05)

    def test_tracks_should_fail_on_a_silent_fallback(self):
        with self.assertRaisesRegex(AssertionError, r"^assert_tracks: actual is bitwise equal .*silent fallback"):
            self.assertTracks(A.copy(), A)

    def test_tracks_should_fail_beyond_the_bound_in_the_row(self):
        with self.assertRaisesRegex(AssertionError, r"relative norm 0\.5000 exceeds the bound 0\.22$"):
            self.assertTracks(A * 1.5, A)
        self.assertAlmostEqual(self.assertTracks(A * 1.5, A, max_rel_norm=0.6), 0.5, places=6)

    def test_msg_is_appended_under_long_message(self):
        with self.assertRaises(AssertionError) as cm:
            self.assertTracks(A.copy(), A, msg="layer 3")
        self.assertRegex(str(cm.exception), r"^assert_tracks: actual is bitwise equal .* : layer 3$")

    def test_msg_replaces_the_message_without_long_message(self):
        self.longMessage = False
        with self.assertRaises(AssertionError) as cm:
            self.assertTracks(A.copy(), A, msg="layer 3")
        self.assertEqual(str(cm.exception), "layer 3")

    def test_a_meaningless_input_is_an_error_not_a_failure(self):
        with self.assertRaisesRegex(ValueError, "the reference is all zeros"):
            self.assertTracks(A, np.zeros_like(A))

    def test_quantized_should_pass(self):
        (record,) = self.assertQuantized(_quantized_matmul, A, B)
        self.assertTrue(record.quantized)

    def test_quantized_should_fail_on_a_full_precision_matmul(self):
        with self.assertRaisesRegex(AssertionError, r"^assert_quantized: 1 of 1 matmuls reach full precision:\n"
                                                    r".*_plain_matmul.*lhs and rhs unquantized"):
            self.assertQuantized(_plain_matmul, A, B)

    def test_quantized_skip_exempts_a_matmul(self):
        (record,) = self.assertQuantized(_plain_matmul, A, B, skip=lambda r: r.function == "_plain_matmul")
        self.assertFalse(record.quantized)

    def test_fresh_cast_exact_should_pass(self):
        self.assertIsNone(self.assertFreshCastExact(_e4m3fn_site, EQN, LHS, RHS, cast_dtype=ml_dtypes.float8_e4m3fn))

    def test_fresh_cast_exact_should_fail_on_an_unquantized_site(self):
        with self.assertRaisesRegex(AssertionError, r"^assert_fresh_cast_exact: einsum 'ij,jk->ik' differs .*"
                                                    r"silently unquantized"):
            self.assertFreshCastExact(lambda e, a, b: jnp.einsum(e, a, b), EQN, LHS, RHS,
                                      cast_dtype=ml_dtypes.float8_e4m3fn)

    def test_fresh_cast_exact_should_fail_on_the_wrong_flavour(self):
        with self.assertRaisesRegex(AssertionError, r"float8_e4m3fnuz-cast reference bitwise \(wrong fp8 flavour\)"):
            self.assertFreshCastExact(_e4m3fnuz_site, EQN, LHS, RHS, cast_dtype=ml_dtypes.float8_e4m3fn)

    def test_fresh_ragged_cast_exact_should_pass_and_fail(self):
        lhs, rhs = checks.probe_operands(1, (12, 32), (3, 32, 16))
        sizes = np.array([5, 7, 0], np.int32)

        def site(a, b, gs):
            return jax.lax.ragged_dot(_cast(a, jnp.float8_e4m3fn), _cast(b, jnp.float8_e4m3fn), gs)

        self.assertFreshCastExact(site, checks.Ragged(sizes), lhs, rhs, cast_dtype=ml_dtypes.float8_e4m3fn)
        with self.assertRaisesRegex(AssertionError, r"^assert_fresh_cast_exact: ragged_dot differs .*silently "
                                                    r"unquantized"):
            self.assertFreshCastExact(jax.lax.ragged_dot, checks.Ragged(sizes), lhs, rhs,
                                      cast_dtype=ml_dtypes.float8_e4m3fn)

    def test_format_matches_referee_should_pass(self):
        self.assertFormatMatchesReferee(LHS, "int8", jit=False)

    def test_format_matches_referee_should_fail_on_int8_scaled_to_128(self):
        # Op by op (jit=False): the patched module global is read at call time.
        with mock.patch("qcheck.formats._int8.INT8_MAX", 128):
            with self.assertRaisesRegex(AssertionError, r"^assert_format_matches_referee: int8: codes differs from the referee at index"):
                self.assertFormatMatchesReferee(LHS, "int8", jit=False)

    def test_layer_checks_is_offered_only_with_the_library_check(self):
        import qcheck

        self.assertEqual(hasattr(self, "assertLayerChecks"), hasattr(qcheck, "check_layer"))

    def test_layer_checks_forwards_to_the_library_check_and_fails_with_its_message(self):
        # Whatever qcheck.check_layer does, the method must pass its arguments and
        # result through and turn its AssertionError into a failure: shown on a stand-in,
        # with a fresh copy of qcheck.testing defined while qcheck has one.
        import importlib.util

        import qcheck

        def check_layer(layer, reference, x, *, seed=0):
            if layer is reference:
                raise AssertionError("check_layer: the layer is its own reference")
            return {"seed": seed}

        with mock.patch.object(qcheck, "check_layer", check_layer, create=True):
            spec = importlib.util.spec_from_file_location("_qcheck_testing_with_layer_check", testing.__file__)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            case = type("Case", (module.QuantizationAssertions, absltest.TestCase), {"runTest": lambda self: None})()
            self.assertEqual(case.assertLayerChecks("q", "ref", A, seed=3), {"seed": 3})
            with self.assertRaisesRegex(AssertionError, r"^check_layer: the layer is its own reference : layer 0$"):
                case.assertLayerChecks("q", "q", A, msg="layer 0")


class CaseParametersTest(absltest.TestCase):

    def test_names_are_the_case_ids_as_identifiers(self):
        rows = testing.case_parameters(recipes=("fp8",), models=("mixtral",))
        self.assertEqual([r["testcase_name"] for r in rows],
                         ["fp8_mixtral_dense", "fp8_mixtral_dense_drop", "fp8_mixtral_sparse"])
        self.assertEqual([r["case"].id for r in rows], ["fp8-mixtral-dense", "fp8-mixtral-dense-drop",
                                                        "fp8-mixtral-sparse"])

    def test_an_invariant_keeps_the_cases_it_applies_to(self):
        # `state` holds only recipes with fp8 state; `rng` is for SHARED (nvfp4) on one layer.
        state = testing.case_parameters("state", recipes=("fp8", "int8"), models=("mixtral",))
        self.assertEqual([r["testcase_name"] for r in state],
                         ["fp8_mixtral_dense", "fp8_mixtral_dense_drop", "fp8_mixtral_sparse"])
        rng = testing.case_parameters("rng", recipes=("nvfp4", "fp8"))
        self.assertEqual([r["testcase_name"] for r in rng], ["nvfp4_mixtral_dense"])

    def test_bad_names_are_errors_listing_the_valid_ones(self):
        from qcheck.suite.invariants import INVARIANTS

        valid = ", ".join(inv.name for inv in INVARIANTS)
        with self.assertRaisesRegex(ValueError, rf"unknown invariant 'exactly'; valid invariants: {valid}$"):
            testing.case_parameters("exactly")
        with self.assertRaisesRegex(ValueError, r"unknown recipe 'fp9'; registered recipes: none, "):
            testing.case_parameters(recipes=("fp9",))
        with self.assertRaisesRegex(TypeError, r"recipes must be a sequence of names, not the string 'fp8'"):
            testing.case_parameters(recipes="fp8")
        with self.assertRaisesRegex(ValueError, r"unknown invariant 'exactly'; valid invariants: .*golden, paths"):
            type("Bad", (testing.InvariantTestCase,), {"qcheck_invariants": ("exactly",)})


class TrackedCasesTest(testing.QuantizationAssertions, parameterized.TestCase):
    """The parameterized smoke: named parameters over qcheck's case table, checked with an assertion method."""

    @parameterized.named_parameters(
        testing.case_parameters("tracks", recipes=("fp8", "int8"), models=("mixtral",), paths=("dense",)))
    def test_tracks(self, case):
        figure = self.assertTracks(cases.layer_output(case), cases.layer_output(case.reference),
                                   max_rel_norm=get_recipe(case.recipe).expect.max_rel_norm)
        self.assertGreater(figure, 0)


class Fp8MixtralSuite(testing.InvariantTestCase):
    """What a user writes to run qcheck's invariant suite on their recipe (here fp8) in an absltest suite."""

    qcheck_recipes = ("fp8",)
    qcheck_models = ("mixtral",)
    qcheck_paths = ("dense",)
    qcheck_invariants = ("sites", "exact", "tracks", "state")


class InvariantTestCaseTest(absltest.TestCase):

    def test_a_subclass_gets_one_named_test_per_invariant_and_case(self):
        self.assertEqual(unittest.TestLoader().getTestCaseNames(Fp8MixtralSuite), [
            f"test_{inv}_fp8_mixtral_dense{drop}"
            for inv in ("exact", "sites", "state", "tracks") for drop in ("", "_drop")])
        self.assertEqual(unittest.TestLoader().getTestCaseNames(testing.InvariantTestCase), [])

    def test_a_narrower_subclass_drops_its_parents_other_tests(self):
        narrower = type("Narrower", (Fp8MixtralSuite,), {"qcheck_invariants": ("tracks",)})
        self.assertEqual(unittest.TestLoader().getTestCaseNames(narrower),
                         ["test_tracks_fp8_mixtral_dense", "test_tracks_fp8_mixtral_dense_drop"])

    def test_paths_agree_is_offered_when_none_is_selected(self):
        suite = type("WithNone", (testing.InvariantTestCase,), {"qcheck_recipes": ("none",),
                                                                "qcheck_models": ("gemma",)})
        names = unittest.TestLoader().getTestCaseNames(suite)
        self.assertIn("test_paths_agree_gemma_drop", names)
        self.assertIn("test_golden_none_gemma_dense", names)

    def test_a_planted_bug_fails_the_suite_with_the_invariants_message(self):
        # The layer's output replaced by its unquantized twin's: quantization silently fell away.
        real = cases.layer_output
        result = unittest.TestResult()
        with mock.patch.object(cases, "layer_output", lambda case: real(case.reference)):
            Fp8MixtralSuite("test_tracks_fp8_mixtral_dense").run(result)
        self.assertEqual((result.testsRun, len(result.errors)), (1, 0))
        (_, trace), = result.failures
        self.assertRegex(trace, r"AssertionError: fp8-mixtral-dense: assert_tracks: actual is bitwise equal")
        # and the same test passes without the bug
        result = unittest.TestResult()
        Fp8MixtralSuite("test_tracks_fp8_mixtral_dense").run(result)
        self.assertTrue(result.wasSuccessful(), result.failures)

    def test_sharded_skips_saying_why_without_eight_devices(self):
        suite = type("Sharded", (testing.InvariantTestCase,), {
            "qcheck_recipes": ("fp8",), "qcheck_models": ("mixtral",), "qcheck_paths": ("dense",),
            "qcheck_invariants": ("sharded",)})
        result = unittest.TestResult()
        with mock.patch.object(jax, "devices", lambda *a: [None] * 4):
            suite("test_sharded_fp8_mixtral_dense").run(result)
        (_, reason), = result.skipped
        self.assertRegex(reason, r"needs 8 CPU devices, this process has 4: set XLA_FLAGS=")


def _env() -> dict[str, str]:
    # A fresh run, not a worker of this one. The fresh interpreter is the point, not compiling afresh what this
    # run compiled already: it shares this process's compilation cache where there is one (the run's, under CI).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "QCHECK_RUN_"))}
    env["QCHECK_XLA_CACHE"] = jax.config.jax_compilation_cache_dir or "0"
    return env


def test_pytest_collects_the_absltest_classes_with_readable_names():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_absltest.py"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    ids = set(done.stdout.split())
    for expected in ("TrackedCasesTest::test_tracks_fp8_mixtral_dense",
                     "TrackedCasesTest::test_tracks_int8_mixtral_dense_drop",
                     "Fp8MixtralSuite::test_exact_fp8_mixtral_dense",
                     "AssertionsTest::test_tracks_should_pass"):
        assert f"tests/test_absltest.py::{expected}" in ids, done.stdout
    assert not [i for i in ids if re.search(r"test_tracks(0|_twin|\d)", i)], done.stdout


def test_absltest_main_runs_the_module_on_its_own():
    # TESTBRIDGE_TEST_ONLY is absltest's filter (what bazel's --test_filter sets): unittest -k patterns.
    env = {**_env(), "TESTBRIDGE_TEST_ONLY": "test_tracks_int8_mixtral_dense test_sites_fp8 test_tracks_should_pass"}
    done = subprocess.run([sys.executable, "-m", "tests.test_absltest"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for name in ("TrackedCasesTest.test_tracks_int8_mixtral_dense",
                 "TrackedCasesTest.test_tracks_int8_mixtral_dense_drop",
                 "Fp8MixtralSuite.test_sites_fp8_mixtral_dense", "AssertionsTest.test_tracks_should_pass"):
        assert f"[       OK ] {name}\n" in out, out
    assert re.search(r"Ran 5 tests in .*\n\nOK", out), out
    assert "DeprecationWarning" not in out, out  # e.g. a test method returning a value


if __name__ == "__main__":
    jax.config.update("jax_numpy_rank_promotion", "raise")  # as the pytest suite's conftest sets it
    absltest.main()
