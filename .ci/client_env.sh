# Sourced by the pinned clients' scripts (one per row of .ci/clients.tsv: .ci/maxtext.sh, .ci/easydel.sh, ...,
# and .ci/bare.sh for the [test]-alone stage): each lives in its own environment, on its row's Python, so none of
# them touches the suite's environments or another client's.
#
# Each environment installs from a lock of its whole stack, .ci/locks/NAME.txt (what `bash .ci/lock NAME` froze
# after building it unlocked, the same way): pip's -c on every install, so a release upstream cannot change a stage
# between two landings, and after qcheck goes in, the environment must be the lock exactly.
PYTHON312=${PYTHON312:-python3.12}
CI_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$CI_DIR")

# python_at VERSION: the path of a Python VERSION interpreter (3.12: PYTHON312, default python3.12). A pyenv shim
# named python3.12 may exist without that version selected: try it, then pyenv's newest VERSION (PYENV_312 for 3.12).
python_at() {
  local version=$1 named pinned
  named=python$version; pinned=
  if [ "$version" = 3.12 ]; then named=$PYTHON312; pinned=${PYENV_312:-}; fi
  if "$named" -c '' 2> /dev/null; then "$named" -c 'import sys; print(sys.executable)'; return; fi
  [ -n "$pinned" ] || pinned=$(pyenv versions --bare 2> /dev/null | grep -E "^${version//./\\.}\\.[0-9]+$" | sort -V | tail -n 1)
  [ -n "$pinned" ] || { echo "no Python $version: neither $named nor a pyenv $version.x" >&2; exit 1; }
  PYENV_VERSION=$pinned pyenv exec python -c 'import sys; print(sys.executable)'
}
python312() { python_at 3.12; }

# client_field NAME COLUMN: NAME's cell in COLUMN of .ci/clients.tsv, the clients' one table (empty for bare, which
# is no client: its stage runs the whole suite).
client_field() {
  awk -F '\t' -v name="$1" -v column="$2" '/^#/ || NF == 0 { next }
    !header { for (i = 1; i <= NF; i++) col[$i] = i; header = 1; next }
    $1 == name { print $col[column] }' "$CI_DIR/clients.tsv"
}

# new_venv VENV: create VENV, with the Python of the client's row (LOCK_NAME's; 3.12 where it has none), unless it
# exists.
new_venv() {
  local venv=$1 version
  [ -x "$venv/bin/python" ] && return 0
  version=$(client_field "$LOCK_NAME" python)
  "$(python_at "${version:-3.12}")" -m venv "$venv"
}

# run PYTHON CMD...: CMD with that environment's tools first on PATH, on the CPU (a client's script may add more).
run() {
  local py=$1; shift
  PATH="$(dirname "$py"):$PATH" JAX_PLATFORMS=cpu "$@"
}

# use_lock NAME: the client's lock becomes LOCK, which locked_pip constrains every install to. .ci/lock sets
# QCHECK_CI_UNLOCKED=1 to build the stack as pip resolves it today, the lock it then writes being what it got.
use_lock() {
  LOCK_NAME=$1
  LOCK=
  [ -n "${QCHECK_CI_UNLOCKED:-}" ] || LOCK="$CI_DIR/locks/$1.txt"
}
need_lock() {
  [ -z "$LOCK" ] || [ -f "$LOCK" ] || { echo "$LOCK missing: write it with bash .ci/lock $LOCK_NAME" >&2; exit 1; }
}

# locked_pip PYTHON ARGS...: pip install ARGS into PYTHON's environment, constrained by the lock.
locked_pip() {
  local py=$1; shift
  need_lock
  "$py" -m pip install -q ${LOCK:+-c "$LOCK"} "$@"
}

# lock_id: what the stamp of a stack built from the lock names: the lock's hash, so a changed lock rebuilds.
lock_id() {
  need_lock
  if [ -n "$LOCK" ]; then sha256sum "$LOCK" | cut -c1-16; else echo unlocked; fi
}

# build_stack VENV BUILD: the client's own stack in VENV (BUILD PYTHON installs it), once per lock: no qcheck, so it
# can build while qcheck's tree is in use. A stack these scripts built from another lock is removed first, so
# that nothing the new lock dropped stays behind; a VENV without their stamp is never removed.
build_stack() {
  local venv=$1 build=$2 stamp
  need_lock
  stamp="$venv/.qcheck-stack-$LOCK_NAME-$(lock_id)"
  [ -f "$stamp" ] && return 0
  if compgen -G "$venv/.qcheck-*" > /dev/null; then rm -rf "$venv"; fi
  new_venv "$venv"
  "$build" "$venv/bin/python"
  touch "$stamp"
}

# frozen PYTHON: the environment as pip freeze writes it, less qcheck (installed editable from this tree).
frozen() {
  "$1" -m pip freeze --exclude-editable | grep -Eiv '^qcheck[-_]jax( |=|@|$)' || true
}

# add_qcheck VENV EXTRAS: qcheck, editable with EXTRAS (test, or test,aqt), into the stack; then the environment must
# be the lock exactly: qcheck moved no pin, and no step of the client's script installs what the lock does not name.
add_qcheck() {
  local venv=$1 extras=$2 differences
  locked_pip "$venv/bin/python" -e "$REPO[$extras]"
  [ -n "$LOCK" ] || return 0
  if ! differences=$(diff <(grep -Ev '^(#|$)' "$LOCK") <(frozen "$venv/bin/python")); then
    echo "$venv differs from ${LOCK#"$REPO"/} (< the lock, > the environment):" >&2
    echo "$differences" >&2
    echo "if the script's steps changed on purpose, write the lock again: bash .ci/lock $LOCK_NAME" >&2
    exit 1
  fi
}

# pinned_stack VENV NAME==VERSION...: a stack that is these pins and what they need.
pinned_stack() {
  local venv=$1; shift
  PINNED=("$@")
  build_stack "$venv" install_pinned
}
install_pinned() { locked_pip "$1" "${PINNED[@]}"; }

# pinned_env VENV NAME==VERSION...: the stack, then qcheck (editable, with [test]), held to the lock; qcheck must not
# move a pin (checked unlocked too, so that .ci/lock never writes a lock whose pins qcheck moved).
pinned_env() {
  pinned_stack "$@"
  add_qcheck "$1" test
  "$1/bin/python" -c 'import importlib.metadata as m, sys
pins = [p.split("==") for p in sys.argv[1:] if "==" in p]
moved = [f"{name} {m.version(name)} (pinned {version})" for name, version in pins if m.version(name) != version]
sys.exit("installing qcheck moved the pins: " + ", ".join(moved) if moved else 0)' "${@:2}"
}
