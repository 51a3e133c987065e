"""W&B through launch.py, offline (no network): the run W&B recorded matches metrics.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import launch
from wandb_offline import read_offline_run

pytestmark = pytest.mark.slow

KEYS = ["train/loss", "train/avg_streak", "train/noise_std", "train/lr", "perf/ktok_s", "perf/hs_queue_depth"]


def last_values(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        out.update({k: v for k, v in json.loads(line).items() if v is not None})
    return out


def _offline_args(run_dir):
    return [
        "experiment=smoke",
        "logging=wandb",
        "logging.wandb.mode=offline",
        f"hydra.run.dir={run_dir}",
        "loss.kl_temperature=2.0",
        "schedule.noise_start=0.05",
        "eval.num_prompts=1",
    ]


def test_offline_run_matches_metrics_jsonl_and_resumes_same_run(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    launch(_offline_args(run_dir), cache_dir, check=True, env={"WANDB_MODE": "offline"})
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    rec = read_offline_run(run_dir)
    assert rec["state"] == "finished"
    assert rec["config"]["loss"]["kl_temperature"] == 2.0
    jsonl = last_values(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())  # the W&B summary is summary.json's
    for key in KEYS:
        assert key in rec["history_keys"] and key in jsonl, key
        assert math.isclose(rec["summary"][key], summary[key], rel_tol=1e-6, abs_tol=1e-9), key
    assert "eval/tau" in rec["summary"]
    run_id = rec["run_id"]
    # resuming continues the same W&B run id
    launch([f"resume={run_dir}", "train.max_steps=9"], cache_dir, check=True, env={"WANDB_MODE": "offline"})
    ids = {p.name.rsplit("-", 1)[-1] for p in run_dir.glob("wandb/offline-run-*")}
    assert ids == {run_id}


def test_multirun_jobs_share_a_group(tmp_path, cache_dir, tiny_target):
    sweep = tmp_path / "sweep"
    launch(
        [
            "-m",
            "experiment=smoke",
            "logging=wandb",
            "logging.wandb.mode=offline",
            f"hydra.sweep.dir={sweep}",
            "train.max_steps=3",
            "eval.num_prompts=0",
            "loss=kl",  # reads kl_temperature (dpace, the default, does not: such a sweep is refused)
            "loss.kl_temperature=1,2",
        ],
        cache_dir,
        check=True,
        env={"WANDB_MODE": "offline"},
    )
    recs = [read_offline_run(sweep / str(i)) for i in (0, 1)]
    assert recs[0]["run_id"] != recs[1]["run_id"]
    assert recs[0]["group"] == recs[1]["group"] and recs[0]["group"]
    assert {r["name"] for r in recs} == {"loss.kl_temperature=1", "loss.kl_temperature=2"}


ENV_SECRETS = {
    "WANDB_API_KEY": "env-wandb-key-0001",
    "OPENAI_API_KEY": "env-openai-key-0002",
    "HF_TOKEN": "env-hf-0003",
}
CLI_SECRET = "sk-cli-secret-0004"
SECRET_ARG = f"+logging.wandb.settings.api_key={CLI_SECRET}"


def _files_with_secrets(root: Path) -> list[str]:
    """Every file under root (W&B's binary run record included) that holds one of the secrets, as raw bytes."""
    secrets = [CLI_SECRET, *ENV_SECRETS.values()]
    return [f"{f}: {s}" for f in root.rglob("*") if f.is_file() for s in secrets if s.encode() in f.read_bytes()]


def test_no_secret_from_the_command_line_or_the_environment_reaches_a_file(tmp_path, cache_dir, tiny_target):
    """Secrets in the environment and on the command line (a run, then its resume): no file of the run holds
    one, W&B's record has the redacted command, and the command line's secret costs one warning."""
    run_dir = tmp_path / "run"
    env = {**ENV_SECRETS, "WANDB_MODE": "offline"}
    proc = launch([*_offline_args(run_dir), "train.max_steps=4", SECRET_ARG], cache_dir, check=True, env=env)
    out = proc.stdout + proc.stderr
    warnings = [line for line in out.splitlines() if "looks like a secret" in line]
    assert len(warnings) == 1 and "logging.wandb.settings.api_key" in warnings[0] and "oc.env" in warnings[0]
    assert CLI_SECRET not in out
    launch([f"resume={run_dir}", "train.max_steps=6", SECRET_ARG], cache_dir, check=True, env=env)
    assert (run_dir / ".hydra/resume/overrides.yaml").is_file()
    records = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(records) == 2  # the run's and the resume's
    for record in records:  # each records the command, redacted
        assert b"+logging.wandb.settings.api_key=<redacted>" in record.read_bytes(), record
    assert _files_with_secrets(run_dir) == []


def test_no_secret_from_the_command_line_reaches_a_file_of_a_multirun(tmp_path, cache_dir, tiny_target):
    sweep = tmp_path / "sweep"
    args = ["-m", "experiment=smoke", "logging=wandb", f"hydra.sweep.dir={sweep}", "train.max_steps=2", SECRET_ARG]
    proc = launch([*args, "eval.num_prompts=0"], cache_dir, check=True, env={**ENV_SECRETS, "WANDB_MODE": "offline"})
    out = proc.stdout + proc.stderr
    assert out.count("looks like a secret") == 1 and "#0 : " in out and CLI_SECRET not in out
    assert (sweep / "multirun.yaml").is_file() and list(sweep.glob("0/wandb/offline-run-*/run-*.wandb"))
    assert _files_with_secrets(sweep) == []


def test_wandb_unimportable_run_completes_with_warning(tmp_path, cache_dir, tiny_target):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "wandb.py").write_text("raise ImportError('wandb is broken here')\n")
    run_dir = tmp_path / "run"
    proc = launch(_offline_args(run_dir), cache_dir, check=True, env={"PYTHONPATH": str(shim)})
    out = proc.stdout + proc.stderr  # Hydra's job logging writes to stdout
    assert "wandb is broken here" in out and "W&B disabled" in out
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


