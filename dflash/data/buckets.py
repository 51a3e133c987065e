"""Single conversations as batch rows, right-padded, in length buckets; seeded and resumable at (pass, index).

One row is one record (truncated to `train.seq_len`), so the target's causal attention and the drafter's
context never cross into another conversation: padding only follows a row's tokens, and causal attention
never looks ahead, so a row's features are the ones the conversation alone gives. The padding is never
supervised, so no anchor lands in it.

Each pass shuffles the rows with the seed, sorts every run of `bucket_batches` batches' worth of rows by
length (similar lengths share a batch: little padding), cuts them into batches and shuffles the batch order.
A batch is as wide as its longest row, rounded up to `pad_to_multiple_of` (fewer distinct shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from dflash.data.batches import Batch

FetchRows = Callable[[np.ndarray], tuple[list[list[int]], list[list[int]]]]


class BucketedBatches:
    def __init__(
        self,
        fetch: FetchRows,
        rows: np.ndarray,
        lengths: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int,
        pad_id: int,
        pad_to_multiple_of: int = 64,
        bucket_batches: int = 64,
    ):
        if rows.size < batch_size:
            raise ValueError(
                f"{rows.size} usable records: fewer than one batch of train.batch_size={batch_size}; "
                "use more data or a smaller batch"
            )
        self.fetch, self.rows = fetch, np.asarray(rows, dtype=np.int64)
        self.lengths = np.minimum(np.asarray(lengths)[self.rows], seq_len)  # per usable row, truncated
        self.seq_len, self.batch_size, self.seed, self.pad_id = seq_len, batch_size, seed, pad_id
        self.multiple, self.bucket_batches = max(1, pad_to_multiple_of), max(1, bucket_batches)
        self.batches_per_pass = self.rows.size // batch_size

    def __len__(self) -> int:
        return self.batches_per_pass

    def pass_order(self, data_pass: int) -> list[np.ndarray]:
        """Positions (into `self.rows`) of every batch of a pass, in training order."""
        rng = np.random.default_rng([self.seed, data_pass])
        order = rng.permutation(self.rows.size)[: self.batches_per_pass * self.batch_size]
        chunk = self.batch_size * self.bucket_batches
        batches = []
        for start in range(0, order.size, chunk):
            part = order[start : start + chunk]
            part = part[np.argsort(self.lengths[part], kind="stable")]
            batches.extend(part[i : i + self.batch_size] for i in range(0, part.size, self.batch_size))
        return [batches[i] for i in rng.permutation(len(batches))]

    def make_batch(self, positions: np.ndarray, data_pass: int, index: int) -> Batch:
        ids, masks = self.fetch(self.rows[positions])
        lengths = self.lengths[positions]
        width = min(self.seq_len, -(-int(lengths.max()) // self.multiple) * self.multiple)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        loss_mask = torch.zeros((len(ids), width), dtype=torch.bool)
        for r, (row_ids, row_mask, n) in enumerate(zip(ids, masks, lengths)):
            input_ids[r, :n] = torch.as_tensor(row_ids[:n])
            loss_mask[r, :n] = torch.as_tensor(row_mask[:n], dtype=torch.bool)
        lengths = torch.as_tensor(lengths, dtype=torch.long)
        return Batch(input_ids, loss_mask, int(lengths.sum()), data_pass, index, lengths=lengths)

    def iterate(self, start_pass: int = 0, start_index: int = 0) -> Iterator[Batch]:
        data_pass, index = start_pass, start_index
        while True:
            order = self.pass_order(data_pass)
            while index < len(order):
                yield self.make_batch(order[index], data_pass, index)
                index += 1
            data_pass, index = data_pass + 1, 0
