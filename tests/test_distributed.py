"""Data-parallel training under torchrun with gloo on CPU: 2 processes, the tiny random target."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, launch, run_process_group
from safetensors.torch import load_file

from dflash.core.config import register_configs
from dflash.core.distributed import World, init_world, launch_settings
from dflash.data.batches import Batch, rank_batches, rank_slice

# AdamW, not the default Muon: these tests hold ranks, resumes and layouts to one process's weights within 1e-5 (or
# bitwise), and torch.optim.Muon orthogonalises its update in bfloat16, which turns the all-reduce's 1e-7 round-off
# into ~1e-3 of an update; Muon under ddp/fsdp has its own tests (tests/test_optim_dist.py)
SMALL = ["experiment=smoke", "pipeline=sync", "train.batch_size=4", "eval.num_prompts=0", "optim=adamw"]


def torchrun(
    args: list[str], cache_dir: Path, nproc: int = 2, timeout: float = 300, check: bool = False, env: dict | None = None
) -> subprocess.CompletedProcess:
    full_env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(cache_dir),
        "WANDB_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",
        "HYDRA_FULL_ERROR": "1",
        **(env or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "launch.py",
        *args,
    ]
    proc = run_process_group(cmd, full_env, timeout)  # the ranks ended with their launcher on a timeout
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


def sigterm_once_training(cmd: list[str], run_dir: Path, env: dict) -> None:
    """Start `cmd`, send SIGTERM once the run has logged a training step, and wait (60 s at most) for the end."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() or not train_records(run_dir):
            assert time.monotonic() < deadline and proc.poll() is None, "training never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "drafter" / "model.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def diff_report(a: dict, b: dict, *run_dirs: Path, top: int = 4) -> str:
    """What an assertion on max_diff prints: the tensors that differ most, and the machine each run recorded
    (a failure on another CPU kind says which parameter moved and on what)."""
    diffs = sorted(((a[k] - b[k]).abs().max().item(), k) for k in a)[::-1][:top]
    where = [json.loads((d / "run.json").read_text()).get("device", {}) for d in run_dirs if (d / "run.json").exists()]
    return f"largest differences: {', '.join(f'{k} {v:.2e}' for v, k in diffs)}; devices: {where}"


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/loss" in r]


def summary(run_dir: Path) -> dict:
    """summary.json: its train metrics are the mean over the last steps, the same whenever the monitor sampled (the
    last metrics.jsonl record's window depends on timing)."""
    return json.loads((run_dir / "summary.json").read_text())


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


# --------------------------------------------------------------------------------------------- unit


def test_rank_slices_cover_the_global_batch_in_order():
    ids = torch.arange(4 * 8).view(4, 8)
    mask = ids % 3 == 0
    batch = Batch(ids, mask, ids.numel(), data_pass=1, index=5)
    parts = [rank_slice(batch, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), ids)
    assert [p.row_start for p in parts] == [0, 2] and all(p.global_tokens == 32 for p in parts)
    assert all(torch.equal(p.global_loss_mask, mask) for p in parts) and parts[1].num_tokens == 16
    assert list(rank_batches(iter([batch]), 0, 1)) == [batch]  # one rank: the global batch as it is
    with pytest.raises(ValueError, match="must divide by the 3 ranks"):
        rank_slice(batch, 0, 3)


def test_single_world_needs_no_process_group(monkeypatch):
    world = init_world(type("P", (), {"name": "single"})(), "cpu")
    assert world == World() and world.is_main and not world.distributed
    # run.json's world.device is the job's device (it said cpu for a model.device=cuda run on an H200)
    assert init_world(type("P", (), {"name": "single"})(), "meta").device == torch.device("meta")
    values = torch.tensor([1.0, 2.0])
    assert world.all_reduce(values) is values and world.agree(True) and world.broadcast_object(3) == 3
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="parallel=single in a job of 2 processes"):
        init_world(type("P", (), {"name": "single"})())


