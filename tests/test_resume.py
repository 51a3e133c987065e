"""Checkpoints, resume and fault tolerance."""

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
from conftest import REPO, launch
from safetensors.torch import load_file
from test_drafter import make_drafter

from dflash.train.checkpoint import (
    CheckpointMismatch,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

COMMON = [
    "experiment=smoke",
    "train.max_steps=12",
    "checkpoint.every_steps=4",
    "eval.num_prompts=0",
    "checkpoint.keep_last=5",
]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "drafter" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_kill9_then_resume_matches_uninterrupted_run(tmp_path, cache_dir, tiny_target, pipeline):
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    common = [*COMMON, f"pipeline={pipeline}"]
    launch([*common, f"hydra.run.dir={ref}"], cache_dir, check=True)
    proc = launch([*common, f"hydra.run.dir={crashed}", "+debug=faults", "debug.crash_at_step=9"], cache_dir)
    assert proc.returncode == -signal.SIGKILL  # killed after its second checkpoint (steps 4, 8)
    assert json.loads((crashed / "status.json").read_text())["status"] == "running"
    assert latest_checkpoint(crashed).name == "step_8"

    launch([f"resume={crashed}", "debug.crash_at_step=null"], cache_dir, check=True)
    assert json.loads((crashed / "status.json").read_text())["status"] == "completed"
    steps = [r["step"] for r in read_jsonl(crashed / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == len(set(steps)) and steps == sorted(steps) and steps[-1] == 12
    ref_steps = [r["step"] for r in read_jsonl(ref / "metrics.jsonl") if "train/loss" in r]
    assert ref_steps[-1] == 12
    a, b = final_weights(ref), final_weights(crashed)
    assert a.keys() == b.keys()
    for k in a:
        # bitwise on CPU: same data order, anchors and noise from (seed, step), same thread counts per stage
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


@pytest.mark.slow
def test_sigterm_checkpoint_then_resume_completes(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    env = {**os.environ, "DFLASH_CACHE_DIR": str(cache_dir), "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "launch.py",
            "experiment=smoke",
            f"hydra.run.dir={run_dir}",
            "train.max_steps=100000",
            "checkpoint.every_steps=0",
            "eval.num_prompts=0",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "interrupted"
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    stopped_at = int(ckpt.name.split("_")[1])
    launch([f"resume={run_dir}", f"train.max_steps={stopped_at + 5}"], cache_dir, check=True)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert steps[-1] == stopped_at + 5 and len(steps) == len(set(steps))


@pytest.mark.slow
def test_resume_refuses_model_and_data_changes_and_leaves_the_run_as_it_was(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    launch([*COMMON, "pipeline=sync", f"hydra.run.dir={run_dir}", "train.max_steps=4"], cache_dir, check=True)
    before = {f: (run_dir / f).read_text() for f in ("status.json", "config_resolved.yaml", "run.json")}
    proc = launch([f"resume={run_dir}", "model.block_size=8"], cache_dir)
    assert proc.returncode != 0 and "model.block_size" in proc.stderr and "keeps its model" in proc.stderr
    # data-stream keys are refused too (the checkpoint's data position counts batches of that stream)
    proc = launch([f"resume={run_dir}", "train.batch_size=4", "data.max_files=3"], cache_dir)
    assert proc.returncode != 0 and "train.batch_size=4, data.max_files=3" in proc.stderr
    assert "data stream" in proc.stderr
    # resuming into another directory would find no checkpoint and silently start over
    proc = launch([f"resume={run_dir}", f"hydra.run.dir={tmp_path / 'elsewhere'}"], cache_dir)
    assert proc.returncode != 0 and "in its own directory" in proc.stderr
    assert not (tmp_path / "elsewhere" / "status.json").exists()  # (Hydra itself makes the directory)
    # a refused resume leaves the run directory as it was
    assert before == {f: (run_dir / f).read_text() for f in before}
    assert json.loads(before["status.json"])["status"] == "completed"
    # an accepted resume records itself in run.json and keeps how the run was started
    launch([f"resume={run_dir}", "train.max_steps=6"], cache_dir, check=True)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["start_time"] == json.loads(before["run.json"])["start_time"]
    assert [r["overrides"] for r in run["resumes"]] == [[f"resume={run_dir}", "train.max_steps=6"]]


class _Trainer:
    def __init__(self, step):
        self.step = step

    def state_dict(self):
        return {"step": self.step, "tokens": 10 * self.step, "optimizer": {}, "next_data": [0, self.step]}


def test_truncated_checkpoint_is_ignored(tmp_path):
    d = make_drafter()
    save_checkpoint(tmp_path, d, _Trainer(4).state_dict(), {}, keep_last=3)
    save_checkpoint(tmp_path, d, _Trainer(8).state_dict(), {}, keep_last=3)
    ckpts = tmp_path / "checkpoints"
    # a write cut short: weights present, meta.json missing -> not complete
    (ckpts / "step_8" / "meta.json").unlink()
    shutil.copytree(ckpts / "step_4", ckpts / "step_12.tmp")  # and a temp dir that was never renamed
    assert latest_checkpoint(tmp_path).name == "step_4"
    # truncated weights with a meta.json: the file is unreadable, also skipped
    save_checkpoint(tmp_path, d, _Trainer(16).state_dict(), {}, keep_last=5)
    (ckpts / "step_16" / "state.pt").unlink()
    assert latest_checkpoint(tmp_path).name == "step_4"


def test_resume_hashes_a_checkpoint_once(tmp_path, monkeypatch):
    """The newest checkpoint is verified once (by rank 0 under data parallelism, its verdict broadcast), then
    loaded without hashing its files again."""
    from dflash.train import checkpoint
    from dflash.train.checkpointer import CheckpointManager

    d = make_drafter()
    save_checkpoint(tmp_path, d, _Trainer(4).state_dict(), {}, keep_last=3)
    hashed = []
    real = checkpoint.file_digest
    monkeypatch.setattr(checkpoint, "file_digest", lambda path: hashed.append(Path(path).name) or real(path))

    class T:
        step = 0

        def load_state_dict(self, state):
            self.step = state["step"]

    cfg = type("C", (), {"enabled": True, "every_steps": 0, "keep_last": 3})()
    trainer = T()
    assert CheckpointManager(cfg, tmp_path, make_drafter(seed=5), "target").resume(trainer) == 4
    assert sorted(hashed) == sorted(set(hashed)) and len(hashed) >= 2, hashed


def test_keep_last_prunes(tmp_path):
    d = make_drafter()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, d, _Trainer(step).state_dict(), {}, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3", "step_4"]


def test_checkpoint_of_another_shape_or_mask_is_refused(tmp_path):
    save_checkpoint(tmp_path, make_drafter(mask_id=1), _Trainer(1).state_dict(), {}, keep_last=1)
    ckpt = latest_checkpoint(tmp_path)
    load_checkpoint(ckpt, make_drafter(mask_id=1, seed=5))  # same shape: loads
    with pytest.raises(CheckpointMismatch, match="mask_token_id"):
        load_checkpoint(ckpt, make_drafter(mask_id=2))
    with pytest.raises(CheckpointMismatch, match="num_hidden_layers"):
        load_checkpoint(ckpt, make_drafter(layers=2))
    with pytest.raises(CheckpointMismatch, match="target_layer_ids"):
        load_checkpoint(ckpt, make_drafter(layer_ids=(1, 3)))


def test_state_is_loaded_with_weights_only(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, make_drafter(), _Trainer(1).state_dict(), {}, keep_last=1)
    calls = []
    real = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)

    class T:
        def load_state_dict(self, state):
            self.state = state

    t = T()
    load_checkpoint(latest_checkpoint(tmp_path), make_drafter(), t)
    assert calls == [True] and t.state["step"] == 1


@pytest.mark.slow
def test_resuming_a_completed_run_repeats_nothing(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    launch(
        [
            "experiment=smoke",
            "train.max_steps=4",
            "eval.num_prompts=1",
            "eval.max_new_tokens=4",
            f"hydra.run.dir={run_dir}",
        ],
        cache_dir,
        check=True,
    )
    before = (run_dir / "metrics.jsonl").read_text()
    assert '"eval/tau"' in before
    launch([f"resume={run_dir}"], cache_dir, check=True)
    assert (run_dir / "metrics.jsonl").read_text() == before  # no second final-eval row
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert json.loads((run_dir / "summary.json").read_text())["eval/tau"] >= 1.0


def test_resume_of_a_mistyped_path_creates_nothing(tmp_path, cache_dir):
    proc = launch([f"resume={tmp_path / 'nope'}"], cache_dir)
    assert proc.returncode != 0 and "not a run directory" in proc.stderr
    assert not (tmp_path / "nope").exists()


def test_resume_path_with_tilde_is_expanded_before_hydra(tmp_path, monkeypatch):
    from dflash.runner import entry

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config_resolved.yaml").write_text("{}\n")
    argv = entry._route_resume(["launch.py", "+resume=~/run", "train.max_steps=3"])
    assert argv == [
        "launch.py",
        f"resume={tmp_path / 'run'}",
        "train.max_steps=3",
        f"hydra.run.dir={tmp_path / 'run'}",
        "hydra.output_subdir=.hydra/resume",
    ]


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":  # 64 bytes flipped in the middle: same size, other content
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 64]) + data[mid + 64 :])
    else:  # cut to half
        path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_resume_skips_a_corrupt_newest_checkpoint(tmp_path, cache_dir, tiny_target, how, caplog):
    """The newest checkpoint's weights flipped or cut: resume says so (path and file) and falls back to the
    previous complete checkpoint; with every checkpoint corrupt it stops with a clear message."""
    run_dir = tmp_path / "run"
    proc = launch([*COMMON, f"hydra.run.dir={run_dir}", "+debug=faults", "debug.crash_at_step=9"], cache_dir)
    assert proc.returncode == -signal.SIGKILL
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    assert [p.name for p in ckpts] == ["step_4", "step_8"]
    meta = json.loads((ckpts[-1] / "meta.json").read_text())
    assert set(meta["files"]) == {"drafter.safetensors", "state.pt"} and len(meta["files"]["state.pt"]["sha256"]) == 64
    _corrupt(ckpts[-1] / "drafter.safetensors", how)

    proc = launch([f"resume={run_dir}", "debug.crash_at_step=null"], cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "step_8: drafter.safetensors" in out and "falling back" in out
    assert "from step_4 (step 4)" in out

    for ckpt in (run_dir / "checkpoints").glob("step_*"):  # now every checkpoint is corrupt
        _corrupt(ckpt / "state.pt", how)
    proc = launch([f"resume={run_dir}", "train.max_steps=20"], cache_dir)
    assert proc.returncode != 0
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and "no checkpoint of this run verifies" in status["error"]


def test_resume_refuses_changed_training_data(tmp_path, cache_dir, tiny_target):
    """data=jsonl rewritten between a crash and the resume: refused, naming the file; accepted on request and
    recorded in run.json."""
    data = tmp_path / "data.jsonl"
    text = json.dumps({"text": "def f(x):\n    return x + 1\n" * 40})
    data.write_text((text + "\n") * 24)
    run_dir = tmp_path / "run"
    common = [*COMMON, "data=jsonl", f"data.path={data}"]
    proc = launch([*common, f"hydra.run.dir={run_dir}", "+debug=faults", "debug.crash_at_step=9"], cache_dir)
    assert proc.returncode == -signal.SIGKILL
    fingerprint = json.loads((run_dir / "run.json").read_text())["data_fingerprint"]
    assert str(data.resolve()) in fingerprint["files"] and fingerprint["tokenizer"]

    data.write_text((text.replace("x + 1", "x + 2") + "\n") * 24)  # same size, other content
    proc = launch([f"resume={run_dir}", "debug.crash_at_step=null"], cache_dir)
    assert proc.returncode != 0
    error = json.loads((run_dir / "status.json").read_text())["error"]
    assert "training data changed since checkpoint step_8" in error and str(data.resolve()) in error

    launch([f"resume={run_dir}", "debug.crash_at_step=null", "resume_accept_data_change=true"], cache_dir, check=True)
    run_info = json.loads((run_dir / "run.json").read_text())
    assert any(str(data.resolve()) in " ".join(r.get("accepted_data_change", [])) for r in run_info["resumes"])
    assert "resume_accept_data_change: true" in (run_dir / "config_resolved.yaml").read_text()  # this resume's
