"""Training blocks: anchor sampling, block inputs, labels and the training attention mask (pure tensor functions).

A sequence of S tokens yields N blocks of B slots. Block j starts at anchor a_j (a supervised position):
slot 0 holds the anchor token itself, slots k = 1..B-1 hold MASK and predict the token at a_j + k
("same-position" labels, the convention of z-lab, SpecForge and NeMo). Block slot k sits at absolute
position a_j + k. The drafter's keys/values are [context (S positions) | block_0 | ... | block_{N-1}].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.model.anchor_budget import anchor_counts
from dflash.model.window import LayerRule, WindowedBlocks, as_rules, effective_window, query_positions


@dataclass
class TrainingBlocks:
    anchors: torch.Tensor  # (bsz, N) long, anchor positions (0 for padding blocks)
    block_valid: torch.Tensor  # (bsz, N) bool, False for padding blocks
    input_ids: torch.Tensor  # (bsz, N * B) long: [anchor token, MASK x (B-1)] per block
    position_ids: torch.Tensor  # (bsz, S + N * B) long: context positions 0..S-1, then a_j + k
    labels: torch.Tensor  # (bsz, N, B-1) long: token at a_j + k
    label_valid: torch.Tensor  # (bsz, N, B-1) bool: block valid and label a supervised token
    teacher_positions: torch.Tensor  # (bsz, N, B-1) long: a_j + k - 1, the target position predicting label k
    # (bsz, 1, N * B, S + N * B) bool tensor (True = may attend), a flex BlockMask, or under a window with sdpa
    # a WindowedBlocks (model/window.py); a list of them, one per layer, where the drafter's layers differ
    attention_mask: object


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
    budget: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors per sequence, without replacement, sorted; padded with invalid blocks.

    An anchor a is eligible when its whole block fits (a + B - 1 < S) and the first predicted token a + 1 is
    supervised. loss_mask: (bsz, S) bool. Returns anchors (bsz, N) long and valid (bsz, N) bool: N = num_anchors,
    or under a `budget` (train.anchor_budget) the largest row's count (`anchor_counts`).
    Anchors are resampled on every call (every pass over the data), as in the paper.
    """
    bsz, seq_len = loss_mask.shape
    eligible = torch.zeros_like(loss_mask, dtype=torch.bool)
    last = seq_len - block_size  # last anchor whose block fits
    if last >= 0:
        eligible[:, : last + 1] = loss_mask[:, 1 : last + 2].bool()
    counts = anchor_counts(eligible.sum(dim=1).tolist(), num_anchors, budget)
    width = num_anchors if budget is None else max(1, max(counts, default=0))
    anchors = torch.zeros(bsz, width, dtype=torch.long)
    valid = torch.zeros(bsz, width, dtype=torch.bool)
    for b in range(bsz):
        candidates = eligible[b].nonzero().flatten().cpu()
        if candidates.numel() == 0:
            continue
        pick = candidates[torch.randperm(candidates.numel(), generator=generator)[: counts[b]]]
        pick, _ = pick.sort()
        anchors[b, : pick.numel()] = pick
        valid[b, : pick.numel()] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def build_training_attention_mask(
    anchors: torch.Tensor,
    block_valid: torch.Tensor,
    seq_len: int,
    block_size: int,
    window: int | None = None,
    causal: bool = False,
    origin: str = "query",
):
    """(bsz, 1, N*B, S + N*B) bool. A query in block j sees context positions < a_j (not the anchor's own
    feature: at inference the bonus token's hidden state does not exist yet), every slot of its own block
    (bidirectional; `causal`: slots <= its own), and nothing of other blocks. Padding blocks see only themselves
    (keeps softmax finite; their loss weight is zero). `window` W (model/window.py): slot k also sees only context
    positions > a_j + k - W (`origin` "anchor": >= a_j - W)."""
    bsz, n = anchors.shape
    device = anchors.device
    ctx = torch.arange(seq_len, device=device)
    ctx_visible = ctx[None, None, :] < anchors[:, :, None]  # (bsz, N, S)
    if window is not None and origin == "anchor":
        ctx_visible = ctx_visible & (ctx[None, None, :] >= anchors[:, :, None] - window)
    ctx_visible = ctx_visible & block_valid[:, :, None]
    ctx_visible = ctx_visible.repeat_interleave(block_size, dim=1)  # (bsz, N*B, S)
    if window is not None and origin == "query":
        ctx_visible = ctx_visible & (query_positions(anchors, block_size)[:, :, None] - ctx < window)
    slot = torch.arange(n * block_size, device=device)
    block_id = slot // block_size
    same_block = block_id[:, None] == block_id[None, :]
    if causal:
        same_block = same_block & (slot[None, :] <= slot[:, None])
    return torch.cat([ctx_visible, same_block.expand(bsz, -1, -1)], dim=-1).unsqueeze(1)


