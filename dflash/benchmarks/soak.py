"""`python -m dflash.bench soak [key=value ...]`: a long run of the real job, watching its memory.

It runs `launch.py experiment=smoke` (the tiny random target) with the async pipeline for `steps` steps, with
periodic evals and checkpoints and an offline W&B run (so queues, metric windows, W&B buffers and eval copies
all take part), samples the process's resident memory (VmRSS) every `sample_s`, and prints RSS and step time
at the start (after `warmup` of the steps) and at the end. Memory must stay flat: the bench exits 1 when it
grew by more than `max_growth` (default 5%) after warm-up.

Options: steps=5000 warmup=0.1 eval_every=1000 checkpoint_every=1000 sample_s=1.0 max_growth=0.05.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from dflash.benchmarks.options import parse_opts

DEFAULTS = {
    "steps": "5000",
    "warmup": "0.1",
    "eval_every": "1000",
    "checkpoint_every": "1000",
    "sample_s": "1.0",
    "max_growth": "0.05",
}
REPO = Path(__file__).resolve().parents[2]


def _rss_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:  # the run has just exited
        return None


def _step_time(records: list[dict], lo: int, hi: int) -> float | None:
    """Seconds per step between the records nearest to steps lo and hi."""
    pts = [(r["step"], r["time_s"]) for r in records if "train/loss" in r and lo <= r["step"] <= hi]
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def bench(args: list[str]) -> None:
    opts = parse_opts(args, DEFAULTS)
    steps = int(opts["steps"])
    warm = int(steps * float(opts["warmup"]))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "launch.py",
            "experiment=smoke",
            f"train.max_steps={steps}",
            f"eval.every_steps={opts['eval_every']}",
            f"checkpoint.every_steps={opts['checkpoint_every']}",
            "logging=wandb",
            "logging.wandb.mode=offline",
            "pipeline.monitor_interval_s=0.5",
            f"hydra.run.dir={run_dir}",
        ]
        env = {
            **os.environ,
            "WANDB_MODE": "offline",
            "DFLASH_CACHE_DIR": os.environ.get("DFLASH_CACHE_DIR", str(REPO / "outputs/.cache")),
        }
        print(
            f"soak bench: {steps} steps of experiment=smoke (async pipeline, evals every {opts['eval_every']}, "
            f"checkpoints every {opts['checkpoint_every']}, W&B offline); RSS every {opts['sample_s']} s"
        )
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        samples: list[tuple[int, float]] = []  # (step, rss MB)
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None:
            time.sleep(float(opts["sample_s"]))
            rss = _rss_mb(proc.pid)
            step = 0
            if metrics.exists():
                lines = metrics.read_text().splitlines()
                step = next((json.loads(x).get("step", 0) for x in reversed(lines) if '"train/loss"' in x), 0)
            if rss is not None:
                samples.append((step, rss))
        if proc.returncode != 0:
            raise SystemExit(f"the soak run failed (rc {proc.returncode}):\n{proc.stderr.read()[-3000:]}")
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
    after_warmup = [rss for step, rss in samples if step >= warm]
    if len(after_warmup) < 2:
        raise SystemExit("too few memory samples after warm-up; raise steps")
    start, end, peak = after_warmup[0], after_warmup[-1], max(after_warmup)
    t_start = _step_time(records, warm, warm + steps // 10)
    t_end = _step_time(records, steps - steps // 10, steps)
    growth = end / start - 1
    print(f"{'':>12} {'step':>7} {'RSS MiB':>9} {'ms/step':>8}")
    print(f"{'after warmup':>12} {warm:>7} {start:>9.0f} {1000 * (t_start or float('nan')):>8.1f}")
    print(f"{'end':>12} {steps:>7} {end:>9.0f} {1000 * (t_end or float('nan')):>8.1f}")
    print(f"RSS growth after warm-up: {100 * growth:+.1f}% (peak {peak:.0f} MiB, {len(samples)} samples)")
    if growth > float(opts["max_growth"]):
        raise SystemExit(f"memory grew by {100 * growth:.1f}% (> {100 * float(opts['max_growth']):.0f}%)")
