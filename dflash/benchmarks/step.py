"""`python -m dflash.bench step`: one drafter training step (blocks, drafter forward, the fused chunked loss,
backward) at a long sequence, full attention against `model.sliding_window` sizes, and what the loss is given of
the target (`teachers`), each in a fresh subprocess and printed side by side.

The step is the trainer's: anchors drawn over the sequence, `build_training_blocks` with the window (CPU: sdpa, so
full attention scores every block against all S + N*B keys and a window per block against W - 1 + B), the drafter's
forward and backward through `dflash_loss` (`loss`, ce_decay). Inputs are random at the widths the options give
(default: a 1-layer drafter of 1024 hidden units, 16 heads of 64, 4 KV heads). Peak memory is the rise of the
worker's peak RSS (CPU) or max_memory_allocated (CUDA) over the mark taken once the inputs exist.

budgets: none (train.num_anchors per row: every row's anchor tensor is `anchors` wide, padded with invalid blocks
where a row has fewer positions) against train.anchor_budget=K (the batch's anchors capped at K and shared by
`anchor_counts`' rule: the tensor is as wide as the largest row's count). `lengths` gives each row's supervised
tokens (the rest of the row is padding, as in a batch of mixed lengths; their count is the batch), so a budget's
effect on memory with mixed lengths is measured side by side.

teachers: none (no target: no train/sim_tau), logits (the target's last hidden states: its argmax from its logits, an
LM-head matmul per chunk: before target_next), online (the argmax computed in the step once per distinct position, as
the trainer does online without a KL), argmax (a feature store's: no teacher logits unless the loss has a KL).

Options: seq_len=4096 windows=none,512 teachers=none anchors=64 block_size=16 batch=1 hidden=1024 heads=16
kv_heads=4 head_dim=64 intermediate=2816 layers=1 features=2 vocab=8192 chunk_size=256 loss=ce_decay repeats=2
dtype=float32 device=cpu budgets=none lengths= (empty: `batch` rows of seq_len) precisions=fp32 (fp32,bf16-mixed:
train.precision's two steps side by side; a row is labelled by the precision that ran: `fp32*` is a bf16-mixed that
fell back to fp32 on this machine, given no ratio) optims=none (adamw,muon,muon:float32,muon:bfloat16: the optimizer's
step timed after each backward, over the drafter's parameters as the trainer splits them, and its share of the whole
step; muon is optim.muon_ns_dtype=auto) rounds=1 (each variant's worker this many times, the variants in turn)
draft_vocab=none (none,N: model.draft_vocab_size's head over N of the vocab tokens against the whole head, in one
run: the loss's head the target's rows of the N most frequent labels, labels outside replaced by the target's best
token inside as the trainer does; a teacher other than none is needed for that replacement).
The real target's LM head (SmolLM2-135M): hidden=576 vocab=49152 heads=9 kv_heads=3 head_dim=64 intermediate=1536
layers=2 features=3 seq_len=256 batch=4 anchors=32 block_size=8 windows=none teachers=logits,online,argmax
"""

from __future__ import annotations

import json
import resource
import sys
import time

from dflash.benchmarks.options import parse_opts, run_worker

STEP_DEFAULTS: dict[str, str] = {
    "seq_len": "4096",
    "windows": "none,512",
    "teachers": "none",
    "anchors": "64",
    "block_size": "16",
    "batch": "1",
    "hidden": "1024",
    "heads": "16",
    "kv_heads": "4",
    "head_dim": "64",
    "intermediate": "2816",
    "layers": "1",
    "features": "2",
    "vocab": "8192",
    "chunk_size": "256",
    "loss": "ce_decay",
    "repeats": "2",
    "dtype": "float32",
    "device": "cpu",
    "budgets": "none",
    "lengths": "",
    "precisions": "fp32",
    "optims": "none",
    "rounds": "1",
    "draft_vocab": "none",
}


