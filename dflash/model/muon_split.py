"""optim=muon's rule: which of the drafter's parameters torch.optim.Muon takes and which go to AdamW. One rule for
the optimizer (dflash/train/optimizers.py, which says why these) and the plan (dflash/model/plan.py, which applies it
to the drafter built on the meta device to size the optimizer state)."""

from __future__ import annotations


def split_for_muon(named_params, exclude=()) -> tuple[list, list]:
    """(Muon's, AdamW's) parameters, in `named_params` order: Muon takes the 2-D matrices (both sides > 1) whose
    names contain none of `exclude`; AdamW the rest."""
    muon, adamw = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(part in name for part in exclude)
        (muon if matrix else adamw).append(p)
    return muon, adamw
