"""The answers a ShareGPT experiment trains on besides the target's regenerated ones (#46): ShareGPT's own
first-exchange answers (`original`: no generation; the feature store's one target forward per row still gives the
target's features and its logits, so `loss=kl` distils the target on them) and a seeded mix of regenerated and
original answers (`mix`). Every record says where it comes from (`origin`: regenerated or original;
`conversation`: its index among the usable first exchanges, as regen.jsonl's `source_index`), and
FILE.manifest.json says which records, how they were made, in what order and what making them cost."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from dflash.core.jsonio import write_json, write_text_atomic
from dflash.model.tiny_chat import first_exchange

REGENERATED, ORIGINAL = "regenerated", "original"


def original_name(count: int, cut_suffix: str = "") -> str:
    return f"original-{count}{cut_suffix}.jsonl"


def mix_name(regen: Path, records: int, originals: int, seed: int, cut_suffix: str = "") -> str:
    return f"mix-{regen.stem}-{records}+{ORIGINAL}-{originals}-seed{seed}{cut_suffix}.jsonl"


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".manifest.json")


def original_records(exchanges: list[list[dict]], first: int, max_chars: int | None = None) -> list[dict]:
    """ShareGPT's own answers of `exchanges`, the first of them usable exchange number `first` (from 0). With
    `max_chars` the exchanges are whole and each turn is cut here (tiny_chat's rule); an answer cut carries
    `finish_reason: length`, as regeneration marks one cut at its token limit: its end of turn is not supervised
    under loss.labels=data (dflash/data/chat.py), where it would teach the drafter to end a turn mid-sentence."""
    rows = []
    for i, ex in enumerate(exchanges):
        cut = ex if max_chars is None else first_exchange(ex, max_chars)
        messages = [
            {**m, "finish_reason": "length"} if m["role"] == "assistant" and m["content"] != whole["content"] else m
            for m, whole in zip(cut, ex)
        ]
        rows.append({"messages": messages, "origin": ORIGINAL, "conversation": first + i})
    return rows


def regenerated_records(regen: Path) -> list[dict]:
    """regen.jsonl's answers in conversation order (a record that failed to regenerate is not in it)."""
    rows = [json.loads(line) for line in regen.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: int(r["source_index"]))
    return [{"messages": r["messages"], "origin": REGENERATED, "conversation": int(r["source_index"])} for r in rows]


def mixed(regenerated: list[dict], originals: list[dict], seed: int) -> list[dict]:
    """Both sources in one seeded order (random.Random(seed).shuffle): the same inputs give the same file."""
    rows = [*regenerated, *originals]
    random.Random(seed).shuffle(rows)
    return rows


def write_records(path: Path, records: list[dict], manifest: dict) -> bool:
    """`path` holding `records`, and its manifest; False when `path` held these records already (both left as they
    were, so that nothing built on them looks changed)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if path.exists() and manifest_path(path).exists() and path.read_text() == text:
        return False
    write_text_atomic(path, text)
    counts = {origin: sum(r["origin"] == origin for r in records) for origin in (REGENERATED, ORIGINAL)}
    write_json(
        manifest_path(path),
        {
            **manifest,
            "records": len(records),
            "records_by_origin": counts,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
        },
    )
    return True
