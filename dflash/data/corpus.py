"""Training text as token documents: the stdlib corpus and JSONL records (plain text or chat), each
rendered into token ids with a loss mask (chat: assistant tokens only)."""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


_TEST_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


DEFAULT_HOLDOUT = 0.05  # share of stdlib files held out (data.holdout_fraction's default; the tiny target's too)


class BadRecordError(ValueError):
    """A malformed record in a data file; the message starts with `file:line`."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str, holdout_fraction: float = DEFAULT_HOLDOUT, max_files: int | None = None) -> list[Path]:
    """Non-test .py files of the running Python's stdlib, sorted; `split` is "train" or "heldout".
    The split hashes each file's relative path, so it is the same on every machine with the same Python."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, not {split!r}")
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if not _TEST_DIRS & set(p.relative_to(root).parts))
    threshold = int(holdout_fraction * 10_000)

    def is_heldout(p: Path) -> bool:
        h = int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest()[:8], 16) % 10_000
        return h < threshold

    chosen = [p for p in files if is_heldout(p) == (split == "heldout")]
    return chosen[:max_files] if max_files else chosen


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@dataclass
class Document:
    ids: list[int]
    loss_mask: list[bool]


def _render_record(record: dict, tokenizer, where: str) -> Document:
    if not isinstance(record, dict):
        raise BadRecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise BadRecordError(f"{where}: 'text' must be a string")
        ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        if not ids:
            raise BadRecordError(f"{where}: 'text' is empty: no token to supervise")
        return Document(ids, [True] * len(ids))
    if "messages" in record:
        msgs = record["messages"]
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            raise BadRecordError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
        if not any(m["role"] == "assistant" for m in msgs):
            raise BadRecordError(f"{where}: no assistant message to supervise")
        empty = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and not m["content"].strip()]
        if empty:
            raise BadRecordError(f"{where}: assistant message {empty[0]} is empty (nothing to supervise there)")
        return _render_chat(msgs, tokenizer, where)
    raise BadRecordError(f"{where}: a record needs 'text' or 'messages' (keys: {sorted(record)})")


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _render_chat(messages: list[dict], tokenizer, where: str = "record") -> Document:
    """Render with the chat template; supervise exactly the tokens each assistant turn adds to the prefix.

    Turn i spans from the render of messages[:i] + generation prompt to the render of messages[:i+1]. That
    holds only where both renders are prefixes of the whole conversation's render. Some templates render the
    last turn differently (Qwen3 adds an empty <think></think> block to the final assistant turn only), so an
    earlier turn rendered alone would be longer than in the conversation and its span would run into the next
    user turn. Such turns are left unsupervised (logged once); the final turn always renders consistently.
    """
    ids = _chat_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [False] * len(ids)
    inconsistent = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _chat_ids(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        turn = _chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if ids[: len(head)] != head or ids[: len(turn)] != turn or len(turn) <= len(head):
            inconsistent += 1
            continue
        for j in range(len(head), len(turn)):
            mask[j] = True
    if inconsistent:
        _warn_inconsistent_template(inconsistent)
    if not any(mask):
        raise BadRecordError(f"{where}: the chat template renders no assistant turn as a prefix of the conversation")
    return Document(ids, mask)


_warned_template = False


def _warn_inconsistent_template(turns: int) -> None:
    global _warned_template
    if not _warned_template:
        _warned_template = True
        log.warning(
            "the chat template renders %d assistant turn(s) of a conversation differently on their own than "
            "inside it (e.g. Qwen3's <think> block on the last turn only): those turns are not supervised; "
            "the conversation's last turn is. Logged once.",
            turns,
        )


def jsonl_files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(p.glob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"data.path={path!r}: directory has no .jsonl files")
        return files
    if not p.is_file():
        raise FileNotFoundError(f"data.path={path!r}: no such file or directory")
    return [p]


def read_jsonl(path: str, tokenizer, on_bad_record: str = "fail") -> tuple[list[Document], int]:
    """Documents from every record; returns (documents, number of skipped bad records)."""
    docs, skipped = [], 0
    for f in jsonl_files(path):
        try:
            lines = f.read_bytes().split(b"\n")
        except OSError as e:
            raise FileNotFoundError(f"data.path: cannot read {f}: {e}") from e
        for lineno, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            where = f"{f}:{lineno}"
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadRecordError(f"{where}: not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadRecordError(f"{where}: invalid JSON ({e.msg})") from None
                docs.append(_render_record(record, tokenizer, where))
            except BadRecordError as e:
                if on_bad_record == "fail":
                    raise
                skipped += 1
                log.warning("skipping bad record %s", e)
    if skipped:
        log.warning("skipped %d bad records (data.on_bad_record=skip)", skipped)
    return docs, skipped


def stdlib_documents(tokenizer, split: str, holdout_fraction: float, max_files: int | None = None) -> list[Document]:
    texts = [read_text(p) for p in stdlib_files(split, holdout_fraction, max_files)]
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [Document(ids, [True] * len(ids)) for ids in enc]


def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)
