"""Configuration and environment errors end in one `error:` line that names the fix, without a traceback (that
with HYDRA_FULL_ERROR=1), and where they can be, before Hydra makes a run directory (dflash/runner/preflight.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from conftest import REPO, compose_config, launch
from omegaconf import OmegaConf

from dflash.runner import preflight


def _closed_port_endpoint() -> str:
    """An http endpoint on this machine where nothing listens: a connect is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _no_proxy(monkeypatch) -> None:
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr
    assert lines and lines[-1].startswith("error: "), proc.stderr
    return lines[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needles",
    [
        (["data=jsonl", "data.path=/nonexistent.jsonl"], ["data.path='/nonexistent.jsonl'", "no such file"]),
        (["train.num_anchors=0"], ["train.num_anchors=0 is invalid"]),
        (["model=tiny", "model.build.kind=none", "model.target=/nonexistent/model"], ["/nonexistent/model"]),
        (["-m", "hydra/launcher=slurm_ddp"], ["sbatch", "hydra/launcher=local_ddp"]),
        (["data=jsonl", "data.path=${oc.env:DFLASH_UNSET_FOR_TEST}"], ["data.path:", "DFLASH_UNSET_FOR_TEST"]),
    ],
)
def test_mistakes_are_one_line_before_a_run_directory(tmp_path, cache_dir, args, needles):
    run_dir = tmp_path / "run"
    env = {"HYDRA_FULL_ERROR": "0", "PATH": "/usr/bin:/bin"}  # no sbatch on that PATH
    proc = launch(
        # -m first, as users write it (Hydra's argument parser wants its flags before the overrides)
        sorted(["experiment=smoke", *args, f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={run_dir}"], key="-m".__ne__),
        cache_dir,
        env=env,
    )
    line = _one_error_line(proc)
    assert all(n in line for n in needles), line
    assert not run_dir.exists()


@pytest.mark.slow
def test_the_traceback_is_there_with_hydra_full_error(tmp_path, cache_dir):
    proc = launch(["experiment=smoke", "train.num_anchors=0", f"hydra.run.dir={tmp_path / 'run'}"], cache_dir)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "train.num_anchors=0" in proc.stderr


@pytest.mark.slow
def test_an_unreachable_hub_is_named_at_once(tmp_path, cache_dir, monkeypatch):
    """model=qwen3_8b with no network: the hub's address and both ways out, not transformers' retries."""
    _no_proxy(monkeypatch)
    endpoint = _closed_port_endpoint()
    env = {"HYDRA_FULL_ERROR": "0", "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = launch(["model=qwen3_8b", f"hydra.run.dir={tmp_path / 'run'}"], cache_dir, env=env)
    line = _one_error_line(proc)
    assert endpoint in line and "download it first" in line and "HF_HUB_OFFLINE=1" in line, line
    assert not (tmp_path / "run").exists()
    proc = launch(["model=qwen3_8b"], cache_dir, env={**env, "HF_HUB_OFFLINE": "1"})
    line = _one_error_line(proc)
    assert "HF_HUB_OFFLINE=1" in line and "download it first" in line and str(tmp_path / "hub") in line, line


@pytest.mark.slow
def test_a_refused_resume_is_one_line(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    OmegaConf.save(compose_config(["experiment=smoke"]), run_dir / "config_resolved.yaml")
    proc = launch([f"resume={run_dir}", "model.block_size=8"], cache_dir, env={"HYDRA_FULL_ERROR": "0"})
    line = _one_error_line(proc)
    assert "model.block_size=8 would change the model" in line, line


@pytest.mark.slow
def test_under_torchrun_the_failing_rank_message_ends_the_output(tmp_path, cache_dir):
    """torchrun's closing summary (its root cause) shows the rank's one line, not a pointer to the docs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch.py"]
    args = ["experiment=smoke", "parallel=ddp", "data=jsonl", "data.path=/nonexistent.jsonl"]
    env = {"DFLASH_CACHE_DIR": str(cache_dir), "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run(
        [*cmd, *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        env={**__import__("os").environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    root_cause = proc.stderr.rsplit("Root Cause", 1)[-1]
    assert "error: data.path='/nonexistent.jsonl': no such file" in root_cause, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_a_cached_hub_model_loads_offline_when_the_hub_is_unreachable(tmp_path, monkeypatch):
    """No ~30 s of retries before the cache is used: the process goes offline (HF_HUB_OFFLINE) at once."""
    from huggingface_hub import constants

    _no_proxy(monkeypatch)
    snapshot = tmp_path / "models--org--model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "models--org--model" / "refs").mkdir()
    (tmp_path / "models--org--model" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "ENDPOINT", _closed_port_endpoint())
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    preflight._check_target("org/model")
    assert constants.HF_HUB_OFFLINE and __import__("os").environ["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(preflight.LaunchRefused, match="unreachable"):
        preflight._check_target("org/other")  # not cached: refused, naming the hub


def test_regenerate_without_a_server_names_the_url_and_the_fix(tmp_path):
    """`python -m dflash.regenerate ... --backend openai` with nothing listening: one error line, not the client's
    three chained tracebacks, naming the base URL and saying to start the server."""
    from dflash.recipes.regenerate import main

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    base_url = _closed_port_endpoint() + "/v1"
    argv = [str(chats), str(tmp_path / "out.jsonl"), "--backend", "openai", "--base-url", base_url, "--max-retries=0"]
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    message = str(stopped.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert base_url in message and "start the server" in message, message
    assert not (tmp_path / "out.jsonl").exists()
