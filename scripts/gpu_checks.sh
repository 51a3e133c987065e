#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one script (run from the repo root after `make setup`, or with PY=python3
# where a CUDA torch and the project's dependencies are installed): the one script to run when a GPU is at hand.
# Their results go in docs/results.md. Each check has its own timeout; a line per check goes to $OUT/summary.txt.
# Checks 1-5 took 8.5 minutes on one H200: 30-40 s a job, of which ~17-19 s passed before its first log line
# (Python's start and imports there) and 7-15 s training. On one H100: checks 6, 7 and 8 took 3 minutes, checks 1
# and 3 2.5 minutes. CHECKS="6" (or any subset) runs only those checks.
#   0. issue 47: make real's target on a GPU node without network access (python -m dflash.offline_gpu.cli), dry-run
#      on the tiny random target with the run step on the GPU: stage, the check step, a changed piece refused, the run
#      step (seconds of training), the evaluation. The real steps are scripts/gpu_real_check.sh 1, then
#      scripts/gpu_real_run.sh 2 on the same node, staged here first (docs/training.md)
#   1. the smoke job on CUDA, async and sync pipelines (train, checkpoints, eval tau, export)
#   2. the FlexAttention training path (model.attention=flex: a BlockMask, compiled) with feature noise on CUDA
#      (its generator must live on the GPU)
#   3. issue 13: data-parallel training with NCCL: DDP and FSDP2 (bf16 mixed precision) on the GPUs there are
#      (2 ranks need 2 GPUs; on 1 GPU a 1-rank world checks the NCCL/FSDP2/DCP path), an FSDP2 resume from
#      its sharded (DCP) checkpoint, and the dist bench
#   4. issue 15: parallel.target_devices/drafter_device in one process (non-blocking device copies), and on 2
#      GPUs 1 target rank + 1 drafter rank (parallel.target_ranks=1) over NCCL point-to-point (issue 23: items
#      and credits on separate communicators; on 3 GPUs also 1 target + 2 drafter ranks)
#   5. issue 25: a feature store built on CUDA (bf16 and fp8), and training from it with the async pipeline
#   6. issue 5: the pipeline bench on a ~1B-parameter Qwen3-shaped target, bf16: tokens/s, busy fractions, MFU
#   7. issue 39: model.sliding_window on CUDA (FlexAttention) at SmolLM2-135M's drafter widths, 8k tokens: step
#      time and peak memory of full attention against windows of 2048 and 512 (on a CPU the window costs memory)
#   8. model.dtype=bfloat16 training on CUDA: the smoke job, and Qwen3-8B's widths (model=qwen3_8b_random: hidden
#      4096, the 151,936-row vocabulary, random weights, one layer each) at 2,048 tokens
#   9. issue 55: hybrid targets on CUDA: the smoke job on the tiny Qwen3.6-shaped vision-language checkpoint,
#      Qwen3-Next and GPT-OSS (the log says which linear-attention path runs: the kernels where `.[hybrid]` is
#      installed, else the reference path), and the verify cycle's rollback per architecture (bench rollback)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-gpu_checks_out}
mkdir -p "$OUT"
export WANDB_MODE=disabled DFLASH_CACHE_DIR="$OUT/cache" PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
CHECKS=${CHECKS:-0 1 2 3 4 5 6 7 8 9}  # e.g. CHECKS="6" runs the 1B bench alone (when the GPU's time is short)
wants() { [[ " $CHECKS " == *" $1 "* ]]; }
: > "$SUMMARY"

# run NAME SECONDS CMD...: the command's output to $OUT/NAME.log, and a summary line: its exit code, and where
# it trained a run directory ($RUN_DIR, default $OUT/NAME), the run's status, last step, tau and world
run() {
  local name=$1 secs=$2
  shift 2
  local dir=${RUN_DIR:-$OUT/$name} t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local run_line=""
  if [ -f "$dir/status.json" ]; then
    run_line=$("$PY" - "$dir" <<'PYEOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
status = json.loads((d / "status.json").read_text())
summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
world = json.loads((d / "run.json").read_text()).get("world", {}) if (d / "run.json").exists() else {}
print(f"status {status['status']}, step {summary.get('step')}, eval/tau {summary.get('eval/tau')}, "
      f"world {world.get('mode')} x {world.get('size')} {world.get('backend')} {world.get('device')}"
      + (f", error {status['error']}" if status.get("error") else ""))
PYEOF
)
  fi
  echo "$name: exit $rc in $((SECONDS - t0)) s; ${run_line:-no run directory}" | tee -a "$SUMMARY"
  [ "$rc" -eq 0 ] || tail -15 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, torch.cuda.get_device_name(0))' | tee -a "$OUT/gpu.txt"
NGPU=$(nvidia-smi --list-gpus | wc -l)
NPROC=$(( NGPU >= 2 ? 2 : 1 ))
SMOKE=(launch.py experiment=smoke model.device=cuda train.max_steps=20)

if wants 0; then
  echo "== 0. make real's target on a GPU node without network: the dry run, its run step on the GPU"
  run gpu_real_dry 300 "$PY" -m dflash.offline_gpu.cli dry-run --device cuda --root "$OUT/gpu_real_dry"
  tail -12 "$OUT/gpu_real_dry.log"
fi

if wants 1; then
  echo "== 1. the smoke job on CUDA, async and sync"
  run smoke_async 240 "$PY" "${SMOKE[@]}" "hydra.run.dir=$OUT/smoke_async"
  run smoke_sync 240 "$PY" "${SMOKE[@]}" pipeline=sync "hydra.run.dir=$OUT/smoke_sync"
