"""What a job reads: the target's files, the target itself (one replica per place, or none where only its
embedding and LM head are needed) and the training data, built the same way by a drafter rank (run.build_job)
and by a target rank of parallel.target_ranks (disaggregated.serve_target). Every process calls these in the
same order: each holds collectives over the whole world (rank 0 first, then the others)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from dflash.core import interrupts
from dflash.core.distributed import World
from dflash.data.corpus import load_tokenizer
from dflash.data.fingerprint import data_fingerprint
from dflash.data.training_data import TrainingData, run_training_data
from dflash.model.build import resolve_target_layer_ids
from dflash.model.target import TargetModel, load_target_config
from dflash.model.tiny import ensure_target


@dataclass
class TargetFiles:
    """The target's config, the layers its features come from, and its tokenizer (no weights loaded)."""

    config: Any
    layer_ids: list[int]
    tokenizer: Any


@dataclass
class TargetAndData:
    replicas: list[TargetModel]  # empty: this process holds no whole target (a lean drafter rank)
    data: TrainingData
    fingerprint: dict | None

    @property
    def target(self) -> TargetModel | None:
        return self.replicas[0] if self.replicas else None


def target_files(cfg: DictConfig, world: World) -> TargetFiles:
    """The target's files, built first by rank 0 when it is the embedded one (transformers writes a model's
    weights only on rank 0 under torch.distributed: another rank building it would leave no weights)."""
    world.main_first(lambda: ensure_target(cfg.model))
    config = load_target_config(cfg.model.target)
    layer_ids = resolve_target_layer_ids(cfg.model, config.num_hidden_layers)
    return TargetFiles(config, layer_ids, load_tokenizer(cfg.model.target))


def target_and_data(
    cfg: DictConfig, world: World, files: TargetFiles, places: list[str], fingerprint: dict | None = None
) -> TargetAndData:
    """A target replica on each of `places` (none: `[]`), the data fingerprint (hashed once, by rank 0: the
    files can be gigabytes; given: the caller's, not hashed again) and the training data (data=jsonl: rank 0
    renders it into the cache first)."""
    replicas = [TargetModel.load(cfg.model.target, files.layer_ids, cfg.model.dtype, p) for p in places]
    if fingerprint is None:
        fingerprint = world.broadcast_to_all(data_fingerprint(cfg.data, cfg.model.target) if world.is_main else None)
    target_model = replicas[0].model if replicas else None

    def build() -> TrainingData:
        if world.is_main and cfg.debug.main_first_sleep_s:  # a slow first render (parallel.init_timeout_s drills)
            interrupts.stop_event().wait(cfg.debug.main_first_sleep_s)
            interrupts.check("the data build")
        return run_training_data(cfg, files.tokenizer, target_model, fingerprint)

    return TargetAndData(replicas, world.main_first(build), fingerprint)
