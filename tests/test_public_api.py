"""The public surface, kept honest: what each public module exports resolves, its lazy table and its
``TYPE_CHECKING`` imports name exactly its ``__all__`` (each name from its table's module), the top-level
``qcheck`` re-exports every assertion of ``qcheck.checks``, ``qcheck.checks`` offers the checks, their figures
and operands and nothing else (the suite's parts are ``qcheck.checks.harness``), and README and docs code
import only public names.

Each rule is an ``assert_*`` function here with a control: a fake module or a fake text that breaks it.
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest

import qcheck

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: (module, its lazy table's name or None): a lazy table maps each name to the module it loads from.
PUBLIC = [
    ("qcheck", "_WHERE"),
    ("qcheck.adapters", "_LAZY"),
    ("qcheck.checks", None),
    ("qcheck.checks.harness", None),
    ("qcheck.recipes", None),
    ("qcheck.libraries", None),
    ("qcheck.referees", None),
    ("qcheck.formats", None),
    ("qcheck.layers.moe", None),
]

#: What ``qcheck.checks`` offers besides its ``assert_*`` checks, by kind: the one list a name joins to be
#: offered there. A part that only qcheck's suite calls goes to ``qcheck.checks.harness`` instead.
CHECKS_OFFERS = {
    "check": {"check_layer", "coverage"},
    "its setup": {"copy_params_into"},
    "figure": {"Figures", "LayerFigures", "RngStateFigures", "fp8_state", "rel_norm"},
    "operand": {"Einsum", "Matmul", "Ragged", "probe_grad", "probe_operands"},
}


def _source(module: types.ModuleType) -> ast.Module:
    return ast.parse(Path(module.__file__).read_text())


def _type_checking_imports(tree: ast.Module) -> set[tuple[str, str]]:
    """(module, name) of each name bound by the imports under the module's top-level ``if TYPE_CHECKING:``."""
    blocks = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    return {(node.module, alias.asname or alias.name) for block in blocks for node in ast.walk(block)
            if isinstance(node, ast.ImportFrom) for alias in node.names}


def _eager_imports(tree: ast.Module) -> set[str]:
    """Public names the module's top level pulls up from private modules: there to be exported (a name
    imported from a public module, such as adapters' ``Recipe``, is there to be used)."""
    return {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
            and node.module != "__future__" and any(p.startswith("_") for p in (node.module or "").split("."))
            for alias in node.names if not (alias.asname or alias.name).startswith("_")}


def _defined(tree: ast.Module) -> set[str]:
    """Public functions and classes the module defines itself."""
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")}


def assert_exports_resolve(module: types.ModuleType) -> None:
    names = list(module.__all__)
    duplicated = sorted({n for n in names if names.count(n) > 1})
    assert not duplicated, f"{module.__name__}.__all__ lists {duplicated} twice"
    missing = []
    for name in names:
        try:
            getattr(module, name)
        except ImportError as e:  # an optional extra's name: it must say which extra to install
            assert "pip install" in str(e), f"{module.__name__}.{name}: ImportError without its extra: {e}"
        except AttributeError:
            missing.append(name)
    assert not missing, f"{module.__name__}.__all__ names {missing}, which do not resolve"


def assert_lazy_table_is_all(module: types.ModuleType, tree: ast.Module, table: str) -> None:
    """The lazy table's keys and the eager imports are ``__all__``; the ``TYPE_CHECKING`` imports are the
    table, each name imported from the module the table loads it from (so type checkers see what users get)."""
    lazy = {(where, name) for name, where in getattr(module, table).items()}
    offered = {name for _, name in lazy} | _eager_imports(tree) | _defined(tree)
    assert offered == set(module.__all__), (
        f"{module.__name__}: {table} and its imports differ from __all__: only offered "
        f"{sorted(offered - set(module.__all__))}, only in __all__ {sorted(set(module.__all__) - offered)}")
    typed = _type_checking_imports(tree)
    assert typed == lazy, (
        f"{module.__name__}: TYPE_CHECKING imports differ from {table}: imported "
        f"{sorted(f'{n} from {m}' for m, n in typed - lazy)}, the table says "
        f"{sorted(f'{n} from {m}' for m, n in lazy - typed)}")


