"""`python -m dflash.bench NAME [key=value ...]`: benchmarks that print ratios measured side by side in one run.

Benchmarks are not tests: they print numbers for a person to read. Add one as a module here with a
`bench(args)` function and list it in `BENCHES`.

loss: the fused chunked loss (`dflash_loss`) against full-logits autograd (`dflash_loss_naive`) at
      Qwen3-8B shapes (hidden 4096, vocab 151936), kl_streak, forward + backward. Each variant runs in a
      fresh subprocess; its peak memory is the rise of the process's resident high-water mark
      (getrusage ru_maxrss) over the mark taken once the inputs exist, so it counts what the loss itself
      allocates (logits, softmaxes, gradients), on CPU or, for cuda, torch.cuda.max_memory_allocated.
      Options: blocks=70 block_size=16 hidden=4096 vocab=151936 dtype=float32 chunk_size=256 repeats=2
      device=cpu.
step: one drafter training step (blocks, forward, fused loss, backward) at a long sequence, full attention
      against model.sliding_window sizes and what the loss gets of the target (teachers=none,logits,online,argmax:
      the target's argmax from its logits, computed per distinct position, or a store's) and train.anchor_budget
      over rows of mixed lengths (budgets=none,K lengths=4096,512,...), each in a fresh subprocess: step time and
      peak memory side by side. Options: seq_len=4096 windows=none,512 anchors=64
      block_size=16 ...; see dflash/benchmarks/step.py.
soak: a long run of the real job (async pipeline, evals, checkpoints, W&B offline) watching its RSS;
      see dflash/benchmarks/soak.py.
dist: 1 against 2 data-parallel processes with the same work per process; see dflash/benchmarks/dist.py.
data: data=jsonl preprocessing of a synthetic chat file (first run, second run from the cache, peak RSS) at
      several sizes; see dflash/benchmarks/data.py.
transport: the target -> drafter feature transport between two processes (p2p) against the in-process queue;
      see dflash/benchmarks/transport.py.
pipeline: pipeline=async against pipeline=sync on the same config with the real stages; see
      dflash/benchmarks/pipeline.py for what is measured and its options.
sweep: a 4-job multirun over loss.kl_temperature online against from a feature store (its build counted), in
      both pipeline modes: wall time, CPU seconds of every process and their ratios, the stage costs timed in
      the same run and the store sweep's cost over its limit (one target pass + N drafter passes + the store's
      I/O), PASS/MISS against the goal of 10%, also per step (fixed costs cancelled by a second size,
      base_steps=1). Options: steps=30 jobs=4 seed=0 modes=sync,async ...; see dflash/benchmarks/sweep.py.
families: each drafter family's cost per draft cycle at one block size (parameters, FLOPs of one proposal, its
      measured CPU latency), side by side, and with target_layers=N each family's break-even tau against a target
      of those widths; see dflash/benchmarks/families.py.
peer: our recipe against a peer's at equal budget: vLLM speculators' DFlash trained by its own model, loss and CLI
      defaults on the same feature-store rows, steps and seeds as our runs (RUN_DIR ...), both evaluated by replay
      per suite, the paired differences; see dflash/benchmarks/peer.py.
rollback: one verify cycle (verify a block, roll the target's cache back to the accepted prefix) on each target
      architecture (hybrids: linear attention, sliding layers, MoE) against a full-attention Qwen3 of the same
      widths; see dflash/benchmarks/rollback.py.
"""

from __future__ import annotations

import importlib
import sys

# name -> module whose `bench(args)` runs it; imported on use, so `--help` needs no torch
BENCHES = {
    "loss": "dflash.benchmarks.loss",
    "step": "dflash.benchmarks.step",
    "pipeline": "dflash.benchmarks.pipeline",
    "dist": "dflash.benchmarks.dist",
    "soak": "dflash.benchmarks.soak",
    "data": "dflash.benchmarks.data",
    "transport": "dflash.benchmarks.transport",
    "sweep": "dflash.benchmarks.sweep",
    "families": "dflash.benchmarks.families",
    "peer": "dflash.benchmarks.peer",
    "rollback": "dflash.benchmarks.rollback",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        names = ", ".join(sorted(BENCHES))
        print(f"usage: python -m dflash.bench NAME [key=value ...]\n  NAME: one of {names}", file=sys.stderr)
        raise SystemExit(2)
    importlib.import_module(BENCHES[argv[0]]).bench(argv[1:])
