#!/usr/bin/env bash
# One run on a GPU node whose Python already has JAX with its CUDA (or ROCm)
# plugin, flax, ml-dtypes and the test extra, and no network: install qcheck
# without dependencies, print the machine and versions, run the hardware-marked
# tests demanding the hardware (QCHECK_REQUIRE_HARDWARE, default gpu,fp8_gpu;
# "all" on Blackwell), then the whole suite with the hardware tests in it.
# Logs go to $OUT (or a new temporary folder); the exit status is the worst of
# the two pytest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$(mktemp -d)}
py=${PYTHON:-python3}
require=${QCHECK_REQUIRE_HARDWARE:-gpu,fp8_gpu}

if ! "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1; then
  cat "$out/install.log"
  exit 1
fi
"$py" - <<'EOF' | tee "$out/machine.txt"
import platform
import flax, jax, jaxlib, ml_dtypes, numpy
from qcheck import hardware
print("python", platform.python_version(), "jax", jax.__version__, "jaxlib", jaxlib.__version__,
      "flax", flax.__version__, "ml_dtypes", ml_dtypes.__version__, "numpy", numpy.__version__)
for d in jax.devices():
    print(d.platform, d.device_kind, "compute capability", getattr(d, "compute_capability", "-"))
print("native fp8 GEMM types:", ", ".join(sorted(hardware.fp8_gemm_dtypes())) or "none")
EOF

"$py" -m pytest -p no:cacheprovider -rs -v tests/test_hardware.py --require-hardware="$require" \
  2>&1 | tee "$out/hardware.log"
hardware=${PIPESTATUS[0]}
"$py" -m pytest -p no:cacheprovider -n "${QCHECK_WORKERS:-8}" -q --require-hardware="$require" \
  2>&1 | tee "$out/suite.log"
suite=${PIPESTATUS[0]}
echo "hardware tests: exit $hardware; whole suite: exit $suite; logs in $out"
exit $(( hardware > suite ? hardware : suite ))
