"""Will it fit: a run's predicted peak memory per rank, split into its parts, from the config and the target's
shape alone (no weights are loaded); the largest batch x seq_len that fits a device; and the target/drafter
token rates that balance the pipeline, from FLOPs. `python -m dflash.plan` prints it; a run logs its headline
at start and records it in run.json, so a GPU run can be compared with its prediction.

The model of memory, per rank and by what the rank loads (bytes of `model.dtype` unless said). Ranks differ
(`ROLES`): rank 0, the other drafter ranks, and parallel.target_ranks' target ranks. A rank that runs no
target forward (features=store; a drafter rank under parallel.target_ranks) holds only the target's embedding
and LM head, unless it is rank 0 and runs the evals (eval.num_prompts or eval.suites), which need the whole
target; a target rank holds the target and the link's items, no drafter.
  target weights        the target's parameters the rank loads (the whole target, or its embedding and LM head)
  drafter parameters    the drafter's parameters, a family's heads included (fsdp: a 1/N shard)
  gradients             one per parameter (fsdp: a shard; ddp: twice, its buckets hold a copy)
  optimizer state       in the parameters' dtype (fsdp: a shard): optim=adamw, AdamW's two moments per parameter;
                        optim=muon, Muon's one momentum buffer per parameter it takes (model/muon_split.py's rule,
                        by each parameter's role, on the family's drafter built on the meta device) and AdamW's two
                        for the rest
  fsdp gathered         fsdp: the largest unit unsharded during forward/backward, weights and gradients
  eval copy             ddp/fsdp: the full drafter gathered on rank 0 for an eval or the export (after
                        training: the larger of it and the fsdp gathered weights counts, never both)
  target activations   one forward without grad: every layer's hidden state (output_hidden_states), the
                        features, and the largest layer intermediate (MLP or, on a CPU, attention scores)
  drafter activations   what one step's backward keeps: per layer the block stream, the context keys/values,
                        the attention probabilities (CPU; on a GPU only the boolean mask) and the MLP; the fused
                        context
  chunked loss          float32 logits, probabilities and their gradient over `loss.chunk_size` positions
  bf16 loss head        train.precision=bf16-mixed: the LM head's bfloat16 copy for the loss (vocab x hidden x 2)
  draft vocabulary head model.draft_vocab_size N: the drafter's frozen head (N x hidden) and the loss's copy of the
                        target's rows (N x hidden, bfloat16 under bf16-mixed); `chunked loss` is then N wide
  queues                feature items alive at once (sync: 1; async: each queue at its bound, plus one per stage)
  feature transport     parallel.target_ranks: items in flight on the link (credits), else 0
  runtime               the process itself: Python, torch, transformers, the data (RUNTIME_BYTES, a constant
                        fitted on one machine: RUNTIME_FIT says which)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dflash.model.anchor_budget import planned_width
from dflash.model.target_shapes import KNOWN_TARGETS, PACKAGED_TARGETS, TargetShape, target_shape

__all__ = ["KNOWN_TARGETS", "PACKAGED_TARGETS", "TargetShape", "target_shape"]  # their home: target_shapes.py

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# the process beside its tensors, a constant: imports (torch, transformers, dflash: 381 MiB of RSS on the project's
# 2-core AMD EPYC, 247 on its 2-core Intel Xeon) and what glibc's allocator keeps of freed activations (its dynamic
# mmap threshold and per-thread arenas), which varies with the machine and the run: the tiny target's widths
# (tests/test_plan.py) peaked 0.54-0.86 GiB beyond their predicted tensors on the two, the Qwen3-8B shapes 0.9-1.1.
# On a GPU it stands for the CUDA context. Host-side data is not in it: data=stdlib's corpus adds ~0.5 GB of RSS
RUNTIME_BYTES = 640 * 2**20
RUNTIME_FIT = (
    "640 MiB, fitted on two 2-core machines, an AMD EPYC and an Intel Xeon (imports: 247-381 MiB; small runs: "
    "0.6-0.9 GiB beyond tensors, most of it the allocator's)"
)
ROLES = ("rank 0", "other drafter ranks", "target ranks")


LOCAL_BUILDS = ("tiny", "random", "tiny_chat")  # model.build.kind: built on this machine from model.build's widths


def planned_shape(model_cfg) -> tuple[TargetShape, str | None]:
    """The shape to plan with, and a note when it is not read from the target: a local build that is not built
    yet is planned from model.build's widths (nothing is built or loaded for a plan; the vocabulary is
    model.build's size, an upper bound of the trained tokenizer's)."""
    from pathlib import Path

    b = model_cfg.get("build")
    built = (Path(str(model_cfg.target)).expanduser() / "config.json").exists()
    if not built and b is not None and b.kind == "gguf_wheel" and b.get("package") in PACKAGED_TARGETS:
        note = f"{model_cfg.target} is not converted yet: planned from {b.package}'s published config"
        return PACKAGED_TARGETS[b.package], note
    if model_cfg.target in KNOWN_TARGETS or built or b is None or b.kind not in LOCAL_BUILDS:
        return target_shape(model_cfg.target), None
    shape = TargetShape(
        b.hidden_size,
        b.num_layers,
        b.num_attention_heads,
        b.num_key_value_heads,
        b.head_dim,
        b.intermediate_size,
        b.model_vocab_size or b.vocab_size,
        bool(b.tie_word_embeddings),
    )
    return shape, f"{model_cfg.target} is not built yet: planned from model.build's widths"


@dataclass(frozen=True)
class DrafterShape:
    layers: int
    features: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layer_params: int
    params: int


def drafter_shape(model_cfg, t: TargetShape) -> DrafterShape:
    """The drafter build_drafter_config makes for this target (its widths, model.draft_* overrides)."""
    ids = model_cfg.target_layer_ids
    features = len(ids) if ids is not None else (model_cfg.num_target_features or model_cfg.num_draft_layers)
    heads = model_cfg.draft_num_attention_heads or t.heads
    kv = model_cfg.draft_num_key_value_heads or t.kv_heads
    hd = model_cfg.draft_head_dim or t.head_dim
    inter = model_cfg.draft_intermediate_size or t.intermediate
    layer = t.layer_params(heads, kv, hd, inter)
    n = model_cfg.num_draft_layers
    return DrafterShape(n, features, heads, kv, hd, inter, layer, n * layer + features * t.hidden**2 + 2 * t.hidden)


def optimizer_state_params(cfg, t: TargetShape, d: DrafterShape) -> int:
    """Parameters' worth of optimizer state: AdamW keeps two moments per parameter (exp_avg, exp_avg_sq); under
    optim=muon torch.optim.Muon keeps one momentum buffer per parameter it takes, AdamW two for the rest."""
    optim = cfg.get("optim")
    if optim is None or optim.name != "muon":
        return 2 * drafter_params(cfg, t, d)
    muon, adamw = muon_split_params(t, d, tuple(optim.muon_exclude), *_family(cfg))
    return muon + 2 * adamw


def drafter_params(cfg, t: TargetShape, d: DrafterShape) -> int:
    """The drafter's parameters: DFlash's (d.params), or a family's with its heads (its drafter counted on the meta
    device)."""
    family, block_size = _family(cfg)
    return d.params if family is None else sum(muon_split_params(t, d, (), family, block_size))


def _family(cfg) -> tuple[tuple | None, int]:
    """(drafter=*'s settings as a hashable key, None for DFlash's; model.block_size): what a family's drafter needs."""
    from omegaconf import OmegaConf

    drafter = cfg.get("drafter")
    if drafter is None or drafter.name == "dflash":
        return None, int(cfg.model.block_size)
    return tuple(sorted(OmegaConf.to_container(drafter, resolve=True).items())), int(cfg.model.block_size)


