"""The tree's one-way direction: the library a user imports never reaches the suite harness, nor JAX's internals."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

QCHECK = Path(__file__).parent.parent / "qcheck"
#: Library modules that are entry points onto the harness, not part of the library proper.
HARNESS_DOORS = {"__main__", "testing"}
#: The private JAX names the library reads, each where no public API exists (file: what and why). None now.
PRIVATE_JAX: dict[str, str] = {}


def library_modules() -> list[str]:
    found = [p for p in QCHECK.rglob("*.py") if "suite" not in p.relative_to(QCHECK).parts]
    names = [".".join(("qcheck", *p.relative_to(QCHECK).with_suffix("").parts)) for p in found]
    return sorted(n.removesuffix(".__init__") for n in names if n.rsplit(".", 1)[-1] not in HARNESS_DOORS)


def test_importing_the_library_loads_nothing_of_the_suite():
    probe = (f"import importlib, sys\nfor name in {library_modules()!r}:\n"
             "    try:\n        importlib.import_module(name)\n"
             "    except ImportError as e:  # only an optional extra may be missing: the adapters say which\n"
             "        assert (e.__cause__ or e).name in ('aqt', 'qwix'), e\n"
             "print(sorted(m for m in sys.modules if m.startswith('qcheck.suite')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_library_reads_private_jax_names_only_where_listed():
    readers = {p.name for p in QCHECK.rglob("*.py") if "jax._src" in p.read_text() and "suite" not in p.parts}
    assert readers == set(PRIVATE_JAX), f"private JAX names read in {sorted(readers)}; listed {sorted(PRIVATE_JAX)}"


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each qcheck module under ``root`` -> the qcheck modules it imports, at module level or inside functions."""
    modules = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names if a.name.startswith(root.name)}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                if base.split(".")[0] == root.name:
                    deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names}
        graph[name] = deps - {name, None}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_among_qcheck_modules():
    cycles = import_cycles(import_graph(QCHECK))
    assert not cycles, "import cycles (imports inside functions count): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_an_import_inside_a_function_closes_a_cycle(tmp_path):
    package = tmp_path / "qcheck"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .a import x\n")
    (package / "sub" / "a.py").write_text("from qcheck.b import y\nx = 1\n")
    (package / "b.py").write_text("y = 2\n")
    assert import_cycles(import_graph(package)) == []
    (package / "b.py").write_text("def f():\n    from qcheck.sub import a\ny = 2\n")  # the twin: back, lazily
    assert import_cycles(import_graph(package)) == [["qcheck.b", "qcheck.sub.a"]]


ARCHITECTURE = QCHECK.parent / "docs" / "architecture.md"


def architecture_gaps(doc: str, root: Path) -> list[str]:
    """What docs/architecture.md and the tree under ``root`` disagree on: paths it names that do not exist,
    and packages or public top-level modules of the tree it does not name."""
    named = set(re.findall(r"`((?:qcheck|golden)/[\w/.]*)`", doc))
    gaps = [f"names {p}, which does not exist" for p in sorted(named) if not (root.parent / p).exists()]
    parts = {f"qcheck/{p.name}/" for p in root.iterdir() if (p / "__init__.py").exists()}
    parts |= {f"qcheck/{p.name}" for p in root.glob("*.py")}
    gaps += [f"does not name {p}" for p in sorted(parts - named)]
    return gaps


def test_the_architecture_page_matches_the_tree():
    assert architecture_gaps(ARCHITECTURE.read_text(), QCHECK) == []


def test_the_architecture_page_check_sees_a_missing_and_an_unnamed_part(tmp_path):
    (tmp_path / "qcheck" / "layers").mkdir(parents=True)
    (tmp_path / "qcheck" / "layers" / "__init__.py").write_text("")
    (tmp_path / "qcheck" / "formats.py").write_text("")
    assert architecture_gaps("`qcheck/formats.py`, `qcheck/layers/`", tmp_path / "qcheck") == []
    assert architecture_gaps("`qcheck/formats.py`, `qcheck/gone/`", tmp_path / "qcheck") == [
        "names qcheck/gone/, which does not exist", "does not name qcheck/layers/"]


# -- a number format is added in two places: its record and its referee --------------------------------

