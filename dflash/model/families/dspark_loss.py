"""DSpark's loss: our CE / KL / D-PACE terms on the Markov-corrected logits, plus total variation and the confidence
head's BCE (the paper's CE + TV + BCE is `loss=ce_decay loss.tv_weight=1`, BCE at loss.confidence_weight).

Per drafted position, with s the draft logits (LM head + Markov bias), p the target's distribution, q = softmax(s):

    per_pos = (1 - kl_weight) CE(s, label) + kl_weight T^2 KL(p_T || q_T) + tv_weight TV(p, q)
    TV(p, q) = 1 - sum_v min(p_v, q_v)       (1 - the rejection-sampling acceptance rate of the position)
    loss     = sum(w * per_pos) / sum(w)  +  confidence_weight * sum(d * BCE(c, 1 - TV)) / sum(d)

w: the loss's position weights (decay, streak or D-PACE: model/loss_weights.py), d: the decay weights (D-PACE's
weights come from CE and are not meant for the BCE, as in speculators). The Markov bias is trainable (its W2 gets a
gradient), so the fused LM-head loss of model/losses.py (a frozen head) does not apply: the logits are made chunk
by chunk under activation checkpointing, so no [P, V] tensor outlives its chunk and backward recomputes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.core.config import default_decay_gamma
from dflash.model.loss_weights import decay_weights, position_weights
from dflash.model.losses import Denominator, LossOutput


def _chunk_terms(h, z, w2, t, labels, weight, temperature: float, use_kl: bool):
    """One chunk: (ce, kl, tv, draft argmax == label, draft argmax == target argmax), each [c]."""
    s = (h @ weight.T).float()
    if z is not None:
        s = s + (z.to(w2.dtype) @ w2.T).float()
    logq = torch.log_softmax(s, dim=-1)
    ce = -logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    t_logits = (t @ weight.T).float()
    tv = 1.0 - torch.minimum(logq.exp(), torch.softmax(t_logits, dim=-1)).sum(-1)
    kl = torch.zeros_like(ce)
    if use_kl:
        logp_t = torch.log_softmax(t_logits / temperature, dim=-1)
        kl = (logp_t.exp() * (logp_t - torch.log_softmax(s / temperature, dim=-1))).sum(-1)
    pred = s.argmax(dim=-1)
    return ce, kl, tv, pred == labels, pred == t_logits.argmax(dim=-1)


def _denominator(weight_denominator: Denominator, local_sum: torch.Tensor) -> torch.Tensor:
    """model/losses.py's rule: the local sum, a number, or fn(local sum) -> global sum; never 0."""
    if weight_denominator is None:
        denom = local_sum
    elif callable(weight_denominator):
        denom = torch.as_tensor(weight_denominator(local_sum.detach()), dtype=torch.float32, device=local_sum.device)
    else:
        denom = torch.as_tensor(weight_denominator, dtype=torch.float32, device=local_sum.device)
    return torch.where(denom > 0, denom, torch.ones_like(denom)).detach()


