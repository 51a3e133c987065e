"""`python -m dflash.bench families`: each drafter family's cost per draft cycle at the same block size, side by side.

For dflash, dspark (each Markov head type) and dflash2, on one random target of the given widths: the drafter's
parameters (the family's own modules apart: heads, convolutions, selector), the FLOPs of one proposal and its
measured CPU latency (median over `repeats` calls of the verify loop's proposer, after `warmup`, with `ctx` positions
of context already cached, as in decoding).

FLOPs of one proposal, forward only (2 per multiply-add), the slots S of one forward (dflash: block, dspark sampling
from the anchor: block - 1) and K = block - 1 drafts:
  backbone   2 x layer params x S + 4 x heads x head_dim x layers x S x (ctx + S)  (attention scores and values)
  LM head    2 x hidden x vocab x K
  Markov     2 x rank x vocab x K (the bias) + gated: 2 x (hidden + rank) x rank x K, rnn: 2 x (2 rank + hidden)
             x 3 rank x K
  confidence 2 x (hidden [+ rank]) x K
  dflash2    per layer, the two convolutions: 2 x (2 x hidden x 2 taps x hidden / group) x S (their kernels) +
             2 x 2 x 2 x taps x hidden x S (input and output side); the selector: (2 hidden + 1 + 2 top_k) x rank x K
The context's own K/V projection (fc, k_proj, v_proj of the accepted tokens) is the same for every family at equal
acceptance and is left out.

target_layers=N (0: off) also times a target of these widths and N layers (random weights: a Qwen3 of the real
target's shape; SmolLM2-135M: 30) after the same `ctx` cached positions: one decode step (1 token) and one verify
forward (`block` tokens), taking turns with the proposals, and prints each family's break-even tau, (verify +
proposal) / decode step: the tau a drafter must pass before speculative decoding beats the target alone here.

Options: hidden=512 vocab=32000 layers=2 heads=8 kv_heads=4 head_dim=64 intermediate=1536 block=16 ctx=256
rank=256 repeats=20 warmup=3 threads=0 (0: torch's default) target_layers=0.
"""

from __future__ import annotations

import statistics
import time

import torch


def _options(args: list[str]) -> dict[str, int]:
    opts = dict(
        hidden=512,
        vocab=32000,
        layers=2,
        heads=8,
        kv_heads=4,
        head_dim=64,
        intermediate=1536,
        block=16,
        ctx=256,
        rank=256,
        repeats=20,
        warmup=3,
        threads=0,
        target_layers=0,
    )
    for arg in args:
        key, _, value = arg.partition("=")
        if key not in opts or not value:
            raise SystemExit(f"bench families: unknown option {arg!r}; options: {', '.join(opts)}")
        opts[key] = int(value)
    return opts


def _target_config(opts: dict[str, int], layers: int):
    """A Qwen3 of the bench's widths with `layers` layers (random weights)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=opts["vocab"],
        hidden_size=opts["hidden"],
        intermediate_size=opts["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=opts["heads"],
        num_key_value_heads=opts["kv_heads"],
        head_dim=opts["head_dim"],
        max_position_embeddings=opts["ctx"] + 2 * opts["block"],
    )


def _drafter(opts: dict[str, int], family: str, head_type: str | None):
    from omegaconf import OmegaConf

    from dflash.core.config import DrafterConfig, ModelConfig
    from dflash.model.build import build_drafter_config, init_drafter
    from dflash.model.families import configure_family

    target = _target_config(opts, 4)
    model_cfg = OmegaConf.structured(
        ModelConfig(name="bench", target="random", block_size=opts["block"], num_draft_layers=opts["layers"])
    )
    config = build_drafter_config(target, model_cfg, [1, 2], 0)
    drafter_cfg = DrafterConfig(
        name=family, markov_rank=opts["rank"], markov_head_type=head_type or "vanilla", selector_rank=opts["rank"]
    )
    configure_family(config, drafter_cfg)
    return init_drafter(config, seed=0).eval()


def proposal_flops(drafter, opts: dict[str, int]) -> float:
    """The module docstring's FLOP count of one proposal."""
    from dflash.model.families import draft_slots

    c = drafter.config
    S, K, H, V, ctx = draft_slots(drafter), drafter.block_size - 1, c.hidden_size, c.vocab_size, opts["ctx"]
    # the DFlash layer's own weights (dflash2's convolutions are counted below)
    layer_params = sum(p.numel() for n, p in drafter.layers.named_parameters() if "conv" not in n) / len(drafter.layers)
    flops = 2 * layer_params * len(drafter.layers) * S
    flops += 4 * c.num_attention_heads * c.head_dim * len(drafter.layers) * S * (ctx + S) + 2 * H * V * K
    markov = getattr(drafter, "markov_head", None)
    if markov is not None:
        r = markov.rank
        flops += 2 * r * V * K
        flops += {"vanilla": 0, "gated": 2 * (H + r) * r * K, "rnn": 2 * (2 * r + H) * 3 * r * K}[markov.head_type]
    selector = getattr(drafter, "candidate_selector", None)
    if selector is not None:
        conv = drafter.layers[0].attention_conv
        taps, groups = conv.kernel_size, conv.groups
        per_layer = 2 * (2 * H * 2 * taps * groups) * S + 2 * 2 * 2 * taps * H * S
        flops += per_layer * len(drafter.layers)
        r = selector.hidden_projection.out_features
        flops += (2 * H + 1 + 2 * selector.top_k) * r * K
    conf = getattr(drafter, "confidence_head", None)
    if conf is not None:
        flops += 2 * conf.proj.in_features * K
    return float(flops)


