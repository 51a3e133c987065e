"""Shared fixtures: one tiny random Qwen3 target per test session, and a helper to run launch.py."""

from __future__ import annotations

import os
import subprocess
import sys
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


def launch(
    args: list[str], cache_dir: Path, timeout: float = 300, env: dict | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """Run `python launch.py ARGS` from the repo root with the session's target cache."""
    full_env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(cache_dir),
        "WANDB_MODE": "disabled",
        "HYDRA_FULL_ERROR": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, "launch.py", *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
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
