#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one short script (run from the repo root on a GPU machine after
# `make setup`; ~5 minutes on one H200). CPU-only sessions cannot run these; their results go in the README.
#   1. issue 5: the pipeline bench on a ~1B-parameter Qwen3-shaped target, bf16: tokens/s, busy fractions, MFU
#   2. the FlexAttention training path (model.attention=flex: a BlockMask, compiled) for a few steps
#   3. feature noise on CUDA (its generator must live on the GPU)
#   4. issue 13: data-parallel training with NCCL: DDP and FSDP2 (bf16 mixed precision) on the GPUs there are
#      (2 ranks need 2 GPUs; on 1 GPU a 1-rank world checks the NCCL/FSDP2/DCP path), and the dist bench
#   5. issue 15: parallel.target_devices/drafter_device in one process (non-blocking device copies), and on 2
#      GPUs 1 target rank + 1 drafter rank (parallel.target_ranks=1) over NCCL point-to-point (issue 23: items
#      and credits on separate communicators; on 3 GPUs also 1 target + 2 drafter ranks)
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

echo "== 4. data parallel with NCCL (DDP, FSDP2) + dist bench"
NGPU=$(nvidia-smi --list-gpus | wc -l)
NPROC=$(( NGPU >= 2 ? 2 : 1 ))
for PAR in ddp fsdp; do
  timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node=$NPROC launch.py experiment=smoke \
    parallel=$PAR train.batch_size=4 train.max_steps=20 "hydra.run.dir=$OUT/dp_$PAR" > "$OUT/dp_$PAR.log" 2>&1
  echo "$PAR x $NPROC: exit $?; status: $(tr -d '\n ' < "$OUT/dp_$PAR/status.json" 2>/dev/null)"
done
timeout 300 "$PY" -m dflash.bench dist device=cuda nproc=$NPROC 2>&1 | tee "$OUT/bench_dist.txt" | tail -4

echo "== 5. issue 15: placement in one process, and a disaggregated target rank (NCCL p2p) on 2 GPUs"
timeout 300 "$PY" launch.py experiment=smoke model.device=cuda "parallel.target_devices=[cuda:0]" \
  parallel.drafter_device=cuda:0 train.max_steps=20 "hydra.run.dir=$OUT/placed" > "$OUT/placed.log" 2>&1
echo "placed: exit $?; status: $(tr -d '\n ' < "$OUT/placed/status.json" 2>/dev/null)"
if [ "$NGPU" -ge 2 ]; then
  timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 launch.py experiment=smoke \
    parallel=ddp parallel.target_ranks=1 train.batch_size=4 train.max_steps=20 "hydra.run.dir=$OUT/disagg" \
    > "$OUT/disagg.log" 2>&1
  echo "1 target + 1 drafter rank (nccl): exit $?; status: $(tr -d '\n ' < "$OUT/disagg/status.json" 2>/dev/null)"
  cat "$OUT/disagg/target_rank1.json" 2>/dev/null
  if [ "$NGPU" -ge 3 ]; then  # two links on one target rank: each link's items and credits on their own groups
    timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node=3 launch.py experiment=smoke \
      parallel=ddp parallel.target_ranks=1 train.batch_size=4 train.max_steps=20 "hydra.run.dir=$OUT/disagg3" \
      > "$OUT/disagg3.log" 2>&1
    echo "1 target + 2 drafter ranks (nccl): exit $?; status: $(tr -d '\n ' < "$OUT/disagg3/status.json" 2>/dev/null)"
  fi
else
  echo "disaggregated NCCL run skipped: needs 2 GPUs"
fi