def assert_package_exports_its_imports(module: types.ModuleType, tree: ast.Module) -> None:
    """A package ``__init__`` imports a public name to export it: one left out of ``__all__`` is forgotten."""
    forgotten = _eager_imports(tree) - set(module.__all__)
    assert not forgotten, f"{module.__name__} imports {sorted(forgotten)} but leaves them out of __all__"


def assert_checks_offer_checks_only(checks: types.ModuleType, harness: types.ModuleType,
                                    offers: dict[str, set[str]]) -> None:
    """``dir(qcheck.checks)`` is ``__all__``: its ``assert_*`` checks and the names ``offers`` lists by kind,
    each listed name offered; none of them is also the harness's."""
    public = set(dir(checks)) - {n for n in dir(checks) if n.startswith("_")}
    assert public == set(checks.__all__), (f"dir({checks.__name__}) differs from __all__: "
                                           f"{sorted(public ^ set(checks.__all__))}")
    listed = set().union(*offers.values())
    other = sorted(n for n in public - listed if not n.startswith("assert_"))
    assert not other, (f"{checks.__name__} offers {other}, neither a check (assert_*) nor listed in CHECKS_OFFERS "
                       f"({', '.join(offers)}): a part only the suite calls belongs in {harness.__name__}")
    gone = sorted(listed - public)
    assert not gone, f"CHECKS_OFFERS lists {gone}, which {checks.__name__} does not offer"
    both = sorted(public & set(harness.__all__))
    assert not both, f"{both} offered by both {checks.__name__} and {harness.__name__}: each name has one place"


def assert_top_level_checks_are_the_checks(top: types.ModuleType, checks: types.ModuleType) -> None:
    """The rule: ``qcheck`` re-exports every assertion of ``qcheck.checks`` (``qcheck.assert_tracks`` and
    ``qcheck.checks.assert_tracks`` are one function), and no other ``assert_*``."""
    top_level = {n for n in top.__all__ if n.startswith("assert_")}
    offered = {n for n in checks.__all__ if n.startswith("assert_")}
    assert top_level == offered, (f"qcheck re-exports {sorted(top_level)}, qcheck.checks offers {sorted(offered)}: "
                                  "qcheck re-exports every assertion of qcheck.checks, and no other")
    for name in sorted(top_level):
        assert getattr(top, name) is getattr(checks, name), f"qcheck.{name} is not qcheck.checks.{name}"


def _private_uses(tree: ast.Module) -> list[str]:
    """``from qcheck... import _x``, ``import qcheck._x`` and ``qcheck...._x`` (or through a name imported
    from qcheck), and names qcheck's public modules do not offer."""
    found, roots = [], {"qcheck"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "qcheck":
            for alias in node.names:
                roots.add(alias.asname or alias.name)
                if any(p.startswith("_") for p in [*node.module.split("."), alias.name]):
                    found.append(f"from {node.module} import {alias.name}")
                elif not _offered(node.module, alias.name):
                    found.append(f"from {node.module} import {alias.name} (not offered there)")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "qcheck" and any(p.startswith("_") for p in a.name.split("."))]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in roots and any(
                    p.startswith("_") and not p.startswith("__") for p in chain):
                found.append(ast.unparse(node))
    return found


def _offered(module_name: str, name: str) -> bool:
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return name in module.__all__
    try:  # a package without __all__ offers its submodules
        importlib.import_module(f"{module_name}.{name}")
    except ModuleNotFoundError:
        return hasattr(module, name)
    return True


def assert_code_blocks_import_public_names(text: str, where: str) -> int:
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    for i, block in enumerate(blocks, 1):
        private = _private_uses(ast.parse(block))
        assert not private, f"{where}: python block {i} uses qcheck's privates: {', '.join(private)}"
    return len(blocks)


# -- the rules on qcheck itself ------------------------------------------------------------------------


