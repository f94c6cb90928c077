#!/usr/bin/env bash
# tokamax 0.0.17 (with qwix 0.1.8) as a pinned client of qcheck, in its own environment (Python 3.12; it
# must not touch the suite's environments or another client's).
#
#   .ci/tokamax.sh env VENV          create VENV from nothing, or bring it up to date (idempotent)
#   .ci/tokamax.sh stack VENV        the client's own stack alone, without qcheck (.ci/run builds it in the background)
#   .ci/tokamax.sh run PYTHON CMD..  CMD with PYTHON's bin first on PATH, on the CPU
#
# `pip install tokamax==0.0.17 qwix==0.1.8` on Python 3.12 resolves in about 40 s (jax 0.12.0.1, flax),
# with no conflicts; the pins keep what tests/test_tokamax.py was checked on, and .ci/locks/tokamax.txt (bash .ci/lock
# tokamax writes it) the rest of the stack: every install is held to it (.ci/client_env.sh).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
TOKAMAX_VERSION=0.0.17
QWIX_VERSION=0.1.8
. "$repo/.ci/client_env.sh"
use_lock tokamax

PINS=("tokamax==$TOKAMAX_VERSION" "qwix==$QWIX_VERSION")
case "${1:-}" in
  env) pinned_env "$2" "${PINS[@]}" ;;
  stack) pinned_stack "$2" "${PINS[@]}" ;;
  run) run "${@:2}" ;;
  *) echo "usage: .ci/tokamax.sh env VENV | stack VENV | run PYTHON CMD..." >&2; exit 2 ;;
esac
