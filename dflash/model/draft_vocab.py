"""model.draft_vocab_size: the drafter's head over the N target tokens most frequent in the run's training labels,
as vLLM speculators 0.9.0 builds it (its train/vocab_mapping.py and model.py's DraftVocabMixin).

The maps are speculators' two buffers of the drafter:

    t2d  bool [V]:  t2d[target id] is True when the token is in the draft vocabulary
    d2t  long [N]:  an offset per draft id: target id = draft id + d2t[draft id] (draft ids ascend with target ids)

Its head (`lm_head`, [N, H]) is the target LM head's rows of those tokens, frozen as speculators freezes it (it
initialises `lm_head` from the verifier's and sets requires_grad False). Training's loss runs over the draft
vocabulary (`draft_targets`): the target's distribution restricted to it and renormalised (speculators'
`verifier_lm_head` has the same rows), a label outside it replaced by the target's most likely token inside it
(speculators' CE label is the argmax of those restricted logits), and the share of such labels reported. Decoding
maps draft ids back (`DraftVocabHead`: target-vocabulary logits, -inf outside), so the target's verification keeps it
lossless.
"""

from __future__ import annotations

import torch
from torch import nn

OOV_METRIC = "train/oov_labels"  # share of the supervised labels outside the draft vocabulary


def build_maps(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from token counts [V], speculators' `build_vocab_mappings_from_distribution`: the N most frequent
    tokens (ties by the lower id; tokens never seen do not count), topped up with the lowest unused ids when fewer
    than N were seen, sorted by target id."""
    vocab = counts.numel()
    if not 1 <= draft_vocab_size < vocab:
        raise ValueError(f"model.draft_vocab_size={draft_vocab_size} must be in [1, {vocab}) (the target's vocabulary)")
    counts = counts.long().cpu()
    seen = counts.nonzero().squeeze(-1)
    order = sorted(seen.tolist(), key=lambda t: (-int(counts[t]), t))[:draft_vocab_size]
    chosen = set(order)
    for tid in range(vocab):
        if len(order) >= draft_vocab_size:
            break
        if tid not in chosen:
            order.append(tid)
    order.sort()
    d2t = torch.tensor(order, dtype=torch.long) - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[order] = True
    return d2t, t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted labels inside the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[t2d.to(counts.device)].sum()) / total if total else 0.0


def has_draft_vocab(drafter) -> bool:
    return getattr(drafter, "d2t", None) is not None


def target_ids(drafter) -> torch.Tensor:
    """[N] the target id of every draft id."""
    return drafter.d2t + torch.arange(drafter.d2t.numel(), device=drafter.d2t.device)


def attach(drafter, d2t: torch.Tensor, t2d: torch.Tensor, target_head_weight: torch.Tensor) -> None:
    """The maps into the drafter's buffers and its frozen head from the target's rows (after its init)."""
    if d2t.numel() != drafter.d2t.numel() or t2d.numel() != drafter.t2d.numel():
        raise ValueError(
            f"draft vocabulary maps of {d2t.numel()} / {t2d.numel()} tokens for a drafter of "
            f"{drafter.d2t.numel()} / {drafter.t2d.numel()}"
        )
    with torch.no_grad():
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        rows = target_head_weight.detach()[target_ids(drafter).to(target_head_weight.device)]
        drafter.lm_head.weight.copy_(rows.to(drafter.lm_head.weight))
    drafter.lm_head.weight.requires_grad_(False)


def head_weight(drafter, target_head_weight: torch.Tensor) -> torch.Tensor:
    """The weight the training loss multiplies: the target head's rows of the draft vocabulary (the values of the
    drafter's frozen `lm_head`, taken from the target so a sharded drafter needs no gather), or the whole head.
    Kept until the maps or the head change (a resume or model.init_from loads the maps after the trainer is built)."""
    if not has_draft_vocab(drafter):
        return target_head_weight
    cache = drafter.__dict__.get("_draft_head_cache")
    if cache is not None and cache[1] is target_head_weight and torch.equal(cache[0], drafter.d2t):
        return cache[2]
    rows = target_head_weight.detach()[target_ids(drafter).to(target_head_weight.device)]
    drafter.__dict__["_draft_head_cache"] = (drafter.d2t.clone(), target_head_weight, rows)
    return rows


class DraftVocabHead(nn.Module):
    """The drafter's head at decoding: target-vocabulary logits, -inf outside the draft vocabulary, so an argmax
    (and every family's proposal rule) returns target ids."""

    def __init__(self, drafter, vocab_size: int):
        super().__init__()
        self.head = drafter.lm_head
        self.vocab_size = vocab_size
        self.register_buffer("ids", target_ids(drafter).clone(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden.to(self.head.weight.dtype))
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.ids.to(out.device)] = logits
        return out

    def to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """A term over the draft vocabulary (DSpark's Markov bias) spread over the target's, 0 elsewhere."""
        out = draft_logits.new_zeros((*draft_logits.shape[:-1], self.vocab_size))
        out[..., self.ids.to(out.device)] = draft_logits
        return out


def decoding_head(drafter, target_head: nn.Module) -> nn.Module:
    """What decoding, sim_tau and replay multiply the drafter's output by: the target's head, or DraftVocabHead."""
    if not has_draft_vocab(drafter):
        return target_head
    return DraftVocabHead(drafter, int(drafter.t2d.numel())).to(drafter.lm_head.weight.device)


def to_draft_ids(drafter, tokens: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids, -1 outside the draft vocabulary (and for negative ids)."""
    index = torch.cumsum(drafter.t2d.long(), 0) - 1
    index = torch.where(drafter.t2d, index, torch.full_like(index, -1))
    safe = tokens.long().clamp(min=0).to(index.device)
    return torch.where(tokens.to(index.device) >= 0, index[safe], torch.full_like(safe, -1)).to(tokens.device)


def draft_targets(
    drafter,
    labels: torch.Tensor,
    valid: torch.Tensor,
    teacher_hidden: torch.Tensor,
    weight: torch.Tensor,
    target_next: torch.Tensor | None,
    weight_denominator=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The loss's labels and target argmax over the draft vocabulary, the valid labels outside it [N, B-1] and their
    share.

    labels [N, B-1] target ids -> draft ids; one outside the draft vocabulary becomes the target's most likely token
    inside it (argmax of the restricted teacher logits `teacher_hidden @ weight.T`, speculators' CE label).
    target_next -> draft ids, -1 where the target's own argmax is outside (the drafter cannot propose it: no hit).
    The share is over this rank's valid labels divided by the global count when `weight_denominator` all-reduces
    (the ranks' shares then sum to the global one)."""
    draft = to_draft_ids(drafter, labels)
    outside = valid & (draft < 0)
    if bool(outside.any()):
        t = teacher_hidden.detach()[outside].to(weight.dtype)
        best = torch.cat([(c @ weight.T).float().argmax(-1) for c in t.split(256)])
        draft = draft.masked_scatter(outside, best.to(draft.dtype))
    draft = torch.where(valid, draft.clamp(min=0), torch.zeros_like(draft))
    nxt = None if target_next is None else to_draft_ids(drafter, target_next)
    count = valid.sum().float()
    if callable(weight_denominator):
        count = torch.as_tensor(weight_denominator(count), dtype=torch.float32)
    share = outside.sum().float().cpu() / max(float(count), 1.0)
    return draft, nxt, outside, share.detach()