@pytest.mark.parametrize("name, table", PUBLIC, ids=[row[0] for row in PUBLIC])
def test_public_module_exports_resolve_and_match_its_tables(name, table):
    module = importlib.import_module(name)
    assert_exports_resolve(module)
    tree = _source(module)
    if table is not None:
        assert_lazy_table_is_all(module, tree, table)
    elif Path(module.__file__).name == "__init__.py" or not _defined(tree):  # a package, or one of re-exports
        assert_package_exports_its_imports(module, tree)


def test_the_readme_imports_unquantized_by_design_from_a_public_name():
    from qcheck.layers import moe

    assert "UNQUANTIZED_BY_DESIGN" in moe.__all__


def test_qcheck_re_exports_every_assertion_of_qcheck_checks():
    assert_top_level_checks_are_the_checks(qcheck, qcheck.checks)


def test_qcheck_checks_offers_the_checks_their_figures_and_operands_only():
    from qcheck.checks import harness

    assert_checks_offer_checks_only(qcheck.checks, harness, CHECKS_OFFERS)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_code_blocks_import_only_public_names(path):
    assert_code_blocks_import_public_names(path.read_text(), path.name)


def test_the_docs_have_code_blocks_to_check():
    assert sum(assert_code_blocks_import_public_names(p.read_text(), p.name) for p in DOCS) >= 10


# -- controls: each rule fails on the mistake it exists for ---------------------------------------------


def _fake(name: str, source: str, **attrs) -> tuple[types.ModuleType, ast.Module]:
    module = types.ModuleType(name)
    vars(module).update(attrs)
    return module, ast.parse(source)


def test_a_name_in_all_that_does_not_resolve_should_fail():
    module, _ = _fake("fake", "", __all__=["present", "missing"], present=1)
    with pytest.raises(AssertionError, match=r"^fake.__all__ names \['missing'\], which do not resolve"):
        assert_exports_resolve(module)
    module.__all__ = ["present", "present"]
    with pytest.raises(AssertionError, match=r"lists \['present'\] twice"):
        assert_exports_resolve(module)


def test_a_lazy_table_or_type_checking_import_out_of_step_should_fail():
    healthy = "from fake._x import eager\nif TYPE_CHECKING:\n    from fake._y import lazy\n"
    module, tree = _fake("fake", healthy, __all__=["eager", "lazy"], _WHERE={"lazy": "fake._y"})
    assert_lazy_table_is_all(module, tree, "_WHERE")
    module.__all__ = ["eager", "lazy", "new"]  # exported, never made lazy
    with pytest.raises(AssertionError, match=r"only in __all__ \['new'\]"):
        assert_lazy_table_is_all(module, tree, "_WHERE")
    module.__all__, module._WHERE = ["eager", "lazy", "new"], {"lazy": "fake._y", "new": "fake._y"}
    with pytest.raises(AssertionError, match=r"TYPE_CHECKING imports differ .*the table says \['new from fake._y'\]"):
        assert_lazy_table_is_all(module, tree, "_WHERE")
    module.__all__, module._WHERE = ["eager", "lazy"], {"lazy": "fake._z"}  # typed from another module
    with pytest.raises(AssertionError, match=r"imported \['lazy from fake._y'\], the table says "
                                             r"\['lazy from fake._z'\]"):
        assert_lazy_table_is_all(module, tree, "_WHERE")


def test_qcheck_checks_offering_a_harness_part_should_fail():
    def fake(offered: list[str], name: str = "checks") -> types.ModuleType:
        checks = types.ModuleType(name)
        checks.__all__ = offered
        vars(checks).update(dict.fromkeys(offered, object()))
        return checks

    harness = fake(["judge_x"], "harness")
    offers = {"figure": {"Figures"}}
    assert_checks_offer_checks_only(fake(["assert_x", "Figures"]), harness, offers)
    with pytest.raises(AssertionError, match=r"^checks offers \['record_calls'\], neither a check \(assert_\*\) "
                                             r"nor listed in CHECKS_OFFERS \(figure\): .* belongs in harness"):
        assert_checks_offer_checks_only(fake(["assert_x", "Figures", "record_calls"]), harness, offers)
    with pytest.raises(AssertionError, match=r"^CHECKS_OFFERS lists \['Figures'\], which checks does not offer"):
        assert_checks_offer_checks_only(fake(["assert_x"]), harness, offers)
    with pytest.raises(AssertionError, match=r"^\['judge_x'\] offered by both checks and harness"):
        assert_checks_offer_checks_only(fake(["assert_x", "Figures", "judge_x"]), harness, {"figure": {"Figures",
                                                                                                       "judge_x"}})
    unlisted = fake(["assert_x", "Figures"])
    unlisted.extra = object()  # in dir(), left out of __all__
    with pytest.raises(AssertionError, match=r"^dir\(checks\) differs from __all__: \['extra'\]"):
        assert_checks_offer_checks_only(unlisted, harness, offers)


