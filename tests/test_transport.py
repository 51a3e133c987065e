"""The feature transport between two processes (gloo on CPU): items arrive whole and in order, the sender's
items in flight stay at the bound under a slow drafter, and a dead peer fails the wait instead of hanging."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.core.distributed import open_links
from dflash.train import transport
from dflash.train.transport import Receiver, Sender, TransportError


def _item(i: int) -> tuple[list[int], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(i)
    rows, seq = 1 + i % 3, 8 + 4 * (i % 5)
    feats = torch.randn(rows, seq, 12, generator=g).to(torch.bfloat16)
    return [i, 2 * i, -1], [
        torch.randint(0, 100, (rows, seq), generator=g),
        feats,
        torch.rand(rows, seq, generator=g) > 0.5,
    ]


def _worker(rank: int, init: str, mode: str, out: dict) -> None:
    """Rank 0 is the drafter, rank 1 its target (parallel.target_ranks=1 in a world of 2), with the link's two
    groups as init_world opens them; every point-to-point call is recorded with its group."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    link = open_links(drafters=1, target_ranks=1, rank=rank, device=torch.device("cpu"), timeout_s=20)[1 - rank]
    used = {"send": set(), "recv": set()}
    real_isend, real_irecv = transport.dist.isend, transport.dist.irecv

    def isend(tensor, dst, group=None, **kw):
        used["send"].add(id(group))
        return real_isend(tensor, dst, group=group, **kw)

    def irecv(tensor, src, group=None, **kw):
        used["recv"].add(id(group))
        return real_irecv(tensor, src, group=group, **kw)

    transport.dist.isend, transport.dist.irecv = isend, irecv
    try:
        if rank == 1:  # the target side
            sender = Sender(0, bound=2, timeout_s=20, link=link)
            peak = 0
            for i in range(12):
                if not sender.send(*_item(i)):
                    break
                peak = max(peak, sender.stats.in_flight)
                if mode == "die" and i == 3:
                    os._exit(3)  # a target rank that dies mid-stream
            sender.wait_for_stop()
            out["peak"], out["sent"] = peak, sender.stats.items
        else:
            receiver = Receiver(1, bound=2, timeout_s=20, build=lambda seq, ints, ts: (seq, ints, ts), link=link)
            got = []
            try:
                for _ in range(10):
                    item = receiver.get()
                    time.sleep(0.05)  # a slow drafter
                    got.append(item)
                receiver.close()
            except TransportError as e:
                out["error"] = str(e)
            out["ok"] = all(
                seq == i and ints == _item(i)[0] and all(torch.equal(a, b) for a, b in zip(tensors, _item(i)[1]))
                for i, (seq, ints, tensors) in enumerate(got)
            )
            out["received"] = len(got)
        # NCCL runs a communicator's p2p operations in order and ignores tags: no group may carry both directions
        out[f"one_direction_per_group_{rank}"] = not used["send"] & used["recv"] and len(used["send"]) == 1
    finally:
        if mode != "die":
            dist.destroy_process_group()


def _run(tmp_path, mode: str) -> dict:
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    out = manager.dict()
    procs = [ctx.Process(target=_worker, args=(r, f"file://{tmp_path}/store", mode, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        assert not p.is_alive(), "a transport process hung"
    return dict(out), [p.exitcode for p in procs]


def test_items_arrive_in_order_and_in_flight_stays_at_the_bound(tmp_path):
    out, codes = _run(tmp_path, "slow")
    assert codes == [0, 0], out
    assert out["ok"] and out["received"] == 10
    assert out["one_direction_per_group_0"] and out["one_direction_per_group_1"]
    assert out["peak"] == 2  # the bound, reached because the drafter is slower
    assert out["sent"] <= 12


def test_a_dead_target_fails_the_drafters_wait_naming_it(tmp_path):
    out, codes = _run(tmp_path, "die")
    assert codes[1] == 3
    assert "target rank 1" in out.get("error", ""), out
    assert out["received"] < 10


def test_the_console_says_which_side_of_the_link_is_slower():
    from dflash.tracking.console import _stats_text

    assert "slower: target ranks" in _stats_text({"perf/link_wait": 0.6, "perf/link_mb_s": 10.0})
    assert "slower: drafters" in _stats_text({"perf/link_wait": 0.01, "perf/link_mb_s": 10.0})
