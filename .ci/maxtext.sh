#!/usr/bin/env bash
# MaxText 0.2.5 as a pinned client of qcheck, in its own environment (MaxText wants
# Python 3.12 and a stack of its own; it must not touch the suite's environments).
#
#   .ci/maxtext.sh env VENV          create VENV from nothing, or bring it up to date (idempotent)
#   .ci/maxtext.sh stack VENV        the client's own stack alone, without qcheck (.ci/run builds it in the background)
#   .ci/maxtext.sh deps PYTHON       MaxText's CPU requirements into the environment of PYTHON
#                                    (maxtext must be installed there already; tox uses this)
# Every install is held to .ci/locks/maxtext.txt (bash .ci/lock maxtext writes it; .ci/client_env.sh).
#   .ci/maxtext.sh run PYTHON CMD..  CMD with PYTHON's bin first on PATH and the variables MaxText needs on CPU
#
# MaxText's wheel declares no dependencies: it ships its requirement lists inside
# itself, and the decoupled one (no Google Cloud clients) is what runs on CPU, less
# the CUDA/NVIDIA wheels, which need a GPU driver and only add gigabytes here.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
MAXTEXT_VERSION=0.2.5
. "$repo/.ci/client_env.sh"
use_lock maxtext

site_packages() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

deps() {
  local py=$1 req filtered
  req=$(site_packages "$py")/dependencies/requirements/generated_requirements/decoupled-requirements.txt
  [ -f "$req" ] || { echo ".ci/maxtext.sh: $req missing: is maxtext==$MAXTEXT_VERSION installed for $py?" >&2; exit 1; }
  filtered=$(mktemp)
  grep -Ev '^(cuda-|nvidia-|pynvml|apache-tvm-ffi)' "$req" > "$filtered"
  locked_pip "$py" -r "$filtered"
  rm -f "$filtered"
}

install() {  # the 2 GB of requirements once per lock (build_stack); qcheck itself every time (editable, cheap)
  locked_pip "$1" "maxtext==$MAXTEXT_VERSION"
  deps "$1"
}

env_() {
  build_stack "$1" install
  add_qcheck "$1" test,aqt
}

# One host device, as a MaxText user on a CPU has: MaxText builds its mesh over every device, and qcheck's own
# eight (for its sharded invariant) would run the layer sharded 8 ways. Sharded there on jax 0.12.1, qwix's int8
# activation codes of the attention's out projection match the referee in no single form (10 of 2048 ties apart):
# holding codes per shard is the "Codes held bitwise wherever they come from" issue's, not this stage's.
run() {
  local py=$1; shift
  PATH="$(dirname "$py"):$PATH" JAX_PLATFORMS=cpu DECOUPLE_GCLOUD=TRUE \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=1" \
    MAXTEXT_ASSETS_ROOT="$(site_packages "$py")/maxtext/assets" "$@"
}

case "${1:-}" in
  env) env_ "$2" ;;
  stack) build_stack "$2" install ;;
  deps) deps "$2" ;;
  run) run "${@:2}" ;;
  *) echo "usage: .ci/maxtext.sh env VENV | stack VENV | deps PYTHON | run PYTHON CMD..." >&2; exit 2 ;;
esac
