#!/usr/bin/env bash
# Call 1 of make real's target on a lent GPU (python -m dflash.offline_gpu.cli; docs/training.md, "The real target on
# a lent GPU"): the device tool carries outputs/gpu_stage/call1 (part 1 of the target file, too large for one call
# with the rest), this checks it against its sha256 and leaves it where call 2 finds it, and reports the machine
# (GPU, torch, transformers, the modules a job would lack). Call 2 (scripts/gpu_real_call2.sh) must follow at once:
# a machine idle for ~30 s is given back, and part 1 with it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$(command -v python3 || command -v python)}
OUT=${OUT:-gpu_real_out}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
"$PY" -m dflash.offline_gpu.limits check --out "$OUT"
