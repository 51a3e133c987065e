#!/usr/bin/env bash
# scripts/gpu_real_check.sh K: step K of make real's target on a GPU node without network access, for every step but
# the last (python -m dflash.offline_gpu.cli stage prints the steps; docs/training.md, "The real target on a GPU node
# without network access"). Run from the checkout on the node, with outputs/gpu_stage/stepK copied there: checks the
# piece of the target file that step brought against its sha256 and leaves it where the last step finds it, and
# reports the node (GPU, torch, transformers, the modules a job would lack) in $OUT/stepK.json. Run the steps in
# order, all on one node: the last needs the pieces the others leave.
set -uo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?usage: scripts/gpu_real_check.sh STEP (the step number the stage printed)}
PY=${PY:-$(command -v python3 || command -v python)}
OUT=${OUT:-gpu_real_out}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
"$PY" -m dflash.offline_gpu.limits check --step "$STEP" --out "$OUT"
