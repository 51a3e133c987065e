"""`resume=RUN_DIR`: continue a run in its own directory with its saved config.

Overrides on the resuming command may change anything but the model (the checkpoint's weights fit only it)
and the data stream (the checkpoint's data position counts its batches); those are refused before anything
in the run directory is touched.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash.core.config import ConfigError
from dflash.core.distributed import World
from dflash.core.rundir import CONFIG_FILE, RunDir, flatten
from dflash.data.fingerprint import differences

log = logging.getLogger(__name__)

# Keys a resume may not change: the model (the checkpoint's weights fit only it), and the data stream (the
# checkpoint's data position counts batches of this stream). Groups are refused by name too (`model=...`).
_DATA_STREAM = "would change the data stream (the checkpoint's data position counts its batches) of"
_FROZEN_ON_RESUME = {
    "model": "would change the model of",
    "drafter": "would change the drafter family or its heads (the checkpoint's weights fit only them) of",
    "data": _DATA_STREAM,
    "train.batch_size": _DATA_STREAM,
    "train.seq_len": _DATA_STREAM,
    "train.seed": "would change the data order and per-step randomness of",
    "train.data_seed": _DATA_STREAM,
}


def _frozen_reason(key: str) -> str | None:
    for frozen, reason in _FROZEN_ON_RESUME.items():
        if key == frozen or key.startswith(frozen + "."):
            return reason
    return None


# keys that moved since a run was saved: old name -> new name
_MOVED_KEYS = {
    "train.fail_at_step": "debug.fail_at_step",
    "train.crash_at_step": "debug.crash_at_step",
    "train.fail_target_at_batch": "debug.fail_target_at_batch",
    "train.betas": "optim.betas",  # the optim group's since issue 39
    "train.weight_decay": "optim.weight_decay",
}


# keys that are gone: pipeline.drafter_workers became the `parallel` group (torchrun ranks); pipeline.name and
# logging.name were read by nothing (the option is pipeline.mode; logging's is logging.wandb.mode)
_DROPPED_KEYS = ("pipeline.drafter_workers", "pipeline.name", "logging.name")


def _upgrade(saved: DictConfig) -> DictConfig:
    """A config saved by an older version, with moved keys under their new names (fault injection was
    `train.*`) and dropped keys removed."""
    for old in (*_MOVED_KEYS, *_DROPPED_KEYS):
        group, _, key = old.partition(".")
        if group in saved and key in saved[group]:
            value = saved[group].pop(key)
            if old in _MOVED_KEYS and value is not None:  # a newer config keeps a moved key as null
                OmegaConf.update(saved, _MOVED_KEYS[old], value, force_add=True)
    if "name" not in saved.get("optim", {}):  # saved before the optim group: it trained with AdamW, not today's
        OmegaConf.update(saved, "optim.name", "adamw", force_add=True)  # default (muon)
    return saved


def resume_config(cfg: DictConfig, job_dir: Path, overrides: list[str]) -> DictConfig:
    """Continue RUN_DIR with its saved config; explicit overrides of this command may change anything but the
    model and the data stream (e.g. `train.max_steps` to train longer, `logging.*`, `eval.*`)."""
    run_dir = Path(cfg.resume).expanduser()
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.exists():
        raise FileNotFoundError(f"resume={cfg.resume!r}: no {CONFIG_FILE} there (not a run directory)")
    if run_dir.resolve() != Path(job_dir).resolve():
        raise ConfigError(
            f"resume={cfg.resume!r} continues that run in its own directory, but this job's directory is "
            f"{job_dir}: drop hydra.run.dir, and resume one run per command (not with -m)"
        )
    saved = _upgrade(OmegaConf.load(saved_path))
    overrides = [o for o in overrides if not o.startswith(("hydra.", "resume=", "+resume="))]
    changes = [o.lstrip("+~") for o in overrides]
    refused = {}
    for o in changes:
        reason = _frozen_reason(o.split("=", 1)[0])
        if reason:
            refused.setdefault(reason, []).append(o)
    if refused:
        raise ConfigError(
            "; ".join(f"resume: {', '.join(keys)} {reason} {run_dir}" for reason, keys in refused.items())
            + "; a resumed run keeps its model and data (start a new run instead)"
        )
    merged = OmegaConf.merge(cfg, saved)  # typed node from this composition, values from the saved run
    for o in changes:
        key = o.split("=", 1)[0]
        # the value as this command's composition parsed it (types, null, lists)
        OmegaConf.update(merged, key, OmegaConf.select(cfg, key), merge=False)
    merged.resume = str(run_dir)
    # accepting changed data is a decision of one resume, not a setting the run keeps
    merged.resume_accept_data_change = any(o.startswith("resume_accept_data_change=") for o in changes) and bool(
        cfg.resume_accept_data_change
    )
    return merged


# what a resume may change but must say it changes: what the steps after it optimise, and in which precision
_SAID_ON_RESUME = ("loss", "train.precision")


def resume_changes(composed: DictConfig, resumed: DictConfig) -> dict[str, dict]:
    """{key: {"from": saved, "to": now}} for each loss key and train.precision this resume's overrides change
    (`composed`: this command's composition, `resumed`: resume_config's; read before the resume rewrites
    config_resolved.yaml). The resume says it in one line; run.json's resume entry records it as `changed`."""
    saved = OmegaConf.merge(composed, _upgrade(OmegaConf.load(Path(resumed.resume).expanduser() / CONFIG_FILE)))

    def leaves(c: DictConfig) -> dict:
        out = {}
        for key in _SAID_ON_RESUME:
            node = OmegaConf.select(c, key)
            value = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
            out.update(flatten(value, key) if isinstance(value, dict) else {key: value})
        return out

    before, now = leaves(saved), leaves(resumed)
    return {k: {"from": before.get(k), "to": now.get(k)} for k in sorted(before | now) if before.get(k) != now.get(k)}


def check_data_unchanged(cfg: DictConfig, run: RunDir, world: World, ckpt: Path, meta: dict, current: dict) -> None:
    """Refuse to resume into data that changed since the checkpoint (its data position would point into other
    batches), unless this command accepts it; an accepted change is recorded in run.json."""
    recorded = meta.get("data_fingerprint")
    if not recorded:
        return  # a checkpoint from before fingerprints were recorded
    changes = differences(recorded, current)
    if not changes:
        return
    if not cfg.resume_accept_data_change:
        raise ConfigError(
            f"resume: the training data changed since checkpoint {ckpt.name}: {'; '.join(changes)}. Its data "
            "position would continue in other data; start a new run, or resume with "
            "resume_accept_data_change=true to continue anyway (recorded in run.json)"
        )
    log.warning("resume: continuing although the training data changed: %s", "; ".join(changes))
    if world.is_main:
        run.add_run_info("accepted_data_change", changes, resumed=True)
