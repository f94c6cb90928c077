"""The tree's one-way direction: the library a user imports never reaches the suite harness, nor JAX's internals."""

import subprocess
import sys
from pathlib import Path

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
