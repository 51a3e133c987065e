"""DFlash2's selector term beside the unary loss (the fused dflash_loss on the LM head's logits, as for DFlash).

Per drafted position: the unary top-k candidates of the draft's LM-head logits (chosen without gradient), the last
replaced by the target's argmax when it is missing (so every position has a label, as speculators trains it), scored
u[c] + transition(h, previous token, c); the loss is the k-way CE of the target's candidate, decay-weighted:

    loss_selector = sum(d * CE_k) / sum(d)        (d: exp(-(k-1)/gamma), the paper's decay)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.model.families.dflash2 import CandidateSelector
from dflash.model.families.dspark_loss import _denominator
from dflash.model.loss_weights import decay_weights
from dflash.model.losses import Denominator


def training_candidates(unary: torch.Tensor, target: torch.Tensor, top_k: int):
    """unary [P, V], target [P] -> (candidates [P, K] with the target injected last when missing, its index [P])."""
    cands = unary.topk(top_k, dim=-1).indices
    match = cands.eq(target[:, None])
    found = match.any(-1)
    cands[:, -1] = torch.where(found, cands[:, -1], target)
    return cands, torch.where(found, match.long().argmax(-1), top_k - 1)


def selector_loss(
    draft_hidden: torch.Tensor,  # [N, K, H]
    prev_ids: torch.Tensor,  # [N, K]: the token before each drafted one
    valid: torch.Tensor,  # [N, K] bool
    lm_head_weight: torch.Tensor,  # [V, H], frozen
    teacher_hidden: torch.Tensor,  # [N, K, H]
    selector: CandidateSelector,
    block_size: int,
    gamma: float,
    chunk_size: int = 256,
    weight_denominator: Denominator = None,
    target_next: torch.Tensor | None = None,  # [N, K]: the target's argmax (a store's), else from teacher_hidden
) -> torch.Tensor:
    n, width, hidden = draft_hidden.shape
    idx = valid.reshape(-1).nonzero().squeeze(-1)
    h = draft_hidden.reshape(-1, hidden).index_select(0, idx)
    t = teacher_hidden.detach().reshape(-1, hidden).index_select(0, idx)
    prev = prev_ids.reshape(-1).index_select(0, idx)
    t_next = None if target_next is None else target_next.reshape(-1).index_select(0, idx).long()
    weight = lm_head_weight.detach()
    ces = []
    for start in range(0, h.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        with torch.no_grad():
            unary = (h[sl].to(weight.dtype) @ weight.T).float()
            target = (t[sl].to(weight.dtype) @ weight.T).argmax(-1) if t_next is None else t_next[sl]
            cands, label = training_candidates(unary, target, selector.top_k)
        scores = (h[sl].unsqueeze(1).to(weight.dtype) * weight[cands]).sum(-1).float()
        scores = scores + selector.transition(h[sl], prev[sl], cands).float()
        ces.append(F.cross_entropy(scores, label, reduction="none"))
    ce = torch.cat(ces) if ces else torch.zeros(0, device=h.device)
    d = decay_weights(block_size, gamma, device=h.device).expand(n, -1).reshape(-1).index_select(0, idx)
    anchor = selector.predecessor_codebook.sum() * 0.0 + selector.successor_codebook.sum() * 0.0
    anchor = anchor + selector.hidden_projection.weight.sum() * 0.0  # every selector weight in the graph (DDP)
    return (d * ce).sum() / _denominator(weight_denominator, d.sum()) + anchor
