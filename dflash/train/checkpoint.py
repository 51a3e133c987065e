"""Resumable checkpoints: `checkpoints/step_N/` with the drafter (safetensors), optimizer + counters + data
position (torch, loaded with weights_only=True), RNG states and meta.json. Data-parallel runs write the
sharded format of checkpoint_dcp.py instead; meta.json says which (`format`).

A checkpoint is written to `step_N.tmp/` and renamed; `meta.json` (written last) carries `complete: true`,
so a directory truncated mid-write is never mistaken for a complete one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.core.disk import remove_partial
from dflash.core.hashing import file_sha256
from dflash.core.jsonio import read_json
from dflash.core.rundir import RunDir

log = logging.getLogger(__name__)

WEIGHTS = "drafter.safetensors"
STATE = "state.pt"
META = "meta.json"
DCP_FORMAT = "dcp"  # sharded: torch.distributed.checkpoint files (checkpoint_dcp.py)
DCP_METADATA = ".metadata"


class CheckpointMismatch(ValueError):
    """A checkpoint made for a different drafter shape or mask token."""


def model_signature(drafter) -> dict:
    """What must match between a checkpoint and the drafter it is loaded into."""
    c = drafter.config
    return {
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size,
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": list(drafter.target_layer_ids),
    }


def save_checkpoint(run_dir: Path, drafter, trainer_state: dict, extra: dict, keep_last: int) -> Path:
    root = RunDir(run_dir).checkpoints
    root.mkdir(parents=True, exist_ok=True)
    step = int(trainer_state["step"])
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS))
        torch.save({"trainer": trainer_state, "rng": {"torch": torch.get_rng_state()}}, tmp / STATE)
        meta = {
            "step": step,
            "tokens": int(trainer_state["tokens"]),
            "signature": model_signature(drafter),
            "drafter_config": drafter.config.to_dict(),
            **extra,
            "complete": True,
        }
        commit(tmp, final, meta, keep_last)
    except BaseException:
        remove_partial(tmp)  # a full disk or a crash mid-write leaves no half checkpoint behind
        raise
    return final


def commit(tmp: Path, final: Path, meta: dict, keep_last: int) -> None:
    """Content hashes of every file into meta.json, meta.json last, every file on disk, then the rename that
    makes `final` a complete checkpoint."""
    meta = {**meta, "files": {f.name: file_digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}}
    (tmp / META).write_text(json.dumps(meta, indent=2, default=str))
    for f in tmp.iterdir():  # on disk before the rename makes the checkpoint look complete
        _fsync(f)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)  # the rename itself survives a power loss
    _prune(final.parent, keep_last)
    log.info("checkpoint step %d -> %s", meta["step"], final)


def file_digest(path: Path) -> dict:
    """{"bytes", "sha256"} of a file, read in 1 MiB pieces."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


class CheckpointCorrupt(ValueError):
    """A checkpoint whose files are missing, cut short or changed since they were written."""


def verify_checkpoint(ckpt: Path) -> None:
    """Raise CheckpointCorrupt naming the first file that is missing, of another size, or of another content
    than meta.json recorded. Checkpoints written before hashes were recorded pass unchecked."""
    ckpt = Path(ckpt)
    meta = read_json(ckpt / META, default=None)
    if not isinstance(meta, dict) or not meta.get("complete"):
        raise CheckpointCorrupt(f"checkpoint {ckpt}: meta.json is missing, unreadable or not marked complete")
    for name, want in (meta.get("files") or {}).items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointCorrupt(f"checkpoint {ckpt}: {name} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointCorrupt(f"checkpoint {ckpt}: {name} has {size} bytes, {want['bytes']} were written")
        if file_digest(path)["sha256"] != want["sha256"]:
            raise CheckpointCorrupt(f"checkpoint {ckpt}: {name} does not match its sha256 (changed on disk)")


def latest_verified_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint whose files verify. A newer one that fails is reported loudly and
    skipped; when checkpoints exist but none verifies, CheckpointCorrupt says what failed in each."""
    root = RunDir(run_dir).checkpoints
    ckpts = _complete_checkpoints(root) if root.is_dir() else []
    failures = []
    for ckpt in reversed(ckpts):
        try:
            verify_checkpoint(ckpt)
        except CheckpointCorrupt as e:
            log.error("%s; falling back to an older checkpoint", e)
            failures.append(str(e))
            continue
        if failures:
            log.warning("resuming from %s: the %d newer checkpoint(s) failed verification", ckpt.name, len(failures))
        return ckpt
    if failures:
        raise CheckpointCorrupt("no checkpoint of this run verifies: " + "; ".join(failures))
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_checkpoints(root: Path) -> list[Path]:
    out = []
    for d in root.glob("step_*"):
        if d.suffix == ".tmp" or not d.is_dir():
            continue
        meta = read_json(d / META, default={})
        if isinstance(meta, dict) and meta.get("complete") and all((d / f).is_file() for f in _files_of(meta)):
            out.append(d)
    return sorted(out, key=lambda d: int(d.name.split("_")[1]))


def _files_of(meta: dict) -> tuple[str, ...]:
    """The files a complete checkpoint of this format has besides meta.json."""
    return (DCP_METADATA,) if meta.get("format") == DCP_FORMAT else (WEIGHTS, STATE)


def is_sharded(ckpt: Path) -> bool:
    return read_meta(ckpt).get("format") == DCP_FORMAT


def check_signature(ckpt: Path, meta: dict, drafter) -> None:
    """Refuse a checkpoint made for another drafter shape or mask token, naming the difference."""
    want, have = model_signature(drafter), meta.get("signature", {})
    diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if diff:
        lines = ", ".join(f"{k}: checkpoint {a} vs run {b}" for k, (a, b) in diff.items())
        raise CheckpointMismatch(f"checkpoint {ckpt} does not fit this drafter ({lines})")


def _prune(root: Path, keep_last: int) -> None:
    for d in _complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(d, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (incomplete or truncated ones are skipped)."""
    root = RunDir(run_dir).checkpoints
    if not root.is_dir():
        return None
    ckpts = _complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def read_meta(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / META).read_text())


def load_checkpoint(ckpt: Path, drafter, trainer=None, verified: bool = False) -> dict:
    """Load weights (and trainer state) into drafter / trainer; refuses a checkpoint that does not verify or is
    of another shape or mask id (`verified`: the caller verified it just now, so its files are hashed once).
    Returns meta.json."""
    if not verified:
        verify_checkpoint(ckpt)
    meta = read_meta(ckpt)
    check_signature(ckpt, meta, drafter)
    weights = load_file(str(Path(ckpt) / WEIGHTS), device=str(next(drafter.parameters()).device))
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise CheckpointMismatch(f"checkpoint {ckpt}: missing keys {missing}, unexpected keys {unexpected}")
    if trainer is not None:
        state = torch.load(Path(ckpt) / STATE, map_location="cpu", weights_only=True)
        trainer.load_state_dict(state["trainer"])
        torch.set_rng_state(state["rng"]["torch"])
    return meta
