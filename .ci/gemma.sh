#!/usr/bin/env bash
# gemma 4.0.1 as a pinned client of qcheck, in its own environment (Python 3.12; it must not touch the
# suite's environments).
#
#   .ci/gemma.sh env VENV          create VENV from nothing, or bring it up to date (idempotent)
#   .ci/gemma.sh stack VENV        the client's own stack alone, without qcheck (.ci/run builds it in the background)
#   .ci/gemma.sh deps PYTHON       gemma and what it needs into the environment of PYTHON (tox uses this)
#   .ci/gemma.sh run PYTHON CMD..  CMD with PYTHON's bin first on PATH, on the CPU
#
# `pip install gemma` does not resolve (its resolver backtracks through kauldron -> xmanager ->
# google-cloud-aiplatform for hours). gemma and kauldron go in without their dependencies, then the few
# that `from gemma import gm, peft` and Gemma 4's modules import: about 30 s. kauldron's unmet
# requirements (tensorflow, xmanager, clu, ...) are left out; pip lists them as conflicts. Every install is held to
# .ci/locks/gemma.txt (bash .ci/lock gemma writes it; .ci/client_env.sh), jax 0.12.0.1 among it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
GEMMA_VERSION=4.0.1
KAULDRON_VERSION=1.4.4
. "$repo/.ci/client_env.sh"
use_lock gemma

deps() {
  local py=$1
  locked_pip "$py" jax==0.12.0.1 jaxlib==0.12.0.1 flax==0.12.12 numpy ml-dtypes
  locked_pip "$py" --no-deps "gemma==$GEMMA_VERSION" "kauldron==$KAULDRON_VERSION"
  locked_pip "$py" --no-deps einops lark ml_collections immutabledict typeguard jaxtyping wadler_lindig
  locked_pip "$py" "etils[edc,enp,epath,epy,etree,etqdm]" tqdm
}

env_() {  # gemma's stack once per lock (build_stack); qcheck itself every time (editable, cheap)
  build_stack "$1" deps
  add_qcheck "$1" test
}

case "${1:-}" in
  env) env_ "$2" ;;
  stack) build_stack "$2" deps ;;
  deps) deps "$2" ;;
  run) run "${@:2}" ;;
  *) echo "usage: .ci/gemma.sh env VENV | stack VENV | deps PYTHON | run PYTHON CMD..." >&2; exit 2 ;;
esac
