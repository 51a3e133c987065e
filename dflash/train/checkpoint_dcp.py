"""Sharded checkpoints of data-parallel runs: the drafter and optimizer through torch.distributed.checkpoint.

    checkpoints/step_N/  .metadata + __<rank>_0.distcp   drafter and optimizer state, keyed by parameter name
                         rng_rank<r>.pt                    each rank's torch RNG state
                         meta.json                         step, counters, data position, world size, format

Every rank writes its shards into `step_N.tmp/`; rank 0 renames it once all have (the same commit as the
single-process format). DCP reshards on load, so a run resumes at another world size, with DDP or FSDP2,
or in one process (`parallel=single`, where DCP loads without a process group). A single-process
checkpoint (safetensors) loads into a data-parallel run too (`load_full_into`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from dflash.core.disk import remove_partial
from dflash.core.distributed import World
from dflash.train.checkpoint import (
    DCP_FORMAT,
    STATE,
    WEIGHTS,
    check_signature,
    commit,
    model_signature,
    read_meta,
    verify_checkpoint,
)
from dflash.train.parallelize import unwrap

log = logging.getLogger(__name__)


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def save_sharded(final: Path, model, trainer, world: World, extra: dict, keep_last: int) -> Path:
    """Collective: every rank calls it at the same step."""
    tmp = final.with_name(final.name + ".tmp")
    if world.is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    world.barrier()
    try:
        model_state, optim_state = get_state_dict(model, list(trainer.optimizer.parts.values()))
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp), process_group=world.group)
        torch.save({"torch": torch.get_rng_state()}, tmp / _rng_file(world.rank))
    except BaseException:
        remove_partial(tmp)  # a full disk: no half checkpoint left (a rank that did not fail finds none either)
        raise
    world.barrier()  # every rank's shards are written
    if world.is_main:
        drafter = unwrap(model)
        meta = {
            "step": trainer.step,
            "tokens": trainer.tokens,
            "format": DCP_FORMAT,
            "world_size": world.size,
            "parallel": world.mode,
            "trainer": trainer.counters(),
            "signature": model_signature(drafter),
            "drafter_config": drafter.config.to_dict(),
            **extra,
            "complete": True,
        }
        commit(tmp, final, meta, keep_last)
    world.barrier()  # nobody moves on before the checkpoint is complete
    return final


def load_sharded(ckpt: Path, model, trainer, world: World) -> dict:
    """Collective: drafter, optimizer, counters and (same rank count) RNG from a sharded checkpoint that rank 0
    has verified (CheckpointManager.resume broadcasts its verdict: every rank hashing every shard would multiply
    the reads by the rank count, and a rank failing alone here would leave the others in dcp.load); returns
    meta.json."""
    meta = read_meta(ckpt)
    check_signature(ckpt, meta, unwrap(model))
    parts = list(trainer.optimizer.parts.values())
    model_state, optim_state = get_state_dict(model, parts)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(ckpt), process_group=world.group)
    set_state_dict(model, parts, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer.optimizer.apply_config()  # the resumed config's hyperparameters
    trainer.load_counters(meta["trainer"])
    rng = Path(ckpt) / _rng_file(world.rank)
    if rng.is_file() and meta.get("world_size") == world.size:
        torch.set_rng_state(torch.load(rng, weights_only=True)["torch"])
    return meta


def load_sharded_weights(ckpt: Path, drafter, verified: bool = False) -> dict:
    """Only the drafter's weights (export, evaluation), into a plain module in one process."""
    if not verified:
        verify_checkpoint(ckpt)
    meta = read_meta(ckpt)
    check_signature(ckpt, meta, drafter)
    state = {"model": drafter.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt))
    drafter.load_state_dict(state["model"])
    return meta


def load_full_into(ckpt: Path, model, trainer) -> dict:
    """A single-process checkpoint (full weights, optimizer state by parameter index) into a data-parallel
    model: every rank reads the whole files and keeps its part (verified by rank 0 first, as for load_sharded)."""
    from safetensors.torch import load_file

    meta = read_meta(ckpt)
    drafter = unwrap(model)
    check_signature(ckpt, meta, drafter)
    full = load_file(str(Path(ckpt) / WEIGHTS))
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, full, options=options)
    saved = torch.load(Path(ckpt) / STATE, map_location="cpu", weights_only=True)["trainer"]
    # each single-process optimizer keys its state by the index of a parameter in its own parameter list, which
    # was built as this run's (the same split, in `named_parameters` order): index -> name, one part at a time
    name_of = {p: n for n, p in drafter.named_parameters()}
    by_name: dict = {"state": {}, "param_groups": []}
    for part, optim in trainer.optimizer.split_state(saved["optimizer"]).items():
        names = [name_of[p] for g in trainer.optimizer.parts[part].param_groups for p in g["params"]]
        by_name["state"].update({names[i]: s for i, s in optim["state"].items()})
        by_name["param_groups"] += [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]
    set_optimizer_state_dict(model, list(trainer.optimizer.parts.values()), by_name, options=options)
    trainer.optimizer.apply_config()  # the resumed config's hyperparameters
    trainer.load_counters(saved)
    return meta
