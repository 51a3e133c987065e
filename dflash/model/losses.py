"""DFlash training losses: position-decayed CE, soft-label KL, streak-aware weights, fused chunked LM head.

Layout (from the drafter stage): N blocks of B = block_size slots; slot 0 is the anchor (no loss), slots
k = 1..B-1 are predicted, so every per-position tensor is [N, B-1, ...].

`dflash_loss` never holds a [P x V] logits tensor for all P positions: it gathers the valid positions,
and `_FusedLMHeadLoss` walks them in chunks of `chunk_size`. For each chunk it computes the teacher and
draft logits with the frozen LM head, the per-position CE / KL / top-1 hit, and (when a gradient is
needed) d(per-position loss)/d(draft hidden) right away, so backward is a per-row scale of a saved
[P, H] tensor and no logits are recomputed. `dflash_loss_naive` is the same maths on full logits, the
reference for tests and `python -m dflash.bench loss`.

Position weights (`dflash.model.loss_weights`) are computed outside the fused part from detached
per-position scalars: decay_k = exp(-(k-1)/gamma) (paper Eq. 4), times a streak multiplier for `kl_streak`,
or the D-PACE weights for `dpace`. loss = sum(w * per_pos) / denominator, where the denominator defaults to
the local weight sum and can be overridden (a number, a tensor, or a callable that all-reduces the local sum).

With teacher_hidden or target_next given, every loss also reports `target_correct`: the draft's argmax equals
the target's argmax (what greedy verification accepts), for `sim_tau`. The target's argmax is `target_next` when
given (a feature store holds it, or the trainer computed it once per position), so the teacher's logits cost a
matmul per chunk only for the KL; without it they are computed from teacher_hidden for the argmax too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dflash.core.config import LOSS_NAMES, default_decay_gamma
from dflash.model.loss_weights import decay_weights, dpace_weights, position_weights, streak_weights

# A denominator override: a number, a 0-dim tensor, or fn(local_weight_sum) -> global_weight_sum
# (e.g. an all-reduce), which is the only way to share one global sum for data-dependent streak weights.
Denominator = float | torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None


@dataclass
class LossOutput:
    """What `dflash_loss` returns. Scalars other than `loss` are detached 0-dim tensors (no host sync).

    loss:       scalar with grad, sum(w * per_pos) / denominator.
    loss_ce:    sum(w * CE) / denominator (detached).
    loss_kl:    sum(w * T^2 * KL) / denominator (detached); 0 for ce_decay. With these two,
                loss == kl_weight * loss_kl + (1 - kl_weight) * loss_ce for kl and kl_streak.
    correct:    Bool [N, B-1], draft argmax == label (False at invalid positions).
    target_correct: Bool [N, B-1], draft argmax == the target's argmax (False at invalid positions), or
                None without teacher_hidden: the greedy-verification hit that `sim_tau` counts.
    valid:      Bool [N, B-1], the mask the loss used.
    weight_sum: local sum of weights over valid positions (detached), before any override.
    """

    loss: torch.Tensor
    loss_ce: torch.Tensor
    loss_kl: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor
    weight_sum: torch.Tensor
    target_correct: torch.Tensor | None = None
    # a family's further detached terms by metric name (DSpark: train/loss_tv, train/loss_confidence), each already
    # divided by the global denominator like loss_ce, so ranks sum them
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------
# Fused chunked LM head + per-position losses


class _FusedLMHeadLoss(torch.autograd.Function):
    """Per-position losses of the frozen LM head, computed chunk by chunk.

    forward(h [P, H], t [P, H] | None, t_next [P] | None, labels [P], W [V, H], a, b, T, chunk, use_kl) ->
        per_pos [P] (differentiable: a * T^2 * KL + b * CE), ce [P], kl [P], correct [P], target_hit [P]
        (draft argmax == t_next, or teacher argmax without it; all False without either) (not differentiable)
    Only [chunk, V] logits exist at a time; when h needs a gradient, d per_pos / d h [P, H] is formed in
    forward (one extra [chunk, V] x [V, H] matmul, the same one autograd would run in backward) and backward
    scales its rows. No gradient flows into W or t (both frozen).
    """

    @staticmethod
    def forward(ctx, h, t, t_next, labels, weight, a, b, temperature, chunk_size, use_kl):  # noqa: D102
        need_grad = ctx.needs_input_grad[0]
        n = h.shape[0]
        per_pos = torch.empty(n, device=h.device, dtype=torch.float32)
        ce = torch.empty_like(per_pos)
        kl = torch.zeros_like(per_pos)
        correct = torch.empty(n, device=h.device, dtype=torch.bool)
        target_hit = torch.zeros(n, device=h.device, dtype=torch.bool)
        grad_h = torch.empty_like(h) if need_grad else None
        for start in range(0, n, chunk_size):
            sl = slice(start, min(start + chunk_size, n))
            t_sl, next_sl = (None if x is None else x[sl] for x in (t, t_next))
            out = _chunk_losses(h[sl], t_sl, next_sl, labels[sl], weight, a, b, temperature, need_grad, use_kl)
            ce[sl], kl[sl], correct[sl] = out[0], out[1], out[2]
            per_pos[sl] = b * out[0] + (a * temperature**2) * out[1]  # ce_decay: a = 0, b = 1, kl = 0
            if out[4] is not None:
                target_hit[sl] = out[4]
            if need_grad:
                grad_h[sl] = out[3]
        ctx.mark_non_differentiable(ce, kl, correct, target_hit)
        if need_grad:
            ctx.save_for_backward(grad_h)
        return per_pos, ce, kl, correct, target_hit

    @staticmethod
    def backward(ctx, g_per_pos, _g_ce, _g_kl, _g_correct, _g_hit):  # noqa: D102
        (grad_h,) = ctx.saved_tensors
        g = grad_h * g_per_pos.to(grad_h.dtype).unsqueeze(-1)  # (P, H)
        return g, None, None, None, None, None, None, None, None, None


def _chunk_losses(
    h: torch.Tensor,
    t: torch.Tensor | None,
    t_next: torch.Tensor | None,
    labels: torch.Tensor,
    weight: torch.Tensor,
    a: float,
    b: float,
    temperature: float,
    need_grad: bool,
    use_kl: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk: (ce [c], kl [c], correct [c], d per_pos / d h [c, H] or None, draft argmax == t_next (without it
    the teacher's argmax) [c] or None without t and t_next). Softmaxes in float32; the teacher's logits only when
    use_kl or no t_next names the target's argmax.

    With s the draft logits, p_t = softmax(t/T), per_pos = a*T^2*KL(p_t || softmax(s/T)) + b*CE:
    d per_pos / d s = a*T*(softmax(s/T) - p_t) + b*(softmax(s) - onehot(label)).
    """
    h = h.to(weight.dtype)  # train.precision=bf16-mixed: a bfloat16 head, matmuls in bfloat16
    s = (h @ weight.T).float()  # (c, V) draft logits
    lse = torch.logsumexp(s, dim=-1)
    ce = lse - s.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    pred = s.argmax(dim=-1)
    correct = pred == labels
    kl = torch.zeros_like(ce)
    ds = None
    target_hit = None if t_next is None else pred == t_next
    if t is not None and (use_kl or target_hit is None):
        t_logits = (t.to(weight.dtype) @ weight.T).float()  # (c, V)
        if target_hit is None:
            target_hit = pred == t_logits.argmax(dim=-1)
        if not use_kl:
            del t_logits
    if t is not None and use_kl:
        if temperature != 1.0:
            t_logits.div_(temperature)
        logp_t = torch.log_softmax(t_logits, dim=-1)
        del t_logits  # at most ~4 [c, V] float32 tensors live at once
        logq = torch.log_softmax(s / temperature, dim=-1) if temperature != 1.0 else s - lse.unsqueeze(-1)
        p_t = logp_t.exp()
        kl = (p_t * (logp_t - logq)).sum(-1)
        del logp_t
        if need_grad and a != 0.0:
            ds = logq.exp_().sub_(p_t).mul_(a * temperature)  # reuses logq's storage
        del logq, p_t
    if not need_grad:
        return ce, kl, correct, None, target_hit
    if b != 0.0 or ds is None:
        sm = s.sub_(lse.unsqueeze(-1)).exp_()  # softmax(s), in place: s is no longer needed
        sm[torch.arange(sm.shape[0], device=sm.device), labels] -= 1.0
        ds = sm.mul_(b) if ds is None else ds.add_(sm, alpha=b)
    return ce, kl, correct, ds.to(weight.dtype) @ weight, target_hit