def test_a_package_importing_a_name_it_does_not_export_should_fail():
    module, tree = _fake("fake", "from fake._x import kept, forgotten\nfrom fake import _private\n",
                         __all__=["kept"])
    with pytest.raises(AssertionError, match=r"^fake imports \['forgotten'\] but leaves them out of __all__"):
        assert_package_exports_its_imports(module, tree)


def test_top_level_assertions_other_than_the_checks_should_fail():
    checks = types.ModuleType("checks")
    checks.__all__, checks.assert_a, checks.assert_b = ["assert_a", "assert_b"], object(), object()
    top = types.ModuleType("top")
    top.__all__, top.assert_a, top.assert_b = ["assert_a", "assert_b"], checks.assert_a, checks.assert_b
    assert_top_level_checks_are_the_checks(top, checks)
    top.__all__ = ["assert_a"]  # one assertion left out
    with pytest.raises(AssertionError, match=r"re-exports \['assert_a'\], qcheck.checks offers \['assert_a', "
                                             r"'assert_b'\]"):
        assert_top_level_checks_are_the_checks(top, checks)
    top.__all__, top.assert_a = ["assert_a", "assert_b"], object()  # a different function under the same name
    with pytest.raises(AssertionError, match=r"qcheck.assert_a is not qcheck.checks.assert_a"):
        assert_top_level_checks_are_the_checks(top, checks)


@pytest.mark.parametrize("block, named", [
    ("from qcheck.checks._site import assert_site_exact", "from qcheck.checks._site import assert_site_exact"),
    ("from qcheck.recipes import _registry", "from qcheck.recipes import _registry"),
    ("import qcheck\nqcheck.recipes._registry._REGISTRY.clear()", "qcheck.recipes._registry._REGISTRY"),
    ("from qcheck import recipes\nrecipes._registry.get_recipe('fp8')", "recipes._registry.get_recipe"),
    ("import qcheck._coverage", "import qcheck._coverage"),
    ("from qcheck import checks, step", "from qcheck import step (not offered there)"),
])
def test_a_docs_block_using_a_private_name_should_fail(block, named):
    text = f"prose\n```python\nimport jax\n```\n\n```python\n{block}\n```\n"
    with pytest.raises(AssertionError, match=rf"^guide.md: python block 2 uses qcheck's privates: .*"
                                             rf"{re.escape(named)}"):
        assert_code_blocks_import_public_names(text, "guide.md")
    assert assert_code_blocks_import_public_names("```python\nimport qcheck\nqcheck.recipes.get_recipe('fp8')\n"
                                                  "self._cache = 1\n```\n", "guide.md") == 1


# -- the tests themselves: qcheck's and each other's privates -------------------------------------------

OURS = ("qcheck", "tests", "bench")
#: Shared test code lives in these modules, not in test modules.
SHARED_TEST_MODULES = {"tests.helpers", "tests.format_properties", "tests.fp8_loops", "tests.maxtext_like",
                       "tests.maxtext_cells"}

