"""Sliding-window draft attention (`model.sliding_window`): which window a drafter has, and the training path that
computes only the keys the window lets each block see.

The rule is Qwen3's and z-lab's, token by token: a query at absolute position p sees a key at position c only when
|p - c| < W, on top of the DFlash mask (the block anchored at a sees the context positions < a and its own B slots).
So slot k of a block (p = a + k) sees the context positions a + k - W + 1 .. a - 1: at most the last W, fewer for
later slots; W >= B keeps every block wholly visible to itself. The drafter's config records the window as z-lab's
and Qwen3's configs do: `layer_types: ["sliding_attention", ...]`, `sliding_window: W`, `use_sliding_window: true`;
decoding (drafter.py, no mask given) applies the same rule to its KV cache, so training and decoding agree.

A window at least as long as the sequence hides nothing: `effective_window` turns it into None, and the
full-attention path runs unchanged (bitwise the same result).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def draft_window(config) -> int | None:
    """The window of a drafter's config: None when no layer slides, W when every layer does. Training builds one
    mask for all layers, so a mix of full and sliding layers is refused."""
    types = list(getattr(config, "layer_types", None) or [])
    sliding = [t == "sliding_attention" for t in types]
    window = getattr(config, "sliding_window", None)
    if not any(sliding) or window is None:
        return None
    if not all(sliding):
        raise ValueError(
            f"drafter layer_types={types} mixes full and sliding attention: training supports all layers sliding "
            "(model.sliding_window) or none"
        )
    return int(window)


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
    (N*B) x (S + N*B) mask: per block the W - 1 context positions before its anchor and its own B slots, so a
    step's attention scores are N*B x (W - 1 + B). The drafter calls `attend` in place of SDPA over all keys."""

    anchors: torch.Tensor  # (bsz, N)
    block_valid: torch.Tensor  # (bsz, N) bool; padding blocks see only themselves
    seq_len: int
    block_size: int
    window: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (bsz, heads, N*B, d); k, v (bsz, kv_heads, S + N*B, d) -> (bsz, heads, N*B, d)."""
        bsz, heads, q_len, d = q.shape
        kv_heads, S, B, span = k.shape[1], self.seq_len, self.block_size, self.window - 1
        n = q_len // B
        ctx_pos = self.anchors[:, :, None] + torch.arange(-span, 0, device=q.device)  # (bsz, N, span): a-W+1 .. a-1
        ctx_ok = (ctx_pos >= 0) & self.block_valid[:, :, None]
        # slot k sees context c = a - span + i when a + k - c < W, i.e. i >= k
        slot_ok = torch.arange(span, device=q.device)[None, :] >= torch.arange(B, device=q.device)[:, None]
        mask = torch.cat(
            [ctx_ok[:, :, None, :] & slot_ok, torch.ones(bsz, n, B, B, dtype=torch.bool, device=q.device)], dim=-1
        ).reshape(bsz * n, 1, B, span + B)
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
