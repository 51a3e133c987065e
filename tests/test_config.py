"""Every config file composes and validates; bad input fails fast with one message naming the key or path."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import REPO, compose_config, launch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dflash.core.config import ConfigError, register_configs
from dflash.core.validation import validate
from dflash.model.build import resolve_target_layer_ids

CONF = REPO / "conf"
register_configs()


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _group_options():
    for group_dir in sorted(p for p in CONF.iterdir() if p.is_dir()):
        for f in sorted(group_dir.glob("*.yaml")):
            yield group_dir.name, f.stem


@pytest.mark.parametrize("group,option", list(_group_options()))
def test_every_config_file_composes_and_validates(group, option):
    # debug is not in the defaults list: its options are appended (`+debug=faults`), as users do
    overrides = [f"+{group}={option}" if group == "debug" else f"{group}={option}"]
    if (group == "data" and option in ("jsonl", "tokens")) or option == "paper_qwen3_8b":
        overrides.append("data.path=/some/data.jsonl")
    cfg = _compose(overrides)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    validate(cfg)
    if group == "pipeline":  # its option is its mode
        assert cfg.pipeline.mode == option
    elif group not in ("experiment", "debug", "logging"):  # logging's options differ in wandb.mode alone
        assert cfg[group].name == option


def test_published_shapes():
    cfg = _compose(["model=qwen3_8b"])
    assert (cfg.model.block_size, cfg.model.num_draft_layers, cfg.model.mask_token_id) == (16, 5, 151669)
    assert resolve_target_layer_ids(cfg.model, 36) == [1, 9, 17, 25, 33]
    cfg = _compose(["model=qwen3_6_27b"])
    assert cfg.model.mask_token_id == 248070 and resolve_target_layer_ids(cfg.model, 64) == [1, 16, 31, 46, 61]


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.block_size=1", "model.block_size"),
        ("loss.kl_temperature=0", "loss.kl_temperature"),
        ("loss.streak_alpha=-0.5", "loss.streak_alpha"),
        ("loss.dpace_alpha=1.5", "loss.dpace_alpha"),
        ("schedule.noise_start=0.1", None),  # noise_end 0 <= 0.1 is fine
        ("schedule.noise_end=0.5", "schedule.noise_end"),  # end above start (0)
        ("train.seq_len=8", "train.seq_len"),
        ("logging.wandb.mode=sometimes", "logging.wandb.mode"),
        ("pipeline.mode=parallel", "pipeline.mode"),
        ("data.on_bad_record=ignore", "data.on_bad_record"),
        # each of these used to fail only after the target had loaded (or at the final eval)
        ("eval.prompt_lookup_ngram=0", "eval.prompt_lookup_ngram"),
        ("eval.prompt_len=0", "eval.prompt_len"),
        ("pipeline.queue_bytes=0", "pipeline.queue_bytes"),
        ("pipeline.join_timeout_s=0", "pipeline.join_timeout_s"),
        ("pipeline.threads_per_stage=0", "pipeline.threads_per_stage"),
        ("optim.weight_decay=-0.1", "optim.weight_decay"),
        ("optim.betas=[0.9,1.0]", "optim.betas"),
        ("optim=muon optim.muon_momentum=1.0", "optim.muon_momentum"),
        ("optim=muon optim.muon_adjust_lr=keller", "optim.muon_adjust_lr"),
        ("model.num_target_features=0", "model.num_target_features"),
        ("data.max_files=0", "data.max_files"),
        ("model.draft_num_attention_heads=0", "model.draft_num_attention_heads"),
    ],
)
def test_value_checks_name_the_key(override, key):
    cfg = _compose(override.split())
    if key is None:
        validate(cfg)
        return
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_flex_attention_on_cpu_is_refused_before_loading():
    with pytest.raises(ConfigError, match="model.attention.*flex needs a CUDA device"):
        validate(_compose(["model.attention=flex", "model.device=cpu"]))
    validate(_compose(["model.attention=flex", "model.device=auto"]))  # resolved on the machine that runs it


def test_target_layer_ids_checked_against_target():
    cfg = _compose(["model.target_layer_ids=[1,9]"])
    with pytest.raises(ConfigError, match=r"model\.target_layer_ids"):
        resolve_target_layer_ids(cfg.model, 6)


def _status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle,creates_run_dir",
    [
        (["model.blok_size=3"], "blok_size", False),  # unknown key: Hydra refuses at composition
        (["model.block_size=abc"], "model.block_size", False),  # wrong type
        # out of range, a missing target or data: refused before Hydra makes the run directory
        # (dflash/runner/preflight.py)
        (["model.block_size=1"], "model.block_size", False),
        (["model=tiny", "model.build.kind=none", "model.target=/nonexistent/model"], "/nonexistent/model", False),
        (["data=jsonl", "data.path=/nonexistent/data.jsonl"], "/nonexistent/data.jsonl", False),
        # a sweep's job is checked in its run directory (its values may be swept): status.json says failed
        (["-m", "model.block_size=1,2", "hydra.sweep.dir=SWEEP"], "model.block_size", True),
    ],
)
def test_bad_input_fails_fast(tmp_path, cache_dir, tiny_target, args, needle, creates_run_dir):
    run_dir = tmp_path / "run"
    if "-m" in args:  # the first job's directory
        args, run_dir = [a.replace("SWEEP", str(tmp_path / "sweep")) for a in args], tmp_path / "sweep" / "0"
    t0 = time.time()
    args = ["-m"] * ("-m" in args) + ["experiment=smoke", f"hydra.run.dir={run_dir}", *(a for a in args if a != "-m")]
    proc = launch(args, cache_dir, timeout=120, env={"HYDRA_FULL_ERROR": "0"})
    assert proc.returncode != 0
    assert time.time() - t0 < 60
    assert needle in proc.stderr + proc.stdout
    if creates_run_dir:
        status = _status(run_dir)
        assert status["status"] == "failed" and needle in status["error"]
    else:
        assert not (run_dir / "status.json").exists()


@pytest.mark.slow
def test_unreadable_data_file(tmp_path, cache_dir, tiny_target):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "print(1)"}\n')
    data.chmod(0o000)
    if data.stat().st_mode & 0o777 == 0 and __import__("os").access(data, __import__("os").R_OK):
        data.write_bytes(b"\xff\xfe\xfa not utf-8")  # root reads anything: make it undecodable instead
    run_dir = tmp_path / "run"
    proc = launch(["experiment=smoke", f"hydra.run.dir={run_dir}", "data=jsonl", f"data.path={data}"], cache_dir)
    assert proc.returncode != 0
    assert str(data) in proc.stderr
    assert _status(run_dir)["status"] == "failed"


def test_cuda_device_without_cuda_is_a_config_error(monkeypatch):
    import torch

    from dflash.core.config import ConfigError
    from dflash.core.distributed import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="model.device='cuda:1' is invalid: torch sees no CUDA device"):
        resolve_device("cuda:1")
    assert resolve_device("auto").type == "cpu" and resolve_device("cpu").type == "cpu"


def test_resume_upgrades_a_config_saved_by_an_older_version(tmp_path):
    """Fault-injection keys moved from train.* to debug.*, pipeline.drafter_workers is gone: an old run resumes."""
    from dflash.runner.resume import resume_config

    run_dir = tmp_path / "old"
    run_dir.mkdir()
    saved = OmegaConf.to_container(_compose([]), resolve=True)
    saved.pop("debug")
    saved.pop("parallel")
    saved["train"]["crash_at_step"] = 9
    saved["pipeline"]["drafter_workers"] = 1
    saved["resume_accept_data_change"] = True  # accepted by an earlier resume: not carried into the next
    OmegaConf.save(OmegaConf.create(saved), run_dir / "config_resolved.yaml")
    cfg = _compose([f"resume={run_dir}"])
    merged = resume_config(cfg, run_dir, [f"resume={run_dir}"])
    assert merged.debug.crash_at_step == 9 and "crash_at_step" not in merged.train
    assert "drafter_workers" not in merged.pipeline and merged.parallel.name == "single"
    assert merged.resume_accept_data_change is False
    validate(merged)


def test_dataclass_defaults_are_what_the_default_run_composes(monkeypatch):
    """One source of every default: each dataclass default equals the value `python launch.py` composes (the
    default group options and config.yaml), so no file holds a competing value. Keys a group option owns by
    its nature are the exceptions: which target (model.name, model.target, model.build.kind: real models
    build nothing) and which data (data.name)."""
    from omegaconf import OmegaConf

    from dflash.core.config import Config

    for var in ("WANDB_MODE", "WANDB_PROJECT", "DFLASH_CACHE_DIR"):  # env-interpolated defaults, resolved
        monkeypatch.delenv(var, raising=False)
    owned_by_the_option = {"model.name", "model.target", "model.build.kind", "data.name"}
    composed = OmegaConf.to_container(compose_config([]), resolve=True)
    schema = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)

    def leaves(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    expected = dict(leaves(schema))
    differ = {
        key: (value, expected.get(key, "<no field>"))
        for key, value in leaves(composed)
        if key not in owned_by_the_option and value != expected.get(key, "<no field>")
    }
    assert not differ, f"composed value vs dataclass default: {differ}"
