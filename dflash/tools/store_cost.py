"""`python -m dflash.tools.store_cost [--jobs 9 ...]`: what a feature store saves a sweep on a real target, in
GPU-hours from FLOPs, and the bytes it takes per token. Arithmetic on published shapes, not a measurement.

The structure is the one `python -m dflash.bench sweep` measures on CPU: an online sweep of N jobs pays N target
passes and N drafter passes; a sweep from the store pays one target pass, N drafter passes and the store's I/O.
FLOPs per training sequence of `seq_len` tokens with `anchors` blocks of `block` tokens:

  target    2 x params x seq_len (a forward; every parameter once per token, embeddings and LM head included)
  drafter   6 x (its layers' parameters) x anchors x block  (forward + backward of the block tokens)
          + 6 x (fc + every layer's k_proj, v_proj) x seq_len (the context's keys and values, trained too)
          + 3 x 4 x heads x head_dim x layers x anchors x block x (seq_len / 2 + block)  (attention scores and
            values over the context before a uniform anchor, forward + backward)
          + 6 x hidden x vocab x anchors x (block - 1): the frozen LM head's forward and input gradient (4) and the
            KL teacher's logits from the stored last hidden state (2)

The drafter's shape is the one the framework builds for the target (`build_drafter_config` with the model preset's
settings), its parameters counted on the meta device. The target's attention scores are left out, which makes
the target's share and the saving smaller, not larger.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from dflash.model.plan import KNOWN_TARGETS

CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"
H200_BF16_TFLOPS = 989.4  # dense bf16 peak, no sparsity (as the pipeline bench uses)


@dataclass(frozen=True)
class TargetShape:
    """A target's published config.json numbers and its parameter count, with the model preset that names it."""

    preset: str  # conf/model/<preset>.yaml: the drafter settings the framework uses for it
    params: float
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


def _published(preset: str, hub_name: str) -> TargetShape:
    """The shape `python -m dflash.plan` knows for a hub target (one table of published shapes)."""
    s = KNOWN_TARGETS[hub_name]
    return TargetShape(
        preset, float(s.total_params), s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab
    )


TARGETS = {
    "Qwen3-8B": _published("qwen3_8b", "Qwen/Qwen3-8B"),
    # Qwen3.6-27B: 64 layers, 24 heads of 256, 4 KV heads, hybrid attention; its total is the published ~27B
    "Qwen3.6-27B": _published("qwen3_6_27b", "Qwen/Qwen3.6-27B"),
}
STORE_DTYPES = ("float32", "bfloat16", "fp8")


def drafter_shape(target: TargetShape) -> dict:
    """The framework's drafter for this target: parameters of its layers, of the context path (fc and each
    layer's k_proj/v_proj) and its attention shape, from the model preset and build_drafter_config."""
    import torch
    from omegaconf import OmegaConf
    from transformers import Qwen3Config

    from dflash.config import ModelConfig
    from dflash.model.build import build_drafter_config
    from dflash.model.drafter import DFlashDraftModel

    model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF_MODEL / f"{target.preset}.yaml"))
    target_config = Qwen3Config(
        vocab_size=target.vocab,
        hidden_size=target.hidden,
        intermediate_size=target.intermediate,
        num_hidden_layers=target.layers,
        num_attention_heads=target.heads,
        num_key_value_heads=target.kv_heads,
        head_dim=target.head_dim,
        max_position_embeddings=40960,
    )
    layer_ids = list(model_cfg.target_layer_ids)
    config = build_drafter_config(target_config, model_cfg, layer_ids, model_cfg.mask_token_id)
    with torch.device("meta"):
        drafter = DFlashDraftModel(config)
    params = dict(drafter.named_parameters())
    layers = sum(p.numel() for n, p in params.items() if n.startswith("layers."))
    kv = sum(p.numel() for n, p in params.items() if n.startswith("layers.") and (".k_proj." in n or ".v_proj." in n))
    return {
        "layers": layers,
        "context": params["fc.weight"].numel() + kv,
        "total": sum(p.numel() for p in params.values()),
        "num_layers": config.num_hidden_layers,
        "attn_width": config.num_attention_heads * config.head_dim,
        "num_features": len(layer_ids),
        "block": model_cfg.block_size,
    }


