"""Documents packed into one token stream, cut into seq_len windows and served as seeded, resumable batches."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dflash.data.corpus import Document, read_jsonl, stdlib_documents
from dflash.data.prompts import split_heldout
from dflash.data.regenerate import regenerated_corpus

log = logging.getLogger(__name__)


def pack(docs: list[Document], eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token stream (docs joined by EOS) and its loss mask; the EOS after a document is supervised when
    the document's last token is (the drafter should learn where text ends)."""
    ids: list[int] = []
    mask: list[bool] = []
    for d in docs:
        ids.extend(d.ids)
        mask.extend(d.loss_mask)
        if d.ids and d.ids[-1] == eos_id:
            continue  # already ends with EOS (e.g. a regenerated answer): a second one would teach "EOS -> EOS"
        ids.append(eos_id)
        mask.append(bool(d.loss_mask[-1]) if d.loss_mask else False)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (bsz, S)
    loss_mask: torch.Tensor  # (bsz, S) bool
    num_tokens: int
    data_pass: int
    index: int  # batch index within the pass


class PackedBatches:
    """Windows of `seq_len` tokens from a packed stream, shuffled per pass; resumable at (pass, index)."""

    def __init__(
        self, ids: torch.Tensor, mask: torch.Tensor, seq_len: int, batch_size: int, seed: int, min_supervised: int = 1
    ):
        n = ids.numel() // seq_len
        if n < batch_size:
            raise ValueError(
                f"the corpus has {ids.numel()} tokens: fewer than one batch of train.batch_size={batch_size} x "
                f"train.seq_len={seq_len}; use more data or smaller values"
            )
        windows = ids[: n * seq_len].view(n, seq_len)
        masks = mask[: n * seq_len].view(n, seq_len)
        keep = masks.sum(1) >= min_supervised  # windows with too little to supervise teach nothing
        self.windows, self.masks = windows[keep], masks[keep]
        if self.windows.shape[0] < batch_size:
            raise ValueError("too few windows with supervised tokens for one batch; check the data's loss mask")
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_pass = self.windows.shape[0] // batch_size

    def __len__(self) -> int:
        return self.batches_per_pass

    def iterate(self, start_pass: int = 0, start_index: int = 0) -> Iterator[Batch]:
        data_pass, index = start_pass, start_index
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + data_pass)
            order = torch.randperm(self.windows.shape[0], generator=g)
            while index < self.batches_per_pass:
                sel = order[index * self.batch_size : (index + 1) * self.batch_size]
                yield Batch(
                    self.windows[sel], self.masks[sel], int(sel.numel() * self.windows.shape[1]), data_pass, index
                )
                index += 1
            data_pass, index = data_pass + 1, 0


def build_batches(
    data_cfg,
    train_cfg,
    tokenizer,
    block_size: int,
    target_model=None,
    target_path: str = "",
    cache_dir: str | None = None,
) -> tuple[PackedBatches, int]:
    """The training batches for a run: (PackedBatches, number of skipped records)."""
    skipped = 0
    if data_cfg.name == "stdlib" and data_cfg.regenerate.enabled:
        docs = regenerated_corpus(target_model, tokenizer, target_path, data_cfg, train_cfg.seed, cache_dir)
    elif data_cfg.name == "stdlib":
        docs = stdlib_documents(tokenizer, "train", data_cfg.holdout_fraction, data_cfg.max_files)
    else:
        docs, skipped = read_jsonl(data_cfg.path, tokenizer, data_cfg.on_bad_record)
        docs, held = split_heldout(docs, data_cfg.holdout_fraction)
        log.info(
            "data=jsonl: the last %d of %d records are held out for eval prompts (data.holdout_fraction)",
            len(held),
            len(docs) + len(held),
        )
    if not docs:
        raise ValueError(f"data={data_cfg.name}: no documents")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids, mask = pack(docs, eos)
    min_sup = data_cfg.min_supervised_tokens or 2 * block_size
    log.info(
        "data=%s: %d documents, %.2fM tokens (%.0f%% supervised)",
        data_cfg.name,
        len(docs),
        ids.numel() / 1e6,
        100 * mask.float().mean().item(),
    )
    return PackedBatches(ids, mask, train_cfg.seq_len, train_cfg.batch_size, train_cfg.seed, min_sup), skipped
