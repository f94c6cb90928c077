"""A library is one record (``qcheck.Library``); a user's library needs no edit of qcheck, and a layer may declare
itself.

The user's library is ``tests/plugins/qcheck_userlib``, a package outside qcheck that offers its Library through
the ``qcheck.libraries`` entry point of its distribution, installed for a test by putting it on ``sys.path``
(``helpers.installed``). Installed, its reader is read by default, its machinery moves a site to the user's
line and its kernel's roles are held; each beside the control without it, and a reader that returns the wrong
format failing the stock layer, naming the site and the library that read the declaration. Bad input: a name
already taken, a reader that raises, an entry point that fails to load.
"""

from __future__ import annotations

import inspect
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qcheck
from qcheck import libraries
from tests.helpers import PLUGINS, installed

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(8, 16)).astype(np.float32)
W = _RNG.normal(size=(16, 8)).astype(np.float32) * 0.5
HERE = "tests/test_library_registry.py"


def _userlib():
    import sys

    sys.path.insert(0, PLUGINS)
    try:
        import qcheck_userlib
        from qcheck_userlib import layers, ops
    finally:
        sys.path.remove(PLUGINS)
    return qcheck_userlib, layers, ops


USERLIB, LAYERS, OPS = _userlib()


def model(x):
    """The user's own code calling the library's op: the site a user means."""
    return OPS.qmatmul(x, jnp.asarray(W))


MODEL_LINE = f"{HERE}:{inspect.getsourcelines(model)[1] + 2}"