def _target_calls(full_target, opts: dict[str, int]) -> list:
    """The target's decode step and verify forward after `ctx` cached positions, each a call that leaves the
    cache as it found it."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, opts["vocab"], (1, opts["ctx"] + opts["block"]), generator=g)
    cache = full_target(input_ids=ids[:, : opts["ctx"]], use_cache=True).past_key_values

    def call(n: int):
        def run() -> None:
            full_target(input_ids=ids[:, opts["ctx"] : opts["ctx"] + n], past_key_values=cache, use_cache=True)
            cache.crop(-n)  # back to the ctx cached positions

        return run

    return [call(1), call(opts["block"])]


def proposal_latencies_ms(drafters: list, target, opts: dict[str, int], extra_calls: list = ()) -> list[float]:
    """Median wall time of one proposal (the verify loop's proposer) per drafter, with `ctx` cached context
    positions, then of each of `extra_calls`; all take turns call by call, so a load that drifts on a shared
    machine hits them alike."""
    from dflash.evaluation.decoding import DFlashProposer

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, opts["vocab"], (opts["ctx"] + 1,), generator=g).tolist()
    feats = torch.randn(1, opts["ctx"], 2 * opts["hidden"], generator=g)
    proposers = [DFlashProposer(d, target) for d in drafters]
    for proposer in proposers:
        proposer.propose(seq, feats, opts["block"] - 1)  # caches the context; later calls add no new position
    calls = [lambda p=p: p.propose(seq, feats[:, :0], opts["block"] - 1) for p in proposers] + list(extra_calls)
    times: list[list[float]] = [[] for _ in calls]
    for i in range(opts["warmup"] + opts["repeats"]):
        for call, own in zip(calls, times):
            t0 = time.perf_counter()
            call()
            if i >= opts["warmup"]:
                own.append(time.perf_counter() - t0)
    return [1000 * statistics.median(t) for t in times]


def bench(args: list[str]) -> None:
    from transformers import Qwen3ForCausalLM

    opts = _options(args)
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    target = Qwen3ForCausalLM(_target_config(opts, 1)).eval()  # only its embedding and LM head are used
    names, drafters = [], []
    for family, head in (
        ("dflash", None),
        ("dspark", "vanilla"),
        ("dspark", "gated"),
        ("dspark", "rnn"),
        ("dflash2", None),
    ):
        names.append(family + (f"/{head}" if head else ""))
        drafters.append(_drafter(opts, family, head))
    full = Qwen3ForCausalLM(_target_config(opts, opts["target_layers"])).eval() if opts["target_layers"] else None
    with torch.no_grad():
        extra = _target_calls(full, opts) if full is not None else []
        latencies = proposal_latencies_ms(drafters, target, opts, extra)
    target_ms = latencies[len(drafters) :]
    rows = []
    for name, drafter, ms in zip(names, drafters, latencies):
        heads = sum(
            p.numel() for n, p in drafter.named_parameters() if any(w in n for w in ("_head", "conv", "selector"))
        )
        total = sum(p.numel() for p in drafter.parameters())
        rows.append((name, total, heads, proposal_flops(drafter, opts), ms))
    base_flops, base_ms = rows[0][3], rows[0][4]
    print(
        f"block {opts['block']}, context {opts['ctx']}, hidden {opts['hidden']}, vocab {opts['vocab']}, "
        f"{opts['layers']} draft layers, markov rank {opts['rank']}, {torch.get_num_threads()} CPU threads"
    )
    print(
        f"{'family':<16}{'params (M)':>12}{'heads (M)':>11}{'GFLOP/proposal':>16}{'x dflash':>10}"
        f"{'CPU ms':>10}{'x dflash':>10}" + (f"{'break-even tau':>16}" if target_ms else "")
    )
    for name, total, heads, flops, ms in rows:
        even = f"{(target_ms[1] + ms) / target_ms[0]:>16.2f}" if target_ms else ""
        print(
            f"{name:<16}{total / 1e6:>12.2f}{heads / 1e6:>11.2f}{flops / 1e9:>16.3f}{flops / base_flops:>10.2f}"
            f"{ms:>10.2f}{ms / base_ms:>10.2f}{even}"
        )
    if target_ms:
        print(
            f"target ({opts['target_layers']} layers, random weights): decode step {target_ms[0]:.2f} ms, verify "
            f"forward of {opts['block']} tokens {target_ms[1]:.2f} ms; break-even tau = (verify + proposal) / step"
        )
