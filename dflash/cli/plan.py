"""`python -m dflash.plan [OVERRIDES ...] [+nproc=N] [+memory_gib=G,...] [+tflops=T]`: a run's predicted peak
memory per rank split into its parts, the largest train.batch_size x train.seq_len that fits each device memory,
and the target/drafter token rates that balance the pipeline, from FLOPs. OVERRIDES are launch.py's (Hydra
composes the same config); `+nproc` is the number of data-parallel ranks (torchrun's --nproc-per-node x nodes),
`+memory_gib` the device memories to fit (default 80 and 141), `+device=cpu` plans a CPU run (default cuda
unless model.device=cpu), `+tflops` a device's dense TFLOP/s at the dtype
(default 989: an H100's bf16) for the token rates. Nothing is loaded or built: a hub target the presets name is
planned from its published shape, a local build not built yet (model=tiny, qwen3_8b_random) from model.build's
widths, any other from its config.json. Each kind of rank gets its column: rank 0, the other drafter ranks, and
parallel.target_ranks' target ranks; a rank that runs no target forward (features=store, a drafter rank under
target_ranks) holds only the target's embedding and LM head, unless rank 0 runs the evals."""

from __future__ import annotations

import sys

from dflash.cli.features import compose
from dflash.core.validation import validate
from dflash.model.plan import (
    DTYPE_BYTES,
    GIB,
    RUNTIME_FIT,
    flops_per_token,
    largest_fit,
    memory_parts,
    planned_anchors,
    planned_shape,
    roles,
)

PLAN_KEYS = {"nproc": int, "memory_gib": str, "tflops": float, "device": str}


def split_args(argv: list[str]) -> tuple[list[str], dict]:
    """Hydra overrides, and the plan's own `+key=value` (not config keys: the config is launch.py's)."""
    overrides, opts = [], {"nproc": 1, "memory_gib": "80,141", "tflops": 989.0, "device": None}
    for a in argv:
        key, _, value = a.lstrip("+").partition("=")
        if key in PLAN_KEYS and value:
            opts[key] = PLAN_KEYS[key](value)
        else:
            overrides.append(a)
    return overrides, opts


def anchors_text(cfg) -> str:
    tr = cfg.train
    if tr.get("anchor_budget") is None:
        return f"{tr.num_anchors} anchors"
    per_row = planned_anchors(cfg, tr.batch_size, tr.seq_len)
    return (
        f"train.anchor_budget={tr.anchor_budget} anchors per batch ({per_row} per full row; a longer row among "
        f"shorter ones up to train.num_anchors={tr.num_anchors})"
    )


def target_parts(t, dtype: str) -> list[str]:
    """The whole target's weights by part, under the table (a hybrid's linear-attention layers, experts)."""
    counts = {kind: t.kinds.count(kind) for kind in dict.fromkeys(t.kinds)}
    layers = ", ".join(f"{n} {kind.replace('_', '-')}" for kind, n in counts.items())
    rows = [f"{name} {n / 1e9:.2f}B ({n * DTYPE_BYTES[dtype] / GIB:.2f} GiB)" for name, n in t.parts().items()]
    return ["", f"the whole target's weights by part ({t.layers} layers: {layers}): " + "; ".join(rows)]


def render(cfg, nproc: int, memories: list[float], tflops: float, device: str) -> str:
    t, note = planned_shape(cfg.model)
    kinds = roles(cfg, nproc)
    by_role = {r: memory_parts(cfg, t, nproc, device=device, role=r) for r in kinds}
    par = cfg.parallel.name if nproc > 1 else "single"
    lines = [
        f"plan for {cfg.model.name} ({cfg.model.target}, {t.total_params / 1e9:.2f}B params), {cfg.model.dtype}, "
        f"parallel={par} on {nproc} {device} rank(s), train.batch_size={cfg.train.batch_size} (global) x "
        f"train.seq_len={cfg.train.seq_len}, {anchors_text(cfg)} x block {cfg.model.block_size}"
        + (f", sliding window {cfg.model.sliding_window}" if cfg.model.get("sliding_window") else ""),
        *([note] if note else []),
        "",
        "| part | " + " | ".join(f"GiB, {r}" for r in kinds) + " |",
        "|---|" + "---|" * len(kinds),
        *(f"| {k} | " + " | ".join(f"{by_role[r][k] / GIB:.2f}" for r in kinds) + " |" for k in by_role[kinds[0]]),
        "| **predicted peak** | " + " | ".join(f"**{sum(by_role[r].values()) / GIB:.2f}**" for r in kinds) + " |",
        *target_parts(t, cfg.model.dtype),
        "",
        f"runtime: {RUNTIME_FIT}; a constant, not a prediction.",
        "",
        "largest global train.batch_size that fits (predicted; 0 = not even 1 per rank):",
        "",
        "| train.seq_len | " + " | ".join(f"{g:g} GiB" for g in memories) + " |",
        "|---|" + "---|" * len(memories),
    ]
    fits = {g: largest_fit(cfg, t, nproc, int(g * GIB), device=device) for g in memories}
    for S in next(iter(fits.values())):
        lines.append(f"| {S} | " + " | ".join(str(fits[g][S]) for g in memories) + " |")
    f = flops_per_token(cfg, t)
    share = f["target"] / (f["target"] + f["drafter"])
    rate = tflops * 1e12
    lines += [
        "",
        f"FLOPs per context token: target forward {f['target'] / 1e9:.1f} G, drafter step {f['drafter'] / 1e9:.1f} G "
        f"(fwd+bwd, LM head included). At {tflops:g} TFLOP/s a device alone runs the target at "
        f"{rate / f['target'] / 1e3:.1f} ktok/s or the drafter at {rate / f['drafter'] / 1e3:.1f} ktok/s; balanced, "
        f"the target takes {100 * share:.0f}% of the compute: {rate / (f['target'] + f['drafter']) / 1e3:.1f} ktok/s "
        f"per device, and with parallel.target_ranks K = N x {share:.2f} of N devices feed the rest.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    overrides, opts = split_args(argv)
    cfg = compose(overrides)
    validate(cfg)
    memories = [float(x) for x in str(opts["memory_gib"]).split(",") if x]
    device = opts["device"] or ("cpu" if cfg.model.device == "cpu" else "cuda")  # a plan is for GPUs by default
    print(render(cfg, opts["nproc"], memories, opts["tflops"], device))
    return 0
