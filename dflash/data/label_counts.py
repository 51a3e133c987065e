"""How often each token is a supervised label in one pass over a run's training data (the tokens under the loss
mask, as speculators' `save_token_frequency_distribution` counts them): what model.draft_vocab_size's maps are built
from (dflash/model/draft_vocab.py), cached under paths.cache_dir by the data's fingerprint, the settings that shape
its batches, and the draft vocabulary's size."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def count_labels(batches, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: supervised tokens of one pass of `batches` (PackedBatches or BucketedBatches: the rows a
    run trains on, the same rows a feature store of the run holds)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    it = batches.iterate()
    for _ in range(len(batches)):
        batch = next(it)
        labels = batch.input_ids[batch.loss_mask.bool()].long()
        counts += torch.bincount(labels.clamp(0, vocab_size - 1), minlength=vocab_size)[:vocab_size]
    return counts


def cache_file(cache_dir: str | Path, fingerprint: dict | None, shape: dict, draft_vocab_size: int) -> Path:
    """<cache_dir>/draft_vocab/<sha256 of the fingerprint and batch settings>-n<N>.pt"""
    key = json.dumps({"fingerprint": fingerprint, "batches": shape}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return Path(cache_dir) / "draft_vocab" / f"{digest}-n{int(draft_vocab_size)}.pt"


def cached(path: Path, build) -> dict:
    """The dict saved at `path`, or `build()` saved there first (one pass over the data per fingerprint and N)."""
    if path.is_file():
        try:
            return torch.load(path, weights_only=True)
        except Exception as e:  # noqa: BLE001 - a cut-short file is rebuilt
            log.warning("%s unreadable (%s): counting the labels again", path, e)
    value = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(value, tmp)
    tmp.replace(path)  # atomic: a reader sees the whole file or none
    return value
