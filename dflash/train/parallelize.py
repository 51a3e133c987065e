"""The drafter across ranks: DDP or FSDP2 wrapping, and its full weights gathered back for eval and export.

The frozen target (and its LM head, which the loss shares) stays outside: every rank holds a replica.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.core.distributed import World
from dflash.model.families import drafter_class


def parallelize_drafter(drafter: nn.Module, world: World, mixed_precision: bool = True) -> nn.Module:
    """The module the trainer calls: the drafter itself (single), DistributedDataParallel around it (ddp), or
    the drafter with FSDP2 `fully_shard` on each decoder layer and on the root (fsdp, in place)."""
    if world.mode == "single":
        return drafter
    if world.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [world.device.index] if world.device.type == "cuda" else None
        return DistributedDataParallel(drafter, device_ids=device_ids, process_group=world.group)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if mixed_precision and world.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in drafter.layers:
        fully_shard(layer, mesh=world.mesh, mp_policy=mp)
    fully_shard(drafter, mesh=world.mesh, mp_policy=mp)
    return drafter


def unwrap(model: nn.Module) -> nn.Module:
    """The drafter inside a DDP wrapper (FSDP2 shards in place: the module is the drafter)."""
    return getattr(model, "module", model)


def full_state_dict(model: nn.Module, world: World) -> dict[str, torch.Tensor] | None:
    """The drafter's full weights on CPU on rank 0, None elsewhere. Under fsdp this is a collective: every rank
    must call it at the same point."""
    if world.mode == "single":
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if world.is_main else None


def frozen_copy(
    drafter: nn.Module, state: dict[str, torch.Tensor] | None = None, device: torch.device | None = None
) -> nn.Module:
    """An unwrapped drafter of the same config in eval mode, without grads or optimizer state, holding `state`
    (the full weights gathered from the ranks) or else a detached clone of the drafter's own weights, on
    `device` (default: the drafter's). An eval or the export then sees one consistent set of weights while
    training goes on: take it between optimizer steps, from the thread that steps."""
    import copy

    unwrapped = unwrap(drafter)
    if state is None:
        with torch.no_grad():
            state = {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    device = device if device is not None else next(unwrapped.parameters()).device
    with torch.device("meta"):  # not type(unwrapped): FSDP2 swaps the class of a sharded module
        clone = drafter_class(unwrapped.config)(copy.deepcopy(unwrapped.config))  # its family's class
    clone.load_state_dict(state, assign=True, strict=True)
    # non-persistent buffers (RoPE inv_freq) are not in the state dict
    for name, buf in unwrapped.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        owner = clone.get_submodule(owner_name) if owner_name else clone
        owner._buffers[attr] = buf.detach().clone()
    clone.requires_grad_(False)
    return clone.to(device).eval()
