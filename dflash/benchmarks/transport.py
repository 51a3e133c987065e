"""`python -m dflash.bench transport [key=value ...]`: the feature transport between two processes (a target
rank sending HiddenItems to a drafter rank over torch.distributed point-to-point, gloo on CPU) against the
in-process queue (BoundedChannel between two threads) on the same items, in one run.

Items are Qwen3-8B-shaped: `rows` x `seq` tokens, the drafter's features (5 target layers x hidden 4096) and
the last hidden state (the teacher's), in `dtype`, plus ids and masks. Prints MB/s and items/s of each, their
ratio, and the bytes per token on the wire (header and masks included).

Options: items=24 rows=1 seq=1024 hidden=4096 layers=5 dtype=bfloat16 bound=4 backend=gloo.
"""

from __future__ import annotations

import tempfile
import threading
import time

import torch

from dflash.benchmarks.options import parse_opts

DEFAULTS = {
    "items": "24",
    "rows": "1",
    "seq": "1024",
    "hidden": "4096",
    "layers": "5",
    "dtype": "bfloat16",
    "bound": "4",
    "backend": "gloo",
}


def make_item(opts: dict, i: int):
    from dflash.train.trainer import HiddenItem

    rows, seq, hidden = int(opts["rows"]), int(opts["seq"]), int(opts["hidden"])
    dtype = getattr(torch, opts["dtype"])
    return HiddenItem(
        input_ids=torch.randint(0, 151_936, (rows, seq)),
        loss_mask=torch.ones(rows, seq, dtype=torch.bool),
        target_hidden=torch.randn(rows, seq, int(opts["layers"]) * hidden).to(dtype),
        last_hidden=torch.randn(rows, seq, hidden).to(dtype),
        num_tokens=rows * seq,
        data_pass=0,
        index=i,
    )


def _wire_bytes(item) -> int:
    from dflash.train.transport import HEADER_LEN, item_to_wire

    _, tensors = item_to_wire(item)
    return HEADER_LEN * 8 + sum(t.numel() * t.element_size() for t in tensors)


def _transport_worker(rank: int, init: str, opts: dict, out: dict) -> None:
    import torch.distributed as dist

    from dflash.train.transport import Receiver, Sender, item_from_wire, item_to_wire

    torch.set_num_threads(1)
    dist.init_process_group(opts["backend"], init_method=init, rank=rank, world_size=2)
    n, bound = int(opts["items"]), int(opts["bound"])
    try:
        if rank == 0:
            items = [make_item(opts, i) for i in range(min(n, 4))]  # made up front: the bench times the wire only
            sender = Sender(1, bound, timeout_s=300)
            dist.barrier()
            for i in range(n):
                item = items[i % len(items)]
                item.index = i
                sender.send(*item_to_wire(item))
            sender.wait_for_stop()
        else:
            receiver = Receiver(0, bound, timeout_s=300, build=lambda seq, ints, ts: item_from_wire(seq, ints, ts))
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                receiver.get()
            out["seconds"] = time.perf_counter() - t0
            out["bytes"] = receiver.stats.bytes
            receiver.close()
    finally:
        dist.destroy_process_group()


def _queue_seconds(opts: dict) -> float:
    from dflash.train.channel import END, BoundedChannel

    n = int(opts["items"])
    items = [make_item(opts, i) for i in range(min(n, 4))]
    channel = BoundedChannel(int(opts["bound"]), name="bench")

    def produce():
        for i in range(n):
            channel.put(items[i % len(items)])
        channel.close()

    t0 = time.perf_counter()
    thread = threading.Thread(target=produce)
    thread.start()
    while channel.get() is not END:
        pass
    thread.join()
    return time.perf_counter() - t0


def bench(args: list[str]) -> None:
    import torch.multiprocessing as mp

    opts = parse_opts(args, DEFAULTS)
    n = int(opts["items"])
    item = make_item(opts, 0)
    per_item = _wire_bytes(item)
    tokens = item.num_tokens
    print(
        f"items: {opts['rows']} x {opts['seq']} tokens, features {opts['layers']}+1 x {opts['hidden']} "
        f"{opts['dtype']}: {per_item / 2**20:.1f} MB each, {per_item / tokens:.0f} bytes/token on the wire; "
        f"{n} items, bound {opts['bound']}",
        flush=True,
    )
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_transport_worker, args=(r, f"file://{tmp}/store", opts, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    if any(p.exitcode for p in procs) or "seconds" not in out:
        raise SystemExit(f"the transport run failed (exit codes {[p.exitcode for p in procs]})")
    wire_s, queue_s = out["seconds"], _queue_seconds(opts)
    wire_mb = out["bytes"] / 2**20 / wire_s
    queue_mb = n * per_item / 2**20 / queue_s
    print(f"  {opts['backend']} p2p, 2 processes: {wire_mb:9.0f} MB/s  {n / wire_s:9.1f} items/s  ({wire_s:.2f} s)")
    print(f"  in-process queue, 2 threads: {queue_mb:9.0f} MB/s  {n / queue_s:9.1f} items/s  ({queue_s:.4f} s)")
    print(f"  transport / queue: x{wire_mb / queue_mb:.4f} (the queue passes references; the wire copies bytes)")
    print(f"  at {n / wire_s * tokens / 1e3:.1f} ktok/s of features the transport is not the bottleneck below that")
