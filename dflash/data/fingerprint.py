"""A run's training data, fingerprinted: the files (path, size, content hash), the tokenizer and the data
settings. run.json and every checkpoint record it, so a resume notices data that changed under it.

Files up to `FULL_HASH_BYTES` are hashed whole; larger ones by their size, their first and last MiB and a
MiB at each tenth (a sound proxy: an edit that keeps the size and misses all eleven samples is rare, and
any append or truncation changes the size).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from dflash.data.corpus import jsonl_files, stdlib_root
from dflash.data.tokens import token_files

FULL_HASH_BYTES = 256 << 20
_PIECE = 1 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json", "merges.txt")


# a target's weights, as hashed: its config, one weights file or an index, and every shard an index names
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TARGET_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", *WEIGHT_INDEXES)


def hashed_files(root: Path, names) -> dict[str, str]:
    """`file_hash` of each of `names` that is a file under `root` (none: {}, e.g. a hub id, not a directory)."""
    return {name: file_hash(root / name) for name in names if (root / name).is_file()}


def target_hashes(target: str, extra=()) -> dict:
    """What a target's weights are: `TARGET_FILES`, every shard its index's weight_map names
    (model-00001-of-00005.safetensors ...) and `extra`, hashed; for a hub name {"hub": name, "revision": the commit
    the local hub cache resolves it to} (the files there are that commit's)."""
    root = Path(target).expanduser()
    return hashed_files(root, (*TARGET_FILES, *weight_shards(root), *extra)) or hub_entry(target)


def weight_shards(root: Path) -> list[str]:
    """The files the weight indexes under `root` name (their weight_map's values), sorted."""
    shards: set[str] = set()
    for name in WEIGHT_INDEXES:
        if (root / name).is_file():
            try:
                shards.update(json.loads((root / name).read_text())["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{root / name}: not a weight index (no weight_map: {type(e).__name__})") from None
    return sorted(shards)


def hub_entry(name: str) -> dict:
    return {"hub": str(name), "revision": hub_revision(str(name))}


def hub_revision(name: str) -> str | None:
    """The commit the local hub cache's `main` resolves `name` to (what from_pretrained loads), read from the cache
    without the network; None when nothing of it is cached."""
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a repo id
        return None
    return Path(path).parent.name if isinstance(path, str) else None  # .../snapshots/<commit>/config.json


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
    if data_cfg.name in ("jsonl", "tokens"):
        listed = jsonl_files(data_cfg.path) if data_cfg.name == "jsonl" else token_files(data_cfg.path)
        files = {str(p.resolve()): {"bytes": p.stat().st_size, "sha256": file_hash(p)} for p in listed}
    else:  # the Python standard library's sources: their version stands for their content
        files = {str(stdlib_root()): {"python": sys.version.split()[0]}}
    tokenizer = hashed_files(Path(target).expanduser(), TOKENIZER_FILES)
    settings = {k: data_cfg.get(k) for k in ("name", "holdout_fraction", "max_files", "min_supervised_tokens")}
    if data_cfg.name == "jsonl" and data_cfg.get("long_conversations", "truncate") != "truncate":
        settings["long_conversations"] = data_cfg.get("long_conversations")  # runs from before it truncated
    if data_cfg.get("chat_template_kwargs"):  # only when set: runs recorded before it existed still match
        settings["chat_template_kwargs"] = _plain(data_cfg.get("chat_template_kwargs"))
    return {"files": files, "tokenizer": tokenizer or hub_entry(target), "settings": settings}


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
    if not _same_tokenizer(recorded.get("tokenizer"), current.get("tokenizer")):
        out.append("the tokenizer files changed")
    if recorded.get("settings") != current.get("settings"):
        out.append(f"data settings changed ({recorded.get('settings')} -> {current.get('settings')})")
    return out


def _same_tokenizer(recorded, current) -> bool:
    """Equal, or a hub target recorded by name alone (before revisions were recorded) that names the same one."""
    if isinstance(recorded, dict) and "hub" in recorded and "revision" not in recorded and isinstance(current, dict):
        return recorded["hub"] == current.get("hub")
    return recorded == current


def _describe(entry: dict) -> str:
    if "bytes" in entry:
        return f"{entry['bytes']} bytes, sha256 {str(entry.get('sha256', ''))[-12:]}"
    return ", ".join(f"{k} {v}" for k, v in entry.items())
