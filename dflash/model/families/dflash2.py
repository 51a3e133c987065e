"""DFlash2 (inco.ai, August 2026; vLLM speculators 0.9.0 `speculators/models/dflash2`): the DFlash backbone with a
two-tap dynamic convolution on the draft positions around each sublayer, and a top-k candidate selector.

Our implementation of the architecture as speculators defines it, under its parameter names (so the export loads
there: families/speculators_layout.py).

Convolution, per layer, around attention and around the MLP: with x_k the block's slot k (k = 0..S-1) and taps
t = 0..T-1 (conv_kernel_size T, default 2), channels in groups of G (conv_group_size),

    y_k = sum_{t <= k} x_{k-t} * (base[t] + delta_k[t, group])      delta = kernel_projection(input), per token

the input side uses base[0] and the first half of delta, the output side base[1] and the second half (both
computed from the sublayer's input). Initialised as the identity (base tap 0 = 1, the rest and the projection 0),
so an untrained DFlash2 is a DFlash drafter.

Selector: draft j = the best of the top-k (selector_top_k) unary candidates c of the LM head's logits u_j, scored
u_j[c] + <P[prev] * (W_h h_j), S[c]> (predecessor and successor codebooks P, S of rank selector_rank; prev the
token chosen before it, the anchor for the first draft): a greedy path through the block. Trained by a k-way CE
over the unary top-k whose last candidate is replaced by the target's argmax when it is missing (dflash2_loss.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.model.drafter import DFlashDraftModel, Qwen3DFlashDecoderLayer
from dflash.model.muon_split import EMBEDDING

FAMILY = "dflash2"


def dflash2_settings(config) -> dict:
    settings = getattr(config, "dflash2_config", None)
    if not settings:
        raise ValueError("a DFlash2 drafter's config needs dflash2_config (conv_kernel_size, selector_rank, ...)")
    return dict(settings)


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, slots: int, group: int) -> torch.Tensor:
    """x (bsz, n * slots, H), delta (bsz, n * slots, T, H / group), base (T, H) -> the causal grouped dynamic
    convolution inside each block of `slots` tokens."""
    bsz, length, hidden = x.shape
    taps = base.shape[0]
    xs = x.view(bsz, length // slots, slots, hidden // group, group)
    ds = delta.view(bsz, length // slots, slots, taps, hidden // group)
    out = torch.zeros_like(xs)
    for t in range(min(taps, slots)):
        coeff = base[t].to(x.dtype).view(hidden // group, group) + ds[:, :, t:, t, :, None]
        out[:, :, t:] = out[:, :, t:] + xs[:, :, : slots - t] * coeff
    return out.view(bsz, length, hidden)


class GroupedDynamicCausalConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer, their kernels from one projection."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of drafter.conv_group_size={group_size}")
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 passes x through, every other coefficient is 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return block_conv(x, kernels[..., 0, :, :], self.base_kernel[0], slots, self.group_size), kernels[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, slots: int) -> torch.Tensor:
        return block_conv(y, delta, self.base_kernel[1], slots, self.group_size)


class DFlash2DecoderLayer(Qwen3DFlashDecoderLayer):
    def __init__(self, config, layer_idx: int, slots: int, kernel_size: int, group_size: int):
        super().__init__(config, layer_idx)
        self.slots = slots
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, kernel_size, group_size)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, kernel_size, group_size)

    def forward(self, hidden_states, target_hidden, cos_sin, attention_mask, past_key_values=None):
        residual = hidden_states
        x, delta = self.attention_conv.prepare(self.input_layernorm(hidden_states), self.slots)
        y = self.self_attn(x, target_hidden, cos_sin, attention_mask, past_key_values)
        hidden_states = residual + self.attention_conv.finish(y, delta, self.slots)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(hidden_states), self.slots)
        return hidden_states + self.mlp_conv.finish(self.mlp(x), delta, self.slots)


class CandidateSelector(nn.Module):
    # token codebooks, a row per vocabulary entry (looked up by the previous token and by the candidates): tables,
    # not hidden matrices, so optim=muon leaves them to AdamW (muon_split.py)
    PARAMETER_ROLES = {"predecessor_codebook": EMBEDDING, "successor_codebook": EMBEDDING}

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for p in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(p, std=0.02)

    def transition(self, hidden: torch.Tensor, prev_ids: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """hidden [.., H], prev_ids [..], candidates [.., K] -> transition scores [.., K]."""
        context = self.predecessor_codebook[prev_ids.long()] * self.hidden_projection(hidden).to(
            self.predecessor_codebook.dtype
        )
        return (context.unsqueeze(-2) * self.successor_codebook[candidates.long()]).sum(-1)


class DFlash2DraftModel(DFlashDraftModel):
    """The backbone with convolution-wrapped layers and the selector; `choose_drafts` is its proposal rule."""

    def __init__(self, config):
        s = dflash2_settings(config)
        super().__init__(config)
        if not 1 <= s["conv_kernel_size"] <= self.block_size:
            raise ValueError(f"conv_kernel_size={s['conv_kernel_size']} must be in [1, block_size={self.block_size}]")
        self.layers = nn.ModuleList(
            [
                DFlash2DecoderLayer(config, i, self.block_size, s["conv_kernel_size"], s["conv_group_size"])
                for i in range(config.num_hidden_layers)
            ]
        )
        self.candidate_selector = CandidateSelector(
            config.vocab_size, config.hidden_size, s["selector_rank"], min(s["selector_top_k"], config.vocab_size)
        )
        self.post_init()
        for layer in self.layers:  # post_init drew the convolutions like any Linear: back to the identity
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()

    def slots_for(self, num_draft: int) -> int:
        return num_draft + 1  # DFlash's block: the anchor's slot predicts nothing

    @property
    def fixed_block_size(self) -> int:
        """The only block size it runs: its convolutions reshape the stream into blocks of the training size, so a
        block of 16 at size 8 would run as two independent blocks of 8 (families.check_block_size refuses it)."""
        return self.block_size

    @torch.no_grad()
    def choose_drafts(self, block_hidden: torch.Tensor, lm_head: nn.Module, anchor: int):
        """The greedy path: per draft the best of the unary top-k after the transition score from the previous
        choice. Returns (drafts, None)."""
        hidden = block_hidden[1:]
        unary = lm_head(hidden.to(lm_head.weight.device, lm_head.weight.dtype)).float()
        sel = self.candidate_selector
        prev, drafts = anchor, []
        for j in range(hidden.shape[0]):
            cands = unary[j].topk(sel.top_k).indices.to(hidden.device)
            score = (
                unary[j, cands].to(hidden.device)
                + sel.transition(hidden[j], torch.tensor(prev, device=hidden.device), cands).float()
            )
            prev = int(cands[score.argmax()])
            drafts.append(prev)
        return drafts, None


def configure_dflash2(config, drafter_cfg) -> None:
    config.drafter_family = FAMILY
    config.architectures = ["DFlash2DraftModel"]
    config.dflash2_config = {
        "conv_kernel_size": int(drafter_cfg.conv_kernel_size),
        "conv_group_size": int(drafter_cfg.conv_group_size),
        "selector_rank": int(drafter_cfg.selector_rank),
        "selector_top_k": int(drafter_cfg.selector_top_k),
    }
