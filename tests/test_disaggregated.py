"""parallel.target_ranks: 1 target rank + 2 drafter ranks under torchrun (gloo on CPU, the tiny random target)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from test_distributed import SMALL, max_diff, sigterm_once_training, status, summary, torchrun, train_records, weights

pytestmark = pytest.mark.slow

DISAGG = ["parallel=ddp", "parallel.target_ranks=1"]


def target_stats(run_dir) -> dict:
    return json.loads((run_dir / "target_rank2.json").read_text())


def test_one_target_and_two_drafters_train_like_two_colocated_ranks(tmp_path, cache_dir, tiny_target):
    """Bitwise the weights of the colocated run; drafter rank 1 holds only the target's embedding and LM head,
    rank 0 (the rank that runs evals) the whole target. The target is a wider random one (~80 MB), so that the
    difference shows in resident memory above the runtime's own."""
    target = cache_dir / "mid-random-qwen3"  # built under torchrun by the first run (rank 0 builds, rank 1 waits)
    wide = [f"model.target={target}", "model.build.hidden_size=256", "model.build.intermediate_size=4096"]
    common = [*SMALL, *wide, "train.max_steps=16", "pipeline.monitor_interval_s=1000"]
    colocated, disaggregated = tmp_path / "colocated", tmp_path / "disaggregated"
    torchrun([*common, "parallel=ddp", f"hydra.run.dir={colocated}"], cache_dir, check=True)
    torchrun([*common, *DISAGG, f"hydra.run.dir={disaggregated}"], cache_dir, nproc=3, check=True)
    assert max_diff(weights(colocated), weights(disaggregated)) == 0.0
    one, two = summary(colocated), summary(disaggregated)  # the last steps' mean, not the monitor's last window
    assert one["step"] == two["step"] == 16 and one["tokens"] == two["tokens"]
    assert two["train/loss"] == one["train/loss"]
    world = json.loads((disaggregated / "run.json").read_text())["world"]
    assert world["size"] == 2 and world["target_ranks"] == 1
    stats = target_stats(disaggregated)
    assert stats["drafter_ranks"] == [0, 1] and stats["batches"] >= 16
    assert "perf/link_mb_s" in two
    target_mb = (target / "model.safetensors").stat().st_size / 2**20
    assert target_mb > 40
    # what each rank holds of the target: rank 1 its embedding and LM head, rank 0 (evals) and colocated ranks all
    assert two["perf/target_mb_min"] < 0.05 * target_mb, two["perf/target_mb_min"]
    assert (
        two["perf/target_mb_max"] == pytest.approx(target_mb, rel=0.05) and one["perf/target_mb_min"] > 0.95 * target_mb
    )
    # and in peak RSS: the lean rank below the colocated ranks by most of the target's size (on CPU the weights of
    # a target that never runs a forward are mapped from its file, not resident: rank 0's RSS does not show them)
    gap = one["perf/peak_rss_mb_min"] - two["perf/peak_rss_mb_min"]
    assert gap > 0.5 * target_mb, (gap, target_mb)


def test_a_slow_drafter_holds_the_target_at_the_bound(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    args = [
        *SMALL[:1],
        "train.batch_size=4",
        "eval.num_prompts=0",
        "train.max_steps=40",
        *DISAGG,
        "parallel.items_in_flight=2",
        "+debug=faults",
        "debug.slow_step_s=0.05",
        f"hydra.run.dir={run_dir}",
    ]
    torchrun(args, cache_dir, nproc=3, check=True)
    stats = target_stats(run_dir)
    assert stats["items_in_flight_peak"] == 2  # reached, never passed
    assert stats["credit_wait"] > 0.5  # the target spent most of its time waiting for the drafters
    # steps + the link's items in flight + the drafter's pipeline (2 queues of 4, 3 items in stage threads)
    assert stats["batches"] <= 40 + 2 + 2 * 4 + 3
    rss = stats["rss_mb"]
    assert rss["max"] - rss["after_4_batches"] < 50, rss


@pytest.mark.parametrize(
    ("fault", "culprit"),
    [(["debug.fail_target_at_batch=3"], "rank 2"), (["debug.fail_at_step=3", "debug.fail_rank=1"], "rank 1")],
)
def test_a_failing_target_or_drafter_rank_ends_all_three(fault, culprit, tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    args = [*SMALL, "train.max_steps=200", *DISAGG, "+debug=faults", *fault, f"hydra.run.dir={run_dir}"]
    proc = torchrun(args, cache_dir, nproc=3, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60
    st = status(run_dir)
    assert st["status"] == "failed" and culprit in st["error"], st["error"]


def test_sigterm_stops_all_three_with_one_checkpoint_and_the_run_resumes(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    env = {**os.environ, "DFLASH_CACHE_DIR": str(cache_dir), "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", "launch.py"]
    args = [*SMALL, *DISAGG, "train.max_steps=100000", "checkpoint.every_steps=0", "pipeline.monitor_interval_s=0.1"]
    sigterm_once_training([*cmd, *args, f"hydra.run.dir={run_dir}"], run_dir, env)
    assert status(run_dir)["status"] == "interrupted"
    step = json.loads((run_dir / "summary.json").read_text())["step"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{step}"]
    left = subprocess.run(["pgrep", "-f", f"hydra.run.dir={run_dir}"], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left behind: {left}"
    torchrun([f"resume={run_dir}", f"train.max_steps={step + 3}"], cache_dir, nproc=3, check=True)
    assert status(run_dir)["status"] == "completed" and train_records(run_dir)[-1]["step"] == step + 3
