"""model.build.architecture: the tiny random targets of every family a drafter is trained for, built in seconds from
transformers' own config classes at model.build's widths (tests, smoke runs, and a first try of a new target).

qwen3 (the default), llama; qwen3_5 (Qwen3.5/3.6 dense: 3 Gated DeltaNet linear-attention layers to 1 gated full
attention), qwen3_5_moe (Qwen3.5/3.6-35B-A3B), qwen3_next (Qwen3-Next); gemma4_text (Gemma 4: sliding and global
layers, per-layer inputs); gpt_oss (sliding and full layers, attention sinks, MoE). A `_vl` suffix saves the
vision-language wrapper the real checkpoints ship as (`Qwen3_5ForConditionalGeneration`, `Gemma4...`): a small
vision tower beside the language model, text weights under `model.language_model.*`; the run loads the language
model alone (dflash/model/architectures.py).
"""

from __future__ import annotations

from dflash.core.config import ARCHITECTURES

SLIDING_WINDOW = 16  # the sliding layers' window: short, so an eval's prompts run past it and exercise the rollback


def _common(b, vocab_size: int, tok) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": b.hidden_size,
        "num_hidden_layers": b.num_layers,
        "num_attention_heads": b.num_attention_heads,
        "num_key_value_heads": b.num_key_value_heads,
        "head_dim": b.head_dim,
        "max_position_embeddings": b.max_position_embeddings,
        "tie_word_embeddings": b.tie_word_embeddings,
        "bos_token_id": tok.eos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def _linear(b) -> dict:
    """Gated DeltaNet's heads at the tiny widths (Qwen3.6-27B: V 48 / QK 16 heads of 128)."""
    heads = max(1, b.num_attention_heads)
    return {
        "linear_num_key_heads": heads,
        "linear_num_value_heads": 2 * heads,
        "linear_key_head_dim": b.head_dim,
        "linear_value_head_dim": b.head_dim,
        "linear_conv_kernel_dim": 4,
    }


def _moe(b) -> dict:
    small = max(8, b.intermediate_size // 4)
    return {"moe_intermediate_size": small, "shared_expert_intermediate_size": small, "num_experts": 4,
            "num_experts_per_tok": 2}  # fmt: skip


def _vision(kind: str, hidden: int) -> dict:
    """A vision tower of one block: enough to save the checkpoint's layout, never loaded by a run."""
    if kind == "qwen":
        return {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": hidden,
                "patch_size": 4, "num_position_embeddings": 64}  # fmt: skip
    return {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "position_embedding_size": 64}  # fmt: skip


def tiny_model(b, vocab_size: int, tok):
    """A random model of `model.build.architecture` at model.build's widths, ready to save_pretrained."""
    import transformers as T

    arch = b.get("architecture", "qwen3") if hasattr(b, "get") else getattr(b, "architecture", "qwen3")
    common = _common(b, vocab_size, tok)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    special = {k: tok.eos_token_id for k in ("image_token_id", "video_token_id")}
    if arch == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**common, intermediate_size=b.intermediate_size, rope_parameters=rope))
    if arch == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common, intermediate_size=b.intermediate_size, rope_parameters=rope))
    if arch in ("qwen3_5", "qwen3_5_vl"):
        text = {**common, **_linear(b), "intermediate_size": b.intermediate_size}
        if arch == "qwen3_5":
            return T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**text))
        config = T.Qwen3_5Config(text_config=text, vision_config=_vision("qwen", b.hidden_size), **special)
        config.tie_word_embeddings = b.tie_word_embeddings
        return T.Qwen3_5ForConditionalGeneration(config)
    if arch in ("qwen3_5_moe", "qwen3_5_moe_vl"):
        text = {**common, **_linear(b), **_moe(b)}
        if arch == "qwen3_5_moe":
            return T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**text))
        config = T.Qwen3_5MoeConfig(text_config=text, vision_config=_vision("qwen", b.hidden_size), **special)
        config.tie_word_embeddings = b.tie_word_embeddings
        return T.Qwen3_5MoeForConditionalGeneration(config)
    if arch == "qwen3_next":
        config = T.Qwen3NextConfig(**common, **_linear(b), **_moe(b), intermediate_size=b.intermediate_size)
        return T.Qwen3NextForCausalLM(config)
    if arch in ("gemma4_text", "gemma4_vl"):
        text = {**common, "intermediate_size": b.intermediate_size, "hidden_size_per_layer_input": 8,
                "vocab_size_per_layer_input": vocab_size, "sliding_window": SLIDING_WINDOW,
                "global_head_dim": b.head_dim,
                "layer_types": ["sliding_attention"] * (b.num_layers - 1) + ["full_attention"]}  # fmt: skip
        if arch == "gemma4_text":
            return T.Gemma4ForCausalLM(T.Gemma4TextConfig(**text))
        ids = {"boi_token_id": 0, "eoi_token_id": 0, "boa_token_id": 0, "eoa_token_index": 0, "audio_token_id": 0}
        config = T.Gemma4Config(text_config=text, vision_config=_vision("gemma", b.hidden_size), audio_config=None,
                                **special, **ids)  # fmt: skip
        return T.Gemma4ForConditionalGeneration(config)
    if arch == "gpt_oss":
        config = T.GptOssConfig(**common, intermediate_size=b.intermediate_size, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=SLIDING_WINDOW)  # fmt: skip
        return T.GptOssForCausalLM(config)
    raise ValueError(f"model.build.architecture={arch!r} is invalid: must be one of {', '.join(ARCHITECTURES)}")
