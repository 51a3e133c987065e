"""Drafter attention per layer (`model.layer_types`, `model.sliding_window`, `model.sliding_block`,
`model.window_origin`): which rule each layer of a drafter has, and the training path that computes only the keys a
window lets each block see.

A layer's rule (`LayerRule`, read from the drafter's config by drafter.py's `_layer_rule`, the one decoding applies)
is, on top of the DFlash mask (the block anchored at a sees the context positions < a and its own B slots):
  - window W (sliding layers): query origin (z-lab, vLLM, Qwen3): slot k (p = a + k) sees context c only when
    p - c < W, i.e. a + k - W < c, the last W - 1 - k positions; anchor origin (speculators 0.9.0): a - W <= c for
    every slot, the last W positions. W >= B keeps every block wholly visible to itself;
  - causal block: slot k sees the slots j <= k of its own block (z-lab's and vLLM's default in sliding layers),
    else all B of them (bidirectional).
A drafter has at most two distinct rules (its sliding and its full layers): training builds one mask per distinct
rule and hands each layer its own (a list); a drafter with one rule gets one mask, as before per-layer rules.

A window at least as long as the sequence hides nothing: `effective_window` turns it into None, and a bidirectional
layer runs the full-attention path unchanged (bitwise the same result).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.model.drafter import _layer_rule


@dataclass(frozen=True)
class LayerRule:
    """One layer's attention: window (None = the whole context before the anchor), causal block, window origin."""

    window: int | None = None
    causal: bool = False
    origin: str = "query"  # query | anchor

    @property
    def plain(self) -> bool:
        """Full attention over the context and the whole block: the mask of a drafter without a rule."""
        return self.window is None and not self.causal


def layer_rules(config) -> tuple[LayerRule, ...]:
    """Every layer's rule, as the drafter's own decoding reads its config."""
    return tuple(LayerRule(*_layer_rule(config, i)) for i in range(config.num_hidden_layers))


def draft_window(config) -> tuple[LayerRule, ...] | None:
    """What training needs to know of a drafter's attention beyond the plain DFlash mask: None when every layer is
    full and bidirectional, else each layer's rule (`build_training_blocks`' `window`)."""
    rules = layer_rules(config)
    return None if all(r.plain for r in rules) else rules


def as_rules(window) -> tuple[LayerRule, ...] | None:
    """`build_training_blocks`' window: None, an int W (every layer sliding, bidirectional, query origin: the uniform
    model.sliding_window) or the per-layer rules."""
    if window is None:
        return None
    if isinstance(window, int):
        return (LayerRule(int(window)),)
    return tuple(window)


def effective_window(window: int | None, seq_len: int) -> int | None:
    """None when the window hides nothing in a sequence of seq_len positions (any two are < seq_len apart)."""
    return None if window is None or window >= seq_len else int(window)


def query_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(bsz, N) anchors -> (bsz, N * B) absolute positions a_j + k of the block slots."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).reshape(anchors.shape[0], -1)


@dataclass
class WindowedBlocks:
    """model.attention=sdpa's training mask under a window, as what each block sees instead of a dense
    (N*B) x (S + N*B) mask: per block the span context positions before its anchor (W - 1 from the query, W from
    the anchor) and its own B slots, so a step's attention scores are N*B x (span + B). The drafter calls `attend`
    in place of SDPA over all keys."""

    anchors: torch.Tensor  # (bsz, N)
    block_valid: torch.Tensor  # (bsz, N) bool; padding blocks see only themselves
    seq_len: int
    block_size: int
    window: int
    causal: bool = False  # slot k sees slots j <= k of its block
    origin: str = "query"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (bsz, heads, N*B, d); k, v (bsz, kv_heads, S + N*B, d) -> (bsz, heads, N*B, d)."""
        bsz, heads, q_len, d = q.shape
        kv_heads, S, B = k.shape[1], self.seq_len, self.block_size
        span = self.window - (self.origin == "query")
        n = q_len // B
        ctx_pos = self.anchors[:, :, None] + torch.arange(-span, 0, device=q.device)  # (bsz, N, span)
        ctx_ok = (ctx_pos >= 0) & self.block_valid[:, :, None]
        ones = torch.ones(B, B, dtype=torch.bool, device=q.device)
        if self.origin == "query":  # slot k sees context c = a - span + i when a + k - c < W, i.e. i >= k
            slot_ok = torch.arange(span, device=q.device)[None, :] >= torch.arange(B, device=q.device)[:, None]
        else:  # every slot sees a - W .. a - 1
            slot_ok = torch.ones(B, span, dtype=torch.bool, device=q.device)
        own = (ones.tril() if self.causal else ones).expand(bsz, n, B, B)
        mask = torch.cat([ctx_ok[:, :, None, :] & slot_ok, own], dim=-1).reshape(bsz * n, 1, B, span + B)
        idx = ctx_pos.clamp(min=0).reshape(bsz, 1, n * span, 1).expand(bsz, kv_heads, n * span, d)

        def per_block(x: torch.Tensor) -> torch.Tensor:  # (bsz, kv_heads, S + N*B, d) -> (bsz*N, kv_heads, span+B, d)
            ctx = x[:, :, :S].gather(2, idx).view(bsz, kv_heads, n, span, d)
            own = x[:, :, S:].reshape(bsz, kv_heads, n, B, d)
            return torch.cat([ctx, own], dim=3).transpose(1, 2).reshape(bsz * n, kv_heads, span + B, d)

        qb = q.reshape(bsz, heads, n, B, d).transpose(1, 2).reshape(bsz * n, heads, B, d)
        # grouped-query heads share the gathered keys (no per-head copies of the windows)
        out = F.scaled_dot_product_attention(
            qb, per_block(k), per_block(v), attn_mask=mask, enable_gqa=heads != kv_heads
        )
        return out.reshape(bsz, n, heads, B, d).transpose(1, 2).reshape(bsz, heads, q_len, d)