def _line(fn, text: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    return str(start + next(i for i, line in enumerate(lines) if text in line))


# -- a user's library through its entry point ------------------------------------------------------------------

def test_the_entry_point_registers_the_users_library_after_qchecks_own():
    names = [lib.name for lib in qcheck.registered_libraries()]
    assert "UserLib" not in names and names[:2] == ["JAX", "Flax"] and "Keras" in names
    with installed(PLUGINS):
        after = qcheck.registered_libraries()
        assert [lib.name for lib in after] == [*names, "UserLib"] and after[-1] is USERLIB.LIBRARY
    assert [lib.name for lib in qcheck.registered_libraries()] == names  # uninstalled: gone


def test_the_users_reader_is_read_by_default_should_pass():
    layer = LAYERS.QDense(W)
    with installed(PLUGINS):
        records = qcheck.assert_quantized(layer, X)
    assert records.declared_from == "read from the fn: UserLib QDense(fmt='fp8')", records.declared_from
    (r,) = records
    assert (r.lhs_declared, r.rhs_declared, r.findings) == ("e4m3fn", "e4m3fn", ())
    assert r.lhs_hold.bitwise and r.rhs_hold.bitwise, (r.lhs_hold, r.rhs_hold)


def test_without_the_users_library_nothing_is_read_should_fail():
    records = qcheck.coverage(LAYERS.QDense(W), X)
    assert records.declared_from.startswith("nothing read: no reader ("), records.declared_from
    with pytest.raises(ValueError, match=r"^coverage: declared=True, but no reader \(qcheck_declaration, MaxText, "
                                         r"gemma, haliax, qwix, Keras, EasyDeL\) finds a declaration on it of QDense"):
        qcheck.coverage(LAYERS.QDense(W), X, declared=True)


def test_the_users_reader_says_why_it_reads_nothing():
    with installed(PLUGINS):
        records = qcheck.coverage(LAYERS.QDense(W, fmt="int3"), X)
    assert records.declared_from == ("nothing read: the UserLib reader: QDense(fmt='int3') is no qcheck format "
                                     "(fn QDense); pass declared= to hold its sites"), records.declared_from


def test_the_users_machinery_moves_the_site_to_the_users_line():
    with installed(PLUGINS):
        (r,) = qcheck.coverage(model, X, declared=False)
    assert r.location == MODEL_LINE and r.function == "model", (r.location, MODEL_LINE)


def test_without_the_users_machinery_the_site_is_inside_the_library():
    (r,) = qcheck.coverage(model, X, declared=False)
    assert r.location.endswith(f"qcheck_userlib/ops.py:{_line(OPS.qmatmul, 'jnp.dot(')}"), r.location


def test_the_users_kernel_roles_are_held_should_pass():
    layer = LAYERS.QDense(W, kernel=True)
    with installed(PLUGINS):
        records = qcheck.assert_quantized(layer, X)
    (r,) = records
    assert (r.opaque, r.kernel, r.kernel_roles) == (True, "userlib_scaled_matmul", "UserLib"), r
    assert r.quantized and (r.lhs.dtype, r.rhs.dtype) == ("float8_e4m3fn", "float8_e4m3fn")
    assert (r.lhs_shape, r.rhs_shape) == (X.shape, W.shape) and r.findings == ()


def test_without_the_users_library_its_kernel_roles_are_unknown_should_fail():
    with pytest.raises(AssertionError, match=re.escape("opaque kernel(s) whose roles qcheck cannot read")):
        qcheck.assert_quantized(LAYERS.QDense(W, kernel=True), X, declared=False)


def test_a_reader_declaring_the_wrong_format_fails_the_stock_layer_should_fail():
    def wrong(layer):
        return {"weights": "e5m2", "activations": "e5m2"} if isinstance(layer, LAYERS.QDense) else None

    liar = libraries.Library("UserLib", reader=wrong, machinery=USERLIB.LIBRARY.machinery)
    with installed(PLUGINS), libraries.registered(liar, replace=True):
        with pytest.raises(AssertionError) as failure:
            qcheck.assert_quantized(LAYERS.QDense(W), X)
    message = str(failure.value)
    site = f"qcheck_userlib/layers.py:{_line(LAYERS.QDense.__call__, 'return')}"
    assert re.search(rf"dot_general at \S*{re.escape(site)} ", message), message
    assert "lhs (activation) is cast to float8_e4m3fn; declared e5m2" in message, message
    assert message.endswith("declared: read from the fn: the UserLib reader"), message


# -- a layer declares itself ----------------------------------------------------------------------------------

class Mine(nnx.Module):
    """An in-house layer: its own e4m3fn cast at scale 1, and its own word on what it is."""

    def __init__(self, declares):
        self.w = nnx.Param(jnp.asarray(W))
        self.declares = declares

    def qcheck_declaration(self):
        if isinstance(self.declares, Exception):
            raise self.declares
        return self.declares

    def __call__(self, x):
        xq, wq = x.astype(jnp.float8_e4m3fn), self.w[...].astype(jnp.float8_e4m3fn)
        return jnp.dot(xq.astype(jnp.float32), wq.astype(jnp.float32))


def test_a_layer_that_declares_itself_is_read_should_pass():
    records = qcheck.assert_quantized(Mine({"weights": "e4m3fn", "activations": "e4m3fn"}), X)
    assert records.declared_from == "read from the fn: Mine.qcheck_declaration()", records.declared_from
    (r,) = records
    assert r.lhs_hold.bitwise and r.rhs_hold.bitwise and r.findings == ()
    assert qcheck.coverage(Mine("e4m3fn"), X).declared_from == (
        "read from the fn: Mine.qcheck_declaration(): format 'e4m3fn' on weights and activations")


def test_the_guides_layer_that_declares_itself_is_read():
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "checking-your-layer.md").read_text()
    (code,) = re.findall(r"<!-- check-layer: declares-itself -->\n```python\n(.*?)```", doc, re.S)
    namespace = {"__name__": "declares_itself"}
    exec(compile(code, "docs/checking-your-layer.md", "exec"), namespace)
    records = qcheck.assert_quantized(namespace["Mine"](jnp.asarray(W)), X)
    assert records.declared_from == "read from the fn: Mine.qcheck_declaration()" and records[0].rhs_hold.bitwise


def test_a_layer_that_declares_the_wrong_format_fails_should_fail():
    with pytest.raises(AssertionError) as failure:
        qcheck.assert_quantized(Mine({"weights": "e5m2", "activations": "e5m2"}), X)
    message = str(failure.value)
    assert f"dot_general at {HERE}:{_line(Mine.__call__, 'jnp.dot(')} " in message, message
    assert message.endswith("declared: read from the fn: Mine.qcheck_declaration()"), message


def test_a_layer_declares_itself_before_its_library_reads_it():
    class Declared(LAYERS.QDense):
        def qcheck_declaration(self):
            return {"weights": "e5m2", "activations": "e5m2"}

    with installed(PLUGINS):
        assert qcheck.coverage(LAYERS.QDense(W), X).declared_from == "read from the fn: UserLib QDense(fmt='fp8')"
        records = qcheck.coverage(Declared(W), X)
    assert records.declared_from == "read from the fn: Declared.qcheck_declaration()", records.declared_from


def test_a_layer_declaring_none_is_read_by_its_library():
    class Undeclared(LAYERS.QDense):
        def qcheck_declaration(self):
            return None

    with installed(PLUGINS):
        records = qcheck.coverage(Undeclared(W), X)
    assert records.declared_from == "read from the fn: UserLib QDense(fmt='fp8')", records.declared_from


