#!/usr/bin/env bash
# Levanter (marin-levanter, with haliax) as a pinned client of qcheck, in its own environment
# (Levanter pins jax<0.12 and a stack of its own; it must not touch the suite's environments).
#
#   .ci/levanter.sh env VENV          create VENV from nothing, or bring it up to date (idempotent)
#   .ci/levanter.sh stack VENV        the client's own stack alone, without qcheck (.ci/run builds it in the background)
#   .ci/levanter.sh run PYTHON CMD..  CMD with PYTHON's bin first on PATH and the variables Levanter needs on CPU
#
# `pip install marin-levanter` on Python 3.12 resolves in about 4 minutes (jax 0.11.2, flax 0.12.12,
# aqtp 0.9.0); the pins below keep what tests/test_levanter.py was checked on, and .ci/locks/levanter.txt (bash
# .ci/lock levanter writes it) the rest of the stack: every install is held to it (.ci/client_env.sh).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
LEVANTER_VERSION=0.2.227.dev40316220070
HALIAX_VERSION=0.2.227.dev40316220070
. "$repo/.ci/client_env.sh"
use_lock levanter

install() {  # Levanter's stack once per lock (build_stack); qcheck itself every time (editable, cheap)
  locked_pip "$1" "marin-levanter==$LEVANTER_VERSION" "marin-haliax==$HALIAX_VERSION"
}

env_() {
  local venv=$1
  build_stack "$venv" install
  add_qcheck "$venv" test
  # qcheck must not move Levanter's jax (it supports jax 0.11.2).
  "$venv/bin/python" -c 'import jax, sys; sys.exit(0 if jax.__version__.startswith("0.11.") else
    f".ci/levanter.sh: jax {jax.__version__} in the Levanter environment; Levanter {sys.argv[1]} pins jax<0.12")' \
    "$LEVANTER_VERSION"
}

case "${1:-}" in
  env) env_ "$2" ;;
  stack) build_stack "$2" install ;;
  run) run "${@:2}" ;;
  *) echo "usage: .ci/levanter.sh env VENV | stack VENV | run PYTHON CMD..." >&2; exit 2 ;;
esac
