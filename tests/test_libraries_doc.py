"""docs/libraries.md: its code blocks run, its table of library defects names tests that exist, and the
README's summary of that table has its libraries and versions.

The blocks run in this process, each in a fresh namespace, under the repository's
strict settings (warnings are errors, no rank promotion), as a user's test would.
"""

import re
from pathlib import Path

import numpy as np
import pytest

from tests import (test_adapters, test_easydel, test_fp8_state, test_gemma, test_keras, test_keras_hub, test_levanter,
                   test_maxtext, test_qwix_formats, test_tokamax)
from tests.helpers import QWIX_WARNS, import_extra

#: The modules whose tests the defect table may name (test_maxtext, test_gemma, test_levanter, test_tokamax,
#: test_keras, test_keras_hub and test_easydel import without their library).
DEFECT_MODULES = (test_adapters, test_qwix_formats, test_fp8_state, test_maxtext, test_gemma, test_levanter, test_tokamax,
                  test_keras, test_keras_hub, test_easydel)

ROOT = Path(__file__).parent.parent
DOC = (ROOT / "docs" / "libraries.md").read_text()
README = (ROOT / "README.md").read_text()
#: The library each block needs, by its label.
NEEDS = {"flax": None, "aqt": "aqt", "qwix": "qwix", "qwix_recipe": "qwix", "qwix_reader": "qwix"}  # the extra each block needs


def doc_blocks() -> dict[str, str]:
    return dict(re.findall(r"<!-- libraries: (\w+) -->\n```python\n(.*?)```", DOC, re.S))


def defect_rows() -> list[list[str]]:
    return _table(DOC, "| defect | library | version checked | caught by | test |")


def _table(text: str, header: str) -> list[list[str]]:
    table = text.split("## Defects qcheck finds in the libraries you use", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert lines[0] == header
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_readme_sums_up_the_defect_table_by_library_and_version():
    summary = {library: versions for library, versions, _ in
               _table(README, "| library | versions checked | defects |")}
    assert summary == {library: version for _, library, version, _, _ in defect_rows()}


def test_every_library_has_a_block():
    assert sorted(doc_blocks()) == sorted(NEEDS)


@pytest.mark.parametrize("label", sorted(doc_blocks()))
@QWIX_WARNS[0]  # qwix 0.1.8 uses APIs flax 0.12 deprecates
@QWIX_WARNS[1]
def test_doc_block_runs(label, capsys):
    if NEEDS[label]:
        import_extra(NEEDS[label])
    namespace = {"__name__": f"doc_{label}"}
    exec(compile(doc_blocks()[label], f"docs/libraries.md[{label}]", "exec"), namespace)
    assert capsys.readouterr().out.strip(), "a block shows its figures"
    FIGURES[label](namespace)


def _flax_figures(ns) -> None:
    # Each history's newest entry is its own operand's amax (the swap the check exists for would trade them).
    amax = ns["amax"]
    (inp,) = [v for k, v in amax.items() if k.endswith("input_amax_history")]
    (ker,) = [v for k, v in amax.items() if k.endswith("kernel_amax_history")]
    assert inp == float(np.max(np.abs(ns["lhs"]))) and ker == float(np.max(np.abs(8 * ns["rhs"])))


def _tracks_figure(ns) -> None:
    assert 0 < ns["rel"] <= 0.05  # quantized (not equal), and close


def _aqt_figures(ns) -> None:
    _tracks_figure(ns)
    assert ns["rows"] == 7  # the other experts' rows: group sizes [5, 7, 0], group 0 scaled


def _reader_figures(ns) -> None:
    # The rule read off the model, and both sites (the codes' matmul and the zero point's) held bitwise to it.
    records = ns["records"]
    assert records.declared_from == ("read from the fn: qwix QtProvider rules on 1 module(s) (module_path='.*': "
                                     "weights int8_qwix, activations int8_qwix_minmax)"), records.declared_from
    assert len(records) == 2 and all(r.lhs_hold.bitwise and r.rhs_hold.bitwise for r in records)


#: What each block's figures must be.
FIGURES = {"flax": _flax_figures, "aqt": _aqt_figures, "qwix": _tracks_figure, "qwix_recipe": _tracks_figure,
           "qwix_reader": _reader_figures}


def _defect_test(name: str):
    found = [(m, getattr(m, name)) for m in DEFECT_MODULES if callable(getattr(m, name, None))]
    return found[0] if found else None


def test_defect_table_rows_name_existing_defect_tests():
    rows = defect_rows()
    assert rows
    for defect, library, version, caught_by, test in rows:
        name = test.strip("`")
        assert _defect_test(name) is not None, f"{name}: no such test in {[m.__name__ for m in DEFECT_MODULES]}"
        assert "should_pass" not in name, f"{name} is a control, not the defect's test"
        assert library and caught_by and re.search(r"\d+\.\d+", version), (defect, library, version, caught_by)


def test_defect_table_lists_the_library_versions_the_tests_pin():
    # The version column and the test's docstring must agree, so neither drifts alone.
    for defect, _, version, _, test in defect_rows():
        module, fn = _defect_test(test.strip("`"))
        doc = fn.__doc__ or module.__doc__
        for v in re.findall(r"\d+\.\d+\.\d+", version):
            assert v in doc, f"{test}: docstring does not mention {v} ({defect})"
