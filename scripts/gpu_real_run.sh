#!/usr/bin/env bash
# scripts/gpu_real_run.sh N: the last step of make real's target on a GPU node without network access (python -m
# dflash.offline_gpu.cli stage prints the steps; docs/training.md, "The real target on a GPU node without network
# access"), on the node that ran the steps before it, with outputs/gpu_stage/stepN copied there. The target file is
# rebuilt from every piece (each and the whole checked by sha256; a missing or changed piece stops here, named); the
# staged wheels go on PYTHONPATH; then the target is converted, the staged prompts answered again on the GPU, the
# drafter trained for what the wall-clock budget has left, and the result packed into $OUT in files that may come back
# (the stage's --return-files and --return-file-mib: by default at most 8 files of 16 MiB: result.json, summary.txt,
# result.tar.gz.NN). BUDGET_S replaces the stage's --budget-s (540 by default: the step's seconds from its start to
# its files); RUN_ARGS go to `python -m dflash.offline_gpu.node_run` (e.g. "--regen-s 120").
set -uo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?usage: scripts/gpu_real_run.sh STEP (the number of the last step, as the stage printed it)}
export GPU_REAL_T0=${GPU_REAL_T0:-$(date +%s)}
PY=${PY:-$(command -v python3 || command -v python)}
OUT=${OUT:-gpu_real_out}
WORK=${DFLASH_GPU_WORK:-outputs/gpu_node}
export DFLASH_CACHE_DIR=${DFLASH_CACHE_DIR:-$WORK/cache} WANDB_MODE=disabled PYTHONUNBUFFERED=1
"$PY" -m dflash.offline_gpu.limits assemble --step "$STEP" --out "$OUT" || exit 2
case "$WORK" in /*) DEPS=$WORK/deps ;; *) DEPS=$PWD/$WORK/deps ;; esac
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC2086  # RUN_ARGS are words
"$PY" -m dflash.offline_gpu.node_run --out "$OUT" ${BUDGET_S:+--budget-s "$BUDGET_S"} ${RUN_ARGS:-}
