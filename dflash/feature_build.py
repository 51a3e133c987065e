"""Building a feature store for a run's config: the target over the run's global batches, in the order the run
reads them, written in shards (dflash/train/feature_store.py). Resumable; one builder at a time per store (a
file lock: in a sweep with features.build_missing=true the first job builds, the others wait, then read)."""

from __future__ import annotations

import fcntl
import itertools
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from dflash.data.fingerprint import data_fingerprint
from dflash.disk import check_free, mib
from dflash.distributed import World
from dflash.model.target import resolve_device
from dflash.sources import target_and_data, target_files
from dflash.terminal import display
from dflash.train.feature_store import INDEX, StoreWriter, manifest_for, store_bytes_per_token, store_path
from dflash.train.trainer import total_steps

log = logging.getLogger(__name__)


def planned_bytes(cfg: DictConfig, files) -> tuple[int, int]:
    """(global batches, bytes) a store for this config takes, from the target's config alone."""
    batches = total_steps(cfg.train)
    tokens = batches * cfg.train.batch_size * cfg.train.seq_len
    per_token = store_bytes_per_token(files.config.hidden_size, len(files.layer_ids), cfg.features.dtype)
    return batches, tokens * per_token


def is_complete(store: Path) -> bool:
    from dflash.jsonio import read_json

    index = read_json(Path(store) / INDEX, default=None)
    return isinstance(index, dict) and bool(index.get("complete"))


def build_store(cfg: DictConfig, world: World | None = None) -> Path:
    """Build (or finish building) the store `cfg` reads; returns its path. Refuses to start without the room."""
    world = world or World()
    files = target_files(cfg, world)
    manifest = manifest_for(cfg, files.layer_ids, data_fingerprint(cfg.data, cfg.model.target))
    store = store_path(cfg, manifest)
    batches, needed = planned_bytes(cfg, files)
    store.mkdir(parents=True, exist_ok=True)
    with open(store / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another job building this store: wait for it, then find it complete
        if is_complete(store):
            log.info("feature store %s is complete", store)
            return store
        writer = StoreWriter(store, {**manifest, "num_batches": batches}, cfg.features.shard_batches)
        done = writer.done
        check_free(store, needed * (batches - done) // max(batches, 1), "the feature store")
        log.info("feature store %s: %d of %d batches to build (%s)", store, batches - done, batches, mib(needed))
        loaded = target_and_data(cfg, world, files, [str(resolve_device(cfg.model.device))])
        target = loaded.target
        with torch.inference_mode(), display().phase("features", batches - done) as phase:
            for batch in itertools.islice(loaded.data.batches.iterate(0, 0), done, batches):
                target_hidden, last_hidden = target.features(batch.input_ids.to(target.device))
                writer.add(batch, target_hidden, last_hidden)
                phase.advance()
        writer.close()
    log.info("feature store %s: %d batches written", store, batches)
    return store