def flops_per_sequence(target: TargetShape, drafter: dict, seq_len: int, anchors: int) -> tuple[float, float]:
    """(target forward, drafter training step) FLOPs of one sequence; the terms are in the module docstring."""
    block = drafter["block"]
    block_tokens = anchors * block
    target_flops = 2 * target.params * seq_len
    attention = 3 * 4 * drafter["attn_width"] * drafter["num_layers"] * block_tokens * (seq_len / 2 + block)
    lm_head = 6 * target.hidden * target.vocab * anchors * (block - 1)
    drafter_flops = 6 * drafter["layers"] * block_tokens + 6 * drafter["context"] * seq_len + attention + lm_head
    return target_flops, drafter_flops


def store_bytes(hidden: int, num_layers: int, dtype: str) -> tuple[int, bool]:
    """(bytes per token, from the store's own formula?) at `dtype`. fp8 before the store supports it: the same
    formula with 1 byte per value and a float32 scale per token and stored tensor row (False)."""
    from dflash.train.feature_store import store_bytes_per_token

    try:
        return store_bytes_per_token(hidden, num_layers, dtype), True
    except KeyError:
        if dtype != "fp8":
            raise
        return (num_layers + 1) * (hidden * 1 + 4) + 9, False


def sweep_gpu_hours(
    target: TargetShape, jobs: int, tokens: float, seq_len: int, anchors: int, mfu: float, peak_tflops: float
) -> dict:
    """GPU-hours of an online sweep and of one from the store (I/O overlapped with compute), and what the store
    must stream per GPU at bf16 to keep up with the drafter."""
    drafter = drafter_shape(target)
    target_flops, drafter_flops = flops_per_sequence(target, drafter, seq_len, anchors)
    sequences = tokens / seq_len
    rate = peak_tflops * 1e12 * mfu  # FLOP/s a GPU sustains
    target_h, drafter_h = (f * sequences / rate / 3600 for f in (target_flops, drafter_flops))
    per_token, _ = store_bytes(target.hidden, drafter["num_features"], "bfloat16")
    return {
        "drafter_params": drafter["total"],
        "target_share": target_flops / (target_flops + drafter_flops),
        "target_pass_h": target_h,
        "drafter_pass_h": drafter_h,
        "online_h": jobs * (target_h + drafter_h),
        "store_h": target_h + jobs * drafter_h,
        "saved_h": (jobs - 1) * target_h,
        "store_tb_bf16": tokens * per_token / 1e12,
        "read_gb_s_per_gpu": per_token * seq_len / (drafter_flops / rate) / 1e9,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dflash.tools.store_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=9)
    ap.add_argument("--conversations", type=float, default=800_000)
    ap.add_argument("--mean-tokens", type=float, default=1500, help="tokens per conversation, mean")
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    a = ap.parse_args(argv)
    tokens = a.conversations * a.mean_tokens
    print(
        f"{a.jobs}-job sweep, one epoch of {a.conversations:,.0f} conversations x {a.mean_tokens:,.0f} tokens = "
        f"{tokens / 1e9:.2f}B tokens in {a.seq_len}-token sequences, {a.anchors} anchors; "
        f"{a.peak_tflops:g} TFLOP/s bf16 peak at {a.mfu:.0%} MFU"
    )
    columns = (
        "target, drafter params, target share of a job, target pass GPU-h, drafter pass GPU-h, online sweep GPU-h, "
        "store sweep GPU-h, saved GPU-h, store TB (bf16), store read GB/s per GPU"
    ).split(", ")
    print("\n| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for name, target in TARGETS.items():
        r = sweep_gpu_hours(target, a.jobs, tokens, a.seq_len, a.anchors, a.mfu, a.peak_tflops)
        print(
            f"| {name} | {r['drafter_params'] / 1e9:.2f}B | {r['target_share']:.2f} | {r['target_pass_h']:,.0f} | "
            f"{r['drafter_pass_h']:,.0f} | {r['online_h']:,.0f} | {r['store_h']:,.0f} | {r['saved_h']:,.0f} | "
            f"{r['store_tb_bf16']:,.1f} | {r['read_gb_s_per_gpu']:.2f} |"
        )
    print("\n| target (5 layers + last hidden) | dtype | bytes per token | TB for these tokens |")
    print("|---|---|---|---|")
    for name, target in TARGETS.items():
        for dtype in STORE_DTYPES:
            per_token, native = store_bytes(target.hidden, 5, dtype)
            note = "" if native else " (formula; fp8 not in this build's store)"
            print(f"| {name} | {dtype}{note} | {per_token:,} | {tokens * per_token / 1e12:,.1f} |")


if __name__ == "__main__":
    main()