# ----------------------------------------------------------------------------------------------------
# Public losses


def _check_inputs(
    draft_hidden: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    lm_head_weight: torch.Tensor,
    loss_name: str,
    block_size: int,
    teacher_hidden: torch.Tensor | None,
    chunk_size: int,
) -> None:
    if loss_name not in LOSS_NAMES:
        raise ValueError(f"loss.name={loss_name!r} is invalid: must be one of {', '.join(LOSS_NAMES)}")
    if loss_name in ("kl", "kl_streak") and teacher_hidden is None:
        raise ValueError(f"loss.name={loss_name!r} needs teacher_hidden (the target's last hidden states); got None")
    if draft_hidden.dim() != 3 or draft_hidden.shape[1] != block_size - 1:
        raise ValueError(
            f"draft_hidden must be [N, block_size - 1 = {block_size - 1}, H]; got {tuple(draft_hidden.shape)}"
        )
    if labels.shape != draft_hidden.shape[:2] or valid.shape != draft_hidden.shape[:2]:
        raise ValueError(
            f"labels {tuple(labels.shape)} and valid {tuple(valid.shape)} must be [N, B-1] = "
            f"{tuple(draft_hidden.shape[:2])}"
        )
    if teacher_hidden is not None and teacher_hidden.shape != draft_hidden.shape:
        raise ValueError(
            f"teacher_hidden {tuple(teacher_hidden.shape)} must match draft_hidden {tuple(draft_hidden.shape)}"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != draft_hidden.shape[2]:
        raise ValueError(f"lm_head_weight must be [V, H={draft_hidden.shape[2]}]; got {tuple(lm_head_weight.shape)}")
    if lm_head_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "lm_head_weight requires grad, but the fused loss treats the LM head as frozen; "
            "call lm_head.weight.requires_grad_(False)"
        )
    if chunk_size < 1:
        raise ValueError(f"loss.chunk_size={chunk_size} is invalid: must be >= 1")


