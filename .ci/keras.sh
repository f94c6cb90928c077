#!/usr/bin/env bash
# Keras 3.15.1 (on its JAX backend) as a pinned client of qcheck, in its own environment (Python 3.12; it
# must not touch the suite's environments or another client's).
#
#   .ci/keras.sh env VENV          create VENV from nothing, or bring it up to date (idempotent)
#   .ci/keras.sh stack VENV        the client's own stack alone, without qcheck (.ci/run builds it in the background)
#   .ci/keras.sh run PYTHON CMD..  CMD with PYTHON's bin first on PATH, on the CPU, with KERAS_BACKEND=jax and
#                                  KERAS_HOME inside the environment
#
# `pip install keras==3.15.1 'jax[cpu]'` on Python 3.12 resolves with no conflicts (keras-hub is not needed:
# tests/test_keras.py quantizes keras.layers.Dense itself); the pin keeps what tests/test_keras.py was checked on.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
KERAS_VERSION=3.15.1
. "$repo/.ci/client_env.sh"

PINS=("keras==$KERAS_VERSION" "jax[cpu]")

# Keras picks its backend when first imported: JAX, whatever ~/.keras/keras.json says. Keras also writes a
# keras.json into KERAS_HOME (default ~/.keras) on its first import: it goes inside the environment instead.
run_() {
  KERAS_BACKEND=jax KERAS_HOME="$(dirname "$(dirname "$1")")/.keras" run "$@"
}

case "${1:-}" in
  env) pinned_env "$2" "${PINS[@]}" ;;
  stack) pinned_stack "$2" "${PINS[@]}" ;;
  run) run_ "${@:2}" ;;
  *) echo "usage: .ci/keras.sh env VENV | stack VENV | run PYTHON CMD..." >&2; exit 2 ;;
esac
