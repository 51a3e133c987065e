"""Building a feature store for a run's config: the target over the run's global batches, in the order the run
reads them, written in shards (dflash/train/feature_store.py). Resumable; one builder at a time per store (a
file lock: in a sweep with features.build_missing=true the first job builds, the others wait, then read).

Under torchrun (`torchrun --nproc-per-node=N -m dflash.features build ...`) every rank reads the same batches and
runs the target on the global batches of its own shards (the shards still to build, dealt round-robin), so each
shard holds what a one-process build writes there. Rank 0 alone holds the lock, writes the manifest and, once
every rank is done, the index. The ranks meet only in collectives of the process group, each bounded by
`parallel.init_timeout_s`; a rank that fails publishes its error, the others stop at their next shard, and all
of them raise it instead of waiting for the missing shards.

A training job with features.build_missing=true builds the same way with its own ranks (job.build_job): under
ddp/fsdp its ranks share the shards, so no rank waits for a whole build (a rank waits at most for rank 0 to take
the lock and set up, and for the slowest rank's last shard, each within the collective timeout); the data
fingerprint is the job's, hashed once by rank 0."""

from __future__ import annotations

import fcntl
import itertools
import logging
from contextlib import nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig

from dflash.core import determinism
from dflash.core.disk import check_free, mib
from dflash.core.distributed import RankFailed, World, resolve_device
from dflash.core.terminal import display
from dflash.data.fingerprint import data_fingerprint
from dflash.model.target import greedy_tokens
from dflash.runner.sources import target_and_data, target_files
from dflash.train.feature_store import (
    StoreMismatch,
    StoreWriter,
    check_manifest,
    manifest_for,
    store_bytes_per_token,
    store_path,
    stored_batches,
)
from dflash.train.trainer import total_steps

BUILD_LOCK = ".build.lock"  # opened by every build, complete or not: its mtime is no sign of new batches
log = logging.getLogger(__name__)


def planned_bytes(cfg: DictConfig, files) -> tuple[int, int]:
    """(global batches, bytes) a store for this config takes, from the target's config alone."""
    batches = total_steps(cfg.train)
    tokens = batches * cfg.train.batch_size * cfg.train.seq_len
    per_token = store_bytes_per_token(files.config.hidden_size, len(files.layer_ids), cfg.features.dtype)
    return batches, tokens * per_token


def build_store(cfg: DictConfig, world: World | None = None, files=None, fingerprint: dict | None = None) -> Path:
    """Build (or finish building, or extend to more batches) the store `cfg` reads, sharing the shards among
    `world`'s ranks; returns its path. Refuses to start without the room. A training job (features.build_missing)
    passes the target's `files` and the data `fingerprint` it already has: nothing is hashed again."""
    world = world or World()
    files = files or target_files(cfg, world)
    if fingerprint is None:  # hashed by rank 0 alone, broadcast
        fingerprint = world.broadcast_to_all(data_fingerprint(cfg.data, cfg.model.target) if world.is_main else None)
    manifest = manifest_for(cfg, files.layer_ids, fingerprint)
    store = store_path(cfg, manifest)  # named without num_batches: a run reads the store of a longer build
    manifest["num_batches"] = total_steps(cfg.train)
    batches, needed = planned_bytes(cfg, files)
    store.mkdir(parents=True, exist_ok=True)
    # another job building this store: rank 0 waits for it (then finds it complete); its ranks wait for rank 0
    with open(store / BUILD_LOCK, "w") if world.is_main else nullcontext() as lock:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if world.main_first(lambda: _ready(store, manifest, cfg, world, needed, batches)):
            log.info("feature store %s is complete (%d batches)", store, stored_batches(store))
            return store
        writer = StoreWriter(store, manifest, cfg.features.shard_batches, world.rank, world.size, setup=False)
        failure = None
        try:
            _write_shards(cfg, world, files, writer, batches, fingerprint)
        except Exception as e:  # published, so the other ranks stop at their next shard instead of waiting
            failure = e
            world.report_failure(f"{type(e).__name__}: {e}")
        if world.agree(failure is not None):  # every rank's shards are in (or one failed): all say so
            if failure is not None:
                raise failure
            raise RankFailed(world.first_failure() or "another rank failed building the feature store")
        if world.is_main:
            writer.close(batches)
        world.barrier()  # nobody reads the store before rank 0 has listed it complete
    log.info("feature store %s: %d batches written", store, batches)
    return store


