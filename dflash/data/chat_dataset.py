"""`data=jsonl` as a Hugging Face `datasets` table: JSONL lines or .json array records -> rendered
conversations (token ids, loss mask, answer starts and ends), tokenised once by `map(num_proc=data.num_proc)`
into memory-mapped Arrow files under the cache dir and reused by every later run and every rank. The cache is
keyed by the data files' fingerprint, the tokenizer's files and the rendering version, so any change re-renders.

Bad records are kept as rows with an `error` ("file:line: why") and a `reason`, so `data.on_bad_record=fail`
names the first one, and `skip` counts them by reason, without a second pass over the data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash.core.disk import check_free
from dflash.data.chat import BadRecordError, end_of_turn_marker, parse_line, render_record
from dflash.data.corpus import jsonl_files
from dflash.data.records import iter_raw_records, read_error_reason

log = logging.getLogger(__name__)

# bump when rendering changes, so caches made by older code are not reused (3: a .json array's bytes that are not
# UTF-8 make its record not_utf8, as in JSONL, where 2 trained on U+FFFD; 4: an answer cut at its limit,
# `finish_reason: length`, regenerated or, since issue 57, original, has no supervised end of turn)
RENDER_VERSION = 4
_MIN_RECORDS_PER_PROC = 2_000  # below this, starting worker processes costs more than it saves


def _read_lines(files: list[str], fingerprint: str):
    """Raw records with their `file:line` (or `file:record N`), and the reader's error for a cut-off array.
    `fingerprint` only keys the cache (the files' content)."""
    del fingerprint
    for f in files:
        for where, raw, error in iter_raw_records(f):
            yield {"raw": raw, "where": where, "read_error": error}


def _render_batch(batch: dict, tokenizer, eot: str, template_kwargs: dict) -> dict:
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "answer_starts": [], "length": []}
    out.update({"first_supervised": [], "is_chat": [], "where": [], "error": [], "reason": [], "answer_ends": []})
    for raw, where, read_error in zip(batch["raw"], batch["where"], batch["read_error"]):
        try:
            if read_error:
                raise BadRecordError(read_error, read_error_reason(read_error))
            r = render_record(parse_line(raw, where), tokenizer, where, eot, **template_kwargs)
            error, reason = "", ""
        except BadRecordError as e:
            r, error, reason = None, str(e), e.reason
        mask = np.asarray(r.loss_mask if r else [], dtype=np.int8)
        supervised_after_first = np.flatnonzero(mask[1:]) + 1
        out["input_ids"].append(r.ids if r else [])
        out["loss_mask"].append(mask)
        out["answer_starts"].append(r.answer_starts if r else [])
        out["answer_ends"].append(r.answer_ends if r else [])
        out["length"].append(len(mask))
        out["first_supervised"].append(int(supervised_after_first[0]) if supervised_after_first.size else -1)
        out["is_chat"].append(bool(r and r.is_chat))
        out["where"].append(where)
        out["error"].append(error)
        out["reason"].append(reason)
    return out


def _features():
    from datasets import Features, Sequence, Value

    return Features(
        {
            "input_ids": Sequence(Value("int32")),
            "loss_mask": Sequence(Value("int8")),
            "answer_starts": Sequence(Value("int32")),
            "answer_ends": Sequence(Value("int32")),  # token index after each supervised turn
            "length": Value("int32"),
            "first_supervised": Value("int32"),  # first supervised token after the first (-1: none)
            "is_chat": Value("bool"),
            "where": Value("string"),
            "error": Value("string"),
            "reason": Value("string"),  # the error's reason ("" when none): data/skipped/<reason>
        }
    )


