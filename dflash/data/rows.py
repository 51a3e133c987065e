"""Training rows of `data=jsonl`: a conversation that fits `train.seq_len` is one row; a longer one is split at
turn boundaries into several rows (`data.long_conversations=split`, the default), each supervising whole
assistant turns and filling the rest of its window with as much of the preceding conversation as fits, as
unsupervised context. A turn that does not fit in three quarters of a window is itself cut into pieces, each
with a quarter window or more of what precedes it. `truncate` keeps one row per conversation, cut at seq_len
(what the peers do). A row is (record, window start, supervised from, window end): its tokens are the record's
[start, end), supervised where the record's mask is and not before `supervised from`.

Supervised turns are contiguous runs of the mask ([answer_starts[k], answer_ends[k]); a text record is one
turn over all of it), so every count here comes from those bounds, not from the masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Rows:
    record: np.ndarray  # per row: the record (a row of the chat table)
    start: np.ndarray  # window start (token index in the record)
    sup_from: np.ndarray  # supervised from here (earlier tokens of the window are context)
    end: np.ndarray  # window end
    supervised_total: int  # supervised tokens of the records
    supervised_truncated: int  # ... kept by one row per record cut at seq_len
    supervised_kept: int  # ... kept by these rows
    left_out: int  # records with no row: no supervised token after a window's first (an anchor needs one)
    split_records: int  # records longer than seq_len

    @property
    def lengths(self) -> np.ndarray:
        return self.end - self.start


def turn_bounds(chat, records: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(starts, ends) of the supervised turns of each record."""
    out = []
    starts_col = _lists(chat.table, "answer_starts")
    ends_col = _lists(chat.table, "answer_ends")
    is_chat = chat.table.data.column("is_chat").to_numpy()
    for r in records:
        if not is_chat[r]:
            out.append((np.array([0]), np.array([chat.lengths[r]])))
            continue
        out.append((_one(starts_col, r), _one(ends_col, r)))
    return out


def _lists(table, name: str):
    col = table.data.column(name).combine_chunks()
    return col.offsets.to_numpy(), col.values.to_numpy()


def _one(col, r: int) -> np.ndarray:
    offsets, values = col
    return values[offsets[r] : offsets[r + 1]].astype(np.int64)


def _overlap(starts: np.ndarray, ends: np.ndarray, a: int, e: int) -> int:
    return int(np.clip(np.minimum(ends, e) - np.maximum(starts, a), 0, None).sum())


def split_record(starts: np.ndarray, ends: np.ndarray, length: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(window start, supervised from, window end) of each row of one record (its turns: [starts, ends))."""
    if length <= seq_len:
        return [(0, 0, length)]
    budget = seq_len - seq_len // 4  # supervised span of a row: the rest is context
    rows, k = [], 0
    while k < len(starts):
        a = int(starts[k])
        if ends[k] - a > budget:  # a turn too long for one row: pieces of `budget` tokens
            for piece in range(a, int(ends[k]), budget):
                e = min(piece + budget, int(ends[k]))
                rows.append((max(0, e - seq_len), piece, e))
            k += 1
            continue
        j = k
        while j + 1 < len(starts) and ends[j + 1] - a <= budget:
            j += 1
        e = int(ends[j])
        rows.append((max(0, e - seq_len), a, e))
        k = j + 1
    return rows


def build_rows(chat, records: np.ndarray, seq_len: int, mode: str) -> Rows:
    """The training rows of `records` (usable, in file order) for `data.long_conversations` = split | truncate."""
    if mode not in ("split", "truncate"):
        raise ValueError(f"data.long_conversations must be split or truncate, not {mode!r}")
    lengths = chat.lengths[records].astype(np.int64)
    long = lengths > seq_len
    bounds = dict(zip(records[long].tolist(), turn_bounds(chat, records[long])))
    out: list[tuple[int, int, int, int]] = []
    whole: list[int] = []
    total = truncated = kept = left_out = 0
    for r, n in zip(records.tolist(), lengths.tolist()):
        if n <= seq_len:  # the whole record; it teaches when a supervised token follows its first token
            if chat.first_supervised[r] > 0:
                out.append((r, 0, 0, n))
                whole.append(r)
            else:
                left_out += 1
            continue
        starts, ends = bounds[r]
        total += _overlap(starts, ends, 0, n)
        truncated += _overlap(starts, ends, 0, seq_len)
        pieces = [(0, 0, seq_len)] if mode == "truncate" else split_record(starts, ends, n, seq_len)
        rows = [(r, w, a, e) for w, a, e in pieces if _overlap(starts, ends, max(a, w + 1), e) >= 1]
        kept += sum(_overlap(starts, ends, a, e) for _, _, a, e in rows)
        left_out += not rows
        out.extend(rows)
    short_sup = _short_supervised(chat, np.asarray(whole, dtype=np.int64))
    rows = np.asarray(out, dtype=np.int64).reshape(-1, 4)
    return Rows(
        rows[:, 0],
        rows[:, 1],
        rows[:, 2],
        rows[:, 3],
        supervised_total=total + short_sup,
        supervised_truncated=truncated + short_sup,
        supervised_kept=kept + short_sup,
        left_out=left_out,
        split_records=int(long.sum()),
    )


def _short_supervised(chat, records: np.ndarray) -> int:
    """Supervised tokens of records that fit seq_len (whole: their turns' bounds, all of a text record)."""
    if records.size == 0:
        return 0
    starts_col, ends_col = _lists(chat.table, "answer_starts"), _lists(chat.table, "answer_ends")
    is_chat = chat.table.data.column("is_chat").to_numpy()
    total = 0
    for r in records.tolist():
        total += int((_one(ends_col, r) - _one(starts_col, r)).sum()) if is_chat[r] else int(chat.lengths[r])
    return total


def fetch_rows(chat, rows: Rows):
    """`BucketedBatches`' fetch: (ids, masks) of rows, the mask cleared before each row's `sup_from`."""

    def fetch(indices: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        indices = np.asarray(indices, dtype=np.int64)
        ids, masks = chat.rows(rows.record[indices])
        out_ids, out_masks = [], []
        for i, row_ids, row_mask in zip(indices.tolist(), ids, masks):
            w, a, e = int(rows.start[i]), int(rows.sup_from[i]), int(rows.end[i])
            mask = list(row_mask[w:e])
            mask[: a - w] = [0] * (a - w)
            out_ids.append(row_ids[w:e])
            out_masks.append(mask)
        return out_ids, out_masks

    return fetch
