#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one short script (run from the repo root on a GPU machine after
# `make setup`; ~5 minutes on one H200). CPU-only sessions cannot run these; their results go in the README.
#   1. issue 5: the pipeline bench on a ~1B-parameter Qwen3-shaped target, bf16: tokens/s, busy fractions, MFU
#   2. the FlexAttention training path (model.attention=flex: a BlockMask, compiled) for a few steps
#   3. feature noise on CUDA (its generator must live on the GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-gpu_checks_out}
mkdir -p "$OUT"
export WANDB_MODE=disabled DFLASH_CACHE_DIR="$OUT/cache"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"

echo "== 1. pipeline bench, 1B target, bf16"
timeout 300 "$PY" -m dflash.bench pipeline size=1b device=cuda dtype=bfloat16 2>&1 | tee "$OUT/bench_1b.txt" | tail -14

echo "== 2. flex attention training + 3. feature noise on CUDA"
timeout 300 "$PY" launch.py experiment=smoke model.device=cuda model.attention=flex schedule.noise_start=0.1 \
  schedule.noise_end=0.01 train.max_steps=20 "hydra.run.dir=$OUT/flex_noise" > "$OUT/flex_noise.log" 2>&1
echo "exit $?; status: $(cat "$OUT/flex_noise/status.json" 2>/dev/null | tr -d '\n ')"
tail -5 "$OUT/flex_noise.log"
