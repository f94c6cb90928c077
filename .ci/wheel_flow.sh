#!/usr/bin/env bash
# qcheck where its users are: built as a wheel, installed into a fresh environment, run from directories that
# hold none of qcheck's files. The main job from an empty directory; then a user's project from nothing: a recipe
# module, `qcheck golden add`, the matrix for it, the invariant suite through the pytest plugin, and a recipe with
# a deliberate bug whose run must fail naming its case and the check.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
py=${PYTHON:-python3}

step() { echo; echo "+ [wheel] $*"; }

step "build the wheel"
"$py" -m pip wheel -q --no-deps -w "$work/dist" "$repo"
wheel=$(ls "$work"/dist/qcheck_jax-*.whl)
step "install it into a fresh environment: $(basename "$wheel")"
"$py" -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
pip install -q "${wheel}[test]"

step "qcheck from an empty directory: every built-in recipe passes against the goldens it ships"
mkdir "$work/empty" && cd "$work/empty"
qcheck
test -z "$(ls -A "$work/empty")" || { echo "qcheck wrote into the directory it ran in:"; ls -A; exit 1; }

step "a user's project: a recipe module, its golden cases, the matrix, the suite"
mkdir "$work/project" && cd "$work/project"
cat > my_recipes.py <<'PY'
import qcheck

qcheck.register_recipe(qcheck.Recipe("my_e5m2", lhs="e5m2_current", rhs="e5m2_current"))
PY
qcheck golden add my_e5m2 --recipes my_recipes.py
test "$(ls golden/my_e5m2 | wc -l)" = 5  # mixtral and gemma, dense and sparse, and mixtral dense with token dropping
qcheck --recipes my_recipes.py
pytest -n auto -p no:cacheprovider --qcheck-recipes=my_recipes.py | tee "$work/suite.log"
grep -q "test_golden_case\[my_e5m2-mixtral-dense\]\|passed" "$work/suite.log"
if grep -q "fp8-mixtral" "$work/suite.log"; then echo "the suite ran built-in recipes it was not asked for"; exit 1; fi

step "a recipe with a deliberate bug (its sites never quantize) fails, naming its case and the check"
cat > buggy_recipes.py <<'PY'
import qcheck
from qcheck.recipes import NoQuant


class SilentFallback(qcheck.Recipe):
    """Declares e4m3 operands, but its sites multiply in full precision: the silent fallback."""

    def site_module(self, name):
        return NoQuant().site_module(name)


qcheck.register_recipe(SilentFallback("silent_fp8", lhs="e4m3fn_current", rhs="e4m3fn_current"))
PY
qcheck golden add silent_fp8 --recipes buggy_recipes.py
set +e
# The one case whose failure is asserted below: the other four add minutes, not evidence.
pytest -n auto -p no:cacheprovider -rf --qcheck-recipes=buggy_recipes.py -k "silent_fp8-mixtral-dense]" \
  > "$work/buggy.log" 2>&1
status=$?
set -e
expect() {  # the buggy run's log must hold this line; its pytest summary stays out of CI's closing lines
  grep -q "$1" "$work/buggy.log" || { tail -n 40 "$work/buggy.log"; echo "expected in the buggy run: $1"; exit 1; }
}
test "$status" = 1 || { tail -n 40 "$work/buggy.log"; echo "expected the buggy suite to fail (exit 1), got $status"; exit 1; }
expect "FAILED .*test_layer_tracks_unquantized_twin\[silent_fp8-mixtral-dense\]"
expect "silent_fp8-mixtral-dense: assert_tracks: actual is bitwise equal to the unquantized reference"
grep "^FAILED" "$work/buggy.log"
set +e
qcheck --recipes buggy_recipes.py --model mixtral --path dense > "$work/buggy-matrix.log" 2>&1
status=$?
set -e
test "$status" = 1 || { echo "expected the buggy recipe's matrix to fail (exit 1), got $status"; exit 1; }
grep -q "silent_fp8-mixtral-dense tracks:" "$work/buggy-matrix.log"
echo
echo "wheel flow: passed"
