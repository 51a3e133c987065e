"""Resumable checkpoints: `checkpoints/step_N/` with the drafter (safetensors), optimizer + counters + data
position (torch, loaded with weights_only=True), RNG states and meta.json.

A checkpoint is written to `step_N.tmp/` and renamed; `meta.json` (written last) carries `complete: true`,
so a directory truncated mid-write is never mistaken for a complete one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.jsonio import read_json
from dflash.rundir import RunDir

log = logging.getLogger(__name__)

WEIGHTS = "drafter.safetensors"
STATE = "state.pt"
META = "meta.json"


class CheckpointMismatch(ValueError):
    """A checkpoint made for a different drafter shape or mask token."""


def model_signature(drafter) -> dict:
    """What must match between a checkpoint and the drafter it is loaded into."""
    c = drafter.config
    return {
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size,
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": list(drafter.target_layer_ids),
    }


def save_checkpoint(run_dir: Path, drafter, trainer_state: dict, extra: dict, keep_last: int) -> Path:
    root = RunDir(run_dir).checkpoints
    root.mkdir(parents=True, exist_ok=True)
    step = int(trainer_state["step"])
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(tmp / WEIGHTS))
    torch.save({"trainer": trainer_state, "rng": {"torch": torch.get_rng_state()}}, tmp / STATE)
    meta = {
        "step": step,
        "tokens": int(trainer_state["tokens"]),
        "signature": model_signature(drafter),
        "drafter_config": drafter.config.to_dict(),
        **extra,
        "complete": True,
    }
    (tmp / META).write_text(json.dumps(meta, indent=2, default=str))
    for name in (WEIGHTS, STATE, META):  # on disk before the rename makes the checkpoint look complete
        _fsync(tmp / name)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)  # the rename itself survives a power loss
    _prune(root, keep_last)
    log.info("checkpoint step %d -> %s", step, final)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_checkpoints(root: Path) -> list[Path]:
    out = []
    for d in root.glob("step_*"):
        if d.suffix == ".tmp" or not d.is_dir():
            continue
        meta = read_json(d / META, default={})
        if isinstance(meta, dict) and meta.get("complete") and (d / WEIGHTS).is_file() and (d / STATE).is_file():
            out.append(d)
    return sorted(out, key=lambda d: int(d.name.split("_")[1]))


def _prune(root: Path, keep_last: int) -> None:
    for d in _complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(d, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (incomplete or truncated ones are skipped)."""
    root = RunDir(run_dir).checkpoints
    if not root.is_dir():
        return None
    ckpts = _complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def read_meta(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / META).read_text())


def load_checkpoint(ckpt: Path, drafter, trainer=None) -> dict:
    """Load weights (and trainer state) into drafter / trainer; refuses a checkpoint of another shape or mask id.
    Returns meta.json."""
    meta = read_meta(ckpt)
    want, have = model_signature(drafter), meta.get("signature", {})
    diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if diff:
        lines = ", ".join(f"{k}: checkpoint {a} vs run {b}" for k, (a, b) in diff.items())
        raise CheckpointMismatch(f"checkpoint {ckpt} does not fit this drafter ({lines})")
    weights = load_file(str(Path(ckpt) / WEIGHTS), device=str(next(drafter.parameters()).device))
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise CheckpointMismatch(f"checkpoint {ckpt}: missing keys {missing}, unexpected keys {unexpected}")
    if trainer is not None:
        state = torch.load(Path(ckpt) / STATE, map_location="cpu", weights_only=True)
        trainer.load_state_dict(state["trainer"])
        torch.set_rng_state(state["rng"]["torch"])
    return meta


def load_drafter_from_source(source: Path):
    """A drafter from a checkpoint dir, a run dir (its latest checkpoint, else its drafter/), or a drafter dir.
    Returns (drafter, target path or None)."""
    from transformers import Qwen3Config

    from dflash.model.drafter import DFlashDraftModel

    source = Path(source)
    target = None
    run = RunDir(source)
    if run.config_file.exists():
        from omegaconf import OmegaConf

        target = OmegaConf.load(run.config_file).model.target
        ckpt = latest_checkpoint(source)
        if ckpt is None:
            if (run.drafter / "config.json").exists():
                return DFlashDraftModel.from_pretrained(run.drafter), target
            raise FileNotFoundError(f"{source}: run has no complete checkpoint and no drafter/")
        source = ckpt
    if (source / META).exists():
        meta = read_meta(source)
        drafter = DFlashDraftModel(Qwen3Config.from_dict(meta["drafter_config"]))
        load_checkpoint(source, drafter)
        return drafter, target or meta.get("target")
    if (source / "config.json").exists():
        return DFlashDraftModel.from_pretrained(source), target
    raise FileNotFoundError(f"{source}: not a run dir, checkpoint dir or drafter dir")


class CheckpointManager:
    """Owns *when* and *how* a run checkpoints: every `checkpoint.every_steps`, once more on every way the run
    ends (completed, interrupted, failed: at most the current step is lost), `keep_last`, and loading the
    newest complete checkpoint on resume.

    `extra_state()` supplies what the tracking sinks need back on resume (the W&B run id).
    """

    def __init__(self, cfg, run_dir: Path, drafter, target_path: str):
        self.cfg = cfg  # the `checkpoint` config group
        self.run_dir = Path(run_dir)
        self.drafter = drafter
        self.target_path = target_path
        self.on_saved: Callable[[int, Path], None] = lambda step, path: None
        self.extra_state: Callable[[], dict] = dict
        self.resumed_state: dict = {}  # meta.json of the checkpoint a resume loaded

    def should_save(self, step: int) -> bool:
        return bool(self.cfg.enabled and self.cfg.every_steps and step % self.cfg.every_steps == 0)

    def maybe_save(self, trainer) -> None:
        if self.should_save(trainer.step):
            self.save(trainer)

    def save(self, trainer) -> Path:
        # a resumed job without W&B keeps the resumed id for the next resume that has W&B
        run_id = self.extra_state().get("wandb_run_id") or self.resumed_state.get("wandb_run_id")
        extra = {"wandb_run_id": run_id, "target": self.target_path}
        path = save_checkpoint(self.run_dir, self.drafter, trainer.state_dict(), extra, self.cfg.keep_last)
        self.on_saved(trainer.step, path)
        return path

    def save_final(self, trainer) -> Path | None:
        """The checkpoint of the step the run ended on, unless it exists already or nothing was trained."""
        if trainer.step == 0 or not self.cfg.enabled:
            return None
        last = latest_checkpoint(self.run_dir)
        if last is not None and last.name == f"step_{trainer.step}":
            return None
        return self.save(trainer)

    def resume(self, trainer) -> int | None:
        """Load the newest complete checkpoint into the drafter and trainer; returns its step (None: none)."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            log.warning("resume=%s: no complete checkpoint, starting from step 0", self.run_dir)
            return None
        self.resumed_state = load_checkpoint(ckpt, self.drafter, trainer)
        log.info("resuming %s from %s (step %d)", self.run_dir, ckpt.name, trainer.step)
        return trainer.step