#: The modules of qcheck that may hold a literal collection of two or more format names (module: why it is
#: not a list a new format must join). The records' table is where a format is added, and the referee keeps
#: its own, independent by design; every other table of formats is read off the records.
FORMAT_LISTS = {
    "qcheck/formats/_table.py": "the records: the one place a format is added",
    "qcheck/referees/_formats.py": "the referee's own table, written from each format's definition",
    "qcheck/referees/_libraries.py": "what other libraries compute in place of some formats, not every format",
    "qcheck/adapters/_jax.py": "JAX's scaled_dot_general modes, keyed by JAX's own names",
    "qcheck/native.py": "the block formats jax.nn.scaled_matmul takes natively: the hardware's list",
}


def format_lists(root: Path, names: set[str]) -> dict[str, list[str]]:
    """Each module under ``root`` that holds a literal tuple, list or set of two or more of ``names`` (or a
    dict keyed by them) -> those collections, as ``line: names``. A single name (``fmt == "nvfp4"``) is one
    format's own behaviour, not a list of formats."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                elements = node.elts
            elif isinstance(node, ast.Dict):
                elements = [k for k in node.keys if k is not None]
            else:
                continue
            held = [e.value for e in elements if isinstance(e, ast.Constant) and e.value in names]
            if len(held) >= 2:
                found.setdefault(str(path.relative_to(root.parent)), []).append(f"{node.lineno}: {held}")
    return found


def test_formats_are_listed_only_in_their_records_and_the_referee():
    from qcheck import formats

    found = format_lists(QCHECK, set(formats.format_names()))
    assert set(found) - set(FORMAT_LISTS) == set(), (
        f"format names listed outside the records: {found}; read them off qcheck.formats.FORMATS")
    assert set(FORMAT_LISTS) - set(found) == set(), f"listed but holding no format list: {set(FORMAT_LISTS) - set(found)}"


def test_a_list_of_formats_outside_the_records_is_found(tmp_path):
    (tmp_path / "qcheck").mkdir()
    (tmp_path / "qcheck" / "site.py").write_text('ONE = fmt == "int8"\nKEYS = {"a": 1, "int8": 2}\n')
    assert format_lists(tmp_path / "qcheck", {"int8", "e4m3fn"}) == {}
    (tmp_path / "qcheck" / "site.py").write_text('INTEGER = frozenset({"int8", "e4m3fn"})\n')
    assert format_lists(tmp_path / "qcheck", {"int8", "e4m3fn"}) == {"qcheck/site.py": ["1: ['int8', 'e4m3fn']"]}


#: The packages that may branch on one format's name: the records, the referee (independent of them by
#: design) and the adapters (a library's own rule under a format's name).
FORMAT_BRANCH_PACKAGES = ("qcheck/formats/", "qcheck/referees/", "qcheck/adapters/")
#: Modules outside them whose comparisons with a format's name are another library's own names that happen to
#: coincide (module: why).
FORMAT_BRANCH_HOMONYMS = {
    "qcheck/libraries/keras.py": "Keras's quantization mode and dtype strings (\"int8\"), compared as Keras names them",
}


def format_branches(root: Path, names: set[str]) -> dict[str, list[str]]:
    """Each module under ``root`` that branches on one format's name -> those branches, as ``line: source``: a
    comparison (``==``, ``!=``, ``in``, ``not in``) with a format name or a ``"float8_"``-prefixed literal,
    ``.startswith`` / ``.removeprefix`` / ``.endswith`` / ``.removesuffix`` of one, or a dtype name built from
    a format's (``"float8_" + name``, ``f"float8_{name}"``). Such a fact belongs in the format's record
    (``record.stochastic``, ``record.kind``, ``record.element.name``)."""

    def names_a_format(node: ast.AST) -> bool:
        values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(v, ast.Constant) and isinstance(v.value, str)
                   and (v.value in names or v.value.startswith("float8_")) for v in values)

    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Compare):
                hit = any(names_a_format(x) for x in (node.left, *node.comparators))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("startswith", "removeprefix", "endswith", "removesuffix")):
                hit = any(names_a_format(a) for a in node.args)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                hit = any(isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.endswith("float8_")
                          for v in (node.left, node.right))
            elif isinstance(node, ast.JoinedStr):
                hit = any(isinstance(v, ast.Constant) and v.value.endswith("float8_") and i + 1 < len(node.values)
                          for i, v in enumerate(node.values))
            else:
                continue
            if hit:
                found.setdefault(str(path.relative_to(root.parent)), []).append(
                    f"{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


def test_no_branch_on_a_format_name_outside_the_records_the_referee_and_the_adapters():
    from qcheck import formats

    found = {path: hits for path, hits in format_branches(QCHECK, set(formats.format_names())).items()
             if not path.startswith(FORMAT_BRANCH_PACKAGES) and path not in FORMAT_BRANCH_HOMONYMS}
    assert found == {}, f"branches on one format's name outside its record: {found}; read a field of its record"


def test_a_branch_on_a_format_name_is_found(tmp_path):
    (tmp_path / "qcheck").mkdir()
    site = tmp_path / "qcheck" / "site.py"
    site.write_text('ok = record.stochastic\nname = "nvfp4"\nkeys = {"int8": 1}\n')
    assert format_branches(tmp_path / "qcheck", {"int8", "nvfp4"}) == {}
    site.write_text('a = fmt == "nvfp4"\nb = "nvfp4" in (lhs, rhs)\nc = fmt.startswith("int8")\n'
                    'd = dt.name.removeprefix("float8_")\ne = grad != "nvfp4"\nf = "float8_" + fmt\n'
                    'g = f"g in float8_{fmt}"\n')
    assert format_branches(tmp_path / "qcheck", {"int8", "nvfp4"}) == {"qcheck/site.py": [
        '1: fmt == "nvfp4"', '2: "nvfp4" in (lhs, rhs)', '3: fmt.startswith("int8")',
        '4: dt.name.removeprefix("float8_")', '5: grad != "nvfp4"', '6: "float8_" + fmt', '7: f"g in float8_{fmt}"']}


def test_a_branch_planted_in_the_tree_fails_the_layout_check(tmp_path):
    """The check on the real tree, with one branch planted in a copy of a module that has none."""
    import shutil

    from qcheck import formats

    tree = tmp_path / "qcheck"
    shutil.copytree(QCHECK, tree, ignore=shutil.ignore_patterns("__pycache__", "golden"))
    names = set(formats.format_names())
    clean = {p: h for p, h in format_branches(tree, names).items() if not p.startswith(FORMAT_BRANCH_PACKAGES)}
    site = tree / "checks" / "_site.py"
    site.write_text(site.read_text() + '\n\ndef _planted(fmt):\n    return fmt == "nvfp4"\n')
    planted = {p: h for p, h in format_branches(tree, names).items() if not p.startswith(FORMAT_BRANCH_PACKAGES)}
    assert set(clean) <= set(FORMAT_BRANCH_HOMONYMS)
    assert planted.get("qcheck/checks/_site.py", [""])[-1].endswith('fmt == "nvfp4"')


# -- a library is one module: its import path is named in qcheck/libraries/ only ------------------------------

#: The packages that may name a library's import path: the libraries' own modules, the adapters (a library run
#: as a recipe) and the referee (what a library computes under a format's name).
LIBRARY_PATH_PACKAGES = ("qcheck/libraries/", "qcheck/adapters/", "qcheck/referees/")
#: Strings outside them equal to a library's import name that name something else (module: (strings, why)).
LIBRARY_PATH_HOMONYMS = {
    "qcheck/checks/_layer_forms.py": ({"keras", "equinox"}, "the layer forms' kinds (how a Keras or Equinox layer "
                                      "is called, split and paired with its twin), entangled with check_layer's Form"),
    "qcheck/checks/_copy_params.py": ({"equinox"}, "the layer form's kind"),
    "qcheck/checks/_layer.py": ({"keras"}, "the layer form's kind"),
    "qcheck/layers/moe.py": ({"gemma"}, "the Gemma-4 style of router, a model family's name"),
    "qcheck/checks/_moe_matches.py": ({"gemma"}, "the Gemma-4 style of router"),
    "qcheck/suite/_layer_matches.py": ({"gemma"}, "the Gemma-4 style of router"),
}


def library_import_names() -> set[str]:
    """The top-level import names of the registered libraries, but those qcheck itself depends on (jax, flax)."""
    import tomllib

    from qcheck import libraries

    pins = tomllib.loads((QCHECK.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    own = {re.split(r"[<>=~!\[ ]", p)[0].replace("-", "_") for p in pins} | {"jaxlib"}
    return {n for lib in libraries.registered_libraries() for n in lib.import_paths()} - own


def library_paths(root: Path, names: set[str]) -> dict[str, list[str]]:
    """Each module under ``root`` that names a library's import path -> where, as ``line: path``: an import of
    it, or a string (not a docstring) that is one of ``names`` or a dotted or ``/`` path under one."""
    def names_one(value: str) -> bool:
        return any(value == n or value.startswith((n + ".", n + "/")) for n in names)

    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                hits = [a.name for a in node.names if names_one(a.name)]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                hits = [node.module] if names_one(node.module or "") else []
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                hits = [node.value] if names_one(node.value) else []
            else:
                continue
            for hit in hits:
                found.setdefault(str(path.relative_to(root.parent)), []).append(f"{node.lineno}: {hit}")
    return {module: sorted(hits, key=lambda h: int(h.split(":")[0])) for module, hits in found.items()}


def _outside_libraries(found: dict[str, list[str]]) -> dict[str, list[str]]:
    out = {}
    for module, hits in found.items():
        allowed = LIBRARY_PATH_HOMONYMS.get(module, (set(), ""))[0]
        if not module.startswith(LIBRARY_PATH_PACKAGES) and (rest := [h for h in hits
                                                                      if h.split(": ", 1)[1] not in allowed]):
            out[module] = rest
    return out


def test_no_module_outside_the_libraries_names_a_library():
    names = library_import_names()
    assert {"keras", "qwix", "maxtext", "haliax", "gemma", "tokamax", "aqt", "equinox"} <= names, names
    assert _outside_libraries(library_paths(QCHECK, names)) == {}, (
        "a library's import path named outside qcheck/libraries/: move what reads it into its library's module")


def test_a_library_path_named_outside_the_libraries_is_found(tmp_path):
    site = tmp_path / "qcheck" / "checks" / "_site.py"
    site.parent.mkdir(parents=True)
    site.write_text('"""Reads keras.src.ops: a docstring names it."""\nkind = "keras"\n')
    found = library_paths(tmp_path / "qcheck", {"keras", "qwix"})
    assert found == {"qcheck/checks/_site.py": ["2: keras"]} and _outside_libraries(
        {"qcheck/checks/_layer_forms.py": ["2: keras"]}) == {}
    site.write_text('import sys\nimport qwix.core\nfrom keras import ops\nk = sys.modules.get("keras.src")\n'
                    'f = "qwix/_src/x.py"\n')
    assert library_paths(tmp_path / "qcheck", {"keras", "qwix"}) == {"qcheck/checks/_site.py": [
        "2: qwix.core", "3: keras", "4: keras.src", "5: qwix/_src/x.py"]}
    assert _outside_libraries({"qcheck/checks/_layer_forms.py": ["4: keras.src"],
                               "qcheck/libraries/keras.py": ["4: keras.src"]}) == {
        "qcheck/checks/_layer_forms.py": ["4: keras.src"]}


def test_the_architecture_page_says_where_a_format_is_added():
    row = next(line for line in ARCHITECTURE.read_text().splitlines() if line.startswith("| number format |"))
    where = [p for p in FORMAT_LISTS if f"`{p}`" in row]
    assert where == ["qcheck/formats/_table.py", "qcheck/referees/_formats.py"], row


def test_pyproject_lists_every_package_of_the_tree():
    import tomllib

    setuptools = tomllib.loads((QCHECK.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {".".join(p.parent.relative_to(QCHECK.parent).parts) for p in QCHECK.rglob("__init__.py")}
    # golden/ travels as package data under qcheck/, mapped at build time (pyproject's package-dir).
    assert set(setuptools["packages"]) == tree | {"qcheck._golden"}
    assert setuptools["package-dir"] == {"qcheck._golden": "golden"}


def private_reaches(root: Path) -> list[str]:
    """Each use, in a module under ``root``, of another qcheck module's private name: ``from m import _x``
    or ``m._x``. Private modules are fine (``from qcheck.checks import _site``): their names are the point."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == root.name:
                for alias in node.names:
                    if alias.name.startswith("_") and f"{node.module}.{alias.name}".replace(".", "/") not in {
                            str(p.relative_to(root.parent).with_suffix("")) for p in root.rglob("*.py")} | {
                            str(p.parent.relative_to(root.parent)) for p in root.rglob("__init__.py")}:
                        found.append(f"{path.relative_to(root.parent)}: from {node.module} import {alias.name}")
                    modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == root.name}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_privates():
    assert private_reaches(QCHECK) == []