def test_launch_settings_come_from_the_composed_config():
    """torchrun joins the process group before Hydra runs: with the backend and init timeout the command line's
    config asks for (config files and experiments included); a sweep's values are left to init_world."""
    register_configs()
    conf = REPO / "conf"
    argv = ["launch.py", "parallel=ddp", "parallel.init_timeout_s=5", "hydra.run.dir=/tmp/x"]
    assert launch_settings(argv, conf) == ("auto", 5.0)
    assert launch_settings(["launch.py", "-m", "parallel=fsdp", "parallel.backend=gloo", "train.seed=0,1"], conf) == (
        "gloo",
        300.0,
    )
    assert launch_settings(["launch.py", "parallel=ddp", "parallel.init_timeout_s=5,9"], conf) == ("auto", 300.0)
    assert launch_settings(["launch.py", "parallel=ddp", "parallel.no_such_key=1"], conf) == ("auto", 300.0)


def _two_jobs(rank: int, init: str, out: dict) -> None:
    """Two jobs of one multirun in a process of a world of 2 (the group joined once, init_world per job): rank 1
    fails in the first job; in the second every rank reads the failure record before anyone fails."""
    from omegaconf import OmegaConf

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    cfg = OmegaConf.create({"name": "ddp", "backend": "gloo", "init_timeout_s": 30, "timeout_s": 30, "target_ranks": 0})
    for job in (0, 1):
        world = init_world(cfg, "cpu")
        if job == 0 and rank == 1:
            world.report_failure("RuntimeError: the first job's fault")
        world.barrier()
        out[f"job{job}/rank{rank}"] = world.first_failure()
        world.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes
