"""`python -m dflash.bench loss`: the fused chunked loss against full-logits autograd, each in a fresh subprocess
(see dflash/benchmarks/__init__.py for what is measured)."""

from __future__ import annotations

import json
import resource
import sys
import time

from dflash.benchmarks.options import parse_opts, run_worker

LOSS_DEFAULTS: dict[str, str] = {
    "blocks": "70",
    "block_size": "16",
    "hidden": "4096",
    "vocab": "151936",
    "dtype": "float32",
    "chunk_size": "256",
    "repeats": "2",
    "device": "cpu",
}


def _worker(args: list[str]) -> None:
    """Child process: build inputs, run one variant `repeats` times, print one JSON line."""
    import torch

    from dflash.model.losses import dflash_loss, dflash_loss_naive

    variant, opts = args[0], json.loads(args[1])
    device = torch.device(opts["device"])
    dtype = getattr(torch, opts["dtype"])
    n, bs, hidden, vocab = int(opts["blocks"]), int(opts["block_size"]), int(opts["hidden"]), int(opts["vocab"])
    g = torch.Generator(device=device).manual_seed(0)
    # allocate every input at its final dtype / device (no transient copies that would raise the baseline)
    weight = torch.randn(vocab, hidden, generator=g, device=device, dtype=dtype).mul_(hidden**-0.5)
    draft = torch.randn(n, bs - 1, hidden, generator=g, device=device, dtype=dtype)
    teacher = draft.clone().add_(torch.randn(n, bs - 1, hidden, generator=g, device=device, dtype=dtype))
    draft.requires_grad_(True)
    labels = torch.randint(0, vocab, (n, bs - 1), generator=g, device=device)
    valid = torch.ones(n, bs - 1, dtype=torch.bool, device=device)  # all valid: both variants do the same work
    fn = dflash_loss if variant == "chunked" else dflash_loss_naive
    kw = dict(
        loss_name="kl_streak",
        block_size=bs,
        decay_gamma=None,
        kl_temperature=1.0,
        kl_weight=0.5,
        streak_alpha=0.5,
        teacher_hidden=teacher,
        chunk_size=int(opts["chunk_size"]),
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    base_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, peak_mb = [], 0.0
    for _ in range(int(opts["repeats"])):
        draft.grad = None
        t0 = time.perf_counter()
        out = fn(draft, labels, valid, weight, **kw)
        out.loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak_mb = max(peak_mb, (torch.cuda.max_memory_allocated(device) - base) / 2**20)
        else:
            peak_mb = max(peak_mb, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss_kb) / 1024)
    print(
        json.dumps(
            {
                "variant": variant,
                "peak_mb": peak_mb,
                "times_s": times,
                "loss": out.loss.item(),
                "grad_norm": draft.grad.float().norm().item(),
                "grad_sum": draft.grad.float().sum().item(),
                "threads": torch.get_num_threads(),
            }
        )
    )


def bench(args: list[str]) -> None:
    """Chunked fused loss vs full-logits loss: peak memory and time of forward + backward."""
    opts = parse_opts(args, LOSS_DEFAULTS)
    n, bs, vocab = int(opts["blocks"]), int(opts["block_size"]), int(opts["vocab"])
    positions = n * (bs - 1)
    itemsize = 2 if opts["dtype"] in ("bfloat16", "float16") else 4
    print(
        f"loss bench: kl_streak, forward+backward, {n} blocks x {bs - 1} positions = {positions} positions, "
        f"hidden {opts['hidden']}, vocab {vocab}, inputs {opts['dtype']} (softmax in float32), "
        f"chunk_size {opts['chunk_size']}, device {opts['device']}, {opts['repeats']} repeats"
    )
    print(
        f"one full [P x V] float32 logits tensor: {positions * vocab * 4 / 2**20:.0f} MiB; "
        f"LM head: {vocab * int(opts['hidden']) * itemsize / 2**20:.0f} MiB"
    )
    print("memory: rise of the worker's peak RSS (CPU) / max_memory_allocated (CUDA) over the mark after inputs")
    results = {v: run_worker("dflash.benchmarks.loss", v, opts) for v in ("naive", "chunked")}
    print(f"{'variant':<9} {'peak MiB':>10} {'best s':>8} {'all s':>20} {'loss':>12} {'grad norm':>12}")
    for v, r in results.items():
        all_s = ", ".join(f"{t:.2f}" for t in r["times_s"])
        print(
            f"{v:<9} {r['peak_mb']:>10.0f} {min(r['times_s']):>8.2f} {all_s:>20} {r['loss']:>12.6f} "
            f"{r['grad_norm']:>12.6g}"
        )
    a, b = results["naive"], results["chunked"]
    print(f"naive / chunked peak memory: {a['peak_mb'] / max(b['peak_mb'], 1e-9):.2f}x")
    print(f"naive / chunked time:        {min(a['times_s']) / min(b['times_s']):.2f}x")
    print(
        f"|loss diff| {abs(a['loss'] - b['loss']):.3g}, "
        f"rel grad-norm diff {abs(a['grad_norm'] - b['grad_norm']) / max(a['grad_norm'], 1e-30):.3g}"
    )


if __name__ == "__main__" and sys.argv[1:2] == ["_worker"]:  # one variant, in its own process
    _worker(sys.argv[2:])
