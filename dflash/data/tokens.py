"""`data=tokens`: conversations already rendered into token ids, read without a tokenizer pass or the `datasets`
package (what a machine with only torch and transformers can train on: `python -m dflash.offline_gpu.cli`).

A token file is one `.npz` (numpy's zip of arrays; `data.path` names one, or a directory of them, read in name
order as one sequence of records):

    ids      every record's token ids, concatenated: uint16 where the vocabulary fits, else uint32
    offsets  int64, records + 1: record i is ids[offsets[i]:offsets[i + 1]]
    spans    int32 (n, 3): (record, start, end) of each supervised run of tokens, relative to the record's start
             (an assistant turn: its first token to its end-of-turn token, as data=jsonl's rendering masks it)
    meta     a JSON string: who wrote it and from what (the tokenizer's file hashes, the source, settings)

A record is one training row, cut at `train.seq_len` (no split at turn boundaries: the rows written here are
first exchanges, shorter than a GPU run's rows); a record with no supervised token after its first within the
row is left out, as data=jsonl leaves it out. The last `data.holdout_fraction` of the records are held out: the
eval prompts end where their first supervised run starts, as data=jsonl's do.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SUFFIX = ".npz"
FORMAT = "dflash-tokens-v1"


def token_files(path: str | Path) -> list[Path]:
    """The token files `data.path` names: one .npz file, or every .npz file of a directory, in name order."""
    p = Path(path).expanduser()
    files = sorted(p.glob(f"*{SUFFIX}")) if p.is_dir() else [p] if p.is_file() else []
    if not files:
        raise FileNotFoundError(f"data.path={str(path)!r}: no {SUFFIX} token file (data=tokens: a file or a directory)")
    return files


@dataclass
class TokenRecords:
    ids: np.ndarray
    offsets: np.ndarray
    spans: np.ndarray  # (n, 3) int: record, start, end
    meta: dict

    def __len__(self) -> int:
        return self.offsets.size - 1

    def record(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def spans_of(self, i: int) -> np.ndarray:
        """(start, end) of record i's supervised runs."""
        return self._by_record.get(i, _NONE)

    def mask(self, i: int) -> np.ndarray:
        m = np.zeros(int(self.offsets[i + 1] - self.offsets[i]), dtype=bool)
        for a, e in self.spans_of(i):
            m[a:e] = True
        return m

    def answer_start(self, i: int) -> int:
        """Where the record's first supervised run starts (-1: none)."""
        s = self.spans_of(i)
        return int(s[:, 0].min()) if len(s) else -1

    def __post_init__(self):
        self._by_record: dict[int, np.ndarray] = {}
        if len(self.spans):
            by_record = self.spans[np.argsort(self.spans[:, 0], kind="stable")].astype(np.int64)
            for group in np.split(by_record, np.flatnonzero(np.diff(by_record[:, 0])) + 1):
                self._by_record[int(group[0, 0])] = group[:, 1:]


_NONE = np.zeros((0, 2), dtype=np.int64)


def write_tokens(path: str | Path, records: list[tuple[list[int], list[tuple[int, int]]]], meta: dict) -> Path:
    """Write `records` ((ids, [(start, end), ...] supervised runs)) as a token file (compressed; atomically)."""
    path = Path(path)
    lengths = np.asarray([len(ids) for ids, _ in records], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.fromiter((t for ids, _ in records for t in ids), dtype=np.int64, count=int(offsets[-1]))
    dtype = np.uint16 if flat.size == 0 or int(flat.max()) < 2**16 else np.uint32
    spans = np.asarray([(r, a, e) for r, (_, s) in enumerate(records) for a, e in s], dtype=np.int32).reshape(-1, 3)
    meta = {"format": FORMAT, "records": len(records), "tokens": int(flat.size), **meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, ids=flat.astype(dtype), offsets=offsets, spans=spans, meta=np.array(json.dumps(meta)))
    tmp.replace(path)
    return path


def read_tokens(path: str | Path) -> TokenRecords:
    try:
        with np.load(Path(path), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            out = TokenRecords(z["ids"], z["offsets"].astype(np.int64), z["spans"].astype(np.int64), meta)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: not a token file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, not {FORMAT!r}: write it again")
    return out


def load_records(path: str | Path) -> TokenRecords:
    """Every token file `data.path` names, as one sequence of records (their metas under meta["files"])."""
    parts = [read_tokens(f) for f in token_files(path)]
    if len(parts) == 1:
        return parts[0]
    base = np.cumsum([0] + [len(p) for p in parts[:-1]])
    starts = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
    ids = np.concatenate([p.ids.astype(np.uint32) for p in parts])
    offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
    spans = np.concatenate([p.spans + np.array([b, 0, 0]) for p, b in zip(parts, base)])
    return TokenRecords(ids, offsets, spans, {"files": [p.meta for p in parts]})


@dataclass
class TokenData:
    records: TokenRecords
    train_rows: np.ndarray  # records trained on (each has a supervised token after its first within seq_len)
    heldout_rows: np.ndarray
    left_out: int  # records of the training part with nothing to supervise within seq_len

    def fetch(self, indices: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """BucketedBatches' fetch: each record's ids and mask (cut to the row by the batcher)."""
        idx = [int(i) for i in indices]
        return [self.records.record(i).astype(np.int64) for i in idx], [self.records.mask(i) for i in idx]

    @property
    def supervised_tokens(self) -> int:
        return int(sum(int(self.records.mask(i).sum()) for i in self.train_rows))


def load_token_data(data_cfg, seq_len: int) -> TokenData:
    records = load_records(data_cfg.path)
    n = len(records)
    if n == 0:
        raise ValueError(f"data.path={data_cfg.path!r}: no records")
    held = max(1, int(n * data_cfg.holdout_fraction)) if n >= 2 and data_cfg.holdout_fraction else 0
    candidates = np.arange(n - held)
    first = np.asarray([_first_supervised_after_first(records, int(i)) for i in candidates], dtype=np.int64)
    usable = (first > 0) & (first < seq_len)
    return TokenData(records, candidates[usable], np.arange(n - held, n), int((~usable).sum()))


def _first_supervised_after_first(records: TokenRecords, i: int) -> int:
    """The first supervised position after position 0 (-1: none): an anchor needs a supervised token after it."""
    s = records.spans_of(i)
    if not len(s):
        return -1
    starts = np.maximum(s[:, 0], 1)
    ok = starts < s[:, 1]
    return int(starts[ok].min()) if ok.any() else -1


def token_prompts(data: TokenData, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Held-out records cut where their first supervised run starts (the last `prompt_len` tokens before it)."""
    rows = data.heldout_rows
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for k in torch.randperm(rows.size, generator=g).tolist():
        i = int(rows[k])
        s = data.records.answer_start(i)
        if s >= 4:  # a few tokens of context at least
            prompts.append(data.records.record(i)[max(0, s - prompt_len) : s].astype(np.int64).tolist())
        if len(prompts) >= num_prompts:
            break
    return prompts