_PROCESS = "the setup of qcheck's own processes is what these tests are about"
_FAKE = "fakes what the host has (extras, GPUs): no public seam for it yet"
#: Private names tests still use (``file: use`` -> why). The list may only shrink: a use not listed
#: fails, and so does a listed one no test makes any more.
STILL_PRIVATE: dict[str, str] = {
    "test_absltest.py: from qcheck.suite import _process": _PROCESS,
    "test_process.py: from qcheck.suite import _process": _PROCESS,
    **{f"test_formats.py: {use}": "counts traces of the jitted quantizer qdq calls (qcheck.formats)"
       for use in ("from qcheck.formats import _codec", "_codec._quantize", "setattr(_codec, _quantize)")},
    "test_adapters.py: setattr(adapters, _has)": _FAKE,
    "test_plugin.py: setattr(hardware, _devices)": _FAKE,
    # Not shared code: the docs test looks the tests its table names up in these modules.
    **{f"test_libraries_doc.py: from tests import {m}": "the defect table names their tests"
       for m in ("test_adapters", "test_fp8_state", "test_gemma", "test_levanter", "test_maxtext",
                 "test_qwix_formats", "test_tokamax", "test_keras", "test_keras_hub", "test_easydel")},
    "test_golden.py: from qcheck.suite import _toolchain":
        "a toolchain whose division form the referee does not know exists on no installable jax: the probe is stubbed",
    "test_known_defects.py: from qcheck.suite import _declared_cells":
        "a stand-in recipe's declarations, run through the suite's one judge of declared cells without compiling",
}


def _private_uses_in_tests(tree: ast.Module) -> list[str]:
    """Leading-underscore names of qcheck, bench or another test module a test imports, reads or
    monkeypatches, and names it imports from a test module (shared code belongs in tests/helpers.py)."""
    found, ours = [], set()

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OURS:
            for alias in node.names:
                ours.add(alias.asname or alias.name)
                module = node.module if node.module != "tests" else f"tests.{alias.name}"
                if private(alias.name):
                    found.append(f"from {node.module} import {alias.name}")
                elif module.startswith("tests.test_") or (
                        module.startswith("tests.") and module not in SHARED_TEST_MODULES and node.module != "tests"):
                    found.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            ours |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in OURS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in ours:
                found.append(ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("setattr",
              "setitem", "delattr") and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in ours
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and private(node.args[1].value)):
            found.append(f"{node.func.attr}({node.args[0].id}, {node.args[1].value})")
    return [use for use in found if not any(other.startswith(use + ".") for other in found)]  # a chain once


def _test_sources() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text()) for p in sorted((ROOT / "tests").glob("*.py"))}


def assert_tests_use_no_new_privates(sources: dict[str, ast.Module], allowed) -> None:
    used = {f"{name}: {use}" for name, tree in sources.items() for use in _private_uses_in_tests(tree)}
    allowed = set(allowed)
    assert not used - allowed, f"tests use privates: {sorted(used - allowed)}; use a public name or tests/helpers.py"
    assert not allowed - used, f"STILL_PRIVATE lists uses no test makes any more: {sorted(allowed - used)}"


def test_tests_use_no_privates_of_qcheck_or_of_each_other():
    assert_tests_use_no_new_privates(_test_sources(), STILL_PRIVATE)


@pytest.mark.parametrize("source, use", [
    ("from tests.test_backward import WrongAxes", "from tests.test_backward import WrongAxes"),
    ("from tests import test_layer_check", "from tests import test_layer_check"),
    ("from qcheck.recipes import _registry", "from qcheck.recipes import _registry"),
    ("import qcheck\nqcheck.recipes._registry._REGISTRY.clear()", "qcheck.recipes._registry._REGISTRY"),
    ("from qcheck import formats\ndef test(monkeypatch):\n    monkeypatch.setattr(formats, '_quantize', None)",
     "setattr(formats, _quantize)"),
])
def test_a_test_using_a_private_should_fail(source, use):
    healthy = ast.parse("from tests.helpers import sparse_moe\nfrom qcheck.checks._site import assert_site_exact\n"
                        "import qcheck\nqcheck.recipes.get_recipe('fp8')\nself._cache = 1\n")
    assert_tests_use_no_new_privates({"test_fine.py": healthy}, set())
    with pytest.raises(AssertionError, match=rf"tests use privates: \['test_bad.py: {re.escape(use)}"):
        assert_tests_use_no_new_privates({"test_bad.py": ast.parse(source)}, set())
    with pytest.raises(AssertionError, match=r"STILL_PRIVATE lists uses no test makes any more: \['test_gone.py"):
        assert_tests_use_no_new_privates({"test_fine.py": healthy}, {"test_gone.py: from tests.test_x import y"})