@functools.lru_cache(maxsize=16)  # largest_fit plans hundreds of batch sizes with one drafter
def muon_split_params(
    t: TargetShape, d: DrafterShape, exclude: tuple[str, ...], family: tuple | None = None, block_size: int = 1
) -> tuple[int, int]:
    """(Muon's, AdamW's) parameter counts under optim=muon: optim=muon's own rule (model/muon_split.py: each
    parameter's role) applied to the drafter of these shapes and family (`_family`), built on the meta device (no
    memory, no weights)."""
    from omegaconf import OmegaConf

    from dflash.model.muon_split import split_for_muon

    shape = {"num_draft_layers": d.layers, "draft_num_attention_heads": d.heads, "block_size": block_size}
    shape |= {"draft_num_key_value_heads": d.kv_heads, "draft_head_dim": d.head_dim}
    model_cfg = OmegaConf.create(shape | {"draft_intermediate_size": d.intermediate})
    drafter_cfg = None if family is None else OmegaConf.create(dict(family))
    muon, adamw = split_for_muon(meta_drafter(t, model_cfg, d.features, drafter_cfg), exclude)
    return sum(p.numel() for p in muon), sum(p.numel() for p in adamw)


def meta_drafter(t: TargetShape, model_cfg, features: int, drafter_cfg=None):
    """The drafter build_drafter_config makes for a target of shape `t` reading `features` of its layers (of the
    family `drafter_cfg` names, DFlash's without), on the meta device: its parameters' names and shapes without
    memory."""
    import torch
    from transformers import Qwen3Config

    from dflash.model.build import build_drafter_config
    from dflash.model.families import configure_family, drafter_class

    target = Qwen3Config(
        vocab_size=t.vocab,
        hidden_size=t.hidden,
        intermediate_size=t.intermediate,
        num_hidden_layers=t.layers,
        num_attention_heads=t.heads,
        num_key_value_heads=t.kv_heads,
        head_dim=t.head_dim,
        max_position_embeddings=40960,
    )
    config = build_drafter_config(target, model_cfg, list(range(features)), mask_token_id=0)
    if drafter_cfg is not None:
        configure_family(config, drafter_cfg)
    with torch.device("meta"):
        return drafter_class(config)(config)


