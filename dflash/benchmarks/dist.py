"""`python -m dflash.bench dist [key=value ...]`: data-parallel scaling, 1 against 2 processes, in one run.

Both runs do the same work per process: each rank trains on `batch_size` sequences per step (the global batch
is world size x batch_size) through the real stages (`TargetForward`, `DrafterTrainer.train_on` with DDP,
the global loss denominator and the per-step agreement all-reduce), on a random target of the embedded
default's shape saved and loaded with `from_pretrained`. Each world is started with torchrun (gloo on CPU,
NCCL on GPUs: `device=cuda`, one GPU per process) and reports its tokens/s over `steps` steps after `warmup`.

It prints the tokens/s of 1 and 2 processes and the scaling efficiency = tok/s(2) / (2 x tok/s(1)).
On CPU every process gets `threads` torch threads (default 1), so 2 processes need 2 free cores.

Options: nproc=2 device=cpu batch_size=4 seq_len=256 num_anchors=16 block_size=8 steps=30 warmup=5 threads=1
parallel=ddp.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash.benchmarks.options import parse_opts

DEFAULTS = {
    "nproc": "2",
    "device": "cpu",
    "batch_size": "4",
    "seq_len": "256",
    "num_anchors": "16",
    "block_size": "8",
    "steps": "30",
    "warmup": "5",
    "threads": "1",
    "parallel": "ddp",
}


def _worker(args: list[str]) -> None:
    """One rank of a measured world (started by torchrun): prints rank 0's result as one JSON line."""

    from dflash.benchmarks.pipeline import SHAPES, _config, random_target_overrides
    from dflash.core.distributed import init_world
    from dflash.data.batches import Batch, rank_slice
    from dflash.model.build import build_drafter_config, init_drafter
    from dflash.model.target import TargetModel
    from dflash.train.parallelize import parallelize_drafter
    from dflash.train.trainer import DrafterTrainer, TargetForward

    opts, target_dir = json.loads(args[0]), Path(args[1])
    torch.set_num_threads(int(opts["threads"]))
    par = type("Parallel", (), {"name": opts["parallel"], "backend": "auto", "init_timeout_s": 300.0})()
    world = init_world(par, opts["device"])
    bsz, seq, steps, warmup = (int(opts[k]) for k in ("batch_size", "seq_len", "steps", "warmup"))
    global_bsz = bsz * world.size
    cfg_opts = {**opts, "batch_size": str(global_bsz), "dtype": "float32", "device": str(world.device.type)}
    cfg = _config(cfg_opts, random_target_overrides(target_dir), int(opts["num_anchors"]))
    cfg.parallel.name = opts["parallel"]
    target = TargetModel.load(str(target_dir), [1, 3], "float32", str(world.device))
    drafter = init_drafter(build_drafter_config(target.model.config, cfg.model, [1, 3], 1), 0, world.device)
    model = parallelize_drafter(drafter, world)
    trainer = DrafterTrainer(cfg, target, drafter, 1, 10**6, world=world, model=model)
    forward = TargetForward(target, world.device)
    vocab = SHAPES["tiny"]["vocab_size"]
    g = torch.Generator().manual_seed(0)

    def item(i: int):
        ids = torch.randint(2, vocab, (global_bsz, seq), generator=g)
        batch = Batch(ids, torch.ones_like(ids, dtype=torch.bool), ids.numel(), 0, i)
        return forward(rank_slice(batch, world.rank, world.size))

    items = [item(i) for i in range(steps + warmup)]
    for it in items[:warmup]:
        trainer.train_on(it)
    world.barrier()
    if world.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for it in items[warmup:]:
        trainer.train_on(it)
    if world.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if world.is_main:
        tokens = steps * global_bsz * seq  # all ranks' tokens
        print(json.dumps({"world": world.size, "tok_s": tokens / seconds, "step_s": seconds / steps}))


def _measure(nproc: int, opts: dict, target_dir: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "dflash.benchmarks.dist",
        "_worker",
        json.dumps(opts),
        str(target_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": opts["threads"]})
    if proc.returncode != 0:
        raise SystemExit(f"{nproc}-process run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines()[::-1] if line.startswith("{")))


def bench(args: list[str]) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.benchmarks.pipeline import SHAPES

    opts = parse_opts(args, DEFAULTS)
    nproc = int(opts["nproc"])
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = Path(tmp) / "target"
        torch.manual_seed(0)
        config = Qwen3Config(**SHAPES["tiny"], tie_word_embeddings=True, max_position_embeddings=4096)
        Qwen3ForCausalLM(config).save_pretrained(target_dir)
        print(
            f"dist bench: {opts['parallel']} on {opts['device']}, per process {opts['batch_size']} x "
            f"{opts['seq_len']} tokens per step, {opts['num_anchors']} anchors, block {opts['block_size']}, "
            f"{opts['steps']} steps after {opts['warmup']} warmup, {opts['threads']} torch thread(s) per process, "
            f"{os.cpu_count()} cores"
        )
        one = _measure(1, opts, target_dir)
        many = _measure(nproc, opts, target_dir)
    print(f"{'processes':>9} {'tok/s':>10} {'s/step':>8}")
    for r in (one, many):
        print(f"{r['world']:>9} {r['tok_s']:>10.0f} {r['step_s']:>8.3f}")
    print(
        f"scaling efficiency ({nproc}-process tok/s / ({nproc} x 1-process tok/s)): "
        f"{many['tok_s'] / (nproc * one['tok_s']):.2f}"
    )


if __name__ == "__main__" and sys.argv[1:2] == ["_worker"]:  # one rank, started by torchrun
    _worker(sys.argv[2:])
