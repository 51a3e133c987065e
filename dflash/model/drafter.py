"""DFlash block-diffusion drafter (z-lab parameter names), self-contained.

This file is also the `dflash.py` shipped with every exported drafter, so `AutoModel.from_pretrained(dir,
trust_remote_code=True)` loads it: it imports nothing from the `dflash` package, only torch and transformers.

The drafter has no embedding and no LM head: the block input is the target's (frozen) embedding of
`[anchor, MASK x (B-1)]`, and its output goes through the target's LM head. Context enters only as extra
keys/values ("KV injection"):

    target_hidden (ctx_len, n_feat * H) --fc--> hidden_norm --> H_ctx  (computed once, shared by all layers)
    per layer:  q = q_proj(LN(x)),  k = [k_proj(H_ctx) ; k_proj(LN(x))],  v = [v_proj(H_ctx) ; v_proj(LN(x))]
                (q_norm / k_norm per head, RoPE at absolute positions; H_ctx is not layer-normed)
                x = x + o_proj(attn(q, k, v));  x = x + mlp(post_attention_layernorm(x))
    out = norm(x)

Training (many blocks at once) passes either a boolean `attention_mask` of shape (bsz, 1, q_len, ctx_len + q_len)
(SDPA) or a FlexAttention `BlockMask` (sparse: only visible tiles are computed; CUDA, compiled), or a list of them,
one per layer; inference passes no mask and each layer applies its own rule to its KV cache (`_layer_rule`), as
z-lab's loader (>= 07ebd93) and vLLM read the config:
  - `layer_types[i]` "sliding_attention" with `sliding_window` W: keys less than W positions before the query
    (`window_origin` "anchor", ours: the W positions before the block's anchor, speculators' rule);
  - causal inside the block (slot i sees slots j <= i) when `is_causal` says so, and where it is absent (None) in
    sliding layers only: full layers then see the whole block (z-lab's Qwen3.6 layout). Training builds the same
    rules into its masks (dflash/model/window.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

log = logging.getLogger(__name__)

__all__ = ["DFlashDraftModel", "Qwen3DFlashAttention", "Qwen3DFlashDecoderLayer", "DraftKVCache"]

try:  # FlexAttention (torch >= 2.5); its backward runs on CUDA only
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - old torch
    BlockMask, flex_attention = None, None

_compiled_flex = None


def _flex(q, k, v, block_mask):
    """flex_attention, compiled once on CUDA (eager flex is a slow reference implementation)."""
    global _compiled_flex
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if _compiled_flex is None:
        # the first step waits for the compile (the smoke runs on an H200 spent 5-15 s on 20 steps) without progress
        log.info("compiling FlexAttention for the drafter (the first step on CUDA waits for it)")
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


def _rope_theta(config: Qwen3Config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE; returns cos/sin for arbitrary absolute position ids."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: (bsz, seq) -> cos, sin: (bsz, seq, head_dim)
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (bsz, heads, seq, head_dim); cos/sin: (bsz, seq, head_dim)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _layer_rule(config: Qwen3Config, layer_idx: int) -> tuple[int | None, bool, str]:
    """Layer `layer_idx`'s attention: (window W or None, causal block, window origin "query" | "anchor"). The block
    is causal where `is_causal` is true, and where it is absent in sliding layers (z-lab's and vLLM's default)."""
    types = getattr(config, "layer_types", None) or []
    sliding = layer_idx < len(types) and types[layer_idx] == "sliding_attention"
    is_causal = getattr(config, "is_causal", None)
    causal = sliding if is_causal is None else bool(is_causal)
    window = getattr(config, "sliding_window", None) if sliding else None
    origin = (getattr(config, "window_origin", None) or "query") if window is not None else "query"
    return window, causal, origin


def _decode_mask(q_len: int, k: torch.Tensor, v: torch.Tensor, window: int | None, causal: bool, origin: str):
    """Decoding: the keys hold contiguous positions ending with the queries' own (the cache's context, then the
    block), so query j sits at key index kv_len - q_len + j and the anchor at kv_len - q_len. Keys no query sees
    are dropped; the mask keeps, of the rest, those the layer's rule shows (see the module docstring)."""
    if window is not None:
        keep = min(k.shape[-2], window - (origin == "query") + q_len)
        k, v = k[..., -keep:, :], v[..., -keep:, :]
    kv_len = k.shape[-2]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=k.device)[:, None]
    k_pos = torch.arange(kv_len, device=k.device)[None, :]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=k.device)
    if causal:
        visible &= k_pos <= q_pos
    if window is not None and origin == "anchor":
        visible &= k_pos >= kv_len - q_len - window  # a - W <= c for every slot
    elif window is not None:
        visible &= ((q_pos - k_pos) < window) & ((k_pos - q_pos) < window)
    return k, v, visible


