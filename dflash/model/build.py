"""A drafter for a target: its config (shapes from the target and `model.*`), the mask token, and a seeded
initialisation that the run and `python -m dflash.evaluate` share (the untrained baseline is reproducible)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from dflash.core.config import ConfigError
from dflash.model.architectures import dense_intermediate
from dflash.model.drafter import DFlashDraftModel
from dflash.model.families import drafter_class

log = logging.getLogger(__name__)


def build_drafter_config(target_config, model_cfg, target_layer_ids: list[int], mask_token_id: int):
    """The drafter's Qwen3Config: hidden size and vocabulary from the target (embeddings and LM head are shared),
    attention/MLP shape from model.draft_* (default: the target's), the layer kinds of model.layer_types (null: every
    layer full, or sliding under model.sliding_window W) recorded as Qwen3 and z-lab's configs do, with the block's
    causality as z-lab's loader reads it (`drafter_layer_kinds`; dflash/model/window.py)."""
    from transformers import Qwen3Config

    n = model_cfg.num_draft_layers
    heads = model_cfg.draft_num_attention_heads or target_config.num_attention_heads
    head_dim = (
        model_cfg.draft_head_dim
        or getattr(target_config, "head_dim", None)
        or (target_config.hidden_size // target_config.num_attention_heads)
    )
    kv_heads = model_cfg.draft_num_key_value_heads or target_config.num_key_value_heads
    if heads % kv_heads:
        raise ConfigError(
            f"model.draft_num_attention_heads={heads} is invalid with model.draft_num_key_value_heads={kv_heads} "
            "(null = the target's): the query heads must be a multiple of the key/value heads"
        )
    # The drafter applies plain RoPE (dflash/model/drafter.py), so its config says exactly that: copying a target's
    # scaled RoPE (yarn, ...) would make serving engines apply a scaling the drafter was not trained with.
    target_rope = dict(getattr(target_config, "rope_parameters", None) or {})
    theta = float(target_rope.get("rope_theta", getattr(target_config, "rope_theta", None) or 10000.0))
    if target_rope.get("rope_type", "default") != "default":
        log.warning(
            "the target uses rope_type=%s; the drafter uses plain RoPE (theta %g) and its config says so",
            target_rope["rope_type"],
            theta,
        )
    rope = {"rope_type": "default", "rope_theta": theta}
    types, window, is_causal, origin = drafter_layer_kinds(model_cfg)
    cfg = Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=model_cfg.draft_intermediate_size or dense_intermediate(target_config),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=rope,
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=n,
        layer_types=types,
    )
    if is_causal is not None:  # absent: the per-layer default (sliding layers causal), as z-lab's Qwen3.6 drafter
        cfg.is_causal = is_causal
    if window is not None and origin != "query":  # ours: z-lab and vLLM measure it from each query
        cfg.window_origin = origin
    if getattr(model_cfg, "draft_vocab_size", None) is not None:  # a head over a draft vocabulary (draft_vocab.py)
        if not 1 <= model_cfg.draft_vocab_size < target_config.vocab_size:
            raise ConfigError(
                f"model.draft_vocab_size={model_cfg.draft_vocab_size} is invalid: it must be below the target's "
                f"vocabulary of {target_config.vocab_size} (null = the whole vocabulary)"
            )
        cfg.draft_vocab_size = int(model_cfg.draft_vocab_size)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.auto_map = {"AutoModel": "dflash.DFlashDraftModel"}
    cfg.block_size = int(model_cfg.block_size)
    cfg.num_target_layers = int(target_config.num_hidden_layers)
    cfg.dflash_config = {
        "mask_token_id": int(mask_token_id),
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "block_size": int(model_cfg.block_size),
    }
    return cfg


def drafter_layer_kinds(model_cfg) -> tuple[list[str], int | None, bool | None, str]:
    """model.layer_types/sliding_window/sliding_block/window_origin -> the drafter config's layer_types,
    sliding_window, is_causal (None: absent, each layer's default: causal where it slides) and window origin."""
    given = model_cfg.get("layer_types")
    window = model_cfg.get("sliding_window")
    uniform = "full_attention" if window is None else "sliding_attention"
    types = [uniform] * model_cfg.num_draft_layers if given is None else [str(t) for t in given]
    sliding = "sliding_attention" in types
    block = model_cfg.get("sliding_block") or ("bidirectional" if given is None else "causal")
    is_causal = None if sliding and block == "causal" else False
    return types, int(window) if sliding else None, is_causal, model_cfg.get("window_origin") or "query"


def resolve_mask_token_id(model_cfg, tokenizer, vocab_size: int) -> int:
    """`model.mask_token_id`, else the id of the tokenizer's `model.mask_token`; checked against the vocabulary."""
    mid = model_cfg.mask_token_id
    if mid is None:
        tok_id = tokenizer.convert_tokens_to_ids(model_cfg.mask_token)
        if tok_id is None or tok_id == tokenizer.unk_token_id:
            raise ConfigError(
                f"model.mask_token_id=None and the tokenizer has no {model_cfg.mask_token!r} token: set "
                "model.mask_token_id to an unused embedding row (Qwen3: 151669)"
            )
        mid = tok_id
    if not 0 <= mid < vocab_size:
        raise ConfigError(f"model.mask_token_id={mid} is invalid: outside the target's vocabulary of {vocab_size}")
    return int(mid)


def init_drafter(
    config, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDraftModel:
    """A freshly initialised drafter, its weights drawn from `seed` alone (the caller's RNG state is left as it
    was), so the same config and seed give the same weights wherever they are built."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = drafter_class(config)(config)  # the family's class (model/families/)
    return drafter.to(device=device, dtype=dtype)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's spread: one feature -> [L // 2]; else evenly from layer 1 to L - 3 (Qwen3-8B: [1, 9, 17, 25, 33])."""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ConfigError(
            f"the target has {num_target_layers} layers; the default spread needs >= 4, set model.target_layer_ids"
        )
    span = end - start
    return [int(round(start + i * span / (num_features - 1))) for i in range(num_features)]


def resolve_target_layer_ids(model_cfg: Any, num_target_layers: int) -> list[int]:
    """The target layer ids a run uses, checked against the target's layer count."""
    if model_cfg.target_layer_ids is None:
        n = model_cfg.num_target_features or model_cfg.num_draft_layers
        ids = default_target_layer_ids(num_target_layers, n)
        if len(set(ids)) != len(ids):
            raise ConfigError(
                f"model.target_layer_ids=null spreads {n} features over a {num_target_layers}-layer target as {ids}, "
                "repeating layers: set model.target_layer_ids explicitly or use fewer features"
            )
        return ids
    ids = [int(i) for i in model_cfg.target_layer_ids]
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ConfigError(
            f"model.target_layer_ids={ids} is invalid: ids {bad} are outside the target's layers "
            f"0..{num_target_layers - 1}"
        )
    return ids
