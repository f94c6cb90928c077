# Sourced by the pinned clients' scripts (.ci/maxtext.sh, .ci/levanter.sh, .ci/gemma.sh, .ci/tokamax.sh,
# .ci/keras.sh): each lives in its own Python 3.12 environment, so none of them touches the suite's environments
# or another client's.
PYTHON312=${PYTHON312:-python3.12}

# venv312 VENV: create VENV with Python 3.12 unless it exists.
venv312() {
  local venv=$1
  [ -x "$venv/bin/python" ] && return 0
  # A pyenv shim named python3.12 may exist without that version selected: try it, then pyenv's 3.12.
  if "$PYTHON312" -c '' 2> /dev/null; then "$PYTHON312" -m venv "$venv"
  else PYENV_VERSION=${PYENV_312:-3.12.1} pyenv exec python -m venv "$venv"; fi
}

# run PYTHON CMD...: CMD with that environment's tools first on PATH, on the CPU (a client's script may add more).
run() {
  local py=$1; shift
  PATH="$(dirname "$py"):$PATH" JAX_PLATFORMS=cpu "$@"
}

# pinned_stack VENV NAME==VERSION...: the client's own stack in VENV, once (a stamp names the pins); no qcheck, so it
# can build while qcheck's tree is in use.
pinned_stack() {
  local venv=$1; shift
  local stamp="$venv/.qcheck-stack-$(echo "$*" | tr ' =' '_-')"
  venv312 "$venv"
  if [ ! -f "$stamp" ]; then
    "$venv/bin/python" -m pip install -q "$@"
    touch "$stamp"
  fi
}

# pinned_env VENV NAME==VERSION...: the stack, then qcheck (editable, with [test]); qcheck must not move a pin.
pinned_env() {
  local venv=$1; shift
  pinned_stack "$venv" "$@"
  "$venv/bin/python" -m pip install -q -e "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)[test]"
  "$venv/bin/python" -c 'import importlib.metadata as m, sys
pins = [p.split("==") for p in sys.argv[1:] if "==" in p]
moved = [f"{name} {m.version(name)} (pinned {version})" for name, version in pins if m.version(name) != version]
sys.exit("installing qcheck moved the pins: " + ", ".join(moved) if moved else 0)' "$@"
}
