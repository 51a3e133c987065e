"""The pipeline's stage statistics and its monitor.

``StageStats`` counts one stage's busy time (inside the stage function), wait time (blocked on a channel), items
and tokens. ``Monitor`` holds the three stages' statistics and the two channels; each tick it samples them into
the flat ``perf/*`` dict (keys in ``MONITOR_KEYS``) given to ``on_tick``, and ``totals()`` gives the cumulative
figures a bench compares (``Pipeline.stats``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dflash.train.channel import BoundedChannel

__all__ = ["MONITOR_KEYS", "Monitor", "StageStats", "StageWindow"]

MONITOR_KEYS = (
    "perf/target_queue_depth",
    "perf/hs_queue_depth",
    "perf/hs_queue_mb",
    "perf/target_busy",
    "perf/target_wait",
    "perf/drafter_busy",
    "perf/drafter_wait_s",
    "perf/ktok_s",
    "perf/interval_s",
    "perf/source_cpu_s",
    "perf/target_cpu_s",
    "perf/drafter_cpu_s",
)


@dataclasses.dataclass(frozen=True)
class StageWindow:
    """One stage over one monitor interval. Fractions are per worker: busy_s / (interval_s * workers)."""

    interval_s: float
    busy_s: float
    wait_s: float
    items: int
    tokens: int
    busy_frac: float
    wait_frac: float


class StageStats:
    """Busy time (inside the stage function), wait time (blocked on a channel), items and tokens of one stage.

    Thread-safe; shared by all workers of a stage. Time of a call still in progress is credited up to the
    window, so a drafter step longer than the monitor interval does not show as 0 then > 1. Busy spans also
    count the calling thread's CPU seconds (``cpu_s``, credited when a span ends): where a job's compute goes,
    which a bench compares with the process's total (torch's own intra-op threads, with more than one thread
    per stage, are not counted).
    """

    def __init__(self, name: str, workers: int = 1, clock: Callable[[], float] = time.perf_counter) -> None:
        self.name = name
        self.workers = workers
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[tuple[int, str], float] = {}  # (thread id, "busy"|"wait") -> start of the open span
        self._interval = {"busy": 0.0, "wait": 0.0}
        self._total = {"busy": 0.0, "wait": 0.0}
        self._cpu_s = 0.0
        self._items = self._tokens = 0
        self._total_items = self._total_tokens = 0
        self._interval_start = clock()

    @contextmanager
    def _span(self, kind: str) -> Iterator[None]:
        key = (threading.get_ident(), kind)
        cpu0 = time.thread_time()
        with self._lock:
            self._open[key] = self._clock()
        try:
            yield
        finally:
            cpu = time.thread_time() - cpu0
            with self._lock:
                dt = self._clock() - self._open.pop(key)
                self._interval[kind] += dt
                self._total[kind] += dt
                if kind == "busy":
                    self._cpu_s += cpu

    def busy(self) -> Any:
        """Context manager around the stage function call."""
        return self._span("busy")

    def waiting(self) -> Any:
        """Context manager around a blocking channel get/put."""
        return self._span("wait")

    def count(self, items: int = 1, tokens: int = 0) -> None:
        with self._lock:
            self._items += items
            self._tokens += tokens
            self._total_items += items
            self._total_tokens += tokens

    def take_window(self) -> StageWindow:
        """Totals and fractions since the previous window (or construction); starts a new interval."""
        with self._lock:
            now = self._clock()
            for key, start in self._open.items():  # credit spans still open, then restart them at `now`
                self._interval[key[1]] += now - start
                self._total[key[1]] += now - start
                self._open[key] = now
            interval = max(now - self._interval_start, 1e-9)
            capacity = interval * self.workers
            snap = StageWindow(
                interval_s=interval,
                busy_s=self._interval["busy"],
                wait_s=self._interval["wait"],
                items=self._items,
                tokens=self._tokens,
                busy_frac=self._interval["busy"] / capacity,
                wait_frac=self._interval["wait"] / capacity,
            )
            self._interval = {"busy": 0.0, "wait": 0.0}
            self._items = self._tokens = 0
            self._interval_start = now
            return snap

    @property
    def cpu_s(self) -> float:
        """CPU seconds of the stage's threads inside finished busy spans, since construction."""
        with self._lock:
            return self._cpu_s

    def totals(self) -> dict[str, float]:
        """Cumulative counters plus stand-alone throughput: what the stage would sustain if it never waited
        (``workers * items / busy_s``), the number a bench compares across stages."""
        with self._lock:
            busy, wait, cpu = self._total["busy"], self._total["wait"], self._cpu_s
            items, tokens = self._total_items, self._total_tokens
        rate = self.workers / busy if busy > 0 else 0.0
        return {
            "busy_s": busy,
            "wait_s": wait,
            "cpu_s": cpu,
            "items": items,
            "tokens": tokens,
            "workers": self.workers,
            "items_per_s_standalone": items * rate,
            "tokens_per_s_standalone": tokens * rate,
        }