def build_flex_block_mask(
    anchors: torch.Tensor,
    block_valid: torch.Tensor,
    seq_len: int,
    block_size: int,
    window: int | None = None,
    causal: bool = False,
    origin: str = "query",
):
    """The same visibility as `build_training_attention_mask`, as a FlexAttention BlockMask: only tiles with a
    visible entry are computed, so the cost grows with what each block sees, not with (N*B) x (S + N*B)."""
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, n = anchors.shape
    q_len, kv_len = n * block_size, seq_len + n * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        ctx = (kv_idx < seq_len) & (kv_idx < anchors[b, blk]) & block_valid[b, blk]
        if window is not None and origin == "anchor":
            ctx = ctx & (kv_idx >= anchors[b, blk] - window)
        elif window is not None:  # slot q_idx % B sits at a + q_idx % B; tiles wholly outside the window are skipped
            ctx = ctx & (anchors[b, blk] + q_idx % block_size - kv_idx < window)
        same_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == blk)
        if causal:
            same_block = same_block & (kv_idx - seq_len <= q_idx)
        return ctx | same_block

    return create_block_mask(mask_mod, bsz, None, q_len, kv_len, device=str(anchors.device))


def build_training_blocks(
    input_ids: torch.Tensor,  # (bsz, S)
    loss_mask: torch.Tensor,  # (bsz, S) bool
    anchors: torch.Tensor,  # (bsz, N)
    block_valid: torch.Tensor,  # (bsz, N)
    block_size: int,
    mask_token_id: int,
    attention: str = "sdpa",
    window=None,
) -> TrainingBlocks:
    """attention: "sdpa" builds a dense boolean mask, "flex" a FlexAttention BlockMask. window: the drafter's
    layers' rules (model/window.py's `draft_window`: None = every layer full and bidirectional; an int W = every
    layer sliding, bidirectional); under a window sdpa attends per block (WindowedBlocks)."""
    bsz, seq_len = input_ids.shape
    n = anchors.shape[1]
    device = input_ids.device
    offsets = torch.arange(block_size, device=device)
    pos = anchors[:, :, None] + offsets  # (bsz, N, B)
    pos_clamped = pos.clamp(max=seq_len - 1)
    block_tokens = torch.full((bsz, n, block_size), mask_token_id, dtype=input_ids.dtype, device=device)
    block_tokens[:, :, 0] = torch.gather(input_ids, 1, anchors)
    labels = torch.gather(input_ids, 1, pos_clamped[:, :, 1:].reshape(bsz, -1)).view(bsz, n, block_size - 1)
    in_bounds = pos[:, :, 1:] < seq_len
    supervised = torch.gather(loss_mask.bool(), 1, pos_clamped[:, :, 1:].reshape(bsz, -1)).view(bsz, n, -1)
    label_valid = block_valid[:, :, None] & in_bounds & supervised
    position_ids = torch.cat([torch.arange(seq_len, device=device).expand(bsz, -1), pos.reshape(bsz, -1)], dim=1)
    return TrainingBlocks(
        anchors=anchors,
        block_valid=block_valid,
        input_ids=block_tokens.reshape(bsz, n * block_size),
        position_ids=position_ids,
        labels=labels,
        label_valid=label_valid,
        teacher_positions=pos_clamped[:, :, :-1],  # a_j + k - 1 for k = 1..B-1
        attention_mask=_attention_mask(anchors, block_valid, seq_len, block_size, attention, window),
    )


def _attention_mask(anchors, block_valid, seq_len: int, block_size: int, attention: str, window):
    """One mask per distinct layer rule: a single one where every layer has the same, else a list, one per layer."""
    rules = as_rules(window) or (LayerRule(),)
    built: dict[LayerRule, object] = {}
    per_layer = []
    for rule in rules:
        # a window as long as the sequence: the full-attention path (the plain mask where the block is bidirectional)
        rule = LayerRule(effective_window(rule.window, seq_len), rule.causal, rule.origin)
        if rule not in built:
            built[rule] = _one_mask(anchors, block_valid, seq_len, block_size, attention, rule)
        per_layer.append(built[rule])
    return per_layer[0] if len(built) == 1 else per_layer


def _one_mask(anchors, block_valid, seq_len: int, block_size: int, attention: str, rule: LayerRule):
    args = (anchors, block_valid, seq_len, block_size)
    if attention == "flex":
        return build_flex_block_mask(*args, rule.window, rule.causal, rule.origin)
    if rule.window is not None:
        return WindowedBlocks(*args, rule.window, rule.causal, rule.origin)
    return build_training_attention_mask(*args, causal=rule.causal)


def gather_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x: (bsz, S, H), positions: (bsz, N, K) -> (bsz, N, K, H)."""
    bsz, n, k = positions.shape
    idx = positions.reshape(bsz, n * k, 1).expand(-1, -1, x.shape[-1])
    return torch.gather(x, 1, idx).view(bsz, n, k, x.shape[-1])
