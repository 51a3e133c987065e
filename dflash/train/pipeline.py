"""Generic three-stage pipeline: batch source -> target stage(s) -> drafter loop, plus a monitor.

The module knows nothing about models. The caller injects three things:

- ``source``: an iterable of batches; every batch has an int attribute ``num_tokens``.
- ``target_fn(batch) -> item``: runs the frozen target; ``item`` is typically a small dataclass of tensors
  already on the drafter's device (its byte size is what the hidden-state queue is bounded by).
- ``drafter_fn(item) -> bool``: one drafter training step; returning ``False`` means "training is finished".

``mode="async"`` runs them as threads joined by bounded channels::

    BatchSource --target_queue--> TargetStage x N --hs_queue--> DrafterLoop      Monitor --> on_tick(sample)

``mode="sync"`` calls the same three stages one after the other in the caller's thread (the baseline).

Lifetime is owned by ``Pipeline.run()``: one internal stop event every stage watches; the first exception in
any stage stops every stage and is re-raised as ``StageError`` naming the stage; every thread is joined (with a
timeout) before ``run()`` returns or raises.

A run is stopped from outside one way: the caller's ``stop_event``, which ``dflash.core.interrupts``' SIGTERM/SIGINT
handler sets (``run.py`` passes it unless the drafter trains on several ranks, which agree on a stop in their
trainer). ``run()``'s thread checks it every ``POLL_S`` seconds (sync mode: before each batch, so the current
drafter step finishes first), stops every stage and returns with ``stopped_by="interrupted"`` (it does not
raise), so the caller can checkpoint and write ``status.json``.

The channels are ``dflash/train/channel.py``'s, the stage statistics and the monitor ``dflash/train/monitor.py``'s
(their names are re-exported here); no stage touches another stage's objects.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from dflash.core.config import PIPELINE_MODES
from dflash.core.disk import disk_error
from dflash.train.channel import END, POLL_S, BoundedChannel, ChannelClosed, InOrder, item_nbytes
from dflash.train.monitor import MONITOR_KEYS, Monitor, StageStats, StageWindow

log = logging.getLogger(__name__)

__all__ = ["Pipeline", "PipelineResult", "StageError"]
# the import path of the channel's and the monitor's names before they had modules of their own
__all__ += ["END", "BoundedChannel", "ChannelClosed", "item_nbytes", "MONITOR_KEYS", "StageStats", "StageWindow"]


class StageError(RuntimeError):
    """A pipeline stage raised. ``.stage`` names it, ``__cause__`` is the original exception and
    ``.traceback_text`` its formatted traceback (from the stage's own thread)."""

    def __init__(self, stage: str, exc: BaseException | str, traceback_text: str) -> None:
        error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        super().__init__(f"{stage} stage failed: {error}")
        self.stage = stage
        self.error = error
        self.traceback_text = traceback_text

    def __reduce__(self):
        # a job's exception travels pickled (submitit, Hydra's JobReturn): rebuilt from text, as its cause may
        # not pickle (the cause itself is not carried: Python never pickles __cause__)
        return (type(self), (self.stage, self.error, self.traceback_text))


@dataclasses.dataclass
class PipelineResult:
    """How a run ended without error.

    stopped_by: "finished" (drafter_fn returned False), "exhausted" (source ran out and everything was
    consumed) or "interrupted" (the caller's stop_event was set).
    """

    stopped_by: str
    reason: str
    items: int  # items the drafter consumed
    tokens: int  # target tokens the drafter consumed
    wall_s: float
    stats: dict[str, Any]


@dataclasses.dataclass
class _Envelope:
    """What crosses the channels: the payload plus the bookkeeping the pipeline needs (order, tokens)."""

    seq: int
    num_tokens: int
    payload: Any


def _num_tokens(batch: Any) -> int:
    n = getattr(batch, "num_tokens", None)
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"every batch needs an int attribute num_tokens; got {type(batch).__name__} with num_tokens={n!r}"
        )
    return n


