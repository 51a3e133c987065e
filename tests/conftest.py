"""Shared fixtures: one tiny random Qwen3 target per test session, and a helper to run launch.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """In-process tests use tiny models: one intra-op thread is far faster than two on a shared 2-core box."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """DFLASH_CACHE_DIR for every subprocess run: the tiny_random target is built once per session."""
    return tmp_path_factory.mktemp("dflash-cache")


@pytest.fixture(scope="session")
def tiny_target(cache_dir) -> Path:
    from omegaconf import OmegaConf

    from dflash.core.config import TinyBuildConfig
    from dflash.model.tiny import ensure_target

    spec = OmegaConf.load(REPO / "conf/model/tiny_random.yaml")
    build = TinyBuildConfig(**OmegaConf.to_container(spec.build))
    target = cache_dir / "tiny-random-qwen3-v1"

    class M:  # the two fields ensure_target reads
        pass

    m = M()
    m.target, m.build = str(target), build
    ensure_target(m)
    return target


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, pgrp, ...), or None when it is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def descendants(pid: int) -> list[int]:
    """The live processes below `pid`, however deep: torchrun's ranks run in sessions of their own, out of reach of
    their launcher's process group."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found += (kids := children.get(todo.pop(), []))
        todo += kids
    return found


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader once it ended, or its group never empties
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def end_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """End `proc`'s process group (its session: start_new_session) and every process below it: SIGTERM to the
    group (torchrun passes it on to its ranks and waits for them), then SIGKILL after `grace_s` to the group and to
    any descendant left (a rank in a session of its own). Reaps `proc`; a no-op when all have ended."""
    below = descendants(proc.pid)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not _group_alive(proc) and not any(alive(p) for p in below):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        for pid in below if sig == signal.SIGKILL else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while (_group_alive(proc) or any(alive(p) for p in below)) and time.monotonic() < deadline:
            time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def run_process_group(cmd: list[str], env: dict, timeout: float, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout), in a session of its own: on a timeout,
    or any other way out of this call (pytest-timeout's alarm, Ctrl-C), and after it ends, its whole process group
    is ended, torchrun's ranks too, which would otherwise outlive their launcher (parent PID 1) and slow every
    test after them (issue 57). Output goes through files: a process the command left behind holding a pipe would
    keep a reader of that pipe waiting."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            end_process_group(proc)  # on the way out, and whatever the command left behind in its group
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def launch(
    args: list[str], cache_dir: Path, timeout: float = 300, env: dict | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """Run `python launch.py ARGS` from the repo root with the session's target cache (its process group ended
    on a timeout: run_process_group)."""
    full_env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(cache_dir),
        "WANDB_MODE": "disabled",
        "HYDRA_FULL_ERROR": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    proc = run_process_group([sys.executable, "launch.py", *args], full_env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def compose_config(overrides: list[str], return_hydra_config: bool = False):
    """The job config launch.py would compose for OVERRIDES, for tests that call dflash.runner.run in-process (with
    its `hydra` node: for tests of Hydra callbacks)."""
    from hydra import compose, initialize_config_dir

    from dflash.core.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=return_hydra_config)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A random 4-layer, 64-wide Qwen3 target and its 512-token tokenizer, built in-process (no pretraining)."""
    from dflash.core.config import TinyBuildConfig
    from dflash.model.tiny import build

    d = tmp_path_factory.mktemp("tiny") / "target"
    build(
        d,
        TinyBuildConfig(
            kind="tiny_random",
            vocab_size=512,
            hidden_size=64,
            num_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=128,
            pretrain_steps=0,
        ),
    )
    return d


def biased_target_and_drafter(tiny_dir: Path, block_size: int):
    """`tiny_dir`'s target with random weights and its LM head's row 0 scaled up, so its greedy output often is token
    0, and a 1-layer drafter that always drafts token 0 (its final norm is zero, so every draft logit is 0): accepted
    lengths then vary between 1 and B. Returns (target, drafter, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from dflash.model.drafter import DFlashDraftModel

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    target = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        target.get_output_embeddings().weight[0] *= 4.0
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # fmt: skip
    cfg.dflash_config = {"mask_token_id": tok.mask_token_id, "target_layer_ids": [1, 2], "block_size": block_size}
    cfg.block_size, cfg.num_target_layers = block_size, 4
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        drafter.norm.weight.zero_()
    return target, drafter, tok
