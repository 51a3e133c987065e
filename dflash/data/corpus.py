"""Where training text comes from: the stdlib corpus as token documents, and the JSONL files `data.path` names
(their records are rendered by `chat.py`)."""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


_TEST_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


DEFAULT_HOLDOUT = 0.05  # share of stdlib files held out (data.holdout_fraction's default; the tiny target's too)


class BadRecordError(ValueError):
    """A record that cannot be trained on; the message starts with `file:line` (`file:record N` in a .json
    array), `reason` is a short name it is counted under (`data/skipped/<reason>`; docs/data.md lists them)."""

    def __init__(self, message: str, reason: str = "bad_record"):
        super().__init__(message)
        self.reason = reason


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str, holdout_fraction: float = DEFAULT_HOLDOUT, max_files: int | None = None) -> list[Path]:
    """Non-test .py files of the running Python's stdlib, sorted; `split` is "train" or "heldout".
    The split hashes each file's relative path, so it is the same on every machine with the same Python."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, not {split!r}")
    root = stdlib_root()
    files = sorted(_stdlib_py_files(root))
    threshold = int(holdout_fraction * 10_000)

    def is_heldout(p: Path) -> bool:
        h = int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest()[:8], 16) % 10_000
        return h < threshold

    chosen = [p for p in files if is_heldout(p) == (split == "heldout")]
    return chosen[:max_files] if max_files else chosen


def _stdlib_py_files(root: Path):
    """The .py files under `root` outside _TEST_DIRS. The excluded directories are pruned, not walked: a
    Python's site-packages can hold ten times the stdlib's files, and every job lists them."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _TEST_DIRS]
        yield from (Path(dirpath) / f for f in filenames if f.endswith(".py"))


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@dataclass
class Document:
    ids: list[int]
    loss_mask: list[bool]


def jsonl_files(path: str) -> list[Path]:
    """The data files `data.path` names: a .jsonl or .json file, a directory's *.jsonl and *.json, or a glob
    (sorted). A .json file holds an array of records (dflash/data/records.py)."""
    if any(c in path for c in "*?["):
        matches = glob.glob(str(Path(path).expanduser()), recursive=True)
        files = sorted(p for p in map(Path, matches) if p.is_file())
        if not files:
            raise FileNotFoundError(f"data.path={path!r}: the glob matches no file")
        return files
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted([*p.glob("*.jsonl"), *p.glob("*.json")])
        if not files:
            raise FileNotFoundError(f"data.path={path!r}: directory has no .jsonl or .json files")
        return files
    if not p.is_file():
        raise FileNotFoundError(f"data.path={path!r}: no such file or directory")
    return [p]


def stdlib_documents(tokenizer, split: str, holdout_fraction: float, max_files: int | None = None) -> list[Document]:
    texts = [read_text(p) for p in stdlib_files(split, holdout_fraction, max_files)]
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [Document(ids, [True] * len(ids)) for ids in enc]


def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)
