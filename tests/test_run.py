"""End-to-end runs of launch.py on the tiny random target: output directory, metrics, every loss, faults, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, launch

pytestmark = pytest.mark.slow

DESIGN_TRAIN_KEYS = [
    "train/loss",
    "train/loss_ce",
    "train/loss_kl",
    "train/accuracy",
    "train/avg_streak",
    "train/accuracy_1",
    "train/lr",
    "train/noise_std",
    "train/grad_norm",
]
DESIGN_PERF_KEYS = [
    "perf/ktok_s",
    "perf/target_queue_depth",
    "perf/hs_queue_depth",
    "perf/target_busy",
    "perf/drafter_busy",
    "perf/drafter_wait_s",
]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def test_smoke_run_leaves_a_complete_run_dir(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    launch(
        [
            "experiment=smoke",
            f"hydra.run.dir={run_dir}",
            "train.max_steps=12",
            "pipeline.monitor_interval_s=0.05",
            "train.seed=3",
        ],
        cache_dir,
        check=True,
        env={"WANDB_API_KEY": "secret-key-should-not-leak-123"},
    )
    for name in (
        "config_resolved.yaml",
        "run.json",
        "status.json",
        "metrics.jsonl",
        "summary.json",
        "eval.json",
        ".hydra/config.yaml",
        "drafter/config.json",
        "drafter/model.safetensors",
        "drafter/dflash.py",
        "drafter/README.md",  # the model card: what the drafter is evidence of
    ):
        assert (run_dir / name).exists(), name
    assert status(run_dir)["status"] == "completed"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["choices"]["model"] == "tiny_random" and "train.seed=3" in run["overrides"]
    assert {"torch", "transformers", "hydra-core"} <= set(run["packages"]) and "sha" in run["git"]
    for f in run_dir.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".yaml", ".jsonl", ".log"):
            assert "secret-key-should-not-leak-123" not in f.read_text(errors="ignore"), f
    cfg = (run_dir / "config_resolved.yaml").read_text()
    assert "${" not in cfg and "tiny-random-qwen3-v1" in cfg
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert records, "no training records"
    for key in DESIGN_TRAIN_KEYS + DESIGN_PERF_KEYS + ["step", "tokens", "time_s"]:
        assert key in records[-1], key
    assert records[-1]["step"] == 12
    # a monitor tick without a new step writes no train/* (a mean over records counts each step once)
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if any(k.startswith("train/") for k in r)]
    assert len(steps) == len(set(steps)), steps
    steps = [r["step"] for r in records]
    assert steps == sorted(steps)
    assert any(r["perf/hs_queue_depth"] > 0 for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 12 and "eval/tau" in summary
    card = (run_dir / "drafter" / "README.md").read_text()
    assert card.startswith("---\nbase_model: ") and f"| held-out | {summary['eval/tau']:.3f} |" in card


def test_evaluate_cli_reproduces_the_runs_final_eval(tmp_path, cache_dir, tiny_target):
    """`python -m dflash.evaluate RUN_DIR` repeats the run's own final eval from the run directory alone: the
    prompts recorded in eval.json, the run's settings and seed, and the same acceptance lengths."""
    run_dir = tmp_path / "run"
    launch(
        [
            "experiment=smoke",
            f"hydra.run.dir={run_dir}",
            "train.max_steps=8",
            "train.seed=5",  # the drafter's init: the untrained baseline must be rebuilt with it
            "eval.seed=7",  # the prompts and sampling
            "eval.num_prompts=3",
        ],
        cache_dir,
        check=True,
    )
    ran = json.loads((run_dir / "eval.json").read_text())
    assert ran["seed"] == 7
    assert len(ran["prompts"]) == 3 and all(isinstance(t, int) for p in ran["prompts"] for t in p)
    out = tmp_path / "again.json"
    env = {**os.environ, "DFLASH_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.evaluate", str(run_dir), "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(out.read_text())
    assert again["prompts"] == ran["prompts"]
    for key in ("eval/tau", "eval/tau_baseline", "eval/tau_untrained", "eval/cycles", "eval/lossless"):
        assert again["metrics"][key] == ran["metrics"][key], key
    fields = ("prompt_len", "tokens", "accept_lengths", "baseline_accept_lengths", "untrained_accept_lengths")
    for a, b in zip(ran["details"]["prompts"], again["details"]["prompts"], strict=True):
        assert {k: a[k] for k in fields} == {k: b[k] for k in fields}


@pytest.mark.parametrize("loss", ["ce_decay", "kl", "kl_streak", "dpace"])
def test_each_loss_runs_and_logs(tmp_path, cache_dir, tiny_target, loss):
    run_dir = tmp_path / loss
    launch(
        [
            "experiment=smoke",
            f"loss={loss}",
            f"hydra.run.dir={run_dir}",
            "eval.num_prompts=0",
            "schedule.noise_start=0.1",
            "schedule.noise_end=0.01",
        ],
        cache_dir,
        check=True,
    )
    last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r][-1]
    for key in DESIGN_TRAIN_KEYS:
        assert key in last and last[key] is not None, key
    if loss in ("ce_decay", "dpace"):  # hard labels only (dpace's kl_weight defaults to 0, as the peers')
        assert last["train/loss_kl"] == 0.0
    else:
        assert last["train/loss_kl"] > 0.0
    assert 0.01 <= last["train/noise_std"] <= 0.1