def check_long_enough(store: Path, cfg: DictConfig) -> None:
    """Refuse, before training, a store that holds fewer batches than the run takes steps: the run would stop
    when the store runs out."""
    held, needed = stored_batches(store), total_steps(cfg.train)
    if held < needed:
        what = f"holds {held} batches" if held else "is not complete (a build is running or was stopped)"
        raise StoreMismatch(
            f"feature store {store} {what}; the run takes {needed} steps (train.max_steps={cfg.train.max_steps}): "
            "build it for this run (python -m dflash.features build with the run's overrides extends it) or set "
            "features.build_missing=true"
        )


def _ready(store: Path, manifest: dict, cfg: DictConfig, world: World, needed: int, batches: int) -> bool:
    """True when the store is complete with `batches` batches or more; else (on rank 0) the manifest checked or
    written (a longer build raises its num_batches), torn shards removed and the room checked, before any rank
    writes."""
    if stored_batches(store) >= batches:
        check_manifest(store, manifest)  # complete, but for these settings? (an explicit features.path may not be)
        return True
    if world.is_main:
        writer = StoreWriter(store, manifest, cfg.features.shard_batches)  # the setup: manifest, *.tmp
        left = len(writer.todo(batches)) * cfg.features.shard_batches
        check_free(store, needed * min(left, batches) // max(batches, 1), "the feature store")
        log.info("feature store %s: %d of %d batches to build (%s)", store, min(left, batches), batches, mib(needed))
    return False


def _write_shards(cfg: DictConfig, world: World, files, writer: StoreWriter, batches: int, fingerprint) -> None:
    """This rank's shards: the target over their global batches, every batch of the run read in order (the data
    order depends on what came before), the others skipped."""
    mine = writer.mine(batches)
    device = world.device if world.distributed else resolve_device(cfg.model.device)
    loaded = target_and_data(cfg, world, files, [str(device)] if mine else [], fingerprint)
    target, per_shard, fault = loaded.target, cfg.features.shard_batches, cfg.debug.fail_target_at_batch
    if cfg.debug.fail_rank is not None and cfg.debug.fail_rank != world.rank:
        fault = None
    last = {k: min((k + 1) * per_shard, batches) - 1 for k in mine}
    stream = itertools.islice(loaded.data.batches.iterate(0, 0), batches)
    todo = sum(last[k] + 1 - k * per_shard for k in mine)
    threads = determinism.cpu_threads(cfg.train.deterministic, device)  # the run's target stage's, under it
    with threads, torch.inference_mode(), display().phase("features", todo) as phase:
        for i, batch in enumerate(stream):
            shard = i // per_shard
            if shard not in last:
                if shard > max(last, default=-1):
                    break
                continue
            if fault is not None and i == fault:
                raise RuntimeError(f"injected fault building batch {i} (debug.fail_target_at_batch), rank {world.rank}")
            target_hidden, last_hidden = target.features(batch.input_ids.to(target.device))
            # the target's argmax, once here for every job that reads the store: a loss without the KL then
            # computes no teacher logits
            writer.add(batch, target_hidden, last_hidden, greedy_tokens(last_hidden, target.lm_head.weight))
            phase.advance()
            if i == last[shard]:
                writer.commit(shard)
                if world.first_failure():  # another rank failed: its shards will not come
                    raise RankFailed(world.first_failure())