def _kl_coefficients(loss_name: str, kl_weight: float) -> tuple[float, float]:
    """(a, b) in per_pos = a * T^2 * KL + b * CE. dpace combines with the KL target through kl_weight."""
    if loss_name == "ce_decay":
        return 0.0, 1.0
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"loss.kl_weight={kl_weight} is invalid: must be in [0, 1]")
    return kl_weight, 1.0 - kl_weight


def _uses_kl(loss_name: str, a: float) -> bool:
    return loss_name in ("kl", "kl_streak") or (loss_name == "dpace" and a != 0.0)


def loss_uses_kl(loss_name: str, kl_weight: float) -> bool:
    """Whether the loss reads the teacher's logits (its KL); else all it reads of the teacher is its argmax."""
    return _uses_kl(loss_name, _kl_coefficients(loss_name, kl_weight)[0])


def _check_kl_input(loss_name: str, a: float, teacher_hidden: torch.Tensor | None) -> None:
    if _uses_kl(loss_name, a) and teacher_hidden is None:
        raise ValueError(f"loss.name={loss_name!r} with kl_weight > 0 needs teacher_hidden; got None")


def _finish(
    per_pos: torch.Tensor,
    ce: torch.Tensor,
    kl: torch.Tensor,
    w: torch.Tensor,
    weight_denominator: Denominator,
    correct: torch.Tensor,
    valid: torch.Tensor,
    temperature: float,
    anchor: torch.Tensor,
    target_correct: torch.Tensor | None = None,
) -> LossOutput:
    """Weighted sums over positions; per_pos/ce/kl/w share one layout (flat valid positions or [N, B-1])."""
    weight_sum = w.sum()
    if weight_denominator is None:
        denom = weight_sum
    elif callable(weight_denominator):
        denom = torch.as_tensor(weight_denominator(weight_sum.detach()), dtype=torch.float32, device=w.device)
    else:
        denom = torch.as_tensor(weight_denominator, dtype=torch.float32, device=w.device)
    # a zero-weight batch gives 0 / 1 = 0 instead of 0 / 0 = NaN
    denom = torch.where(denom > 0, denom, torch.ones_like(denom)).detach()
    # `anchor * 0` keeps the graph connected to draft_hidden when there is no valid position
    loss = (w * per_pos).sum() / denom + anchor.sum() * 0.0
    return LossOutput(
        loss=loss,
        loss_ce=((w * ce.detach()).sum() / denom).detach(),
        loss_kl=((w * kl.detach()).sum() / denom * temperature**2).detach(),
        correct=correct,
        valid=valid,
        weight_sum=weight_sum.detach(),
        target_correct=target_correct,
    )


