"""CheckpointManager: *when* and *how* a run checkpoints, in the format its world needs (docs/architecture.md)."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path

from dflash.core.config import ConfigError
from dflash.core.disk import DiskFull, check_free, dir_bytes, remove_partial
from dflash.core.distributed import World
from dflash.core.rundir import RunDir
from dflash.train.checkpoint import (
    META,
    CheckpointCorrupt,
    is_sharded,
    latest_checkpoint,
    latest_verified_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from dflash.train.checkpoint_dcp import load_full_into, load_sharded, load_sharded_weights, save_sharded

log = logging.getLogger(__name__)


class CheckpointManager:
    """Owns *when* and *how* a run checkpoints: every `checkpoint.every_steps`, once more on every way the run
    ends (completed, interrupted, failed: at most the current step is lost), `keep_last`, and loading the
    newest complete checkpoint on resume.

    One process writes `drafter.safetensors` + `state.pt`; a data-parallel run (ddp/fsdp) writes the sharded
    format of checkpoint_dcp.py, every rank its part. Either loads into either. Decisions that depend on the
    file system are made by rank 0 and broadcast, so ranks never disagree about a collective.

    `tracking_state()` supplies what the tracking sinks need back on resume (the W&B run id).
    """

    def __init__(
        self,
        cfg,
        run_dir: Path,
        drafter,
        target_path: str,
        world: World | None = None,
        model=None,
        *,
        data_fingerprint: dict | None = None,
        check_before_resume: Callable[[Path, dict], None] | None = None,
        on_saved: Callable[[int, str], None] | None = None,
        tracking_state: Callable[[], dict] | None = None,
    ):
        self.cfg = cfg  # the `checkpoint` config group
        self.run_dir = Path(run_dir)
        self.drafter = drafter
        self.model = model if model is not None else drafter  # the DDP/FSDP-wrapped drafter
        self.world = world or World()
        self.target_path = target_path
        self.data_fingerprint = data_fingerprint  # recorded in every checkpoint (dflash.data.fingerprint)
        # refuses a checkpoint of other data before it loads (resume.check_data_unchanged)
        self.check_before_resume = check_before_resume or (lambda ckpt, meta: None)
        self.on_saved = on_saved or (lambda step, path: None)  # the run's callbacks.on_checkpoint
        self.tracking_state = tracking_state or dict  # what the sinks need back on resume (the W&B run id)
        self.resumed_meta: dict = {}  # meta.json of the checkpoint a resume loaded
        self.skipped_disk_full = 0  # periodic checkpoints skipped for lack of disk (checkpoint.on_disk_full=skip)
        if self.world.is_main:  # what an earlier process left half-written (a crash, a full disk) is not resumed
            root = RunDir(self.run_dir).checkpoints
            for partial in sorted(root.glob("*.tmp")) if root.is_dir() else []:
                remove_partial(partial, "a checkpoint an earlier process left half-written")

    def should_save(self, step: int) -> bool:
        return bool(self.cfg.enabled and self.cfg.every_steps and step % self.cfg.every_steps == 0)

    def maybe_save(self, trainer) -> None:
        if self.should_save(trainer.step) and self._room_for_checkpoint(trainer.step, periodic=True):
            self.save(trainer)

    def _room_for_checkpoint(self, step: int, periodic: bool) -> bool:
        """Whether a checkpoint (about the size of the newest one) fits on the disk; decided by rank 0 and
        broadcast, so every rank saves or skips together. Without room: DiskFull on every rank, or for a periodic
        checkpoint under checkpoint.on_disk_full=skip a loud warning and False."""
        verdict = None
        if self.world.is_main:
            root = RunDir(self.run_dir).checkpoints
            newest = latest_checkpoint(self.run_dir)
            # the first one: the weights and AdamW's two moments, in fp32
            needed = dir_bytes(newest) if newest else 3 * sum(p.numel() * 4 for p in self.drafter.parameters())
            try:
                check_free(root, needed, f"checkpoint step_{step}")
            except DiskFull as e:
                verdict = e.strerror  # the message alone: the DiskFull raised below adds the errno once
        verdict = self.world.broadcast_object(verdict)
        if verdict is None:
            return True
        if periodic and self.cfg.on_disk_full == "skip":
            self.skipped_disk_full += 1
            log.warning("%s: checkpoint skipped, training goes on (checkpoint.on_disk_full=skip)", verdict)
            return False
        raise DiskFull(errno.ENOSPC, f"{verdict} (checkpoint.on_disk_full=skip skips periodic checkpoints instead)")

    def save(self, trainer) -> Path:
        # a resumed job without W&B keeps the resumed id for the next resume that has W&B
        run_id = self.tracking_state().get("wandb_run_id") or self.resumed_meta.get("wandb_run_id")
        extra = {"wandb_run_id": run_id, "target": self.target_path, "data_fingerprint": self.data_fingerprint}
        if hasattr(trainer, "optimizer"):  # which optim option's state the checkpoint holds (resume checks it)
            extra["optimizer"] = trainer.optimizer.name
        if self.world.distributed:
            final = RunDir(self.run_dir).checkpoints / f"step_{trainer.step}"
            path = save_sharded(final, self.model, trainer, self.world, extra, self.cfg.keep_last)
        else:
            path = save_checkpoint(self.run_dir, self.drafter, trainer.state_dict(), extra, self.cfg.keep_last)
        self.on_saved(trainer.step, str(path))
        return path

    def save_final(self, trainer) -> Path | None:
        """The checkpoint of the step the run ended on, unless it exists already or nothing was trained."""
        if trainer.step == 0 or not self.cfg.enabled:
            return None
        last = self.world.broadcast_object(latest_checkpoint(self.run_dir) if self.world.is_main else None)
        if last is not None and last.name == f"step_{trainer.step}":
            return None
        self._room_for_checkpoint(trainer.step, periodic=False)
        return self.save(trainer)

    def resume(self, trainer) -> int | None:
        """Load the newest complete checkpoint into the drafter and trainer; returns its step (None: none)."""
        # the newest checkpoint that verifies (a corrupt newer one is reported and skipped): hashed once, by rank 0,
        # and its verdict broadcast, so every rank loads it or raises the same error at once
        found = None
        if self.world.is_main:
            try:
                found = latest_verified_checkpoint(self.run_dir)
            except CheckpointCorrupt as e:
                found = e
        found = self.world.broadcast_object(found)
        if isinstance(found, Exception):
            raise found
        ckpt = found
        if ckpt is None:
            log.warning("resume=%s: no complete checkpoint, starting from step 0", self.run_dir)
            return None
        meta = read_meta(ckpt)
        self.check_before_resume(ckpt, meta)
        saved = meta.get("optimizer", "adamw")  # checkpoints from before the optim group hold AdamW's state
        if hasattr(trainer, "optimizer") and saved != trainer.optimizer.name:
            raise ConfigError(
                f"resume: checkpoint {ckpt.name} holds optim={saved}'s state, this run's optimizer is "
                f"optim={trainer.optimizer.name}: resume with optim={saved}, or start a new run from its weights "
                f"with model.init_from={self.run_dir}"
            )
        if is_sharded(ckpt):
            self.resumed_meta = load_sharded(ckpt, self.model, trainer, self.world)
        elif self.world.distributed:
            self.resumed_meta = load_full_into(ckpt, self.model, trainer)
        else:
            self.resumed_meta = load_checkpoint(ckpt, self.drafter, trainer, verified=True)
        log.info("resuming %s from %s (step %d)", self.run_dir, ckpt.name, trainer.step)
        return trainer.step


def load_drafter_from_source(source: Path):
    """A drafter from a checkpoint dir, a run dir (its latest checkpoint, else its drafter/), or a drafter dir.
    Returns (drafter, target path or None)."""
    from transformers import Qwen3Config

    from dflash.model.export import load_drafter  # z-lab's layout, or speculators' for another family
    from dflash.model.families import drafter_class

    source = Path(source)
    target = None
    verified = False
    run = RunDir(source)
    if run.config_file.exists():
        from omegaconf import OmegaConf

        target = OmegaConf.load(run.config_file).model.target
        ckpt = latest_verified_checkpoint(source)
        verified = ckpt is not None
        if ckpt is None:
            if (run.drafter / "config.json").exists():
                return load_drafter(run.drafter), target
            raise FileNotFoundError(f"{source}: run has no complete checkpoint and no drafter/")
        source = ckpt
    if (source / META).exists():
        meta = read_meta(source)
        config = Qwen3Config.from_dict(meta["drafter_config"])
        drafter = drafter_class(config)(config)  # the family the run trained
        if is_sharded(source):
            load_sharded_weights(source, drafter, verified=verified)
        else:
            load_checkpoint(source, drafter, verified=verified)
        return drafter, target or meta.get("target")
    if (source / "config.json").exists():
        return load_drafter(source), target
    raise FileNotFoundError(f"{source}: not a run dir, checkpoint dir or drafter dir")
