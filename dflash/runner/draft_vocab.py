"""model.draft_vocab_size in a job: the training labels counted once (rank 0, cached under paths.cache_dir by the
data's fingerprint, the batch settings and N: dflash/data/label_counts.py), speculators' maps built from the counts
and put into the drafter with its head (dflash/model/draft_vocab.py), and run.json's `draft_vocab` record (size,
coverage of the training labels, what was counted), which the model card states.

What is counted is what the loss trains on: the text's supervised tokens (loss.labels=data), or, under
loss.labels=target with a feature store, the target's argmax labels the store holds for the run's batches. The
target's greedy tokens are not the text's: on ShareGPT's original answers to SmolLM2 the top 16k of the text left
1.3% of the target's labels outside, the top 16k of those labels none (docs/results.md). Online, the target's labels
would cost a target pass over the data: the text is counted, and a warning says so."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash.core.distributed import World
from dflash.data.label_counts import cache_file, cached, count_labels
from dflash.model.draft_vocab import attach, build_maps, coverage, has_draft_vocab
from dflash.train.feature_store import stored_batches, target_label_counts
from dflash.train.trainer import total_steps

log = logging.getLogger(__name__)


TEXT, TARGET = "the text's supervised tokens", "the target's labels in the feature store"


def counted_maps(
    cfg, world: World, data, fingerprint: dict | None, vocab_size: int, store: Path | None = None
) -> dict | None:
    """{counts, d2t, t2d, cache, counted} for model.draft_vocab_size (None when unset): rank 0 counts or reads the
    cache, the drafter ranks receive it. `store`: the run's feature store, whose target labels are counted under
    loss.labels=target (its first train.max_steps batches: those the run reads)."""
    n = cfg.model.get("draft_vocab_size")
    if n is None:
        return None
    entry = None
    if world.is_main:
        target_labels = cfg.loss.get("labels", "data") == "target"
        shape = {k: cfg.train.get(k) for k in ("seq_len", "batch_size", "seed")}
        if target_labels and store is not None:
            batches = min(stored_batches(store), total_steps(cfg.train))
            shape = {**shape, "labels": "target", "store": Path(store).name, "batches": batches}
        elif target_labels:
            log.warning(
                "model.draft_vocab_size under loss.labels=target without a feature store: counted from the text's "
                "supervised tokens, not the target's labels (train/oov_labels is the share of those left outside)"
            )
        path = cache_file(cfg.paths.cache_dir, fingerprint, shape, n)
        counted = TARGET if "store" in shape else TEXT

        def build() -> dict:
            log.info("draft vocabulary: counting %s once (cached at %s)", counted, path)
            if "store" in shape:
                counts = target_label_counts(store, vocab_size, shape["batches"])
            else:
                counts = count_labels(data.batches, vocab_size)
            d2t, t2d = build_maps(counts, int(n))
            return {"counts": counts, "d2t": d2t, "t2d": t2d}

        entry = {**cached(path, build), "cache": str(path), "counted": counted}
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
    counted = maps.get("counted", TEXT)
    log.info("draft vocabulary: %d tokens cover %.2f%% of %s", drafter.d2t.numel(), 100 * cov, counted)
    return {
        "counted": counted,
        "size": int(drafter.d2t.numel()),
        "target_vocab_size": int(drafter.t2d.numel()),
        "coverage": round(cov, 6),
        "labels_counted": int(maps["counts"].sum()),
        "cache": maps["cache"],
    }