def row_lengths(o: dict) -> list[int]:
    """Each row's supervised tokens: `lengths`, or `batch` rows of seq_len."""
    S = int(o["seq_len"])
    lengths = [int(x) for x in o["lengths"].split(",") if x.strip()] or [S] * int(o["batch"])
    if any(not 0 < n <= S for n in lengths):
        raise SystemExit(f"lengths= takes 1..seq_len ({S}) tokens a row, got {o['lengths']!r}")
    return lengths


def _drafter(o: dict, window: int | None):
    from transformers import Qwen3Config

    from dflash.model.drafter import DFlashDraftModel

    layers = int(o["layers"])
    cfg = Qwen3Config(
        vocab_size=int(o["vocab"]),
        hidden_size=int(o["hidden"]),
        intermediate_size=int(o["intermediate"]),
        num_hidden_layers=layers,
        num_attention_heads=int(o["heads"]),
        num_key_value_heads=int(o["kv_heads"]),
        head_dim=int(o["head_dim"]),
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=layers,
        layer_types=["full_attention" if window is None else "sliding_attention"] * layers,
    )
    B = int(o["block_size"])
    cfg.dflash_config = {"mask_token_id": 0, "target_layer_ids": list(range(int(o["features"]))), "block_size": B}
    cfg.block_size, cfg.num_target_layers = B, int(o["features"])
    return DFlashDraftModel(cfg)


