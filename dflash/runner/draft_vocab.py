"""model.draft_vocab_size in a job: the training labels counted once (rank 0, cached under paths.cache_dir by the
data's fingerprint, the batch settings and N: dflash/data/label_counts.py), speculators' maps built from the counts
and put into the drafter with its head (dflash/model/draft_vocab.py), and run.json's `draft_vocab` record (size,
coverage of the training labels), which the model card states."""

from __future__ import annotations

import logging

import torch

from dflash.core.distributed import World
from dflash.data.label_counts import cache_file, cached, count_labels
from dflash.model.draft_vocab import attach, build_maps, coverage, has_draft_vocab

log = logging.getLogger(__name__)


def counted_maps(cfg, world: World, data, fingerprint: dict | None, vocab_size: int) -> dict | None:
    """{counts, d2t, t2d, cache} for model.draft_vocab_size (None when unset): rank 0 counts or reads the cache,
    the drafter ranks receive it."""
    n = cfg.model.get("draft_vocab_size")
    if n is None:
        return None
    entry = None
    if world.is_main:
        shape = {k: cfg.train.get(k) for k in ("seq_len", "batch_size", "seed")}
        path = cache_file(cfg.paths.cache_dir, fingerprint, shape, n)

        def build() -> dict:
            log.info("draft vocabulary: counting the training labels once (cached at %s)", path)
            counts = count_labels(data.batches, vocab_size)
            d2t, t2d = build_maps(counts, int(n))
            return {"counts": counts, "d2t": d2t, "t2d": t2d}

        entry = {**cached(path, build), "cache": str(path)}
    return world.broadcast_object(entry)


def put_into(drafter, maps: dict | None, target_head_weight: torch.Tensor) -> None:
    """The counted maps and the target head's rows into a freshly initialised drafter."""
    if maps is not None:
        attach(drafter, maps["d2t"], maps["t2d"], target_head_weight)


def record(drafter, maps: dict | None) -> dict | None:
    """run.json's `draft_vocab`: the size, the share of the counted training labels the drafter's maps cover (its
    own after model.init_from), the labels counted and the cache file."""
    if maps is None or not has_draft_vocab(drafter):
        return None
    cov = coverage(maps["counts"], drafter.t2d.cpu())
    log.info("draft vocabulary: %d tokens cover %.2f%% of the training labels", drafter.d2t.numel(), 100 * cov)
    return {
        "size": int(drafter.d2t.numel()),
        "target_vocab_size": int(drafter.t2d.numel()),
        "coverage": round(cov, 6),
        "labels_counted": int(maps["counts"].sum()),
        "cache": maps["cache"],
    }
