#!/usr/bin/env bash
# qcheck with only its [test] extra, on Python 3.12 and jax 0.11.2 (tox's jax011 env, what Levanter's jax<0.12
# resolves): the stage of .ci/run where every test needing an optional extra (aqt, qwix) or a client skips naming
# it, and none fails. Its own environment, like the pinned clients', held to .ci/locks/bare.txt (bash .ci/lock bare
# writes it; .ci/client_env.sh).
#
#   .ci/bare.sh env VENV          create VENV from nothing, or bring it up to date (idempotent)
#   .ci/bare.sh stack VENV        qcheck's requirements alone, without qcheck (.ci/run builds it in the background)
#   .ci/bare.sh run PYTHON CMD..  CMD with PYTHON's bin first on PATH
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
JAX_VERSION=0.11.2
. "$repo/.ci/client_env.sh"
use_lock bare

# install PYTHON: qcheck's requirements and its [test] extra's, read from pyproject.toml, on jax 0.11.2.
install() {
  local requirements
  requirements=$(mktemp)
  "$1" -c "import sys, tomllib; p = tomllib.load(open(sys.argv[1], 'rb'))['project']
print('\n'.join(p['dependencies'] + p['optional-dependencies']['test']))" "$repo/pyproject.toml" > "$requirements"
  locked_pip "$1" -r "$requirements" "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"
  rm -f "$requirements"
}

env_() {
  build_stack "$1" install
  add_qcheck "$1" test
  # No extra may be present, or the stage proves nothing.
  "$1/bin/python" -c "import importlib.util as u, sys; found = [m for m in ('aqt', 'qwix') if u.find_spec(m)]
sys.exit(f'.ci/bare.sh: [test] alone installed the extras {found}' if found else 0)"
}

# Unlike the clients' run, JAX picks its platform: the stage runs the suite as a user of [test] alone would.
run_() {
  local py=$1; shift
  PATH="$(dirname "$py"):$PATH" "$@"
}

case "${1:-}" in
  env) env_ "$2" ;;
  stack) build_stack "$2" install ;;
  run) run_ "${@:2}" ;;
  *) echo "usage: .ci/bare.sh env VENV | stack VENV | run PYTHON CMD..." >&2; exit 2 ;;
esac