def test_online_without_key_completes_with_warning(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    args = [a for a in _offline_args(run_dir) if "mode=" not in a] + ["logging.wandb.mode=online"]
    proc = launch(args, cache_dir, check=True, env={"HOME": str(tmp_path), "WANDB_API_KEY": "", "WANDB_MODE": ""})
    assert "wandb login" in proc.stdout + proc.stderr
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


def test_an_unreachable_wandb_server_neither_slows_nor_holds_the_run(tmp_path, cache_dir, tiny_target):
    """logging.wandb.mode=online against a server on 127.0.0.1 that accepts connections and never answers:
    training starts at once (W&B starts beside it), metrics.jsonl is complete, the job ends in bounded time and
    the warning says how to log and sync instead."""
    import socket
    import threading
    import time

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def accept_and_ignore():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept_and_ignore, daemon=True).start()
    run_dir = tmp_path / "run"
    env = {
        "WANDB_MODE": "online",
        "WANDB_API_KEY": "k" * 40,
        "WANDB_BASE_URL": f"http://127.0.0.1:{server.getsockname()[1]}",
    }
    t0 = time.monotonic()
    try:
        proc = launch(
            [
                "experiment=smoke",
                "logging=wandb",
                "logging.wandb.mode=online",
                "train.max_steps=12",
                "logging.wandb.init_timeout_s=15",
                f"hydra.run.dir={run_dir}",
            ],
            cache_dir,
            env=env,
            timeout=180,
        )
    finally:
        server.close()
        for conn in held:
            conn.close()
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert held, "W&B never tried the server"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert train[-1]["step"] == 12 and any("eval/tau" in r for r in records)
    assert train[0]["time_s"] < 10  # training did not wait the 15 s W&B spent trying to start
    assert elapsed < 90, elapsed
    out = proc.stdout + proc.stderr
    assert "wandb.init failed" in out and "wandb sync" in out


def test_a_wandb_server_that_stops_answering_mid_run_neither_slows_nor_holds_the_run(tmp_path, cache_dir, tiny_target):
    """logging.wandb.mode=online against a W&B-shaped server on 127.0.0.1 that answers the run's start and then
    stops answering: training keeps its pace, metrics.jsonl is complete, the job ends within a bounded time
    after its last step and the warning says how to sync the run's files later."""
    import time

    from fake_wandb_server import FakeWandbServer

    server = FakeWandbServer(hang_after_file_stream=1)
    run_dir = tmp_path / "run"
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": server.url}
    t0 = time.monotonic()
    try:
        proc = launch(
            [
                "experiment=smoke",
                "logging=wandb",
                "logging.wandb.mode=online",
                "train.max_steps=200",
                "pipeline.monitor_interval_s=0.05",
                "logging.wandb.finish_timeout_s=10",
                f"hydra.run.dir={run_dir}",
            ],
            cache_dir,
            env=env,
            timeout=240,
        )
    finally:
        server.close()
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert server.hang.is_set() and any("graphql" in r for r in server.requests), server.requests[:5]
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in x]
    assert train[-1]["step"] == 200 and train[-1]["time_s"] < 60  # training did not wait for W&B
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    out = proc.stdout + proc.stderr
    assert "did not finish within 10 s" in out and "wandb sync" in out
    assert elapsed < 150, elapsed