def test_each_job_of_a_multirun_starts_with_a_clean_failure_record(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    procs = [ctx.Process(target=_two_jobs, args=(r, f"file://{tmp_path}/store", out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert not p.is_alive(), "a rank hung"
    assert [p.exitcode for p in procs] == [0, 0], dict(out)
    first = "rank 1: RuntimeError: the first job's fault"
    assert dict(out) == {"job0/rank0": first, "job0/rank1": first, "job1/rank0": None, "job1/rank1": None}


# ----------------------------------------------------------------------------------------- torchrun


@pytest.fixture(scope="module")
def one_rank_reference(tmp_path_factory, cache_dir, tiny_target) -> Path:
    run_dir = tmp_path_factory.mktemp("single") / "run"
    launch(
        [*SMALL, "train.max_steps=20", "pipeline.monitor_interval_s=1000", f"hydra.run.dir={run_dir}"],
        cache_dir,
        check=True,
    )
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_like_one_rank(parallel, one_rank_reference, tmp_path, cache_dir):
    """2 ranks x 2 sequences = 1 rank x 4 sequences: the same weights up to float round-off and the same loss."""
    run_dir = tmp_path / "run"
    torchrun(
        [
            *SMALL,
            "train.max_steps=20",
            "pipeline.monitor_interval_s=1000",
            f"parallel={parallel}",
            f"hydra.run.dir={run_dir}",
        ],
        cache_dir,
        check=True,
    )
    assert max_diff(weights(one_rank_reference), weights(run_dir)) < 1e-5
    one, two = summary(one_rank_reference), summary(run_dir)  # the last steps' mean, not the monitor's last window
    assert one["step"] == two["step"] == 20 and one["tokens"] == two["tokens"]
    assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-6)
    assert two["train/avg_streak"] == pytest.approx(one["train/avg_streak"], rel=1e-6)
    assert json.loads((run_dir / "run.json").read_text())["world"]["size"] == 2


@pytest.mark.slow
def test_killed_ranks_resume_at_the_same_and_another_world_size(tmp_path, cache_dir, tiny_target):
    """SIGKILL of both ranks after the step-6 checkpoint; resumed with 2 ranks the run ends bitwise equal to an
    uninterrupted one, and it also resumes in 1 process; metrics.jsonl never repeats a step."""
    common = [
        *SMALL,
        "parallel=ddp",
        "train.max_steps=12",
        "checkpoint.every_steps=3",
        "pipeline.monitor_interval_s=0.01",
    ]
    full = tmp_path / "full"
    torchrun([*common, f"hydra.run.dir={full}"], cache_dir, check=True)
    crashed = tmp_path / "crashed"
    proc = torchrun([*common, "+debug=faults", "debug.crash_at_step=7", f"hydra.run.dir={crashed}"], cache_dir)
    assert proc.returncode != 0 and status(crashed)["status"] == "running"  # killed: nobody wrote the end
    assert sorted(p.name for p in (crashed / "checkpoints").iterdir()) == ["step_3", "step_6"]
    one_rank, corrupt = tmp_path / "one_rank", tmp_path / "corrupt"
    shutil.copytree(crashed, one_rank)
    shutil.copytree(crashed, corrupt)
    shard = corrupt / "checkpoints" / "step_6" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-16])  # rank 1's shard cut short: verification fails, step_3 is used
    proc = launch([f"resume={corrupt}", "debug.crash_at_step=null"], cache_dir, check=True)
    assert "step_6: __1_0.distcp has" in proc.stdout + proc.stderr and status(corrupt)["status"] == "completed"

    torchrun([f"resume={crashed}", "debug.crash_at_step=null"], cache_dir, check=True)
    assert status(crashed)["status"] == "completed"
    assert max_diff(weights(full), weights(crashed)) == 0.0
    launch([f"resume={one_rank}", "debug.crash_at_step=null"], cache_dir, check=True)  # one process
    assert status(one_rank)["status"] == "completed"
    assert max_diff(weights(full), weights(one_rank)) < 1e-5
    for run_dir in (crashed, one_rank):
        records = train_records(run_dir)
        steps = [r["step"] for r in records]
        assert steps == sorted(steps) and steps[-1] == 12, steps
        # records of the crashed process and of the resumed one (time_s restarts) share no step
        resets = [i for i in range(1, len(records)) if records[i]["time_s"] < records[i - 1]["time_s"]]
        cut = resets[0] if resets else 0  # the crashed process may have died before its first tick
        assert not {r["step"] for r in records[:cut]} & {r["step"] for r in records[cut:]}, steps


@pytest.mark.slow
def test_an_exception_on_one_rank_ends_every_rank(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = torchrun(
        [
            *SMALL,
            "parallel=ddp",
            "train.max_steps=200",
            "+debug=faults",
            "debug.fail_at_step=3",
            "debug.fail_rank=1",
            f"hydra.run.dir={run_dir}",
        ],
        cache_dir,
        timeout=120,
    )
    assert proc.returncode != 0 and time.monotonic() - t0 < 60
    st = status(run_dir)
    assert st["status"] == "failed" and st["error"].startswith("rank 1: "), st["error"]
    assert "injected drafter-stage fault" in st["error"]


@pytest.mark.slow
def test_a_time_budget_ends_every_rank_at_one_step_completed(tmp_path, cache_dir, tiny_target):
    """train.max_minutes under torchrun, rank 1 the slow one (0.2 s a step): every rank stops after the same step,
    the run is `completed` with stop_reason max_minutes, and its saved seconds are the ranks' agreed clock."""
    run_dir = tmp_path / "run"
    args = [*SMALL, "parallel=ddp", "train.max_steps=100000", "train.max_minutes=0.1", "checkpoint.every_steps=0"]
    faults = ["+debug=faults", "debug.slow_step_s=0.2", "debug.fail_rank=1"]
    torchrun([*args, *faults, f"hydra.run.dir={run_dir}"], cache_dir, timeout=240, check=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert status(run_dir)["status"] == "completed" and summary["stop_reason"] == "max_minutes"
    assert 1 < summary["step"] < 100000 and train_records(run_dir)[-1]["step"] == summary["step"]
    # the final checkpoint saves the ranks' agreed clock: at least the budget's 6 s, at most a few slow steps more
    meta = json.loads((run_dir / "checkpoints" / f"step_{summary['step']}" / "meta.json").read_text())
    assert 6.0 <= meta["trainer"]["trained_s"] < 12.0
    assert "Traceback" not in (run_dir / "launch.rank1.log").read_text()  # rank 1 stopped as cleanly as rank 0


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_with_one_checkpoint(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    env = {**os.environ, "DFLASH_CACHE_DIR": str(cache_dir), "WANDB_MODE": "disabled"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "launch.py",
        *SMALL,
        "parallel=ddp",
        "train.max_steps=100000",
        "checkpoint.every_steps=0",
        "pipeline.monitor_interval_s=0.1",
        f"hydra.run.dir={run_dir}",
    ]
    sigterm_once_training(cmd, run_dir, env)
    st = status(run_dir)
    assert st["status"] == "interrupted", st
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{summary['step']}"]
    left = subprocess.run(["pgrep", "-f", f"hydra.run.dir={run_dir}"], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left behind: {left}"


@pytest.mark.slow
def test_two_ranks_write_one_run_directory(tmp_path, cache_dir, tiny_target):
    """One config snapshot, one metrics.jsonl, one offline W&B run; rank 1 keeps its own log."""
    run_dir = tmp_path / "run"
    torchrun(
        ["experiment=smoke", "parallel=ddp", "logging=wandb", "logging.wandb.mode=offline", f"hydra.run.dir={run_dir}"],
        cache_dir,
        check=True,
        env={"WANDB_MODE": "offline"},
    )
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert len(list(run_dir.rglob("config_resolved.yaml"))) == 1 and len(list(run_dir.rglob("metrics.jsonl"))) == 1
    assert (run_dir / "launch.rank1.log").exists() and (run_dir / ".hydra" / "config.yaml").exists()
    records = train_records(run_dir)
    assert {"perf/hs_queue_depth_min", "perf/hs_queue_depth_max", "perf/drafter_busy_max"} <= set(records[-1])
    world = json.loads((run_dir / "run.json").read_text())["world"]
    assert world["size"] == 2 and world["backend"] == "gloo" and world["nodes"] == 1


@pytest.mark.slow
def test_submitit_local_runs_the_slurm_code_path(tmp_path, cache_dir, tiny_target):
    """hydra/launcher=local_ddp: submitit starts 2 tasks that join one world from SLURM-style variables."""
    sweep = tmp_path / "sweep"
    launch(
        ["-m", "hydra/launcher=local_ddp", "experiment=smoke", "parallel=ddp", f"hydra.sweep.dir={sweep}"],
        cache_dir,
        check=True,
    )
    assert status(sweep / "0")["status"] == "completed"
    assert json.loads((sweep / "0" / "run.json").read_text())["world"]["size"] == 2
    assert len(list((sweep / "0" / "checkpoints").glob("step_*/__1_0.distcp"))) >= 1  # rank 1 wrote its shard


@pytest.mark.slow
def test_dist_bench_prints_the_scaling_efficiency():
    """The benchmark's plumbing (not its numbers): 1 and 2 processes measured, one efficiency line."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.bench",
            "dist",
            "steps=2",
            "warmup=1",
            "seq_len=64",
            "batch_size=2",
            "num_anchors=4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scaling efficiency" in proc.stdout and "        2 " in proc.stdout


@pytest.mark.slow
def test_multirun_under_torchrun_runs_the_jobs_in_turn_on_all_ranks(tmp_path, cache_dir, tiny_target):
    sweep = tmp_path / "sweep"
    torchrun(
        ["-m", "experiment=smoke", "parallel=ddp", "train.seed=0,1", f"hydra.sweep.dir={sweep}"], cache_dir, check=True
    )
    for job in ("0", "1"):
        assert status(sweep / job)["status"] == "completed"
        assert json.loads((sweep / job / "run.json").read_text())["world"]["size"] == 2
    summary = json.loads((sweep / "sweep.json").read_text())
    assert summary["finished"] and [j["status"] for j in summary["jobs"]] == ["completed", "completed"]


@pytest.mark.slow
def test_init_timeout_from_the_config_ends_a_rank_waiting_for_rank_0(tmp_path, cache_dir, tiny_target):
    """Rank 0 is slow in its first data build; parallel.init_timeout_s=5 (not the launch default of 300 s) ends
    the waiting rank, and the error names the key to raise."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    args = [*SMALL, "parallel=ddp", "parallel.init_timeout_s=5", "+debug=faults", "debug.main_first_sleep_s=120"]
    proc = torchrun([*args, f"hydra.run.dir={run_dir}"], cache_dir, timeout=150)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60, proc.stderr[-3000:]
    st = status(run_dir)
    assert st["status"] == "failed" and st["error"].startswith("rank 1: "), st
    assert "parallel.init_timeout_s=5 s" in st["error"], st["error"]


@pytest.mark.slow
def test_submitit_tasks_know_their_rank_and_a_fault_on_rank_1_is_the_jobs_error(tmp_path, cache_dir, tiny_target):
    """hydra/launcher=local_ddp with a fault on rank 1: rank 0 alone writes the run's files and names rank 1 in
    status.json, rank 1 logs to its own file, and the launching process reports rank 1's error (submitit
    pickles it back), not an unpickling traceback."""
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=local_ddp", *SMALL, "parallel=ddp", "train.max_steps=20", "+debug=faults"]
    proc = launch([*args, "debug.fail_at_step=3", "debug.fail_rank=1", f"hydra.sweep.dir={sweep}"], cache_dir)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "RankFailed: rank 1: " in out and "injected drafter-stage fault" in out, out[-3000:]
    assert "TypeError" not in out, out[-3000:]
    run_dir = sweep / "0"
    st = status(run_dir)
    assert st["status"] == "failed" and st["error"].startswith("rank 1: "), st["error"]
    assert "injected drafter-stage fault" in st["error"]
    rank1_log = (run_dir / "launch.rank1.log").read_text()
    assert "rank 1 of 2 (drafter)" in rank1_log and "injected drafter-stage fault" in rank1_log
    rank0_log = (run_dir / "launch.log").read_text()
    assert "rank 1 of 2" not in rank0_log and "injected drafter-stage fault at step" not in rank0_log
    # one writer of Hydra's files: rank 1's overrides never reach them
    assert "launch.rank1.log" not in (run_dir / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow
def test_a_diverged_ddp_run_checkpoints_its_last_good_state_and_resumes(tmp_path, cache_dir, tiny_target):
    """NaN from step 4 on, train.max_bad_steps=2: both ranks stop at step 5 with one collective checkpoint;
    a checkpoint that does not verify fails every rank at once; the run resumes from step 5."""
    run_dir = tmp_path / "run"
    common = [*SMALL, "parallel=ddp", "train.max_steps=8", "checkpoint.every_steps=3", "train.max_bad_steps=2"]
    proc = torchrun([*common, "+debug=faults", "debug.nan_at_step=4", f"hydra.run.dir={run_dir}"], cache_dir)
    assert proc.returncode != 0
    st = status(run_dir)
    assert st["status"] == "failed" and "TrainingDiverged" in st["error"], st
    step_5 = run_dir / "checkpoints" / "step_5"
    assert sorted(p.name for p in step_5.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    corrupt = tmp_path / "corrupt"
    shutil.copytree(run_dir, corrupt)
    for ckpt in (corrupt / "checkpoints").iterdir():
        shard = ckpt / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-16])
    t0 = time.monotonic()
    proc = torchrun([f"resume={corrupt}", "debug.nan_at_step=null"], cache_dir, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60
    assert "no checkpoint of this run verifies" in status(corrupt)["error"]

    torchrun([f"resume={run_dir}", "debug.nan_at_step=null"], cache_dir, check=True)
    assert status(run_dir)["status"] == "completed"
    steps = [r["step"] for r in train_records(run_dir)]
    assert steps[-1] == 8 and (run_dir / "checkpoints" / "step_8").is_dir(), steps
