"""`model.init_from=PATH`: a run's drafter starts from existing weights instead of train.seed's initialisation.

PATH is a drafter directory in z-lab's export layout (config.json with `dflash_config` + model.safetensors: our
export `RUN/drafter`, or a released drafter), a checkpoint directory (`RUN/checkpoints/step_N`, either format), or
a run directory (its newest checkpoint that verifies, else its drafter/ export: what `python -m dflash.export`
reads). `find_init_source` checks the source's config against the drafter this run builds (shapes from the
target and `model.*`) before any weight loads, naming every mismatch and the key that sets it; `load_init_weights`
then loads the weights and returns what run.json records (`init_from`: where, and the sha256 of the weights).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash.core.config import ConfigError
from dflash.core.hashing import weights_sha256
from dflash.core.rundir import CONFIG_FILE, RunDir
from dflash.train.checkpoint import (
    META,
    WEIGHTS,
    CheckpointCorrupt,
    file_digest,
    is_sharded,
    latest_verified_checkpoint,
    read_meta,
    verify_checkpoint,
)

log = logging.getLogger(__name__)

EXPORT_WEIGHTS = "model.safetensors"  # z-lab's (and our export's) one weights file

# drafter config fields that fix a weight's shape or what the drafter reads, and the setting that sets each here
_CONFIG_FIELDS = {
    "hidden_size": "the target's hidden size",
    "vocab_size": "the target's vocabulary",
    "num_hidden_layers": "model.num_draft_layers",
    "num_attention_heads": "model.draft_num_attention_heads",
    "num_key_value_heads": "model.draft_num_key_value_heads",
    "head_dim": "model.draft_head_dim",
    "intermediate_size": "model.draft_intermediate_size",
    "draft_vocab_size": "model.draft_vocab_size",  # its maps and head come with its weights
}
_DFLASH_FIELDS = {
    "block_size": "model.block_size",
    "mask_token_id": "model.mask_token_id",
    "target_layer_ids": "model.target_layer_ids",
}


@dataclass
class InitSource:
    """Where a run's initial weights come from: `kind` is drafter (an export's model.safetensors), checkpoint
    (a single-process checkpoint's drafter.safetensors) or sharded (a ddp/fsdp checkpoint's DCP files)."""

    given: str  # model.init_from as set
    path: Path  # the drafter or checkpoint directory read
    kind: str
    config: dict  # the source drafter's config (config.json, or a checkpoint's drafter_config)


def find_init_source(given: str, drafter_config) -> InitSource:
    """The source PATH names, checked against `drafter_config` (the config this run builds) before loading."""
    path = Path(given).expanduser()
    if not path.exists():
        raise ConfigError(f"model.init_from={given!r}: no such directory")
    if (path / CONFIG_FILE).is_file() and not (path / META).is_file():  # a run directory
        try:
            ckpt = latest_verified_checkpoint(path)
        except CheckpointCorrupt as e:
            raise ConfigError(f"model.init_from={given!r}: {e}") from None
        if ckpt is not None:
            path = ckpt
        elif (RunDir(path).drafter / "config.json").is_file():
            path = RunDir(path).drafter
        else:
            raise ConfigError(f"model.init_from={given!r}: a run directory without a complete checkpoint or drafter/")
    if (path / META).is_file():
        try:
            verify_checkpoint(path)
        except CheckpointCorrupt as e:
            raise ConfigError(f"model.init_from={given!r}: {e}") from None
        source = InitSource(
            given, path, "sharded" if is_sharded(path) else "checkpoint", read_meta(path)["drafter_config"]
        )
    elif (path / "config.json").is_file() and (path / EXPORT_WEIGHTS).is_file():
        source = InitSource(given, path, "drafter", json.loads((path / "config.json").read_text()))
    else:
        raise ConfigError(
            f"model.init_from={given!r}: not a drafter directory (config.json + {EXPORT_WEIGHTS}), a checkpoint "
            "directory or a run directory"
        )
    check_fits(source, drafter_config.to_dict())
    return source


def check_fits(source: InitSource, want: dict) -> None:
    """Refuse a source drafter whose config differs from this run's in a shape or in what it reads, in one line
    naming each difference and the key that sets it here."""
    have = source.config
    if not isinstance(have.get("dflash_config"), dict):
        raise ConfigError(
            f"model.init_from={source.given!r}: {source.path} has no dflash_config (not a DFlash drafter)"
        )
    diffs = [
        (name, have.get(name), want.get(name), key)
        for name, key in _CONFIG_FIELDS.items()
        if have.get(name) != want.get(name)
    ]
    for name, key in _DFLASH_FIELDS.items():
        there = have["dflash_config"].get(name, have.get(name))
        here = want["dflash_config"].get(name, want.get(name))
        if (list(there) if isinstance(there, (list, tuple)) else there) != here:
            diffs.append((name, there, here, key))
    if diffs:
        said = "; ".join(f"{name} {a} there, {b} here ({key})" for name, a, b, key in diffs)
        raise ConfigError(
            f"model.init_from={source.given!r}: the drafter at {source.path} does not fit this run: {said}"
        )
    there, here = (_rules(c) for c in (have, want))
    if there != here:  # the same weights, another function: a change of recipe, or a mistake
        log.warning(
            "model.init_from=%r: its layers attend otherwise than this run's (model.layer_types, sliding_window, "
            "sliding_block, window_origin): %s there, %s here",
            source.given,
            there,
            here,
        )


def _rules(config: dict) -> list[str]:
    """Each layer's attention rule in words (the drafter's own reading of its config: dflash/model/window.py)."""
    from types import SimpleNamespace

    from dflash.model.window import layer_rules

    fields = {"layer_types": None, **config}
    # transformers' Qwen3Config (z-lab's loader and ours) drops the window where use_sliding_window is not true
    fields["sliding_window"] = config.get("sliding_window") if config.get("use_sliding_window") else None
    rules = layer_rules(SimpleNamespace(**fields))
    said = ["full" if r.window is None else f"sliding {r.window} from the {r.origin}" for r in rules]
    return [f"{s}, {'causal' if r.causal else 'bidirectional'}" for s, r in zip(said, rules)]


def load_init_weights(drafter: torch.nn.Module, source: InitSource) -> dict:
    """Load the source's weights into `drafter` (its dtype and device kept); returns run.json's `init_from`."""
    record = {"path": source.given, "resolved": str(source.path.resolve()), "kind": source.kind}
    if source.kind == "sharded":
        weights = _read_sharded(source.path, drafter)
    else:
        file = source.path / (EXPORT_WEIGHTS if source.kind == "drafter" else WEIGHTS)
        weights = load_file(str(file))
        record["file_sha256"] = file_digest(file)["sha256"]  # what `sha256sum` says of the file read
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise ConfigError(
            f"model.init_from={source.given!r}: the weights at {source.path} do not fit this drafter "
            f"(missing {missing}, unexpected {unexpected}): a drafter of another family or layout"
        )
    record["weights_sha256"] = weights_sha256(weights)
    log.info("drafter initialised from %s (%s, weights sha256 %s)", source.path, source.kind, record["weights_sha256"])
    return record


def _read_sharded(ckpt: Path, drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A ddp/fsdp checkpoint's drafter weights, read in this process alone (no collective: every rank reads)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state["model"]