@pytest.mark.parametrize(
    "args,stage",
    [
        (["debug.fail_target_at_batch=3"], "target"),
        (["debug.fail_at_step=3"], "drafter"),
    ],
)
def test_stage_fault_ends_the_run(tmp_path, cache_dir, tiny_target, args, stage):
    run_dir = tmp_path / "run"
    t0 = time.time()
    proc = launch(["experiment=smoke", f"hydra.run.dir={run_dir}", "train.max_steps=50", *args], cache_dir, timeout=60)
    assert proc.returncode != 0 and time.time() - t0 < 30
    st = status(run_dir)
    assert st["status"] == "failed" and f"{stage} stage failed" in st["error"]
    log = (run_dir / "launch.log").read_text()
    assert "Traceback" in log and "injected" in log


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_malformed_record(tmp_path, cache_dir, tiny_target, mode):
    data = tmp_path / "data.jsonl"
    good = json.dumps({"text": "def f(x):\n    return x + 1\n" * 40})
    chat = json.dumps(
        {"messages": [{"role": "user", "content": "add"}, {"role": "assistant", "content": "x + 1" * 30}]}
    )
    data.write_text("\n".join([good, chat, good, "{not json", good, good] * 4) + "\n")
    run_dir = tmp_path / "run"
    proc = launch(
        [
            "experiment=smoke",
            f"hydra.run.dir={run_dir}",
            "data=jsonl",
            f"data.path={data}",
            f"data.on_bad_record={mode}",
            "eval.num_prompts=0",
        ],
        cache_dir,
        timeout=60,
    )
    if mode == "fail":
        assert proc.returncode != 0
        assert f"{data}:4" in proc.stderr and "invalid JSON" in proc.stderr
        assert status(run_dir)["status"] == "failed"
    else:
        assert proc.returncode == 0, proc.stderr
        last = read_jsonl(run_dir / "metrics.jsonl")[-1]
        assert last["data/skipped_records"] == 4


