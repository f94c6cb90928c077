#!/usr/bin/env bash
# EasyDeL 0.3.0 as a pinned client of qcheck, in its own environment (Python 3.12; it must not touch the suite's
# environments or another client's), installed as its users install it: `pip install easydel==0.3.0`, which
# resolves its own pins, jax 0.9.2 (ejkernel 0.0.78 pins jax~=0.9.0) and flax 0.12.3 (easydel pins it). qcheck's
# window starts there (pyproject.toml), so installing qcheck moves neither.
#
#   .ci/easydel.sh env VENV          create VENV from nothing, or bring it up to date (idempotent)
#   .ci/easydel.sh stack VENV        the client's own stack alone, without qcheck (.ci/run builds it in the background)
#   .ci/easydel.sh run PYTHON CMD..  CMD with PYTHON's bin first on PATH, on the CPU
#
# One package more than easydel declares: pillow. `import easydel.modules` (every model) imports
# easydel.inference.esurge.multimodal.manager, which imports PIL at module level, and easydel 0.3.0 does not
# require pillow (measured: ModuleNotFoundError: No module named 'PIL'). Not needed on jax 0.9.2: EASYDEL_AUTO=0
# (its import appends GPU-only flags to XLA_FLAGS, which jaxlib 0.10.2 aborts on and 0.9.2 accepts on the CPU).
# The transformers modules easydel reads a torch-only class of outside a `try` are stubbed by tests/test_easydel.py
# (no torch here: easydel does not require it). Every install is held to .ci/locks/easydel.txt (bash .ci/lock
# easydel writes it; .ci/client_env.sh).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
EASYDEL_VERSION=0.3.0
. "$repo/.ci/client_env.sh"
use_lock easydel

PINS=("easydel==$EASYDEL_VERSION")
install() {
  locked_pip "$1" "${PINS[@]}"
  locked_pip "$1" pillow
}

env_() {
  build_stack "$1" install
  add_qcheck "$1" test
  # qcheck must not move EasyDeL's jax or flax (its window starts at them).
  "$1/bin/python" -c 'import importlib.metadata as m, sys
have = {d: m.version(d) for d in ("easydel", "jax", "flax")}
sys.exit(0 if have == {"easydel": sys.argv[1], "jax": "0.9.2", "flax": "0.12.3"} else
         f".ci/easydel.sh: {have} in the EasyDeL environment; easydel {sys.argv[1]} resolves jax 0.9.2, flax 0.12.3")' \
    "$EASYDEL_VERSION"
}

# One host device, as an EasyDeL user on a CPU has: EasyDeL builds its expert mesh over every device, and qcheck's
# own eight (for its sharded invariant) would shard 4 experts 8 ways, which its shard_map refuses.
run_() {
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=1" run "$@"
}

case "${1:-}" in
  env) env_ "$2" ;;
  stack) build_stack "$2" install ;;
  run) run_ "${@:2}" ;;
  *) echo "usage: .ci/easydel.sh env VENV | stack VENV | run PYTHON CMD..." >&2; exit 2 ;;
esac