def _worker(args: list[str]) -> None:
    """Child process: one window, teacher, budget, precision and optimizer ("WINDOW/TEACHER/BUDGET/PRECISION/OPTIM"),
    `repeats` steps, one JSON line."""
    import torch

    from dflash.model.blocks import build_training_blocks, gather_positions, sample_anchors
    from dflash.model.draft_vocab import draft_targets, target_ids
    from dflash.model.losses import dflash_loss
    from dflash.model.target import greedy_tokens, greedy_tokens_at
    from dflash.model.window import draft_window
    from dflash.train.precision import autocast, autocast_dtype, head_for_loss

    name, teacher, budget_name, precision, optim, vocab_name = args[0].split("/")
    window, o = (None if name == "none" else int(name)), json.loads(args[1])
    budget = None if budget_name == "none" else int(budget_name)
    device, dtype = torch.device(o["device"]), getattr(torch, o["dtype"])
    lengths = row_lengths(o)
    S, B, bsz, H, V = int(o["seq_len"]), int(o["block_size"]), len(lengths), int(o["hidden"]), int(o["vocab"])
    torch.manual_seed(0)
    drafter = _drafter(o, window).to(device, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(1, V, (bsz, S), generator=g, device=device)
    feats = torch.randn(bsz, S, int(o["features"]) * H, generator=g, device=device, dtype=dtype)
    embed = torch.randn(V, H, generator=g, device=device, dtype=dtype)
    head = torch.randn(V, H, generator=g, device=device, dtype=dtype).mul_(H**-0.5)
    loss_mask = torch.arange(S, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    last_hidden = torch.randn(bsz, S, H, generator=g, device=device, dtype=dtype)
    stored_next = greedy_tokens(last_hidden, head)  # a store's target_next, made before the steps are timed
    amp = autocast_dtype(precision, device)  # the trainer's train.precision: bf16 autocast and a bf16 loss head
    loss_head = head_for_loss(head, amp)
    optimizer = None if optim == "none" else _optimizer(drafter, optim)
    maps = None if vocab_name == "none" else _draft_maps(ids, loss_mask, V, int(vocab_name))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    base_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, opt_times, peak_mb = [], [], 0.0
    attention = "flex" if device.type == "cuda" else "sdpa"
    for step in range(int(o["repeats"])):
        drafter.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        anchors, valid = sample_anchors(loss_mask, int(o["anchors"]), B, torch.Generator().manual_seed(step), budget)
        anchors, valid = anchors.to(device), valid.to(device)
        blocks = build_training_blocks(ids, loss_mask, anchors, valid, B, 0, attention, draft_window(drafter.config))
        n = anchors.shape[1]
        with autocast(device, amp):  # train.precision=bf16-mixed: the trainer's autocast
            out = drafter(embed[blocks.input_ids], feats, blocks.position_ids, attention_mask=blocks.attention_mask)
            draft = out.view(bsz, n, B, -1)[:, :, 1:].reshape(bsz * n, B - 1, -1)
            kw = dict(
                decay_gamma=7.0, kl_temperature=1.0, kl_weight=0.5 if o["loss"] == "kl" else 0.0, streak_alpha=0.0
            )
            if (
                teacher != "none"
            ):  # as the trainer: the target's last hidden states (and argmax) at the teacher positions
                kw["teacher_hidden"] = gather_positions(last_hidden, blocks.teacher_positions).reshape(
                    bsz * n, B - 1, H
                )
            if teacher == "argmax":
                stored = torch.gather(stored_next, 1, blocks.teacher_positions.reshape(bsz, -1))
                kw["target_next"] = stored.view(bsz * n, B - 1)
            if teacher == "online":
                at = greedy_tokens_at(
                    last_hidden, blocks.teacher_positions, blocks.label_valid, head, int(o["chunk_size"])
                )
                kw["target_next"] = at.view(bsz * n, B - 1)
            labels, label_valid = blocks.labels.reshape(bsz * n, B - 1), blocks.label_valid.reshape(bsz * n, B - 1)
            step_head = loss_head
            if maps is not None:  # the trainer's draft-vocabulary step: the head's rows, labels and argmax mapped
                step_head = loss_head[target_ids(maps)]
                labels, nxt, _, _ = draft_targets(
                    maps, labels, label_valid, kw["teacher_hidden"], step_head, kw.get("target_next")
                )
                if nxt is not None:
                    kw["target_next"] = nxt
            loss = dflash_loss(
                draft, labels, label_valid, step_head,
                loss_name=o["loss"], block_size=B, chunk_size=int(o["chunk_size"]), **kw,
            ).loss  # fmt: skip
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
        if optimizer is not None:  # the optimizer's step, timed apart: its share of the step
            t1 = time.perf_counter()
            optimizer.step()
            sync()
            opt_times.append(time.perf_counter() - t1)
        if device.type == "cuda":
            peak_mb = max(peak_mb, (torch.cuda.max_memory_allocated(device) - base) / 2**20)
        else:
            peak_mb = max(peak_mb, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss_kb) / 1024)
    mask = type(blocks.attention_mask).__name__
    blocks_done = {"blocks": int(valid.sum()), "computed": int(valid.numel())}
    ran = "fp32" if amp is None else precision  # what ran: bf16-mixed falls back to fp32 where bf16 is slow
    extra = {"precision_ran": ran, "opt_times_s": opt_times}
    if optimizer is not None:
        extra["optim_ran"] = optimizer.describe()
    print(json.dumps({"peak_mb": peak_mb, "times_s": times, "loss": loss.item(), "mask": mask, **blocks_done, **extra}))


def _draft_maps(ids, loss_mask, vocab: int, n: int):
    """speculators' maps of the n most frequent labels of the bench's rows, as the drafter's buffers hold them."""
    from types import SimpleNamespace

    import torch

    from dflash.model.draft_vocab import build_maps

    counts = torch.bincount(ids[loss_mask].cpu(), minlength=vocab)
    d2t, t2d = build_maps(counts, n)
    return SimpleNamespace(d2t=d2t.to(ids.device), t2d=t2d.to(ids.device))


def _optimizer(drafter, optim: str):
    """The trainer's optimizer over the drafter: `adamw`, or `muon[:NS_DTYPE]` (optim.muon_ns_dtype, default auto)."""
    from omegaconf import OmegaConf

    from dflash.core.config import OptimConfig
    from dflash.train.optimizers import DrafterOptimizer

    name, _, ns_dtype = optim.partition(":")
    cfg = OmegaConf.structured(OptimConfig(name=name, muon_ns_dtype=ns_dtype or "auto"))
    return DrafterOptimizer(drafter, cfg, lr=1e-3)


def bench(args: list[str]) -> None:
    """Full attention against sliding windows, each teacher and each anchor budget: step time and peak memory of one
    drafter step."""
    import torch

    o = parse_opts(args, STEP_DEFAULTS)
    windows = [w.strip() for w in o["windows"].split(",") if w.strip()]
    teachers = [t.strip() for t in o["teachers"].split(",") if t.strip()]
    budgets = [b.strip() for b in o["budgets"].split(",") if b.strip()]
    precisions = [p.strip() for p in o["precisions"].split(",") if p.strip()]
    if not precisions or set(precisions) - {"fp32", "bf16-mixed"}:
        raise SystemExit(f"precisions= takes fp32, bf16-mixed (comma-separated), got {o['precisions']!r}")
    optims = [x.strip() for x in o["optims"].split(",") if x.strip()]
    vocabs = [x.strip() for x in o["draft_vocab"].split(",") if x.strip()]
    if not vocabs or any(x != "none" and not (x.isdigit() and 1 <= int(x) < int(o["vocab"])) for x in vocabs):
        raise SystemExit(f"draft_vocab= takes none and sizes below vocab={o['vocab']}, got {o['draft_vocab']!r}")
    if set(vocabs) != {"none"} and "none" in [t.strip() for t in o["teachers"].split(",")]:
        raise SystemExit("draft_vocab=N needs teachers= other than none (labels outside are replaced from them)")
    known = {"none", "adamw", "muon", "muon:auto", "muon:float32", "muon:bfloat16"}
    if not optims or set(optims) - known:
        raise SystemExit(f"optims= takes {', '.join(sorted(known))} (comma-separated), got {o['optims']!r}")
    lengths = row_lengths(o)
    if not budgets or any(b != "none" and not (b.isdigit() and int(b) >= len(lengths)) for b in budgets):
        rows = len(lengths)
        raise SystemExit(f"budgets= takes none or anchor budgets >= the batch's {rows} rows, got {o['budgets']!r}")
    if not teachers or set(teachers) - {"none", "logits", "online", "argmax"} or o["loss"] not in ("ce_decay", "kl"):
        raise SystemExit("teachers= takes none, logits, online, argmax (comma-separated); loss= ce_decay or kl")
    if o["loss"] == "kl" and {"none", "online"} & set(teachers):
        raise SystemExit("loss=kl takes teachers=logits,argmax (online, the trainer takes the argmax from its logits)")
    S, n, B = int(o["seq_len"]), int(o["anchors"]), int(o["block_size"])
    print(
        f"step bench: drafter training step (forward + backward, {o['loss']}), seq_len {S}, {n} anchors x block {B}, "
        f"rows of {','.join(map(str, lengths))} supervised tokens, {o['layers']} layer(s) of hidden {o['hidden']} "
        f"({o['heads']} heads x {o['head_dim']}, "
        f"{o['kv_heads']} KV heads), vocab {o['vocab']}, {o['dtype']} on {o['device']}, "
        f"{torch.get_num_threads()} torch threads, {o['repeats']} repeats"
    )
    print("memory: rise of the worker's peak RSS (CPU) / max_memory_allocated (CUDA) over the mark after inputs")
    variants = [
        (w, t, b, p, x, dv)
        for w in windows
        for t in teachers
        for b in budgets
        for p in precisions
        for x in optims
        for dv in vocabs
    ]
    results: dict[tuple, dict] = {}
    for _ in range(int(o["rounds"])):  # the variants take turns, so a load change on the machine hits them all
        for v in variants:
            r = run_worker("dflash.benchmarks.step", "/".join(v), o)
            if v in results:  # the best of the rounds: its times are every round's, its peak the largest
                r = {
                    **r,
                    "times_s": results[v]["times_s"] + r["times_s"],
                    "opt_times_s": results[v]["opt_times_s"] + r["opt_times_s"],
                    "peak_mb": max(r["peak_mb"], results[v]["peak_mb"]),
                }
            results[v] = r
    print(
        f"{'window':<8} {'teacher':<8} {'budget':>6} {'precision':>10} {'vocab':>7} {'blocks':>13} {'keys/query':>10} "
        f"{'mask':>22} {'peak MiB':>10} {'best s':>8} {'all s':>16} {'loss':>10}"
    )
    fell_back = {v for v, r in results.items() if r["precision_ran"] != v[3]}
    for (w, t, b, p, x, dv), r in results.items():
        width = r["computed"] // len(lengths)  # the anchor tensor's width: the keys of full attention follow it
        keys = S + width * B if w == "none" or int(w) >= S else int(w) - 1 + B
        all_s = ", ".join(f"{x:.3f}" for x in r["times_s"])
        blocks = f"{r['blocks']}/{r['computed']}"  # trained / computed (the rest pad the anchor tensor)
        label = r["precision_ran"] if p == r["precision_ran"] else f"{r['precision_ran']}*"
        vocab = o["vocab"] if dv == "none" else dv
        print(
            f"{w:<8} {t:<8} {b:>6} {label:>10} {vocab:>7} {blocks:>13} {keys:>10} {r['mask']:>22} "
            f"{r['peak_mb']:>10.0f} {min(r['times_s']):>8.3f} {all_s:>16} {r['loss']:>10.4f}"
        )
    if fell_back:
        print("fp32*: bf16-mixed fell back to fp32 on this machine (no fast bfloat16 kernels): no ratio for its rows")
    if any(x != "none" for *_, x, _ in results):
        _print_optimizer_steps(results)

    def ratio(label: str, r: dict, ref: dict) -> None:
        memory, time_ = r["peak_mb"] / max(ref["peak_mb"], 1e-9), min(r["times_s"]) / min(ref["times_s"])
        print(f"{label}: peak memory {memory:.2f}x, time {time_:.2f}x")

    for (w, t, b, p, x, dv), r in results.items():
        if (w, t, b, p, x, dv) in fell_back:
            continue
        bud, pre = ("" if b == "none" else f", budget {b}"), ("" if p == "fp32" else f", {p}")
        opt = ("" if x == "none" else f", {x}") + ("" if dv == "none" else f", draft vocab {dv}")
        if w != "none" and ("none", t, b, p, x, dv) in results:
            ratio(f"window {w} / full ({t}{bud}{pre}{opt})", r, results["none", t, b, p, x, dv])
        if t in ("online", "argmax") and (w, "logits", b, p, x, dv) in results:
            ratio(f"window {w}: {t} / logits{bud}{pre}{opt}", r, results[w, "logits", b, p, x, dv])
        if b != "none" and (w, t, "none", p, x, dv) in results:
            ratio(f"budget {b} / per-row anchors (window {w}, {t}{pre}{opt})", r, results[w, t, "none", p, x, dv])
        if p != "fp32" and (w, t, b, "fp32", x, dv) in results:
            ratio(f"{p} / fp32 (window {w}, {t}{bud}{opt})", r, results[w, t, b, "fp32", x, dv])
        if dv != "none" and (w, t, b, p, x, "none") in results:
            ratio(
                f"draft vocab {dv} / full {o['vocab']} (window {w}, {t}{bud}{pre})", r, results[w, t, b, p, x, "none"]
            )


def _print_optimizer_steps(results: dict) -> None:
    """Each optimizer's step and its share of the whole step (forward, loss, backward and the optimizer's step)."""
    print(f"{'optimizer':<16} {'Newton-Schulz':>14} {'optimizer s':>12} {'share of step':>14}")
    for (*_, x, _), r in results.items():
        if x == "none":
            continue
        opt, step = min(r["opt_times_s"]), min(r["times_s"])
        ns = r["optim_ran"].get("muon_ns_dtype", "-")
        print(f"{x:<16} {ns:>14} {opt:>12.3f} {opt / (opt + step):>13.0%}")


if __name__ == "__main__" and sys.argv[1:2] == ["_worker"]:  # one window, in its own process
    _worker(sys.argv[2:])