def roles(cfg, nproc: int) -> list[str]:
    """The kinds of rank a run of `nproc` processes has (ROLES), rank 0 first."""
    target_ranks = (cfg.parallel.get("target_ranks") or 0) if nproc > 1 else 0
    drafters = nproc - target_ranks
    return ["rank 0"] + (["other drafter ranks"] if drafters > 1 else []) + (["target ranks"] if target_ranks else [])


def runs_target(cfg, nproc: int, role: str) -> bool:
    """Whether a rank of `role` runs the target's forward for training (else it reads features)."""
    target_ranks = (cfg.parallel.get("target_ranks") or 0) if nproc > 1 else 0
    if role == "target ranks":
        return True
    return not target_ranks and cfg.features.name != "store"


def loads_whole_target(cfg, nproc: int, role: str) -> bool:
    """Whether a rank of `role` loads the whole target (as job.build_job decides), else its embedding and LM
    head only: for its training forward, or rank 0 for the evals, which decode with the target."""
    target_ranks = (cfg.parallel.get("target_ranks") or 0) if nproc > 1 else 0
    evals = bool(cfg.eval.num_prompts or cfg.eval.get("suites"))
    if role == "rank 0" and (target_ranks or evals):
        return True
    return runs_target(cfg, nproc, role)


def memory_parts(
    cfg,
    t: TargetShape,
    nproc: int = 1,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device=None,
    role: str = "rank 0",
):
    """Predicted bytes per rank of `role` (ROLES), by part (the module docstring says what each holds).
    `device` (cpu | cuda; None: the config's) decides whether attention scores of the target are materialised."""
    m, tr, par = cfg.model, cfg.train, cfg.parallel
    d = drafter_shape(m, t)
    params = drafter_params(cfg, t, d)
    w = DTYPE_BYTES[m.dtype]
    target_ranks = (par.get("target_ranks") or 0) if nproc > 1 else 0
    drafters = nproc - target_ranks  # the data-parallel drafter ranks
    name = par.name if drafters > 1 else "single"
    shard = drafters if name == "fsdp" else 1
    bsz = max(1, (batch_size or tr.batch_size) // drafters)  # train.batch_size is the global batch
    S, B, H = seq_len or tr.seq_len, m.block_size, t.hidden
    A = planned_anchors(cfg, batch_size or tr.batch_size, S)
    T, ctx = bsz * A * B, bsz * S  # block tokens and context tokens of one step on this rank
    device = device or (m.device if m.device != "auto" else ("cuda" if _cuda() else "cpu"))
    cpu = device == "cpu"
    kv_width = d.kv_heads * d.head_dim
    window = effective_window(m, S)
    sdpa = m.attention == "sdpa" or (m.attention == "auto" and cpu)  # trainer.training_attention's choice
    keys = S + A * B if window is None else window - 1 + B  # keys a block query is scored against
    per_layer = (
        T * (6 * H + 2 * d.heads * d.head_dim + 3 * d.intermediate)  # block stream, q, o, MLP
        + (ctx + T) * (H + 4 * kv_width + 2 * d.heads * d.head_dim * (d.heads // d.kv_heads > 1))  # keys/values
        # a CPU's SDPA keeps the attention probabilities for backward; a GPU's fused kernels keep only the mask
        + bsz * A * B * keys * (2 * d.heads if cpu else 1) // (1 if cpu else w)
        + (bsz * A * (keys - B) * 2 * kv_width if window and sdpa else 0)  # sdpa's per-block window K/V copies
    )
    target_act = ctx * H * (t.layers + 2 + d.features) + max(
        3 * ctx * t.intermediate, bsz * t.heads * S * S if cpu else 0
    )
    item = ctx * H * (d.features + 1) * w
    items = 1 if cfg.pipeline.mode == "sync" else cfg.pipeline.queue_size + 2
    if cfg.pipeline.queue_bytes:
        items = min(items, max(1, cfg.pipeline.queue_bytes // max(1, item)) + 2)
    unit = max(d.layer_params, d.features * H * H)
    N, bf16 = getattr(m, "draft_vocab_size", None), tr.get("precision", "fp32") == "bf16-mixed"
    weights = t.total_params if loads_whole_target(cfg, nproc, role) else t.head_params
    parts = {
        "target weights": weights * w,
        "drafter parameters": params * w // shard,
        "gradients": params * w * (2 if name == "ddp" else 1) // shard,
        "optimizer state": optimizer_state_params(cfg, t, d) * w // shard,
        "fsdp gathered": 2 * unit * w if name == "fsdp" else 0,
        "eval copy": max(0, params * w - (2 * unit * w if name == "fsdp" else 0)) if name in ("ddp", "fsdp") else 0,
        "target activations": target_act * w if runs_target(cfg, nproc, role) else 0,
        "drafter activations": (d.layers * per_layer + 3 * ctx * H + 2 * T * H) * w,
        "chunked loss": 5 * min(m_chunk(cfg), T) * head_vocab(m, t) * 4,
        # train.precision=bf16-mixed: the frozen LM head's bfloat16 copy the loss multiplies (train/precision.py)
        "bf16 loss head": t.vocab * H * 2 if bf16 else 0,
        # model.draft_vocab_size N: the drafter's frozen head (N x H) and the loss's copy of the target's rows
        "draft vocabulary head": (N * H * w + N * H * (2 if bf16 else 4)) if N else 0,
        "queues": items * item,
        "feature transport": cfg.pipeline.queue_size * item if target_ranks else 0,
        "runtime": RUNTIME_BYTES,
    }
    if role != "rank 0":
        parts["eval copy"] = 0  # the full drafter is gathered on rank 0 only
    if role == "target ranks":  # the target's forward and the link's items; no drafter
        keep = ("target weights", "target activations", "feature transport", "runtime")
        parts = {k: (v if k in keep else 0) for k, v in parts.items()}
    return parts


def head_vocab(model_cfg, t: TargetShape) -> int:
    """The rows of the head the loss multiplies: model.draft_vocab_size's N, or the target's vocabulary."""
    return getattr(model_cfg, "draft_vocab_size", None) or t.vocab


def planned_anchors(cfg, batch_size: int, seq_len: int) -> int:
    """Anchors per row (the anchor tensor's width): train.num_anchors, or under train.anchor_budget the share of a
    row in a batch of batch_size full rows (model/anchor_budget.py). A batch of mixed lengths gives its longer rows
    more, up to train.num_anchors: the plan of a full batch is then the expected width, not the largest."""
    tr = cfg.train
    return planned_width(tr.num_anchors, tr.get("anchor_budget"), batch_size, seq_len, cfg.model.block_size)


def effective_window(model_cfg, seq_len: int) -> int | None:
    """model.sliding_window where it hides something at seq_len (dflash/model/window.py's rule), else None; a drafter
    that mixes full and sliding layers (model.layer_types) is planned as full attention: an upper bound."""
    w = model_cfg.get("sliding_window")
    if "full_attention" in (model_cfg.get("layer_types") or []):
        return None
    return None if w is None or w >= seq_len else int(w)


def m_chunk(cfg) -> int:
    return int(cfg.loss.chunk_size)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def peak_bytes(cfg, t: TargetShape, nproc: int = 1, **kw) -> int:
    """The predicted peak per rank: the sum of the parts of the rank that holds the most."""
    return max(sum(memory_parts(cfg, t, nproc, role=r, **kw).values()) for r in roles(cfg, nproc))


def largest_fit(
    cfg, t: TargetShape, nproc: int, device_bytes: int, seq_lens=(512, 1024, 2048, 3072, 4096, 8192), device=None
):
    """{seq_len: the largest global train.batch_size (a multiple of nproc) whose predicted peak fits}, 0 = none."""
    out = {}
    for S in seq_lens:
        per_rank = 0
        while per_rank < 4096 and device_bytes >= peak_bytes(
            cfg, t, nproc, batch_size=(per_rank + 1) * nproc, seq_len=S, device=device
        ):
            per_rank += 1
        out[S] = per_rank * nproc
    return out


def flops_per_sequence(model_cfg, t: TargetShape, seq_len: int, anchors: int) -> dict[str, float]:
    """FLOPs of one training sequence of `seq_len` tokens with `anchors` blocks of `model.block_size` (the one
    FLOP model: `python -m dflash.plan` and `python -m dflash.analysis.store_cost` both use it):

      target    2 x (params less the embedding and LM head: the features need neither) per token, plus its
                causal attention, 2 x layers x heads x head_dim x seq_len per token (every layer counted as full
                attention: an upper bound for a hybrid target)
      drafter   6 x (its layers' parameters) x anchors x block  (forward + backward of the block tokens)
              + 6 x (fc + every layer's k_proj, v_proj) x seq_len (the context's keys and values, trained too)
              + 3 x 4 x heads x head_dim x layers x anchors x block x (seq_len / 2 + block): scores and values over
                the keys a query may see (the context before a uniform anchor and its own block), what a block
                mask computes (a dense mask on a CPU computes all seq_len + anchors x block); under
                model.sliding_window W < seq_len the context a uniform anchor sees is W - W^2 / (2 seq_len)
              + 6 x hidden x vocab x anchors x (block - 1): the frozen LM head's forward and input gradient (4)
                and the teacher's logits from the last hidden state (2), counted for every loss: an upper bound
                for a loss without the KL, which reads a store's target argmax instead (sim_tau's) or online
                computes it once per distinct position; under model.draft_vocab_size N the head is N wide, and
                the target's own argmax over the whole vocabulary (2 x hidden x vocab) is counted at every one
                of the seq_len positions (online; a store holds it)"""
    d = drafter_shape(model_cfg, t)
    S, A, B, H = seq_len, anchors, model_cfg.block_size, t.hidden
    block_tokens = A * B
    # the parameters a token runs through (MoE: its active experts), and attention over the context in the layers
    # that have it (a linear-attention layer's cost does not grow with the context)
    target = (2 * (t.active_params - t.head_params) + 2 * t.attention_layers * t.heads * t.head_dim * S) * S
    fc, kv = d.features * H * H, 2 * H * d.kv_heads * d.head_dim * d.layers
    window = effective_window(model_cfg, S)
    seen = S / 2 if window is None else window - window * window / (2 * S)  # context before a uniform anchor
    attention = 3 * 4 * d.heads * d.head_dim * d.layers * block_tokens * (seen + B)
    n_vocab = getattr(model_cfg, "draft_vocab_size", None)
    head = 6 * H * (n_vocab or t.vocab) * A * (B - 1) + (2 * H * t.vocab * S if n_vocab else 0)
    drafter = 6 * d.layers * d.layer_params * block_tokens + 6 * (fc + kv) * S + attention + head
    return {"target": float(target), "drafter": float(drafter)}


def flops_per_token(cfg, t: TargetShape) -> dict[str, float]:
    """flops_per_sequence per context token at the run's train.seq_len and anchors per row (planned_anchors)."""
    S = cfg.train.seq_len
    f = flops_per_sequence(cfg.model, t, S, planned_anchors(cfg, cfg.train.batch_size, S))
    return {k: v / S for k, v in f.items()}


def headline(cfg, t: TargetShape, nproc: int = 1, device: str | None = None) -> dict:
    """What a run records in run.json and logs at start: the predicted peak of the rank that holds the most, its
    largest parts, and each kind of rank's peak."""
    by_role = {r: memory_parts(cfg, t, nproc, device=device, role=r) for r in roles(cfg, nproc)}
    role = max(by_role, key=lambda r: sum(by_role[r].values()))
    parts = by_role[role]
    total = sum(parts.values())
    top = sorted(((k, v) for k, v in parts.items() if v), key=lambda kv: -kv[1])[:3]
    return {
        "predicted_peak_gib_per_rank": round(total / GIB, 3),
        "nproc": nproc,
        "parts_gib": {k: round(v / GIB, 3) for k, v in parts.items()},
        "largest_rank": role,
        "peak_gib_by_rank": {r: round(sum(p.values()) / GIB, 3) for r, p in by_role.items()},
        "text": f"predicted peak {total / GIB:.2f} GiB per rank ("
        + (f"{role}: " if len(by_role) > 1 else "")
        + ", ".join(f"{k} {v / GIB:.2f}" for k, v in top)
        + ")",
    }


def run_headline(cfg, nproc: int) -> dict | None:
    """The headline of the run's own plan (its device, its world size); None, with a warning, if the target's
    shape cannot be read: a plan never stops a run."""
    import logging

    try:
        return headline(cfg, target_shape(cfg.model.target), nproc)
    except Exception as e:  # noqa: BLE001 - a prediction is advice; the run goes on without it
        logging.getLogger(__name__).warning("no memory plan for this run: %s", e)
        return None