def dspark_loss(
    draft_hidden: torch.Tensor,  # [N, B-1, H] (requires grad)
    labels: torch.Tensor,  # [N, B-1]
    valid: torch.Tensor,  # [N, B-1] bool
    lm_head_weight: torch.Tensor,  # [V, H], frozen
    markov_z: torch.Tensor | None,  # [N, B-1, r]: the Markov factors (bias = z @ markov_w2.T), None without the head
    markov_w2: torch.Tensor | None,  # [V, r]
    confidence_logits: torch.Tensor | None,  # [N, B-1] or None without the head
    *,
    tv_weight: float,
    confidence_weight: float,
    loss_name: str,
    block_size: int,
    decay_gamma: float | None,
    kl_temperature: float,
    kl_weight: float,
    streak_alpha: float,
    dpace_alpha: float,
    teacher_hidden: torch.Tensor | None,
    chunk_size: int = 256,
    weight_denominator: Denominator = None,
) -> LossOutput:
    """LossOutput with extra terms `train/loss_tv` and `train/loss_confidence` (each over the same denominator)."""
    if teacher_hidden is None:
        raise ValueError("dspark_loss needs teacher_hidden: TV and the confidence target compare with the target")
    if chunk_size < 1:
        raise ValueError(f"loss.chunk_size={chunk_size} is invalid: must be >= 1")
    gamma = default_decay_gamma(block_size) if decay_gamma is None else decay_gamma
    a = 0.0 if loss_name == "ce_decay" else float(kl_weight)
    use_kl = a != 0.0
    temperature = float(kl_temperature) if use_kl else 1.0
    n_blocks, width, hidden = draft_hidden.shape
    valid = valid.bool()
    idx = valid.reshape(-1).nonzero().squeeze(-1)
    h = draft_hidden.reshape(-1, hidden).index_select(0, idx).to(lm_head_weight.dtype)
    t = teacher_hidden.detach().reshape(-1, hidden).index_select(0, idx).to(h.dtype)
    z = None if markov_z is None else markov_z.reshape(-1, markov_z.shape[-1]).index_select(0, idx)
    lab = labels.reshape(-1).index_select(0, idx).long()
    weight = lm_head_weight.detach()
    parts = []
    for start in range(0, h.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        args = (h[sl], None if z is None else z[sl], markov_w2, t[sl], lab[sl], weight, temperature, use_kl)
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_terms, *args, use_reentrant=False))
        else:
            parts.append(_chunk_terms(*args))
    empty = torch.zeros(0, device=h.device)
    ce, kl, tv = (torch.cat([p[i] for p in parts]) if parts else empty for i in range(3))
    hit, t_hit = (torch.cat([p[i] for p in parts]) if parts else empty.bool() for i in (3, 4))

    def full(x: torch.Tensor, fill=0.0) -> torch.Tensor:  # flat valid positions -> [N, B-1]
        out = torch.full((n_blocks * width,), fill, device=x.device, dtype=x.dtype)
        return out.index_copy(0, idx, x).view(n_blocks, width)

    w = position_weights(loss_name, full(ce.detach()), valid, block_size, gamma, streak_alpha, dpace_alpha)
    w = w.reshape(-1).index_select(0, idx)
    denom = _denominator(weight_denominator, w.sum())
    per_pos = (1.0 - a) * ce + (a * temperature**2) * kl + tv_weight * tv
    # `* 0.0` terms keep every head in the graph when no position is valid (DDP expects a gradient for each)
    loss = (w * per_pos).sum() / denom + draft_hidden.sum() * 0.0
    if markov_z is not None:
        loss = loss + markov_z.sum() * 0.0 + markov_w2.sum() * 0.0
    loss_conf = torch.zeros((), device=h.device)
    if confidence_logits is not None:
        conf = confidence_logits.reshape(-1).index_select(0, idx).float()
        bce = F.binary_cross_entropy_with_logits(conf, (1.0 - tv).detach(), reduction="none")
        d = decay_weights(block_size, gamma, device=h.device).expand(n_blocks, -1).reshape(-1).index_select(0, idx)
        loss_conf = (d * bce).sum() / _denominator(weight_denominator, d.sum())
        loss = loss + confidence_weight * loss_conf + confidence_logits.sum() * 0.0
    return LossOutput(
        loss=loss,
        loss_ce=((w * ce.detach()).sum() / denom).detach(),
        loss_kl=((w * kl.detach()).sum() / denom * temperature**2).detach(),
        correct=full(hit, False),
        valid=valid,
        weight_sum=w.sum().detach(),
        target_correct=full(t_hit, False),
        extra={
            "train/loss_tv": ((w * tv.detach()).sum() / denom).detach(),
            "train/loss_confidence": loss_conf.detach(),
        },
    )
