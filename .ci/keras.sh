#!/usr/bin/env bash
# Keras 3.15.1 (on its JAX backend) as a pinned client of qcheck, in its own environment (Python 3.12; it
# must not touch the suite's environments or another client's).
#
#   .ci/keras.sh env VENV          create VENV from nothing, or bring it up to date (idempotent)
#   .ci/keras.sh stack VENV        the client's own stack alone, without qcheck (.ci/run builds it in the background)
#   .ci/keras.sh run PYTHON CMD..  CMD with PYTHON's bin first on PATH, on the CPU, with KERAS_BACKEND=jax and
#                                  KERAS_HOME inside the environment
#
# `pip install keras==3.15.1 'jax[cpu]'` on Python 3.12 resolves with no conflicts; the pin keeps what
# tests/test_keras.py was checked on. keras-hub 0.32.0 (tests/test_keras_hub.py: its MoE backbones) requires
# tensorflow-text, a TensorFlow of about 3 GB that its model code never imports: it goes in with --no-deps, then
# the four packages its import needs (measured: regex 2026.12.2, tokenizers 0.23.3, kagglehub 1.0.3,
# sentencepiece 0.2.3). pip's check then names tensorflow-text (and kagglesdk's pin) as unmet: expected.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
KERAS_VERSION=3.15.1
. "$repo/.ci/client_env.sh"

PINS=("keras==$KERAS_VERSION" "jax[cpu]")
KERAS_HUB_VERSION=0.32.0
HUB_IMPORTS=(regex tokenizers kagglehub sentencepiece)

# hub VENV: keras-hub without its dependencies, then what its import needs, once (a stamp names the version).
hub() {
  local venv=$1 stamp="$1/.qcheck-keras-hub-$KERAS_HUB_VERSION"
  [ -f "$stamp" ] && return 0
  "$venv/bin/python" -m pip install -q --no-deps "keras-hub==$KERAS_HUB_VERSION"
  "$venv/bin/python" -m pip install -q "${HUB_IMPORTS[@]}"
  touch "$stamp"
}

# Keras picks its backend when first imported: JAX, whatever ~/.keras/keras.json says. Keras also writes a
# keras.json into KERAS_HOME (default ~/.keras) on its first import: it goes inside the environment instead.
run_() {
  KERAS_BACKEND=jax KERAS_HOME="$(dirname "$(dirname "$1")")/.keras" run "$@"
}

case "${1:-}" in
  env) pinned_env "$2" "${PINS[@]}" && hub "$2" ;;
  stack) pinned_stack "$2" "${PINS[@]}" && hub "$2" ;;
  run) run_ "${@:2}" ;;
  *) echo "usage: .ci/keras.sh env VENV | stack VENV | run PYTHON CMD..." >&2; exit 2 ;;
esac