def test_a_private_reached_from_another_module_is_named(tmp_path):
    package = tmp_path / "qcheck"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_step.py").write_text("_TRAINABLE = 1\nTRAINABLE = 2\n")
    (package / "train.py").write_text("from qcheck import _step\nfrom qcheck._step import TRAINABLE\nx = _step.TRAINABLE\n")
    assert private_reaches(package) == []
    (package / "train.py").write_text("from qcheck import _step\nfrom qcheck._step import _TRAINABLE\nx = _step._TRAINABLE\n")
    assert private_reaches(package) == ["qcheck/train.py: from qcheck._step import _TRAINABLE",
                                        "qcheck/train.py:3: _step._TRAINABLE"]


def private_modules_reached(root: Path) -> list[str]:
    """Each import, by a module under ``root``, of another package's private module.

    ``a.b._c`` belongs to the package ``a.b``: only modules inside it import it
    (``qcheck._errors`` belongs to ``qcheck``, so every part may, but
    ``qcheck._coverage._walk`` only ``qcheck._coverage``'s own). What a package
    offers the others is what its ``__init__`` exports.
    """
    found = set()
    for module, deps in import_graph(root).items():
        for dep in deps:
            parts = dep.split(".")
            for i in (i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")):
                owner = ".".join(parts[:i])
                if module != owner and not module.startswith(owner + "."):
                    found.add(f"{module} imports {'.'.join(parts[: i + 1])}")
                    break
    return sorted(found)


def test_no_module_imports_another_packages_private_module():
    assert private_modules_reached(QCHECK) == []


def test_a_private_module_imported_from_another_package_is_named(tmp_path):
    package = tmp_path / "qcheck"
    for sub in ("checks", "suite"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "_errors.py").write_text("")
    (package / "checks" / "_site.py").write_text("from qcheck import _errors\n")
    (package / "checks" / "__init__.py").write_text("from qcheck.checks._site import *\n")
    (package / "suite" / "run.py").write_text("from qcheck import checks\n")
    assert private_modules_reached(package) == []
    (package / "suite" / "run.py").write_text("from qcheck.checks import _site\n")
    assert private_modules_reached(package) == ["qcheck.suite.run imports qcheck.checks._site"]
    (package / "_walk").mkdir()
    (package / "_walk" / "__init__.py").write_text("")
    (package / "_walk" / "_jaxpr.py").write_text("")
    (package / "suite" / "run.py").write_text("from qcheck import _walk\nfrom qcheck._walk import _jaxpr\n")
    assert private_modules_reached(package) == ["qcheck.suite.run imports qcheck._walk._jaxpr"]


def private_modules_with_all(root: Path) -> list[str]:
    """Private modules (``_name.py``, not a package's ``__init__``) that list their names in ``__all__``: what a
    package offers is its ``__init__``'s list, so a second list in a private module is one more to keep in step."""
    found = []
    for path in sorted(root.rglob("_*.py")):
        if path.name.startswith("__"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                found.append(str(path.relative_to(root.parent)))
    return found


def test_no_private_module_keeps_an_all_list():
    assert private_modules_with_all(QCHECK) == []


def test_an_all_list_in_a_private_module_is_found(tmp_path):
    package = tmp_path / "qcheck"
    package.mkdir()
    (package / "__init__.py").write_text('__all__ = ["f"]\nfrom qcheck._f import f\n')
    (package / "_f.py").write_text('__all__ = ["f"]\n\n\ndef f():\n    pass\n')
    assert private_modules_with_all(package) == ["qcheck/_f.py"]


#: The longest function (docstring included) and class in qcheck: past them, a function is doing two jobs.
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 80, 300


def oversized(root: Path) -> list[str]:
    """Every function over MAX_FUNCTION_LINES and class over MAX_CLASS_LINES lines under ``root``, with its size."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = (MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     else MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else None)
            if limit is not None and (size := node.end_lineno - node.lineno + 1) > limit:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({size} lines)")
    return found


def test_no_function_over_80_lines_and_no_class_over_300():
    assert oversized(QCHECK) == []


def test_an_oversized_function_is_found(tmp_path):
    package = tmp_path / "qcheck"
    package.mkdir()
    (package / "m.py").write_text("def f():\n" + "    x = 1\n" * 80 + "\n\ndef g():\n" + "    x = 1\n" * 79)
    assert oversized(package) == ["qcheck/m.py:1 f (81 lines)"]
