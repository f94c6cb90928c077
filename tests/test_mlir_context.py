"""Lowering into reused MLIR contexts: in place in the suite's processes, bounded, and the same modules."""

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import mlir

from qcheck import _mlir_context, formats


def test_the_suites_processes_reuse_contexts():
    # conftest installs it on jax 0.10 (through _fast_jit.install); jax 0.12 reuses them itself.
    # False here on jax 0.10 means JAX's private make_ir_context has changed.
    assert _mlir_context.installed()


def test_a_context_serves_a_bounded_number_of_lowerings():
    x = jnp.float32(1)
    n = 2 * (_mlir_context.REUSES + 1)
    # Distinct programs (a constant apiece), so no lowering comes from a cache.
    modules = [jax.jit(lambda v, c=i + 0.5: v * c).lower(x).compiler_ir() for i in range(n)]
    contexts = {id(m.context) for m in modules}  # the modules keep their contexts alive
    assert 2 <= len(contexts) <= 3, f"{n} lowerings used {len(contexts)} MLIR contexts"


def test_a_program_lowers_to_the_same_module_in_a_reused_context_as_in_a_fresh_one(monkeypatch):
    x = np.linspace(-8, 8, 64, dtype=np.float32).reshape(2, 32)

    def lowered_text():
        # A new function each time, so neither lowering is served from JAX's caches.
        return jax.jit(lambda v: formats.qdq(v, "nvfp4") * v).lower(x).as_text()

    reused = [lowered_text() for _ in range(3)]
    fresh_context = getattr(mlir.make_ir_context, "__wrapped__", None) or mlir._create_ir_context
    monkeypatch.setattr(mlir, "make_ir_context", fresh_context)
    assert reused == [lowered_text()] * 3