def dflash_loss(
    draft_hidden: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    loss_name: str,
    block_size: int,
    decay_gamma: float | None,
    kl_temperature: float,
    kl_weight: float,
    streak_alpha: float,
    teacher_hidden: torch.Tensor | None = None,
    chunk_size: int = 256,
    weight_denominator: Denominator = None,
    dpace_alpha: float = 0.5,
    target_next: torch.Tensor | None = None,
) -> LossOutput:
    """The DFlash drafter loss, fused with the LM head and computed in chunks of positions.

    draft_hidden:   [N, B-1, H] drafter output after its final norm (requires grad).
    labels:         [N, B-1] token at anchor + k (any value at invalid positions).
    valid:          [N, B-1] bool, position is supervised.
    lm_head_weight: [V, H] frozen LM head of the target (logits = hidden @ W.T); gets no gradient.
    teacher_hidden: [N, B-1, H] target's final-normed last hidden state at anchor + k - 1; needed by kl,
                    kl_streak and dpace with kl_weight > 0; when given, `target_correct` is reported.
    target_next:    [N, B-1] int, the target's argmax at those positions (`greedy_tokens`): `target_correct`
                    compares with it, and no teacher logits are computed unless the loss uses the KL.
    loss_name:      ce_decay: sum(w * CE) / sum(w), w = exp(-(k-1)/gamma).
                    kl: per position kl_weight * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - kl_weight) * CE,
                    same weights. kl_streak: as kl, w = decay * streak multiplier (`streak_weights`).
                    dpace: (1 - kl_weight) * CE + kl_weight * T^2 * KL, D-PACE weights (`dpace_weights`,
                    from the hard-label CE, smoothing dpace_alpha); kl_weight = 0 is the peers' D-PACE.
    decay_gamma:    None = the paper default for block_size (7 / 5 / 4 for 16 / 10 / 8).
    chunk_size:     positions per fused chunk: peak extra memory is a few [chunk_size, V] float32 tensors.
    weight_denominator: None = local weight sum; a number / tensor; or fn(local_sum) -> global_sum.
    """
    _check_inputs(draft_hidden, labels, valid, lm_head_weight, loss_name, block_size, teacher_hidden, chunk_size)
    if target_next is not None and target_next.shape != labels.shape:
        raise ValueError(f"target_next {tuple(target_next.shape)} must be [N, B-1] = {tuple(labels.shape)}")
    gamma = default_decay_gamma(block_size) if decay_gamma is None else decay_gamma
    a, b = _kl_coefficients(loss_name, kl_weight)
    _check_kl_input(loss_name, a, teacher_hidden)
    use_kl = _uses_kl(loss_name, a)
    temperature = float(kl_temperature) if use_kl else 1.0
    if not temperature > 0:
        raise ValueError(f"loss.kl_temperature={kl_temperature} is invalid: must be > 0")

    n_blocks, width, hidden = draft_hidden.shape
    valid = valid.bool()
    idx = valid.reshape(-1).nonzero().squeeze(-1)  # (Pv,) flat indices of supervised positions
    h = draft_hidden.reshape(-1, hidden).index_select(0, idx).to(lm_head_weight.dtype)  # (Pv, H)
    t = None
    if teacher_hidden is not None:
        t = teacher_hidden.detach().reshape(-1, hidden).index_select(0, idx).to(h.dtype)
    lab = labels.reshape(-1).index_select(0, idx).long()
    t_next = None if target_next is None else target_next.reshape(-1).index_select(0, idx).long()

    weight = lm_head_weight.detach()
    args = (h, t, t_next, lab, weight, a, b, temperature, chunk_size, use_kl)
    per_pos, ce, kl, hit, t_hit = _FusedLMHeadLoss.apply(*args)

    # back to [N, B-1] for the weights (the streak needs the block layout); invalid positions get CE 0
    ce_full = torch.zeros(n_blocks * width, device=ce.device, dtype=ce.dtype).index_copy_(0, idx, ce)
    ce_full = ce_full.view(n_blocks, width)
    correct = torch.zeros(n_blocks * width, device=hit.device, dtype=torch.bool).index_copy_(0, idx, hit)
    target_correct = None
    if t is not None or t_next is not None:
        target_correct = torch.zeros_like(correct).index_copy_(0, idx, t_hit).view(n_blocks, width)
    w = position_weights(loss_name, ce_full, valid, block_size, gamma, streak_alpha, dpace_alpha)
    w = w.reshape(-1).index_select(0, idx)
    return _finish(
        per_pos,
        ce,
        kl,
        w,
        weight_denominator,
        correct.view(n_blocks, width),
        valid,
        temperature,
        draft_hidden,
        target_correct,
    )


