"""A run's training data: the stdlib corpus (packed windows) or `data=jsonl` (single conversations in length
buckets, rendered once into the `datasets` cache), built the same on every rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from dflash.data.batches import PackedBatches, pack
from dflash.data.buckets import BucketedBatches
from dflash.data.chat_dataset import ChatData, load_chat_data
from dflash.data.corpus import stdlib_documents
from dflash.data.fingerprint import data_fingerprint
from dflash.data.regenerate import regenerated_corpus

log = logging.getLogger(__name__)


@dataclass
class TrainingData:
    batches: PackedBatches | BucketedBatches
    skipped_records: int = 0
    chat: ChatData | None = None  # data=jsonl: the rendered records (the eval prompts come from its held-out rows)


def build_training_data(
    data_cfg,
    train_cfg,
    tokenizer,
    block_size: int,
    target_model=None,
    target_path: str = "",
    cache_dir: str | None = None,
    fingerprint: dict | None = None,
) -> TrainingData:
    if data_cfg.name == "jsonl":
        return _jsonl_data(data_cfg, train_cfg, tokenizer, target_path, cache_dir, fingerprint)
    if data_cfg.regenerate.enabled:
        docs = regenerated_corpus(target_model, tokenizer, target_path, data_cfg, train_cfg.seed, cache_dir)
    else:
        docs = stdlib_documents(tokenizer, "train", data_cfg.holdout_fraction, data_cfg.max_files)
    if not docs:
        raise ValueError(f"data={data_cfg.name}: no documents")
    ids, mask = pack(docs, _pad_id(tokenizer))
    log.info(
        "data=%s: %d documents, %.2fM tokens (%.0f%% supervised)",
        data_cfg.name,
        len(docs),
        ids.numel() / 1e6,
        100 * mask.float().mean().item(),
    )
    min_sup = data_cfg.min_supervised_tokens or 2 * block_size
    return TrainingData(PackedBatches(ids, mask, train_cfg.seq_len, train_cfg.batch_size, train_cfg.seed, min_sup))


def run_training_data(cfg, tokenizer, target_model, fingerprint: dict | None) -> TrainingData:
    """`build_training_data` with a run's config (`cfg.data`, `cfg.train`, `cfg.model`, `cfg.paths`)."""
    return build_training_data(
        cfg.data,
        cfg.train,
        tokenizer,
        cfg.model.block_size,
        target_model=target_model,
        target_path=cfg.model.target,
        cache_dir=cfg.paths.cache_dir,
        fingerprint=fingerprint,
    )


def _jsonl_data(data_cfg, train_cfg, tokenizer, target_path, cache_dir, fingerprint) -> TrainingData:
    fingerprint = fingerprint or data_fingerprint(data_cfg, target_path)
    chat = load_chat_data(data_cfg, tokenizer, fingerprint, cache_dir)
    seq_len = train_cfg.seq_len
    first = chat.first_supervised[chat.train_rows]
    # a row teaches something when a supervised token follows its first one within seq_len (an anchor fits)
    usable = chat.train_rows[(first > 0) & (first < seq_len)]
    dropped = chat.train_rows.size - usable.size
    lengths = chat.lengths[usable]
    truncated = int((lengths > seq_len).sum())
    log.info(
        "data=jsonl: %d records (%d held out for eval prompts, %d skipped as bad), %.2fM tokens; "
        "%d longer than train.seq_len=%d are truncated (%.1f%% of their tokens)%s",
        chat.train_rows.size + chat.heldout_rows.size,
        chat.heldout_rows.size,
        chat.skipped,
        lengths.sum() / 1e6,
        truncated,
        seq_len,
        100 * np.clip(lengths - seq_len, 0, None).sum() / max(1, lengths.sum()),
        f"; {dropped} have no supervised token within seq_len and are left out" if dropped else "",
    )
    batches = BucketedBatches(
        chat.rows,
        usable,
        chat.lengths,
        seq_len,
        train_cfg.batch_size,
        train_cfg.seed,
        _pad_id(tokenizer),
        pad_to_multiple_of=data_cfg.pad_to_multiple_of,
    )
    return TrainingData(batches, chat.skipped, chat)


def _pad_id(tokenizer) -> int:
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
