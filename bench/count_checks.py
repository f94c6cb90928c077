"""Count the invariant x case checks a qcheck tree runs (a benchmark aid, never a test).

    python bench/count_checks.py            # in the tree and venv to count

Counted the same way on any commit: for every case of the case table and every
per-case invariant, one check when the invariant applies to the case, plus one
per dense == sparse comparison of the unquantized layer. Works on the layout
before qcheck.suite existed (qcheck.cases, qcheck.invariants) and after, and before qcheck.layers.
"""

from __future__ import annotations

import importlib
import json


def _module(*names: str):
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"none of {names} is importable here")


def main() -> None:
    cases = _module("qcheck.suite.cases", "qcheck.cases")
    invariants = _module("qcheck.suite.invariants", "qcheck.invariants")
    MODELS = _module("qcheck.layers.moe", "qcheck.moe").MODELS
    from qcheck.recipes import get_recipe

    table = cases.cases()
    per_invariant = {
        inv.name: sum(inv.applies(get_recipe(c.recipe), c.variant) for c in table) for inv in invariants.INVARIANTS
    }
    paths = 2 * len(MODELS)  # dense == sparse, with and without dropping, per model
    print(json.dumps({"cases": len(table), "recipes": len({c.recipe for c in table}),
                      "per_invariant": per_invariant, "paths_agree": paths,
                      "checks": sum(per_invariant.values()) + paths}))


if __name__ == "__main__":
    main()