class Monitor:
    """The statistics of the source, target and drafter stages plus the two channels, sampled each tick.

    ``run(stop, interval_s)`` is the monitor thread's body: a tick every ``interval_s`` until ``stop`` is set.
    ``tick()`` may also be called from another thread (the final tick after the stages stopped); a lock keeps
    ``on_tick`` calls from overlapping. Exceptions of ``on_tick`` propagate to the caller of ``tick``/``run``.
    """

    def __init__(
        self,
        target_queue: BoundedChannel,
        hs_queue: BoundedChannel,
        target_workers: int,
        on_tick: Callable[[dict[str, float]], None] | None = None,
    ) -> None:
        self.source = StageStats("source")
        self.target = StageStats("target", workers=target_workers)
        self.drafter = StageStats("drafter")
        self.target_queue = target_queue
        self.hs_queue = hs_queue
        self._on_tick = on_tick
        self._lock = threading.Lock()

    def run(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.wait(interval_s):
            self.tick()

    def sample(self) -> dict[str, float]:
        """One monitor sample (resets the interval counters): the flat ``perf/*`` dict given to ``on_tick``."""
        tgt = self.target.take_window()
        dft = self.drafter.take_window()
        self.source.take_window()
        return {
            "perf/target_queue_depth": float(self.target_queue.depth()),
            "perf/hs_queue_depth": float(self.hs_queue.depth()),
            "perf/hs_queue_mb": self.hs_queue.nbytes() / 2**20,
            "perf/target_busy": tgt.busy_frac,
            "perf/target_wait": tgt.wait_frac,
            "perf/drafter_busy": dft.busy_frac,
            "perf/drafter_wait_s": dft.wait_s,
            "perf/ktok_s": dft.tokens / dft.interval_s / 1000.0,
            "perf/interval_s": dft.interval_s,
            # cumulative: summary.json's last value is the whole run's (a bench's account of its CPU)
            "perf/source_cpu_s": self.source.cpu_s,
            "perf/target_cpu_s": self.target.cpu_s,
            "perf/drafter_cpu_s": self.drafter.cpu_s,
        }

    def tick(self) -> None:
        with self._lock:
            s = self.sample()
            if self._on_tick is not None:
                self._on_tick(s)

    def totals(self) -> dict[str, Any]:
        """Cumulative per-stage busy/wait totals and stand-alone throughput, plus the channels' peaks."""
        return {
            "source": self.source.totals(),
            "target": self.target.totals(),
            "drafter": self.drafter.totals(),
            "target_queue_peak_depth": self.target_queue.peak_depth,
            "hs_queue_peak_depth": self.hs_queue.peak_depth,
            "hs_queue_peak_mb": self.hs_queue.peak_bytes / 2**20,
        }
