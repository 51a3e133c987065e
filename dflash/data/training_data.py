"""A run's training data: the stdlib corpus (packed windows), `data=jsonl` (single conversations in length
buckets, rendered once into the `datasets` cache) or `data=tokens` (conversations as token ids, data/tokens.py),
built the same on every rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from dflash.core.config import data_seed
from dflash.data.batches import PackedBatches, pack
from dflash.data.buckets import BucketedBatches
from dflash.data.chat_dataset import ChatData, load_chat_data
from dflash.data.corpus import stdlib_documents
from dflash.data.fingerprint import data_fingerprint
from dflash.data.regenerate import regenerated_corpus
from dflash.data.rows import build_rows, fetch_rows
from dflash.data.tokens import load_token_data

log = logging.getLogger(__name__)


@dataclass
class TrainingData:
    batches: PackedBatches | BucketedBatches
    skipped_records: int = 0  # records not trained on: the sum of skipped_by_reason
    chat: ChatData | None = None  # data=jsonl: the rendered records (the eval prompts come from its held-out rows)
    skipped_by_reason: dict = field(default_factory=dict)  # reason -> records (data/skipped/<reason>)
    # data=jsonl: supervised tokens of the usable records: all, kept by truncating at seq_len, kept by the rows
    supervised_tokens: dict = field(default_factory=dict)


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
    if data_cfg.name == "tokens":
        return _token_data(data_cfg, train_cfg, tokenizer)
    if data_cfg.regenerate.enabled:
        docs = regenerated_corpus(target_model, tokenizer, target_path, data_cfg, data_seed(train_cfg), cache_dir)
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
    return TrainingData(
        PackedBatches(ids, mask, train_cfg.seq_len, train_cfg.batch_size, data_seed(train_cfg), min_sup)
    )


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
    seq_len, mode = train_cfg.seq_len, data_cfg.get("long_conversations") or "split"
    rows = build_rows(chat, chat.train_rows, seq_len, mode)
    skipped = dict(chat.skipped_by_reason)
    if rows.left_out:  # nothing to supervise within a row: an anchor needs a supervised token after it
        skipped["nothing_to_supervise_within_seq_len"] = rows.left_out
    sup = {"total": rows.supervised_total, "truncated": rows.supervised_truncated, "kept": rows.supervised_kept}
    log.info(
        "data=jsonl: %d records (%d held out for eval prompts, %d skipped as bad), %.2fM tokens in %d rows; "
        "%d longer than train.seq_len=%d are %s (data.long_conversations); supervised tokens: %.2fM in all, "
        "%.2fM (%.1f%%) kept by truncating at seq_len, %.2fM (%.1f%%) kept by these rows%s",
        chat.train_rows.size + chat.heldout_rows.size,
        chat.heldout_rows.size,
        chat.skipped,
        rows.lengths.sum() / 1e6,
        rows.record.size,
        rows.split_records,
        seq_len,
        "split at turn boundaries" if mode == "split" else "truncated",
        sup["total"] / 1e6,
        sup["truncated"] / 1e6,
        100 * sup["truncated"] / max(1, sup["total"]),
        sup["kept"] / 1e6,
        100 * sup["kept"] / max(1, sup["total"]),
        f"; {rows.left_out} have no supervised token within seq_len and are left out" if rows.left_out else "",
    )
    batches = BucketedBatches(
        fetch_rows(chat, rows),
        np.arange(rows.record.size),
        rows.lengths,
        seq_len,
        train_cfg.batch_size,
        data_seed(train_cfg),
        _pad_id(tokenizer),
        pad_to_multiple_of=data_cfg.pad_to_multiple_of,
    )
    return TrainingData(batches, sum(skipped.values()), chat, skipped, sup)


def _token_data(data_cfg, train_cfg, tokenizer) -> TrainingData:
    data = load_token_data(data_cfg, train_cfg.seq_len)
    sup = data.supervised_tokens
    log.info(
        "data=tokens: %d records (%d held out for eval prompts, %d left out: nothing to supervise within "
        "train.seq_len=%d), %.2fM tokens, %.2fM supervised",
        len(data.records), data.heldout_rows.size, data.left_out, train_cfg.seq_len,
        int(data.records.lengths[data.train_rows].sum()) / 1e6, sup / 1e6,
    )  # fmt: skip
    batches = BucketedBatches(
        data.fetch,
        data.train_rows,
        data.records.lengths,
        train_cfg.seq_len,
        train_cfg.batch_size,
        data_seed(train_cfg),
        _pad_id(tokenizer),
        pad_to_multiple_of=data_cfg.pad_to_multiple_of,
    )
    skipped = {"nothing_to_supervise_within_seq_len": data.left_out} if data.left_out else {}
    return TrainingData(batches, data.left_out, None, skipped, {"total": sup, "kept": sup})


def _pad_id(tokenizer) -> int:
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
