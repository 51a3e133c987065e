"""optim=muon's rule: which of the drafter's parameters torch.optim.Muon takes and which go to AdamW, decided by each
parameter's role, not its rank. One rule for the optimizer (dflash/train/optimizers.py, which says why these) and the
plan (dflash/model/plan.py, which applies it to the drafter built on the meta device to size the optimizer state).

A parameter's role is declared by a module that owns it: a class attribute `PARAMETER_ROLES` maps the dotted names of
its parameters (relative to it: `"markov_w1.weight"`, `"predecessor_codebook"`) to a role. Undeclared, an
`nn.Embedding`'s weight is an embedding, an `nn.Linear`'s weight a hidden matrix, and anything else (norms, biases,
kernels, bare parameters) neither. Muon takes the hidden matrices only: an embedding over the vocabulary or a
projection onto it (DSpark's Markov head, DFlash2's codebooks) is a table whose rows belong to tokens, most of which a
batch never holds, and orthogonalising or weight-decaying its update would move those rows too.
"""

from __future__ import annotations

from torch import nn

EMBEDDING = "embedding"  # a table indexed by token ids
OUTPUT = "output"  # a projection onto the vocabulary, or an output head's logit (DSpark's confidence)
HIDDEN = "hidden"  # a matrix from one hidden space to another: what Muon orthogonalises
OTHER = "other"  # norms, biases, convolution kernels, scalars
ROLES = (EMBEDDING, OUTPUT, HIDDEN, OTHER)


def _default_role(module: nn.Module, local_name: str) -> str:
    if local_name == "weight" and isinstance(module, nn.Embedding):
        return EMBEDDING
    if local_name == "weight" and isinstance(module, nn.Linear):
        return HIDDEN
    return OTHER


def parameter_roles(model: nn.Module) -> dict[str, str]:
    """{parameter name as model.named_parameters() gives it: its role}: the owners' PARAMETER_ROLES over the
    defaults (an outer module's declaration wins over its parts' defaults)."""
    roles = {}
    for prefix, module in model.named_modules():
        for local, _ in module.named_parameters(recurse=False):
            roles[f"{prefix}.{local}" if prefix else local] = _default_role(module, local)
    for prefix, module in model.named_modules():
        for local, role in getattr(module, "PARAMETER_ROLES", {}).items():
            name = f"{prefix}.{local}" if prefix else local
            if role not in ROLES:
                raise ValueError(f"{type(module).__name__}.PARAMETER_ROLES[{local!r}]={role!r}: one of {ROLES}")
            if name not in roles:  # a misspelt declaration would leave the parameter to its default
                raise ValueError(f"{type(module).__name__}.PARAMETER_ROLES names {local!r}, which it does not own")
            roles[name] = role
    return roles


def split_for_muon(model: nn.Module, exclude=()) -> tuple[list, list]:
    """(Muon's, AdamW's) trainable parameters, in `model.named_parameters()` order: Muon takes the hidden matrices
    whose names contain none of `exclude`; AdamW the rest."""
    roles = parameter_roles(model)
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden = roles[name] == HIDDEN and not any(part in name for part in exclude)
        if hidden and p.ndim != 2:
            raise ValueError(f"{name} is a hidden matrix by its role but has shape {tuple(p.shape)}: declare its role")
        (muon if hidden else adamw).append(p)
    return muon, adamw
