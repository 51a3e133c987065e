"""`python -m dflash.analysis.store_cost [--jobs 9 ...]`: what a feature store saves a sweep on a real target, in
GPU-hours from FLOPs, and the bytes it takes per token. Arithmetic on published shapes, not a measurement.

The structure is the one `python -m dflash.bench sweep` measures on CPU: an online sweep of N jobs pays N target
passes and N drafter passes; a sweep from the store pays one target pass, N drafter passes and the store's I/O.
FLOPs per training sequence are `dflash.model.plan.flops_per_sequence`'s (the planner's one FLOP model; its
docstring has the terms), for the drafter the framework builds for the target from the model preset
(`build_drafter_config` with the preset's settings, its parameters also counted on the meta device).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from dflash.model.plan import KNOWN_TARGETS, TargetShape, flops_per_sequence, meta_drafter

CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"
H200_BF16_TFLOPS = 989.4  # dense bf16 peak, no sparsity (as the pipeline bench uses)


@dataclass(frozen=True)
class Target:
    """A hub target's published shape (`dflash.model.plan.KNOWN_TARGETS`) and the model preset that names it."""

    preset: str  # conf/model/<preset>.yaml: the drafter settings the framework uses for it
    hub_name: str

    @property
    def shape(self) -> TargetShape:
        return KNOWN_TARGETS[self.hub_name]

    def model_config(self):
        from omegaconf import OmegaConf

        from dflash.core.config import ModelConfig

        return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF_MODEL / f"{self.preset}.yaml"))


TARGETS = {
    "Qwen3-8B": Target("qwen3_8b", "Qwen/Qwen3-8B"),
    # Qwen3.6-27B: 64 layers, 24 heads of 256, 4 KV heads, hybrid attention; its total is the published ~27B
    "Qwen3.6-27B": Target("qwen3_6_27b", "Qwen/Qwen3.6-27B"),
}
STORE_DTYPES = ("float32", "bfloat16", "fp8")


def drafter_params(target: Target) -> int:
    """The parameters of the drafter the framework builds for this target (build_drafter_config from the
    model preset), counted on the meta device: what the planner's formula must equal."""
    model_cfg = target.model_config()
    drafter = meta_drafter(target.shape, model_cfg, len(model_cfg.target_layer_ids))
    return sum(p.numel() for p in drafter.parameters())


def store_bytes(hidden: int, num_layers: int, dtype: str) -> int:
    """Bytes per token at `dtype`: the store's own formula."""
    from dflash.train.feature_store import store_bytes_per_token

    return store_bytes_per_token(hidden, num_layers, dtype)


def sweep_gpu_hours(
    target: Target, jobs: int, tokens: float, seq_len: int, anchors: int, mfu: float, peak_tflops: float
) -> dict:
    """GPU-hours of an online sweep and of one from the store (I/O overlapped with compute), and what the store
    must stream per GPU at bf16 to keep up with the drafter."""
    model_cfg = target.model_config()
    flops = flops_per_sequence(model_cfg, target.shape, seq_len, anchors)
    target_flops, drafter_flops = flops["target"], flops["drafter"]
    sequences = tokens / seq_len
    rate = peak_tflops * 1e12 * mfu  # FLOP/s a GPU sustains
    target_h, drafter_h = (f * sequences / rate / 3600 for f in (target_flops, drafter_flops))
    per_token = store_bytes(target.shape.hidden, len(model_cfg.target_layer_ids), "bfloat16")
    return {
        "drafter_params": drafter_params(target),
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
    ap = argparse.ArgumentParser(prog="python -m dflash.analysis.store_cost", description=__doc__.split("\n\n")[0])
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
            per_token = store_bytes(target.shape.hidden, 5, dtype)
            print(f"| {name} | {dtype} | {per_token:,} | {tokens * per_token / 1e12:,.1f} |")


if __name__ == "__main__":
    main()
