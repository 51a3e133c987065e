"""A run's training data, fingerprinted: the files (path, size, content hash), the tokenizer and the data
settings. run.json and every checkpoint record it, so a resume notices data that changed under it.

Files up to `FULL_HASH_BYTES` are hashed whole; larger ones by their size, their first and last MiB and a
MiB at each tenth (a sound proxy: an edit that keeps the size and misses all eleven samples is rare, and
any append or truncation changes the size).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from dflash.data.corpus import jsonl_files, stdlib_root

FULL_HASH_BYTES = 256 << 20
_PIECE = 1 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json", "merges.txt")


TARGET_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")  # a target's weights, as hashed


def hashed_files(root: Path, names) -> dict[str, str]:
    """`file_hash` of each of `names` that is a file under `root` (none: {}, e.g. a hub id, not a directory)."""
    return {name: file_hash(root / name) for name in names if (root / name).is_file()}


def file_hash(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for piece in iter(lambda: f.read(_PIECE), b""):
                h.update(piece)
            return h.hexdigest()
        for i in range(11):  # first MiB, every tenth, last MiB
            f.seek(min(size - _PIECE, i * (size - _PIECE) // 10))
            h.update(f.read(_PIECE))
    return "sampled:" + h.hexdigest()


def data_fingerprint(data_cfg, target: str) -> dict:
    """What the training data of a run is: files, tokenizer and the settings that shape the stream."""
    if data_cfg.name == "jsonl":
        files = {
            str(p.resolve()): {"bytes": p.stat().st_size, "sha256": file_hash(p)} for p in jsonl_files(data_cfg.path)
        }
    else:  # the Python standard library's sources: their version stands for their content
        files = {str(stdlib_root()): {"python": sys.version.split()[0]}}
    tokenizer = hashed_files(Path(target).expanduser(), TOKENIZER_FILES)
    settings = {k: data_cfg.get(k) for k in ("name", "holdout_fraction", "max_files", "min_supervised_tokens")}
    if data_cfg.name == "jsonl" and data_cfg.get("long_conversations", "truncate") != "truncate":
        settings["long_conversations"] = data_cfg.get("long_conversations")  # runs from before it truncated
    if data_cfg.get("chat_template_kwargs"):  # only when set: runs recorded before it existed still match
        settings["chat_template_kwargs"] = _plain(data_cfg.get("chat_template_kwargs"))
    return {"files": files, "tokenizer": tokenizer or {"hub": target}, "settings": settings}


def _plain(value):
    """Config values as plain JSON (an OmegaConf dict becomes a dict)."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def differences(recorded: dict, current: dict) -> list[str]:
    """Human-readable differences between two fingerprints, each naming the file or setting."""
    out = []
    old_files, new_files = recorded.get("files", {}), current.get("files", {})
    for path in sorted(set(old_files) | set(new_files)):
        if path not in new_files:
            out.append(f"{path} is gone")
        elif path not in old_files:
            out.append(f"{path} is new")
        elif old_files[path] != new_files[path]:
            out.append(f"{path} changed ({_describe(old_files[path])} -> {_describe(new_files[path])})")
    if recorded.get("tokenizer") != current.get("tokenizer"):
        out.append("the tokenizer files changed")
    if recorded.get("settings") != current.get("settings"):
        out.append(f"data settings changed ({recorded.get('settings')} -> {current.get('settings')})")
    return out


def _describe(entry: dict) -> str:
    if "bytes" in entry:
        return f"{entry['bytes']} bytes, sha256 {str(entry.get('sha256', ''))[-12:]}"
    return ", ".join(f"{k} {v}" for k, v in entry.items())