class DraftKVCache:
    """Per-layer key/value cache for inference: context K/V are kept, block K/V are cropped after each draft.

    Mirrors the two methods of transformers' DynamicCache that the drafter uses (`update`, `crop`), so either works.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []

    def get_seq_length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[-2]

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is None:
            self.keys[layer_idx], self.values[layer_idx] = k, v
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def crop(self, max_length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :max_length, :], v[..., :max_length, :]


class Qwen3DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.sliding_window, self.causal, self.window_origin = _layer_rule(config, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (bsz, q_len, H), layer-normed block stream
        target_hidden: torch.Tensor,  # (bsz, ctx_len, H), fused context, not layer-normed
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each (bsz, ctx_len + q_len, head_dim)
        attention_mask: torch.Tensor | None,  # bool (bsz, 1, q_len, kv_len), or None: the layer's own rule
        past_key_values=None,
    ) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        ctx_len = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([target_hidden, hidden_states], dim=1)  # (bsz, ctx_len + q_len, H)
        k = self.k_norm(self.k_proj(kv_in).view(bsz, ctx_len + q_len, self.num_kv_heads, self.head_dim))
        k = k.transpose(1, 2)  # (bsz, kv_heads, ctx_len + q_len, head_dim)
        v = self.v_proj(kv_in).view(bsz, ctx_len + q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos_sin
        q = _apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])  # queries are the last q_len positions
        k = _apply_rope(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        window = self.sliding_window
        if attention_mask is None and (self.causal or (window is not None and k.shape[-2] > window)):
            k, v, attention_mask = _decode_mask(q_len, k, v, window, self.causal, self.window_origin)
        if hasattr(attention_mask, "attend"):  # a training mask that attends itself (dflash/model/window.py)
            return self.o_proj(attention_mask.attend(q, k, v).transpose(1, 2).reshape(bsz, q_len, -1))
        if BlockMask is not None and isinstance(attention_mask, BlockMask):
            out = _flex(q, k, v, attention_mask)
            return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class Qwen3DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3DFlashAttention(config, layer_idx)
        self.mlp = Qwen3DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden, cos_sin, attention_mask, past_key_values=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.self_attn(
            hidden_states, target_hidden, cos_sin, attention_mask, past_key_values
        )
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(PreTrainedModel):
    """The drafter. `config` is a Qwen3Config with `dflash_config = {mask_token_id, target_layer_ids, block_size}`,
    top-level `block_size` and `num_target_layers` (the fields z-lab's loader, SGLang and vLLM read)."""

    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["Qwen3DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash_config = getattr(config, "dflash_config", None)
        if not dflash_config or "target_layer_ids" not in dflash_config or dflash_config.get("mask_token_id") is None:
            raise ValueError(
                "config.dflash_config must set target_layer_ids and mask_token_id (a DFlash drafter without them "
                "would silently read the wrong target layers or mask embedding)"
            )
        self.target_layer_ids = list(dflash_config["target_layer_ids"])
        self.mask_token_id = int(dflash_config["mask_token_id"])
        self.block_size = int(dflash_config.get("block_size", config.block_size))
        num_target_layers = getattr(config, "num_target_layers", None)
        if num_target_layers is not None and any(not 0 <= i < num_target_layers for i in self.target_layer_ids):
            raise ValueError(
                f"dflash_config.target_layer_ids={self.target_layer_ids} outside the target's "
                f"{num_target_layers} layers"
            )
        self.layers = nn.ModuleList([Qwen3DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, _rope_theta(config))
        # a draft vocabulary (speculators' layout, never z-lab's): its maps t2d [V] / d2t [N] (target id = draft id
        # + d2t[draft id]) and its head, the target head's rows of those tokens, frozen (dflash/model/draft_vocab.py)
        draft_vocab = getattr(config, "draft_vocab_size", None)
        if draft_vocab is not None:
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
            self.register_buffer("d2t", torch.zeros(int(draft_vocab), dtype=torch.long))
            self.lm_head = nn.Linear(config.hidden_size, int(draft_vocab), bias=False)
        self.post_init()
        if draft_vocab is not None:
            self.lm_head.weight.requires_grad_(False)

    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, RotaryEmbedding):
            head_dim = module.inv_freq.shape[0] * 2
            theta = _rope_theta(self.config)
            module.inv_freq.copy_(1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)))

    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """(bsz, ctx_len, n_feat * H) concatenated target layers -> (bsz, ctx_len, H)."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        noise_embedding: torch.Tensor,  # (bsz, q_len, H): target embedding of [anchor, MASK, ...] per block
        target_hidden: torch.Tensor,  # (bsz, ctx_len, n_feat * H): new context features (not yet cached)
        position_ids: torch.Tensor,  # (bsz, ctx_len + q_len): absolute positions of context then block tokens
        attention_mask=None,  # bool (bsz, 1, q_len, kv_len), a BlockMask, a list of one per layer, or None
        past_key_values=None,
        **kwargs,
    ) -> torch.Tensor:
        """Returns the normed hidden states of the block tokens, (bsz, q_len, H); logits = target lm_head(out).
        attention_mask None: each layer's own rule over its KV cache (decoding)."""
        ctx = self.fuse_context(target_hidden)
        cos_sin = self.rotary_emb(noise_embedding, position_ids)
        hidden_states = noise_embedding
        masks = attention_mask if isinstance(attention_mask, (list, tuple)) else [attention_mask] * len(self.layers)
        if len(masks) != len(self.layers):
            raise ValueError(f"{len(masks)} attention masks for {len(self.layers)} layers")
        for layer, mask in zip(self.layers, masks):
            hidden_states = layer(hidden_states, ctx, cos_sin, mask, past_key_values)
        return self.norm(hidden_states)