def dflash_loss_naive(
    draft_hidden: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    loss_name: str,
    block_size: int,
    decay_gamma: float | None,
    kl_temperature: float,
    kl_weight: float,
    streak_alpha: float,
    teacher_hidden: torch.Tensor | None = None,
    chunk_size: int = 256,
    weight_denominator: Denominator = None,
    dpace_alpha: float = 0.5,
) -> LossOutput:
    """`dflash_loss` on full [N, B-1, V] logits with plain autograd: the reference (chunk_size is ignored)."""
    _check_inputs(draft_hidden, labels, valid, lm_head_weight, loss_name, block_size, teacher_hidden, chunk_size)
    gamma = default_decay_gamma(block_size) if decay_gamma is None else decay_gamma
    a, b = _kl_coefficients(loss_name, kl_weight)
    _check_kl_input(loss_name, a, teacher_hidden)
    use_kl = _uses_kl(loss_name, a)
    temperature = float(kl_temperature) if use_kl else 1.0
    valid = valid.bool()
    lab = torch.where(valid, labels.long(), torch.zeros_like(labels, dtype=torch.long))

    logits = (draft_hidden.to(lm_head_weight.dtype) @ lm_head_weight.detach().T).float()  # (N, B-1, V)
    ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="none").view_as(lab)
    correct = (logits.argmax(-1) == lab) & valid
    kl = torch.zeros_like(ce)
    per_pos = ce
    target_correct = None
    if teacher_hidden is not None:
        t_logits = (teacher_hidden.detach().to(lm_head_weight.dtype) @ lm_head_weight.detach().T).float()
        target_correct = (logits.argmax(-1) == t_logits.argmax(-1)) & valid
    if use_kl:
        logp_t = torch.log_softmax(t_logits / temperature, dim=-1)
        logq = torch.log_softmax(logits / temperature, dim=-1)
        kl = (logp_t.exp() * (logp_t - logq)).sum(-1)
        per_pos = a * temperature**2 * kl + b * ce
    w = position_weights(loss_name, ce, valid, block_size, gamma, streak_alpha, dpace_alpha)
    zero = torch.zeros_like(per_pos)
    # where() so that NaN/inf at invalid positions (e.g. garbage labels) cannot leak into the sum
    return _finish(
        torch.where(valid, per_pos, zero),
        torch.where(valid, ce, zero),
        torch.where(valid, kl, zero),
        w,
        weight_denominator,
        correct,
        valid,
        temperature,
        draft_hidden,
        target_correct,
    )


__all__ = [
    "LOSS_NAMES",
    "LossOutput",
    "decay_weights",
    "dpace_weights",
    "dflash_loss",
    "dflash_loss_naive",
    "loss_uses_kl",
    "position_weights",
    "streak_weights",
]