def _check(ok: bool, arg: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{arg}={value!r} is invalid: {rule}")


class Pipeline:
    """Runs source -> target_fn -> drafter_fn, async (threads + bounded channels) or sync (one thread).

    Args:
        source: iterable of batches, each with an int ``num_tokens``.
        target_fn: ``batch -> item``; called from ``target_workers`` threads at once in async mode, so it
            must be thread-safe for that count (one worker per GPU on one node).
        drafter_fn: ``item -> bool``; ``False`` ends the run ("finished"). Called from one thread.
        mode: "async" | "sync".
        queue_size: max items in each channel.
        queue_bytes: optional byte cap of ``hs_queue`` (``item_nbytes`` of each item).
        target_workers: threads running ``target_fn``. Items reach the drafter in source order whatever the
            count (a worker that finishes early waits for its turn), so runs are reproducible.
        monitor_interval_s: seconds between ``on_tick`` calls.
        on_tick: ``sample -> None`` with the flat ``perf/*`` dict (keys in ``MONITOR_KEYS``); called from the
            monitor thread while stages run, and once more from ``run()``'s thread after they stopped.
            Exceptions count as a failure of the "monitor" stage.
        join_timeout_s: total time ``run()`` waits for threads to exit after stopping them; any left alive
            (stuck inside a stage function) are daemon threads, logged with a warning and abandoned.
        threads_per_stage: if set, each stage thread calls ``torch.set_num_threads(n)`` first (sync mode: the
            caller's thread). See the note below. ``None`` leaves torch's threading alone.
        stop_event: an event owned by the caller (``dflash.core.interrupts``' handler sets it on SIGTERM/SIGINT); once
            set, the run stops with ``stopped_by="interrupted"``. Polled by ``run()``'s thread, so no helper thread
            has to watch it; ``None``: only the stages end the run (a data-parallel run stops in its trainer).

    Note on ``threads_per_stage`` (measured with torch 2.13 CPU, OpenMP backend): ``torch.set_num_threads``
    sets the OpenMP team size of the *calling* thread and a process-wide default that threads pick up on their
    first parallel op, plus MKL's global count. So calling it in every stage thread with the same ``n`` gives
    each stage ``n`` intra-op threads (stages do not shrink each other), but it also changes the default for
    threads created later. ``run()`` restores the previous value in the caller's thread when it ends. It has
    no effect on CUDA kernels. Whether splitting cores beats oversubscription is for the bench to measure.
    """

    def __init__(
        self,
        source: Iterable[Any],
        target_fn: Callable[[Any], Any],
        drafter_fn: Callable[[Any], bool],
        *,
        mode: str = "async",
        queue_size: int = 4,
        queue_bytes: int | None = None,
        target_workers: int = 1,
        monitor_interval_s: float = 2.0,
        on_tick: Callable[[dict[str, float]], None] | None = None,
        join_timeout_s: float = 20.0,
        threads_per_stage: int | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        _check(mode in PIPELINE_MODES, "mode", mode, "must be one of async, sync")
        _check(queue_size >= 1, "queue_size", queue_size, "must be >= 1")
        _check(queue_bytes is None or queue_bytes >= 1, "queue_bytes", queue_bytes, "must be >= 1 (or None)")
        _check(target_workers >= 1, "target_workers", target_workers, "must be >= 1")
        _check(monitor_interval_s > 0, "monitor_interval_s", monitor_interval_s, "must be > 0")
        _check(join_timeout_s > 0, "join_timeout_s", join_timeout_s, "must be > 0")
        _check(
            threads_per_stage is None or threads_per_stage >= 1,
            "threads_per_stage",
            threads_per_stage,
            "must be >= 1 (or None)",
        )
        self._source = source
        self._target_fn = target_fn
        self._drafter_fn = drafter_fn
        self.mode = mode
        self.target_workers = target_workers if mode == "async" else 1
        self._monitor_interval_s = monitor_interval_s
        self._on_tick = on_tick
        self._join_timeout_s = join_timeout_s
        self._threads_per_stage = threads_per_stage

        self.target_queue = BoundedChannel(queue_size, name="target_queue")
        self.hs_queue = BoundedChannel(queue_size, queue_bytes, name="hs_queue")
        self._hs_in_order = InOrder(self.hs_queue)  # target workers hand on their results in source order
        self._stop = threading.Event()  # the one stop event every stage watches
        self._lock = threading.Lock()  # guards _error / _outcome / _workers_left
        self._stop_event = stop_event
        self._error: tuple[str, BaseException, str] | None = None
        self._outcome: tuple[str, str] | None = None
        self._workers_left = self.target_workers
        self._threads: list[threading.Thread] = []
        self.leftover_threads: list[str] = []
        self._started = False
        self._t0 = self._t_end = 0.0
        self._new_monitor()

    def _new_monitor(self) -> None:
        self._monitor = Monitor(self.target_queue, self.hs_queue, self.target_workers, self._on_tick)

    # -- control --------------------------------------------------------------------------------------------

    @property
    def stopping(self) -> threading.Event:
        """Set once the pipeline is stopping (for a source that blocks outside the pipeline's queues)."""
        return self._stop

    def _set_outcome(self, stopped_by: str, reason: str) -> None:
        with self._lock:
            if self._outcome is None:
                self._outcome = (stopped_by, reason)
        self._stop.set()

    def _record_error(self, stage: str, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        with self._lock:
            first = self._error is None
            if first:
                self._error = (stage, exc, tb)
        if first and disk_error(exc) is not None:  # a full disk: the run's one error line says it (status.json: tb)
            log.debug("%s stage failed on a full disk; stopping the pipeline\n%s", stage, tb)
        elif first:
            log.error("%s stage failed; stopping the pipeline\n%s", stage, tb)
        else:
            log.warning(
                "%s stage also failed after the pipeline began stopping: %s: %s", stage, type(exc).__name__, exc
            )
        self._stop.set()

    def _check_stop_event(self) -> None:
        """The caller's stop event, once set, stops the run as "interrupted"."""
        if self._stop_event is not None and self._stop_event.is_set() and not self._stop.is_set():
            log.warning("pipeline stop requested: stop event set")
            self._set_outcome("interrupted", "stop event set")

    def _set_threads(self) -> None:
        if self._threads_per_stage is not None:
            torch.set_num_threads(self._threads_per_stage)

    # -- run --------------------------------------------------------------------------------------------------

    def run(self) -> PipelineResult:
        """Run to the end. Returns how it stopped; raises ``StageError`` if a stage failed.

        No pipeline thread is alive when this returns or raises, except ones stuck inside a stage function
        past ``join_timeout_s`` (listed in ``leftover_threads`` and logged).
        """
        if self._started:
            raise RuntimeError("a Pipeline runs once; build a new one")
        self._started = True
        prev_threads = torch.get_num_threads()
        self._new_monitor()
        self._t0 = time.perf_counter()
        try:
            self._start_thread("monitor", lambda: self._monitor.run(self._stop, self._monitor_interval_s))
            if self.mode == "sync":
                self._set_threads()
                self._run_sync()
            else:
                self._start_async()
                self._wait()
        finally:
            self._stop.set()
            self.target_queue.wake()
            self.hs_queue.wake()
            self._join_all()
            self._close_source()
            self._t_end = time.perf_counter()
            self._final_tick()
            if self._threads_per_stage is not None:
                torch.set_num_threads(prev_threads)

        if self._error is not None:
            stage, exc, tb = self._error
            raise StageError(stage, exc, tb) from exc
        stopped_by, reason = self._outcome or ("interrupted", "stopped")
        totals, wall_s = self._monitor.drafter.totals(), self._t_end - self._t0
        items, tokens = int(totals["items"]), int(totals["tokens"])
        log.info("pipeline stopped: %s (%s) after %d items in %.1f s", stopped_by, reason, items, wall_s)
        return PipelineResult(stopped_by, reason, items, tokens, wall_s, self.stats())

    def _start_thread(
        self, stage: str, body: Callable[[], None], after: Callable[[], None] | None = None, worker: str = ""
    ) -> None:
        """Thread ``dflash-<stage><worker>`` runs ``body``, then ``after`` on every way out; an exception in it
        (SystemExit too: a thread must not vanish silently) fails ``stage``."""

        def main() -> None:
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - re-raised by run() as StageError
                self._record_error(stage, exc)
            finally:
                if after is not None:
                    after()

        # Daemon: a thread stuck inside a stage function must not keep the process alive after run() gives up.
        t = threading.Thread(target=main, name=f"dflash-{stage}{worker}", daemon=True)
        self._threads.append(t)
        t.start()

    def _start_async(self) -> None:
        self._start_thread("source", self._source_loop, after=self.target_queue.close)
        for i in range(self.target_workers):
            self._start_thread("target", self._target_loop, after=self._target_worker_done, worker=f"-{i}")
        # the drafter is the last stage: once it is gone, everything stops
        self._start_thread("drafter", self._drafter_loop, after=self._stop.set)

    def _wait(self) -> None:
        # Short timed slices: the main thread stays responsive to Python signal handlers.
        while not self._stop.wait(POLL_S):
            self._check_stop_event()

    def _join_all(self) -> None:
        deadline = time.monotonic() + self._join_timeout_s
        for t in self._threads:
            while t.is_alive() and time.monotonic() < deadline:
                t.join(POLL_S)
        self.leftover_threads = [t.name for t in self._threads if t.is_alive()]
        if self.leftover_threads:
            log.warning(
                "threads %s did not exit within %.1f s (stuck inside a stage function); they are daemon "
                "threads and are abandoned",
                self.leftover_threads,
                self._join_timeout_s,
            )

    def _close_source(self) -> None:
        """Close a generator source here, in run()'s thread, once no stage runs it. Otherwise its frame (and the
        tensors it holds) is freed by whichever thread drops the last reference to the pipeline, possibly a
        daemon thread racing interpreter shutdown, where torch aborts ("terminate called without an active
        exception")."""
        close = getattr(self._source, "close", None)
        if callable(close) and not self.leftover_threads:
            close()

    # -- stage steps: one item through one stage, with its accounting (both modes run these) --------------

    def _source_step(self, it: Iterator[Any], seq: int) -> _Envelope | None:
        """The source's next batch, or ``None`` once it is exhausted."""
        with self._monitor.source.busy():
            try:
                batch = next(it)
            except StopIteration:
                return None
        env = _Envelope(seq, _num_tokens(batch), batch)
        self._monitor.source.count(1, env.num_tokens)
        return env

    def _target_step(self, env: _Envelope) -> _Envelope:
        with self._monitor.target.busy():
            out = self._target_fn(env.payload)
        self._monitor.target.count(1, env.num_tokens)
        return _Envelope(env.seq, env.num_tokens, out)

    def _drafter_step(self, env: _Envelope) -> bool:
        """One drafter step; ``False`` once drafter_fn said training is finished."""
        with self._monitor.drafter.busy():
            keep = self._drafter_fn(env.payload)
        self._monitor.drafter.count(1, env.num_tokens)
        if not isinstance(keep, bool):
            raise TypeError(f"drafter_fn must return a bool (False = training finished), got {type(keep).__name__}")
        if not keep:
            self._set_outcome("finished", "drafter_fn returned False")
        return keep

    # -- sync mode: the three steps one after the other in run()'s thread ----------------------------------

    def _run_sync(self) -> None:
        it = iter(self._source)
        stage = "source"
        try:
            for seq in itertools.count():
                self._check_stop_event()
                if self._stop.is_set():
                    return
                stage = "source"
                env = self._source_step(it, seq)
                if env is None:
                    self._set_outcome("exhausted", "source exhausted")
                    return
                stage = "target"
                env = self._target_step(env)
                stage = "drafter"
                if not self._drafter_step(env):
                    return
        except Exception as exc:  # noqa: BLE001 - re-raised by run() as StageError
            self._record_error(stage, exc)

    # -- async mode: each step in a loop of its own thread, joined by the channels ------------------------

    def _source_loop(self) -> None:
        self._set_threads()
        it = iter(self._source)
        for seq in itertools.count():
            if self._stop.is_set():
                return
            env = self._source_step(it, seq)
            if env is None:
                return
            with self._monitor.source.waiting():
                if not self.target_queue.put(env, self._stop):
                    return

    def _target_loop(self) -> None:
        self._set_threads()
        while True:
            with self._monitor.target.waiting():
                env = self.target_queue.get(self._stop)
            if env is END:
                return
            env = self._target_step(env)
            with self._monitor.target.waiting():
                if not self._hs_in_order.put(env.seq, env, self._stop):
                    return

    def _target_worker_done(self) -> None:
        with self._lock:
            self._workers_left -= 1
            last = self._workers_left == 0
        if last:
            self.hs_queue.close()

    def _drafter_loop(self) -> None:
        self._set_threads()
        while True:
            with self._monitor.drafter.waiting():
                env = self.hs_queue.get(self._stop)
            if env is END:
                if not self._stop.is_set():
                    self._set_outcome("exhausted", "source exhausted")
                return
            if not self._drafter_step(env):
                return

    # -- monitor ------------------------------------------------------------------------------------------

    def _final_tick(self) -> None:
        """Last sample after all stages stopped, so even a run shorter than one interval logs a line."""
        if any(t.name == "dflash-monitor" for t in self._threads if t.is_alive()):
            return  # monitor stuck inside on_tick; do not call it concurrently
        try:
            self._monitor.tick()
        except Exception as exc:  # noqa: BLE001
            self._record_error("monitor", exc)

    def stats(self) -> dict[str, Any]:
        """Cumulative per-stage busy/wait totals and stand-alone throughput, plus queue peaks (for the bench)."""
        end = self._t_end or time.perf_counter()
        return {"mode": self.mode, "wall_s": end - self._t0 if self._t0 else 0.0, **self._monitor.totals()}
