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
# sentencepiece 0.2.3). pip's check then names tensorflow-text (and kagglesdk's pin) as unmet: expected. Every install
# is held to .ci/locks/keras.txt (bash .ci/lock keras writes it; .ci/client_env.sh).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
KERAS_VERSION=3.15.1
. "$repo/.ci/client_env.sh"
use_lock keras

PINS=("keras==$KERAS_VERSION" "jax[cpu]")
KERAS_HUB_VERSION=0.32.0
HUB_IMPORTS=(regex tokenizers kagglehub sentencepiece)

# install PYTHON: Keras and JAX; then keras-hub without its dependencies, and what its import needs.
install() {
  locked_pip "$1" "${PINS[@]}"
  locked_pip "$1" --no-deps "keras-hub==$KERAS_HUB_VERSION"
  locked_pip "$1" "${HUB_IMPORTS[@]}"
}

# Keras picks its backend when first imported: JAX, whatever ~/.keras/keras.json says. Keras also writes a
# keras.json into KERAS_HOME (default ~/.keras) on its first import: it goes inside the environment instead.
run_() {
  KERAS_BACKEND=jax KERAS_HOME="$(dirname "$(dirname "$1")")/.keras" run "$@"
}

case "${1:-}" in
  env) build_stack "$2" install && add_qcheck "$2" test ;;
  stack) build_stack "$2" install ;;
  run) run_ "${@:2}" ;;
  *) echo "usage: .ci/keras.sh env VENV | stack VENV | run PYTHON CMD..." >&2; exit 2 ;;
esac