def cache_key(fingerprint: dict, template_kwargs: dict) -> str:
    """The rendered table's identity: data files, tokenizer files, template arguments, rendering version."""
    src = {
        "files": fingerprint["files"],
        "tokenizer": fingerprint["tokenizer"],
        "template": template_kwargs,
        "v": RENDER_VERSION,
    }
    return hashlib.sha256(json.dumps(src, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class ChatData:
    """The rendered records: the Arrow table, its per-row numbers, and which rows train and which are held out."""

    table: object  # datasets.Dataset
    lengths: np.ndarray  # tokens per row (all rows)
    first_supervised: np.ndarray
    train_rows: np.ndarray  # usable records, in file order, minus the held-out tail
    heldout_rows: np.ndarray
    skipped: int
    key: str
    skipped_by_reason: dict  # reason -> bad records skipped

    def rows(self, indices) -> tuple[list[list[int]], list[list[int]]]:
        part = self.table[[int(i) for i in indices]]
        return part["input_ids"], part["loss_mask"]


_loaded: dict[tuple, ChatData] = {}  # one table per process: the run's batches and eval prompts share it


def load_chat_data(data_cfg, tokenizer, fingerprint: dict, cache_dir: str | None) -> ChatData:
    """Render (or load from the cache) every record of `data.path`; split off the held-out tail."""
    template_kwargs = dict(data_cfg.get("chat_template_kwargs") or {})
    key = cache_key(fingerprint, template_kwargs)
    memo = (key, data_cfg.holdout_fraction, data_cfg.on_bad_record)  # the split and the check depend on these too
    if memo in _loaded:
        return _loaded[memo]
    table = _rendered_table(data_cfg, tokenizer, key, template_kwargs, cache_dir)
    errors = np.asarray(table.data.column("error").to_numpy(zero_copy_only=False))
    bad = np.flatnonzero(errors != "")
    reasons = np.asarray(table.data.column("reason").to_numpy(zero_copy_only=False))[bad]
    if bad.size and data_cfg.on_bad_record == "fail":
        raise BadRecordError(
            f"{errors[bad[0]]} [{reasons[0]}] (data.on_bad_record=skip skips and counts bad records by reason)",
            str(reasons[0]),
        )
    for i in bad[:5]:
        log.warning("skipping bad record %s", errors[i])
    by_reason = {str(r): int(n) for r, n in zip(*np.unique(reasons, return_counts=True))}
    if bad.size:
        counts = ", ".join(f"{r} {n}" for r, n in sorted(by_reason.items(), key=lambda kv: -kv[1]))
        log.warning("skipped %d bad records of %d (data.on_bad_record=skip): %s", bad.size, len(errors), counts)
    good = np.flatnonzero(errors == "")
    if good.size == 0:
        raise ValueError(f"data.path={data_cfg.path!r}: no usable record")
    held = max(1, int(good.size * data_cfg.holdout_fraction)) if good.size >= 2 and data_cfg.holdout_fraction else 0
    data = ChatData(
        table=table,
        lengths=table.data.column("length").to_numpy(),
        first_supervised=table.data.column("first_supervised").to_numpy(),
        train_rows=good[: good.size - held],
        heldout_rows=good[good.size - held :],
        skipped=int(bad.size),
        key=key,
        skipped_by_reason=by_reason,
    )
    _loaded[memo] = data
    return data


def _rendered_table(data_cfg, tokenizer, key: str, template_kwargs: dict, cache_dir: str | None):
    import datasets

    files = [str(p.resolve()) for p in jsonl_files(data_cfg.path)]
    where = str(Path(cache_dir or "outputs/.cache").expanduser() / "datasets")
    lines = datasets.Dataset.from_generator(
        _read_lines,
        gen_kwargs={"files": files, "fingerprint": key},
        cache_dir=where,
        fingerprint=f"dflash-lines-{key}",
    )
    rendered = list(Path(where).rglob(f"cache-dflash-rendered-{key}*.arrow"))
    if not rendered:  # the rendered table: token ids and masks, a few times the records' bytes
        check_free(Path(where), 4 * sum(Path(f).stat().st_size for f in files), "the datasets cache of data.path")
    procs = data_cfg.get("num_proc") or min(8, os.cpu_count() or 1)
    procs = max(1, min(procs, len(lines) // _MIN_RECORDS_PER_PROC))
    eot = end_of_turn_marker(tokenizer, **template_kwargs) if tokenizer.chat_template else ""
    return lines.map(
        _render_batch,
        batched=True,
        batch_size=500,
        remove_columns=lines.column_names,
        fn_kwargs={"tokenizer": tokenizer, "eot": eot, "template_kwargs": template_kwargs},
        num_proc=procs if procs > 1 else None,
        features=_features(),
        new_fingerprint=f"dflash-rendered-{key}",
        desc=f"rendering {len(lines)} records ({procs} processes)",
    )