def test_sigterm_interrupts_cleanly(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    env = {**os.environ, "DFLASH_CACHE_DIR": str(cache_dir), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "launch.py",
            "experiment=smoke",
            f"hydra.run.dir={run_dir}",
            "train.max_steps=100000",
            "checkpoint.every_steps=0",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert time.time() - t0 < 30
    assert proc.returncode != 0
    st = status(run_dir)
    assert st["status"] == "interrupted"
    assert list((run_dir / "checkpoints").glob("step_*")), "SIGTERM must write a checkpoint"


def _in_process(overrides, cache_dir, monkeypatch):
    from conftest import compose_config

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    return compose_config(["experiment=smoke", *overrides])


def test_drafter_stuck_past_join_timeout_writes_no_final_checkpoint(
    tmp_path, cache_dir, tiny_target, monkeypatch, caplog
):
    """SIGTERM while the drafter thread is inside a long periodic eval: the pipeline gives up on it after
    join_timeout_s. Its weights may then be mid-update, so the run fails without a final checkpoint or export
    (the periodic checkpoints stay usable)."""
    import threading

    import dflash.evaluation.evaluator as evaluator_module
    from dflash.runner.lifecycle import JobInfo, main

    release = threading.Event()
    real_evaluate = evaluator_module.evaluate

    def slow_evaluate(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # preemption arrives during the eval
        release.wait(30)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(evaluator_module, "evaluate", slow_evaluate)
    cfg = _in_process(
        ["train.max_steps=20", "eval.every_steps=4", "checkpoint.every_steps=3", "pipeline.join_timeout_s=1"],
        cache_dir,
        monkeypatch,
    )
    run_dir = tmp_path / "run"
    caplog.set_level("INFO", logger="dflash.tracking")
    try:
        with pytest.raises(RuntimeError, match="did not stop within pipeline.join_timeout_s"):
            main(cfg, JobInfo(run_dir))
    finally:
        release.set()
        for t in threading.enumerate():
            if t.name.startswith("dflash-"):
                t.join(30)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "failed"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3"]  # not step_4
    assert not (run_dir / "drafter").exists()
    assert any("run failed at step" in r.getMessage() for r in caplog.records)


def test_failing_export_still_ends_the_callbacks(tmp_path, cache_dir, tiny_target, monkeypatch, caplog):
    import logging

    import dflash.runner.finish
    from dflash.runner.lifecycle import JobInfo, main

    def broken_export(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dflash.runner.finish, "export_drafter", broken_export)
    cfg = _in_process(["train.max_steps=3"], cache_dir, monkeypatch)
    with caplog.at_level(logging.INFO, logger="dflash.tracking"), pytest.raises(OSError, match="disk full"):
        main(cfg, JobInfo(tmp_path / "run"))
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "failed"
    assert any("run failed at step 3/3" in r.getMessage() for r in caplog.records)


def test_second_signal_records_the_status_before_the_forced_exit(monkeypatch):
    """A second SIGTERM/SIGINT exits at once (no cleanup): status.json must say so first, not stay running."""
    import threading

    from dflash.core import interrupts

    installed, raised, recorded = {}, [], []
    monkeypatch.setattr(interrupts.signal, "signal", lambda sig, h: installed.setdefault(sig, h))  # keeps the first
    monkeypatch.setattr(interrupts.signal, "raise_signal", raised.append)
    stop = threading.Event()
    interrupts.install_signal_handlers(stop, recorded.append)
    handler = installed[signal.SIGTERM]
    handler(signal.SIGTERM, None)
    assert stop.is_set() and recorded == [] and raised == []  # first signal: a graceful stop
    handler(signal.SIGTERM, None)
    assert recorded == ["SIGTERM"] and raised == [signal.SIGTERM]


def _start(args: list[str], cache_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "DFLASH_CACHE_DIR": str(cache_dir), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "launch.py", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_log(proc: subprocess.Popen, run_dir: Path, text: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = run_dir / "launch.log"
        if log.exists() and text in log.read_text():
            return
        assert proc.poll() is None, f"the run ended before '{text}': {proc.communicate()[1][-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"'{text}' never appeared in launch.log")


@pytest.mark.parametrize(
    "phase,args,marker,not_done",
    [
        (
            "final eval",
            ["train.max_steps=4", "eval.num_prompts=8", "eval.max_new_tokens=2000"],
            "eval at step 4: 8 prompts with baselines",
            "the final eval",
        ),
        (
            "periodic eval",
            ["train.max_steps=10000", "eval.every_steps=3", "eval.max_new_tokens=2000"],
            "eval at step 3: 2 prompts",
            None,
        ),
        (
            "data regeneration",
            ["data.regenerate.num_prompts=3000", "data.regenerate.max_new_tokens=128"],
            "regenerate: started",
            "training, export, final eval",
        ),
    ],
)
def test_sigterm_in_any_phase_ends_the_run_in_seconds(tmp_path, cache_dir, tiny_target, phase, args, marker, not_done):
    """SIGTERM during an eval (final or periodic) or the data regeneration: the phase is abandoned, the run ends
    within seconds as `interrupted` (saying what was not done), with one line on stderr instead of a traceback
    and exit code 128 + SIGTERM."""
    run_dir = tmp_path / "run"
    proc = _start(["experiment=smoke", f"hydra.run.dir={run_dir}", "checkpoint.every_steps=2", *args], cache_dir)
    try:
        _wait_for_log(proc, run_dir, marker)
        time.sleep(0.3)  # inside the phase
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and took < 15, (proc.returncode, took)
    st = status(run_dir)
    assert st["status"] == "interrupted", st
    if not_done:
        assert f"not done: {not_done}" in st["error"], st["error"]
    assert "Traceback" not in err and "Error executing job" not in err
    assert len([line for line in err.splitlines() if line.startswith("interrupted: ")]) == 1
    if phase == "periodic eval":  # the last checkpoint is complete and the run resumes from it
        assert "abandoned: a stop was requested" in (run_dir / "launch.log").read_text()
        steps = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
        assert (
            steps and json.loads((run_dir / "checkpoints" / f"step_{steps[-1]}" / "meta.json").read_text())["complete"]
        )
