"""`parallel.target_ranks=K`: the last K processes of a torchrun job run only the frozen target and send
hidden-state items to the drafter ranks (0..N-K-1, the data-parallel drafter group), over the point-to-point
transport of `train/transport.py`. Target ranks hold no state worth checkpointing: they start at the data
position rank 0 broadcasts after its resume, and stop when every drafter they feed has stopped its link.

Target rank t feeds the drafter ranks d with d % K == t. For each global batch (the same seeded sequence on
every process) it computes the features of each of its drafters' slices (`rank_slice`, as a colocated rank
would) and sends them in order, so each drafter trains on exactly the items a colocated run makes.
"""

from __future__ import annotations

import logging
import threading
import time

import psutil
import torch
from omegaconf import DictConfig

from dflash.core.distributed import World
from dflash.core.rundir import RunDir
from dflash.data.batches import rank_slice
from dflash.runner.sources import target_and_data, target_files
from dflash.train.trainer import TargetForward
from dflash.train.transport import Receiver, Sender, item_from_wire, item_to_wire

log = logging.getLogger(__name__)


def transport_device(world: World) -> torch.device:
    """Where items travel from and to: the GPU under NCCL, the CPU under gloo."""
    return world.device if world.backend == "nccl" else torch.device("cpu")


def _timeout(cfg: DictConfig) -> float:
    # the first item waits for the target ranks' model load and data build, like the first collectives
    return max(cfg.parallel.timeout_s, cfg.parallel.init_timeout_s)


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def serve_target(cfg: DictConfig, world: World, run: RunDir) -> None:
    """A target rank's whole job: load the target and the data, then send features until its drafters stop.
    Its link totals go to `target_rank<r>.json` in the run directory."""
    # the same set-up as a drafter rank's (run.build_job), collective for collective
    loaded = target_and_data(cfg, world, target_files(cfg, world), [str(world.device)])
    target, data = loaded.target, loaded.data
    start = world.broadcast_to_all(None)  # rank 0's data position after its resume
    peers = world.drafters_of(world.rank)
    device = transport_device(world)
    senders = {d: Sender(d, cfg.parallel.items_in_flight, _timeout(cfg), world.links[d], device) for d in peers}
    forward = TargetForward(target, device, cfg.debug.fail_target_at_batch)
    log.warning("target rank %d: feeding drafter ranks %s from batch %s", world.rank, peers, tuple(start))
    t0, batches, peak = time.monotonic(), 0, 0
    rss_warm = rss_max = None  # resident memory after warm-up and its highest value since (a leak would grow it)
    with torch.inference_mode():
        for batch in data.batches.iterate(*start):
            live = [d for d in peers if not senders[d].stopped]
            if not live:
                break
            for d in live:
                senders[d].send(*item_to_wire(forward(rank_slice(batch, d, world.size))))
                peak = max(peak, senders[d].stats.in_flight)
            batches += 1
            if batches >= 4:
                rss = _rss_mb()
                rss_warm = rss if rss_warm is None else rss_warm
                rss_max = rss if rss_max is None else max(rss_max, rss)
    for sender in senders.values():
        sender.wait_for_stop()
    world.barrier_all()  # the drafters have closed their links too
    seconds = time.monotonic() - t0
    stats = {
        "drafter_ranks": peers,
        "batches": batches,
        "mb_sent": sum(s.stats.bytes for s in senders.values()) / 2**20,
        "seconds": seconds,
        "credit_wait": sum(s.stats.wait_s for s in senders.values()) / max(seconds, 1e-9),
        "items_in_flight_bound": cfg.parallel.items_in_flight,
        "items_in_flight_peak": peak,
        "rss_mb": {"after_4_batches": rss_warm, "max": rss_max, "end": _rss_mb()},
    }
    run.write_target_rank(world.rank, stats)
    log.warning(
        "target rank %d: %d batches, %.0f MB sent in %.0f s; waited for credit %.0f%% of the time (drafters slower)",
        world.rank,
        batches,
        stats["mb_sent"],
        seconds,
        100 * stats["credit_wait"],
    )


class FeatureSource:
    """A drafter rank's items from its target rank: an iterable for the pipeline's source (the pipeline's
    target stage passes items through), link numbers for the monitor, and the link's orderly end."""

    def __init__(self, cfg: DictConfig, world: World, device: torch.device):
        self.peer = world.target_rank_of(world.rank)
        self.receiver = Receiver(
            self.peer,
            cfg.parallel.items_in_flight,
            _timeout(cfg),
            build=lambda seq, ints, tensors: item_from_wire(seq, ints, tensors, device),
            link=world.links[self.peer],
            device=transport_device(world),
        )
        self._last = (0, 0, 0.0)
        self._last_t = time.monotonic()

    def __iter__(self):
        return iter(self.receiver.get, None)

    def abandon_on(self, event: threading.Event) -> None:
        self.receiver.abandon = event

    def sample(self) -> dict[str, float]:
        """perf/link_*: this rank's link from its target rank since the last sample. A high link_wait means the
        drafter waits for features (the target side is the bottleneck); a full link_queue means the drafter is."""
        now = time.monotonic()
        stats = self.receiver.stats
        window = stats.window(self._last, max(now - self._last_t, 1e-9))
        self._last, self._last_t = (stats.items, stats.bytes, stats.wait_s), now
        return {
            "perf/link_items_s": window["items_s"],
            "perf/link_mb_s": window["mb_s"],
            "perf/link_wait": min(1.0, window["wait"]),
            "perf/link_queue": float(self.receiver.queue.depth()),
            "perf/link_queue_mb": self.receiver.queue.nbytes() / 2**20,
        }

    def finish(self, world: World) -> None:
        """Stop the target rank's sending, drain the link, and meet every process once all links are closed."""
        self.receiver.close()
        world.barrier_all()