fi

if wants 2; then
  echo "== 2. flex attention training + feature noise on CUDA"
  run flex_noise 300 "$PY" "${SMOKE[@]}" model.attention=flex schedule.noise_start=0.1 schedule.noise_end=0.01 \
    "hydra.run.dir=$OUT/flex_noise"
fi

if wants 3; then
  echo "== 3. data parallel with NCCL (DDP, FSDP2), an FSDP2 resume from DCP, the dist bench"
  TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node=$NPROC)
  for PAR in ddp fsdp; do
    run "dp_$PAR" 300 "${TORCHRUN[@]}" launch.py experiment=smoke parallel=$PAR train.batch_size=4 \
      train.max_steps=20 checkpoint.every_steps=10 "hydra.run.dir=$OUT/dp_$PAR"
  done
  RUN_DIR=$OUT/dp_fsdp run dp_fsdp_resume 300 "${TORCHRUN[@]}" launch.py "resume=$OUT/dp_fsdp" train.max_steps=30
  run bench_dist 300 "$PY" -m dflash.bench dist device=cuda nproc=$NPROC
  tail -4 "$OUT/bench_dist.log"
fi

if wants 4; then
  echo "== 4. issue 15: placement in one process, and a disaggregated target rank (NCCL p2p) on 2 GPUs"
  run placed 240 "$PY" "${SMOKE[@]}" "parallel.target_devices=[cuda:0]" parallel.drafter_device=cuda:0 \
    "hydra.run.dir=$OUT/placed"
  if [ "$NGPU" -ge 2 ]; then
    run disagg 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 launch.py experiment=smoke \
      parallel=ddp parallel.target_ranks=1 train.batch_size=4 train.max_steps=20 "hydra.run.dir=$OUT/disagg"
    cat "$OUT/disagg/target_rank1.json" 2>/dev/null
    if [ "$NGPU" -ge 3 ]; then  # two links on one target rank: each link's items and credits on their own groups
      run disagg3 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node=3 launch.py experiment=smoke \
        parallel=ddp parallel.target_ranks=1 train.batch_size=4 train.max_steps=20 "hydra.run.dir=$OUT/disagg3"
    fi
  else
    echo "disaggregated NCCL runs skipped: they need 2 GPUs" | tee -a "$SUMMARY"
  fi
fi

if wants 5; then
  echo "== 5. issue 25: a feature store built on CUDA (bf16, fp8) and training from it"
  for DT in bfloat16 fp8; do
    STORE=(experiment=smoke model.device=cuda train.max_steps=20 features.dtype=$DT "features.path=$OUT/store_$DT")
    run "store_build_$DT" 240 "$PY" -m dflash.features build "${STORE[@]}"
    run "store_train_$DT" 240 "$PY" launch.py "${STORE[@]}" features=store "hydra.run.dir=$OUT/store_train_$DT"
  done
fi

if wants 6; then
  echo "== 6. pipeline bench, 1B target, bf16"
  run bench_1b 300 "$PY" -m dflash.bench pipeline size=1b device=cuda dtype=bfloat16
  tail -14 "$OUT/bench_1b.log"
fi

if wants 7; then
  echo "== 7. issue 39: sliding-window draft attention on CUDA, SmolLM2-135M's drafter widths, 8k tokens"
  run bench_window 240 "$PY" -m dflash.bench step device=cuda dtype=bfloat16 hidden=576 vocab=49152 heads=9 \
    kv_heads=3 head_dim=64 intermediate=1536 layers=2 features=3 block_size=8 teachers=argmax repeats=3 \
    seq_len=8192 anchors=512 windows=none,2048,512
  tail -6 "$OUT/bench_window.log"
fi

if wants 8; then
  echo "== 8. model.dtype=bfloat16 training on CUDA: the smoke job, and Qwen3-8B's widths"
  run bf16_smoke 240 "$PY" "${SMOKE[@]}" model.dtype=bfloat16 "hydra.run.dir=$OUT/bf16_smoke"
  run bf16_qwen3_8b 300 "$PY" launch.py experiment=qwen3_8b_cpu model.device=cuda model.dtype=bfloat16 \
    train.max_steps=30 train.seq_len=2048 train.num_anchors=256 data.max_files=200 checkpoint.every_steps=30 \
    "hydra.run.dir=$OUT/bf16_qwen3_8b"
  grep -h -o '"train/loss":[0-9.e+-]*' "$OUT/bf16_qwen3_8b/metrics.jsonl" 2>/dev/null | sed -n '1p;$p'
fi

if wants 9; then
  echo "== 9. issue 55: hybrid targets on CUDA (linear attention, sliding layers, sinks) and their rollback"
  for ARCH in qwen3_5_vl qwen3_next gpt_oss; do
    run "hybrid_$ARCH" 240 "$PY" launch.py experiment=smoke model.device=cuda model.build.architecture=$ARCH \
      "hydra.run.dir=$OUT/hybrid_$ARCH"
    grep -h "linear-attention layers run\|attention, features" "$OUT/hybrid_$ARCH.log" | head -2
  done
  run bench_rollback 240 "$PY" -m dflash.bench rollback device=cuda hidden=1024 heads=8 kv_heads=4 head_dim=128 \
    intermediate=2816 ctx=2048 block=16 repeats=20
  tail -9 "$OUT/bench_rollback.log"
fi

echo "== summary"
cat "$SUMMARY"
