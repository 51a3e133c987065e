"""Position weights of the DFlash losses, computed from detached per-position scalars ([N, B-1] layout).

decay (`ce_decay`, `kl`): w_k = exp(-(k-1)/gamma), the DFlash paper's Eq. 4.
streak (`kl_streak`): decay times (1 - alpha) + alpha * prod_{i<k} q_i, our prefix-only relative of D-PACE.
D-PACE (`dpace`): the position-aware weights that NVIDIA Model-Optimizer uses by default for DFlash and that
SpecForge, speculators and NeMo Automodel offer. As in SpecForge (`OnlineDFlashModel._dpace_weight` in
sgl-project/SpecForge specforge/algorithms/common/dflash_family_model.py) and speculators
(`dpace_loss_decay` in vllm-project/speculators src/speculators/losses/): with the confidence
q_i = exp(-CE_i) on the hard label and the smoothed q~_i = (1 - alpha) q_i + alpha,

    prefix_k = prod_{i<=k} q~_i          (the chance that drafting reaches and keeps position k)
    w_k      = sum_{m>=k} prefix_m        (the expected accepted length that still depends on position k)

detached, no decay factor, alpha = 0.5 by default (both projects' default). Unsupervised positions count
as q~ = 1 inside the product and add nothing to the suffix sum. Both projects divide the weighted sum by
the sum of the weights (`dflash_loss` does the same by default).
"""

from __future__ import annotations

import torch


def decay_weights(
    block_size: int, gamma: float, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Paper decay exp(-(k-1)/gamma) for k = 1..block_size-1. Returns [B-1]; the first entry is 1."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size} is invalid: must be >= 2 (an anchor plus one drafted token)")
    if not gamma > 0:
        raise ValueError(f"decay_gamma={gamma} is invalid: must be > 0")
    k = torch.arange(1, block_size, device=device, dtype=torch.float64)
    return torch.exp(-(k - 1) / gamma).to(dtype)


def streak_weights(accept_prob: torch.Tensor, alpha: float) -> torch.Tensor:
    """Streak multipliers m [N, B-1] (detached) from per-position acceptance probabilities q [N, B-1].

    q_i is the draft's probability of the label at position i (exp(-CE_i)). The survival of the
    teacher-forced streak up to position k is S_1 = 1, S_k = prod_{i<k} q_i (an exclusive cumulative
    product along the block), and the multiplier is

        m_k = (1 - alpha) + alpha * S_k.

    The loss weight is decay_k * m_k. alpha = 0 gives m = 1 (plain decay weights); alpha = 1 weights
    each position by the probability that drafting reaches it, so the budget goes to the positions where
    the streak breaks rather than to positions after an already-likely break. This is a prefix-only
    relative of D-PACE (`dpace_weights`, which sums such products over the suffix); positions without
    supervision should carry q = 1 so that they do not cut the streak.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"streak_alpha={alpha} is invalid: must be in [0, 1]")
    q = accept_prob.detach()
    survival = torch.ones_like(q)
    if q.shape[-1] > 1:
        survival[..., 1:] = torch.cumprod(q[..., :-1], dim=-1)  # S_k = prod_{i<k} q_i
    return (1.0 - alpha) + alpha * survival


def dpace_weights(accept_prob: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [N, B-1] (detached, 0 at invalid positions) from confidences q [N, B-1]; see the module."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace_alpha={alpha} is invalid: must be in [0, 1]")
    q = accept_prob.detach().float()
    smooth = torch.where(valid, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    prefix = torch.cumprod(smooth, dim=-1) * valid
    suffix = prefix.flip(-1).cumsum(-1).flip(-1)  # sum_{m>=k} prefix_m
    return suffix * valid


def position_weights(
    loss_name: str,
    ce: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    decay_gamma: float,
    streak_alpha: float,
    dpace_alpha: float = 0.5,
) -> torch.Tensor:
    """Detached weights [N, B-1], 0 at invalid positions: decay (times the streak multiplier for kl_streak),
    or the D-PACE weights for dpace.

    ce: [N, B-1] per-position hard-label CE (any value at invalid positions).
    """
    if loss_name == "dpace":
        q = torch.where(valid, torch.exp(-ce.detach().float()), torch.ones_like(ce, dtype=torch.float32))
        return dpace_weights(q, valid, dpace_alpha)
    w = decay_weights(block_size, decay_gamma, device=ce.device).expand_as(ce)
    if loss_name == "kl_streak":
        q = torch.where(valid, torch.exp(-ce.detach().float()), torch.ones_like(w))
        w = w * streak_weights(q, streak_alpha)
    return torch.where(valid, w, torch.zeros_like(w))
