"""The Batch, its slicing by rank, and documents packed into one token stream cut into seq_len windows (the stdlib
corpus): seeded, resumable batches."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dflash.data.corpus import Document

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
    """A batch of windows. Under data parallelism, one rank's rows of a global batch (`rank_slice`)."""

    input_ids: torch.Tensor  # (bsz, S)
    loss_mask: torch.Tensor  # (bsz, S) bool
    num_tokens: int  # tokens of these rows
    data_pass: int
    index: int  # global batch index within the pass
    global_loss_mask: torch.Tensor | None = None  # (global bsz, S): the whole batch's mask; None = these rows
    row_start: int = 0  # first row of the global batch that these rows are
    global_tokens: int | None = None  # tokens of the whole global batch; None = num_tokens
    lengths: torch.Tensor | None = None  # (bsz,) real tokens per row when rows are right-padded; None = all real


def rank_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s contiguous rows of a global batch. The whole batch's mask travels along, so the anchors
    each rank draws are exactly the ones one process would draw for these rows."""
    rows = batch.input_ids.shape[0]
    if rows % world_size:
        raise ValueError(f"train.batch_size={rows} is the global batch: it must divide by the {world_size} ranks")
    b = rows // world_size
    part = slice(rank * b, (rank + 1) * b)
    lengths = None if batch.lengths is None else batch.lengths[part]
    return Batch(
        batch.input_ids[part],
        batch.loss_mask[part],
        b * batch.input_ids.shape[1] if lengths is None else int(lengths.sum()),
        batch.data_pass,
        batch.index,
        global_loss_mask=batch.loss_mask,
        row_start=rank * b,
        global_tokens=batch.num_tokens,
        lengths=lengths,
    )


def rank_batches(batches: Iterator[Batch], rank: int, world_size: int) -> Iterator[Batch]:
    """The global batch sequence (fixed by the seed, whatever the world size), sliced for one rank."""
    if world_size == 1:
        yield from batches
        return
    for batch in batches:
        yield rank_slice(batch, rank, world_size)


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
