#!/usr/bin/env bash
# Call 2 of make real's target on a lent GPU (python -m dflash.offline_gpu.cli; docs/training.md, "The real target on
# a lent GPU"), at once after call 1: the device tool carries outputs/gpu_stage/call2. The target file is rebuilt
# from part 1 (left by call 1) and part 2, each part and the whole checked by sha256 (a missing or changed part stops
# here, named); the staged wheels go on PYTHONPATH; then the target is converted, the staged prompts answered again
# on the GPU, the drafter trained for what the call has left, and the result packed into $OUT (at most 8 files of
# under 16 MiB: result.json, summary.txt, result.tar.gz.NN). BUDGET_S (default 540) is the call's seconds from its
# start to its files; RUN_ARGS go to `python -m dflash.offline_gpu.node_run` (e.g. "--regen-s 120").
set -uo pipefail
cd "$(dirname "$0")/.."
export GPU_REAL_T0=${GPU_REAL_T0:-$(date +%s)}
PY=${PY:-$(command -v python3 || command -v python)}
OUT=${OUT:-gpu_real_out}
WORK=${DFLASH_GPU_WORK:-outputs/gpu_device}
export DFLASH_CACHE_DIR=${DFLASH_CACHE_DIR:-$WORK/cache} WANDB_MODE=disabled PYTHONUNBUFFERED=1
"$PY" -m dflash.offline_gpu.limits assemble --out "$OUT" || exit 2
case "$WORK" in /*) DEPS=$WORK/deps ;; *) DEPS=$PWD/$WORK/deps ;; esac
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC2086  # RUN_ARGS are words
"$PY" -m dflash.offline_gpu.node_run --out "$OUT" --budget-s "${BUDGET_S:-540}" ${RUN_ARGS:-}