def test_a_self_declaration_of_the_wrong_shape_is_a_usage_error():
    with pytest.raises(ValueError, match=r"^coverage: Mine\.qcheck_declaration\(\) must be a recipe or format name"):
        qcheck.coverage(Mine(42), X)


def test_a_self_declaration_that_raises_is_a_user_code_error():
    with pytest.raises(qcheck.UserCodeError, match=r"^coverage: Mine\.qcheck_declaration\(\) raised RuntimeError: "
                                                    r"no config$"):
        qcheck.coverage(Mine(RuntimeError("no config\nmore")), X)


# -- bad input ------------------------------------------------------------------------------------------------

def test_registering_a_taken_name_is_one_line_naming_it():
    with pytest.raises(ValueError, match=r"^register_library: a library named 'Keras' is already registered \(pass "
                                         r"replace=True to replace it\); registered libraries: JAX, Flax, [^\n]*$"):
        qcheck.register_library(qcheck.Library("Keras"))
    with pytest.raises(TypeError, match=r"^register_library: library must be a qcheck\.Library, got str$"):
        qcheck.register_library("Keras")


@pytest.mark.parametrize("kwargs, says", [
    (dict(name=""), r"^Library: name must be a non-empty str, got ''$"),
    (dict(name="Mine", machinery="mine"), r"^Library\('Mine'\): machinery must be a tuple of module names"),
    (dict(name="Mine", reader="read"), r"^Library\('Mine'\): reader must be a function of the layer or None, got str"),
    (dict(name="Mine", kernels=(1,)), r"^Library\('Mine'\): kernels must be a tuple of qcheck\.libraries\.KnownKernel"),
])
def test_a_library_record_refuses_bad_fields(kwargs, says):
    with pytest.raises(TypeError, match=says):
        qcheck.Library(**kwargs)


def _raises(layer):
    raise RuntimeError("boom\nsecond line")


def test_a_reader_that_raises_is_one_line_and_the_others_still_read():
    def late(layer):
        return {"weights": "e4m3fn", "activations": "e4m3fn"} if layer is model else None

    broken, reads = qcheck.Library("Broken", reader=_raises), qcheck.Library("Late", reader=late)
    with libraries.registered(broken, reads):
        with pytest.warns(UserWarning, match=r"^qcheck: the Broken reader failed on function: RuntimeError: boom$"):
            records = qcheck.coverage(model, X)
        assert records.declared_from == ("read from the fn: the Late reader; the Broken reader failed on function: "
                                         "RuntimeError: boom"), records.declared_from
        assert (records[0].lhs_declared, records[0].rhs_declared) == ("e4m3fn", "e4m3fn")
        with pytest.warns(UserWarning, match="the Broken reader failed on QDense"):
            nothing = qcheck.coverage(LAYERS.QDense(W), X)
    assert nothing.declared_from.startswith("nothing read: no reader (qcheck_declaration, MaxText, gemma, haliax, "
                                            "qwix, Keras, EasyDeL, Broken, Late) finds a declaration on it; the Broken reader "
                                            "failed on QDense: RuntimeError: boom (fn QDense)"), nothing.declared_from


def _dist(root, name: str, entry: str) -> str:
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[qcheck.libraries]\n{entry}\n")
    return str(root)


@pytest.mark.parametrize("entry, says", [
    ("gone = qcheck_no_such_module:LIBRARY", "ModuleNotFoundError: No module named 'qcheck_no_such_module'"),
    ("notlib = os:sep", "TypeError: entry point notlib = 'os:sep' (group qcheck.libraries) gave str, not a "
                        "qcheck.Library"),
])
def test_an_entry_point_that_fails_to_load_is_one_line_naming_it(tmp_path, entry, says):
    name, value = (part.strip() for part in entry.split("="))
    where = f"entry point {name} = {value!r} (group qcheck.libraries)"
    with installed(_dist(tmp_path, "qcheck-broken", entry)):
        for _ in range(2):  # said at every use, never read on without it
            with pytest.raises(RuntimeError, match=f"^qcheck could not load the library of {re.escape(where)}: "
                                                   f"{re.escape(says)}$"):
                qcheck.registered_libraries()
        with pytest.raises(RuntimeError, match=re.escape(where)):
            qcheck.coverage(model, X)
    assert "UserLib" not in [lib.name for lib in qcheck.registered_libraries()]
