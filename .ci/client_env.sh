# Sourced by the pinned clients' scripts (.ci/maxtext.sh, .ci/levanter.sh, .ci/gemma.sh, .ci/tokamax.sh): each lives in
# its own Python 3.12 environment, so none of them touches the suite's environments or another client's.
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
