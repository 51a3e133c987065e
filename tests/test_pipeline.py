"""Tests for dflash/train/pipeline.py, channel.py and monitor.py with fake stages (time.sleep and small tensors);
no model is involved."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from dflash.core import interrupts
from dflash.train import channel, monitor, pipeline
from dflash.train.channel import END, BoundedChannel, ChannelClosed, InOrder, item_nbytes
from dflash.train.monitor import MONITOR_KEYS, StageStats
from dflash.train.pipeline import Pipeline, StageError


@dataclass
class Batch:
    idx: int
    num_tokens: int


@dataclass
class Item:
    idx: int
    hidden: torch.Tensor


def batches(n: int | None = None, tokens: int = 10):
    """n batches (None = infinite) with num_tokens = tokens + idx, so totals are checkable."""
    counter = itertools.count() if n is None else range(n)
    return (Batch(i, tokens + i) for i in counter)


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dflash-")]


@pytest.fixture(autouse=True)
def no_leftover_threads():
    yield
    assert pipeline_threads() == []


# ---------------------------------------------------------------------------------------------------------
# item_nbytes / BoundedChannel


def test_item_nbytes_sums_tensor_fields():
    item = Item(3, torch.zeros(3, 4, dtype=torch.float32))  # 12 * 4 = 48
    assert item_nbytes(item) == 48
    nested = {"a": item, "b": [torch.zeros(5, dtype=torch.int64), "text", 7]}  # 48 + 5 * 8
    assert item_nbytes(nested) == 88
    assert item_nbytes(Batch(0, 5)) == 0


def test_channel_fifo_close_drains_then_end():
    ch = BoundedChannel(4)
    for i in range(3):
        assert ch.put(i)
    ch.close()
    assert [ch.get(), ch.get(), ch.get()] == [0, 1, 2]
    assert ch.get() is END
    with pytest.raises(ChannelClosed):
        ch.put(9)


def _start(fn, *args):
    out = {}

    def body():
        out["value"] = fn(*args)
        out["t"] = time.perf_counter()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def test_channel_put_blocks_when_full_until_get():
    ch = BoundedChannel(2)
    ch.put("a"), ch.put("b")
    t, out = _start(ch.put, "c")
    t.join(0.3)
    assert t.is_alive() and ch.depth() == 2  # backpressure: producer blocked
    assert ch.get() == "a"
    t.join(2)
    assert out["value"] is True and ch.depth() == 2


def test_channel_stop_event_wakes_blocked_put_and_get():
    stop = threading.Event()
    full = BoundedChannel(1)
    full.put("x")
    empty = BoundedChannel(1)
    tp, out_p = _start(full.put, "y", stop)
    tg, out_g = _start(empty.get, stop)
    time.sleep(0.2)
    assert tp.is_alive() and tg.is_alive()
    t_set = time.perf_counter()
    stop.set()  # no wake(): the 0.1 s poll alone must notice
    tp.join(2), tg.join(2)
    assert out_p["value"] is False and out_g["value"] is END
    assert out_p["t"] - t_set < 1.0 and out_g["t"] - t_set < 1.0  # 10x the poll: room for a busy CI box
    assert full.depth() == 1  # the refused item was not queued


def test_channel_byte_bound_and_oversized_item():
    ch = BoundedChannel(10, max_bytes=100)
    small = torch.zeros(12)  # 48 bytes
    assert ch.put(small) and ch.put(small)
    assert ch.nbytes() == 96
    t, out = _start(ch.put, small)  # 144 > 100: must block although only 2 of 10 items
    t.join(0.3)
    assert t.is_alive()
    ch.get()
    t.join(2)
    assert out["value"] is True and ch.nbytes() == 96 and ch.peak_bytes <= 100

    big = BoundedChannel(10, max_bytes=100)
    huge = torch.zeros(1000)  # 4000 bytes, alone in an empty channel: must pass (no deadlock)
    t, out = _start(big.put, huge)
    t.join(2)
    assert out["value"] is True and big.nbytes() == 4000


def test_in_order_puts_in_sequence_whatever_finishes_first():
    ch, stop = BoundedChannel(4), threading.Event()
    ordered = InOrder(ch)
    t2, out2 = _start(ordered.put, 2, "c")
    t1, out1 = _start(ordered.put, 1, "b")
    time.sleep(0.2)
    assert ch.depth() == 0  # 1 and 2 wait for 0
    assert ordered.put(0, "a")
    t1.join(2), t2.join(2)
    assert [ch.get(), ch.get(), ch.get()] == ["a", "b", "c"] and out1["value"] and out2["value"]
    t4, out4 = _start(ordered.put, 4, "e", stop)  # 3 never comes: the stop event releases it, item dropped
    time.sleep(0.2)
    stop.set()
    t4.join(2)
    assert out4["value"] is False and ch.depth() == 0


def test_pipeline_keeps_the_old_import_path_of_the_channel_and_monitor():
    for name in ("END", "BoundedChannel", "ChannelClosed", "item_nbytes"):
        assert getattr(pipeline, name) is getattr(channel, name)
    for name in ("MONITOR_KEYS", "StageStats", "StageWindow"):
        assert getattr(pipeline, name) is getattr(monitor, name)


def test_channel_rejects_bad_bounds():
    with pytest.raises(ValueError, match="max_items=0"):
        BoundedChannel(0)
    with pytest.raises(ValueError, match="max_bytes=0"):
        BoundedChannel(1, max_bytes=0)


# ---------------------------------------------------------------------------------------------------------
# StageStats


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_stage_stats_fractions_and_open_spans():
    clock = FakeClock()
    st = StageStats("target", workers=2, clock=clock)
    with st.busy():
        clock.t += 2.0
    with st.waiting():
        clock.t += 1.0
    st.count(items=3, tokens=30)
    clock.t += 1.0
    snap = st.take_window()
    assert snap.interval_s == 4.0 and snap.busy_s == 2.0 and snap.wait_s == 1.0
    assert snap.busy_frac == 2.0 / (4.0 * 2) and snap.wait_frac == 1.0 / (4.0 * 2)
    assert (snap.items, snap.tokens) == (3, 30)

    # a span still open at the window end is credited up to it, the rest goes to the next interval
    with st.busy():
        clock.t += 1.0
        first = st.take_window()
        clock.t += 3.0
    second = st.take_window()
    assert (first.busy_s, second.busy_s) == (1.0, 3.0) and first.items == 0
    tot = st.totals()
    assert tot["busy_s"] == 6.0 and tot["items"] == 3
    assert tot["items_per_s_standalone"] == 3 * 2 / 6.0  # two workers: stage rate = workers * items / busy


# ---------------------------------------------------------------------------------------------------------
# Pipeline


def sleepy_target(delay: float):
    def target_fn(batch: Batch) -> Item:
        time.sleep(delay)
        return Item(batch.idx, torch.full((4,), float(batch.idx)))

    return target_fn


def collecting_drafter(seen: list, delay: float = 0.0, stop_after: int | None = None):
    def drafter_fn(item: Item) -> bool:
        time.sleep(delay)
        seen.append(item.idx)
        return stop_after is None or len(seen) < stop_after

    return drafter_fn


def make(source, target_fn, drafter_fn, **kw) -> Pipeline:
    kw.setdefault("mode", "async")
    kw.setdefault("queue_size", 4)
    kw.setdefault("monitor_interval_s", 0.05)
    kw.setdefault("join_timeout_s", 5.0)
    return Pipeline(source, target_fn, drafter_fn, **kw)


def test_async_overlaps_stages():
    walls = {}
    for mode in ("sync", "async"):
        seen: list[int] = []
        p = make(batches(20), sleepy_target(0.05), collecting_drafter(seen, 0.05), mode=mode)
        t0 = time.perf_counter()
        res = p.run()
        walls[mode] = time.perf_counter() - t0
        assert res.stopped_by == "exhausted" and seen == list(range(20))
    # sync ~ 20 * 0.1 = 2.0 s, async ~ 21 * 0.05 = 1.05 s
    assert walls["async"] < 0.75 * walls["sync"], walls


@pytest.mark.parametrize("workers", [1, 3])
def test_order_preserved(workers):
    seen: list[int] = []

    def jittery_target(batch: Batch) -> Item:
        time.sleep(0.002 * ((batch.idx * 7) % 5))  # later batches often finish before earlier ones
        return Item(batch.idx, torch.zeros(1))

    res = make(batches(30), jittery_target, collecting_drafter(seen), target_workers=workers).run()
    assert seen == list(range(30))
    assert res.items == 30 and res.tokens == sum(10 + i for i in range(30))


def test_backpressure_bounds_queue_depth():
    ticks: list[dict] = []
    p = make(batches(25), sleepy_target(0.0), collecting_drafter([], 0.02), queue_size=2, on_tick=ticks.append)
    p.run()
    st = p.stats()
    assert st["target_queue_peak_depth"] <= 2 and st["hs_queue_peak_depth"] <= 2
    assert st["hs_queue_peak_depth"] == 2  # the fast target did fill it
    assert all(t["perf/target_queue_depth"] <= 2 and t["perf/hs_queue_depth"] <= 2 for t in ticks)


def test_byte_bound_respected():
    def target_fn(batch: Batch) -> Item:
        return Item(batch.idx, torch.zeros(1000))  # 4000 bytes

    p = make(batches(15), target_fn, collecting_drafter([], 0.02), queue_size=10, queue_bytes=10_000)
    p.run()
    st = p.stats()
    assert st["hs_queue_peak_mb"] * 2**20 <= 10_000
    assert st["hs_queue_peak_depth"] == 2  # floor(10000 / 4000), well under queue_size


FAILURES = ["source", "target", "drafter", "monitor"]


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("stage", FAILURES)
def test_stage_exception_stops_everything(stage, mode):
    def source():
        for i in itertools.count():
            if stage == "source" and i == 5:
                raise ValueError("boom in source")
            yield Batch(i, 1)

    def target_fn(batch):
        time.sleep(0.01)
        if stage == "target" and batch.idx == 5:
            raise ValueError("boom in target")
        return Item(batch.idx, torch.zeros(2))

    def drafter_fn(item):
        time.sleep(0.01)
        if stage == "drafter" and item.idx == 5:
            raise ValueError("boom in drafter")
        return True

    def on_tick(sample):
        if stage == "monitor":
            raise ValueError("boom in monitor")

    t0 = time.perf_counter()
    with pytest.raises(StageError) as info:
        make(source(), target_fn, drafter_fn, mode=mode, on_tick=on_tick).run()
    assert time.perf_counter() - t0 < 4.0
    err = info.value
    assert err.stage == stage
    assert str(err) == f"{stage} stage failed: ValueError: boom in {stage}"
    assert isinstance(err.__cause__, ValueError) and f"boom in {stage}" in err.traceback_text
    assert "Traceback" in err.traceback_text
    assert pipeline_threads() == []


def test_stage_failure_is_logged(caplog):
    def target_fn(batch):
        raise KeyError("missing")

    with (
        caplog.at_level(logging.ERROR, logger="dflash.train.pipeline"),
        pytest.raises(StageError, match="^target stage"),
    ):
        make(batches(None), target_fn, collecting_drafter([])).run()
    assert any("target stage failed" in r.getMessage() and "KeyError" in r.getMessage() for r in caplog.records)


def test_drafter_must_return_bool():
    with pytest.raises(StageError, match="drafter stage failed: TypeError: drafter_fn must return a bool"):
        make(batches(3), sleepy_target(0.0), lambda item: None).run()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_drafter_false_finishes_infinite_source(mode):
    seen: list[int] = []
    res = make(batches(None), sleepy_target(0.001), collecting_drafter(seen, stop_after=7), mode=mode).run()
    assert res.stopped_by == "finished" and seen == list(range(7))
    assert res.items == 7 and res.tokens == sum(10 + i for i in range(7))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_caller_stop_event_stops_the_run(mode):
    """The one way to stop a run from outside: run.py hands the event its SIGTERM/SIGINT handler sets; no
    watcher thread is needed to forward it."""
    stop = threading.Event()
    seen: list[int] = []
    p = make(batches(None), sleepy_target(0.01), collecting_drafter(seen, 0.01), mode=mode, stop_event=stop)
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    t0 = time.perf_counter()
    res = p.run()
    elapsed = time.perf_counter() - t0
    timer.join()
    assert res.stopped_by == "interrupted" and res.reason == "stop event set"
    assert 0.25 < elapsed < 3.0 and len(seen) > 0


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_generator_source_is_closed_when_run_returns(mode):
    """The source's frame is released in run()'s thread, not by whichever thread frees the pipeline last
    (a daemon thread doing that during interpreter shutdown made torch abort the process at exit)."""
    closed = []

    def source():
        try:
            yield from batches(None)
        finally:
            closed.append(threading.current_thread().name)

    p = make(source(), sleepy_target(0.001), collecting_drafter([], stop_after=5), mode=mode)
    p.run()
    assert closed == [threading.current_thread().name]


def test_signal_handler_stops_the_run(monkeypatch):
    """The main thread waits in short slices, so the real SIGINT handler (dflash.core.interrupts) runs during run()
    and the event it sets stops the pipeline."""
    monkeypatch.setattr(interrupts, "received", None)  # restored after the test, as the handler sets it
    stop = threading.Event()
    p = make(batches(None), sleepy_target(0.01), collecting_drafter([], 0.01), stop_event=stop)
    previous = interrupts.install_signal_handlers(stop)
    try:
        timer = threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.perf_counter()
        res = p.run()
        timer.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert res.stopped_by == "interrupted" and res.reason == "stop event set"
    assert interrupts.received == signal.SIGINT and time.perf_counter() - t0 < 3.0


def test_stuck_stage_is_abandoned_after_join_timeout(caplog):
    release = threading.Event()

    def target_fn(batch):
        if batch.idx == 3:
            release.wait(30)  # stuck "inside the model"
        return Item(batch.idx, torch.zeros(1))

    p = make(batches(None), target_fn, collecting_drafter([], stop_after=3), join_timeout_s=0.5)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="dflash.train.pipeline"):
        res = p.run()
    try:
        assert res.stopped_by == "finished" and time.perf_counter() - t0 < 3.0
        assert p.leftover_threads == ["dflash-target-0"]
        assert any("daemon" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        for t in threading.enumerate():
            if t.name.startswith("dflash-"):
                t.join(5)


def test_monitor_ticks_keys_depth_and_token_rate():
    ticks: list[dict] = []
    p = make(batches(30), sleepy_target(0.0), collecting_drafter([], 0.02), queue_size=3, on_tick=ticks.append)
    res = p.run()
    assert len(ticks) >= 3
    for t in ticks:
        assert set(MONITOR_KEYS) <= set(t)
        assert all(isinstance(v, float) for v in t.values())
    assert max(t["perf/hs_queue_depth"] for t in ticks) > 0  # slow drafter: the queue holds items
    # ktok_s * interval integrates back to every token the drafter consumed
    tokens = sum(t["perf/ktok_s"] * 1000 * t["perf/interval_s"] for t in ticks)
    assert tokens == pytest.approx(res.tokens) and res.tokens == sum(10 + i for i in range(30))
    assert sum(t["perf/interval_s"] for t in ticks) == pytest.approx(res.wall_s, abs=0.1)
    assert all(0.0 <= t["perf/drafter_busy"] <= 1.0 + 1e-6 for t in ticks)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_short_run_gets_one_final_tick(mode):
    ticks: list[dict] = []
    make(
        batches(3), sleepy_target(0.0), collecting_drafter([]), mode=mode, monitor_interval_s=60, on_tick=ticks.append
    ).run()
    assert len(ticks) == 1
    assert ticks[0]["perf/ktok_s"] > 0
    if mode == "sync":
        assert ticks[0]["perf/hs_queue_depth"] == 0 and ticks[0]["perf/target_queue_depth"] == 0


def test_stats_busy_and_standalone_rate():
    p = make(batches(10), sleepy_target(0.02), collecting_drafter([], 0.0))
    p.run()
    st = p.stats()
    assert st["target"]["items"] == 10 and st["drafter"]["items"] == 10
    assert st["target"]["busy_s"] >= 10 * 0.02
    # target is the bottleneck: ~50 items/s stand-alone, the drafter far faster
    assert 25 < st["target"]["items_per_s_standalone"] <= 50
    assert st["drafter"]["items_per_s_standalone"] > st["target"]["items_per_s_standalone"]


def test_each_stage_counts_the_cpu_seconds_of_its_calls():
    """A drafter that computes is charged its CPU time; a target that sleeps is charged (almost) none, though both
    are busy for their calls' wall time."""

    def sleepy(batch):
        time.sleep(0.05)
        return Item(batch.idx, torch.zeros(1))

    def spinning(item):
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        return True

    ticks: list[dict] = []
    p = make(batches(6), sleepy, spinning, on_tick=ticks.append)
    p.run()
    st = p.stats()
    assert 6 * 0.05 <= st["drafter"]["cpu_s"] <= st["drafter"]["busy_s"]
    assert st["target"]["busy_s"] >= 6 * 0.05 and st["target"]["cpu_s"] < 0.05
    assert ticks[-1]["perf/drafter_cpu_s"] == st["drafter"]["cpu_s"]  # cumulative: the last tick is the run's


def test_threads_per_stage_sets_stage_threads_and_restores():
    before = torch.get_num_threads()
    seen: list[int] = []

    def target_fn(batch):
        seen.append(torch.get_num_threads())
        return Item(batch.idx, torch.zeros(1))

    make(batches(3), target_fn, collecting_drafter([]), threads_per_stage=1).run()
    assert seen == [1, 1, 1]
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mode": "pipelined"}, "mode='pipelined'"),
        ({"queue_size": 0}, "queue_size=0"),
        ({"queue_bytes": 0}, "queue_bytes=0"),
        ({"target_workers": 0}, "target_workers=0"),
        ({"monitor_interval_s": 0}, "monitor_interval_s=0"),
        ({"threads_per_stage": 0}, "threads_per_stage=0"),
    ],
)
def test_pipeline_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        make(batches(1), sleepy_target(0.0), collecting_drafter([]), **kw)


def test_batch_without_num_tokens_fails_in_source():
    with pytest.raises(StageError, match="source stage failed: TypeError: every batch needs an int attribute"):
        make(iter([object()]), sleepy_target(0.0), collecting_drafter([])).run()


def test_pipeline_runs_once():
    p = make(batches(2), sleepy_target(0.0), collecting_drafter([]))
    p.run()
    with pytest.raises(RuntimeError, match="runs once"):
        p.run()


@pytest.mark.parametrize("stage,workers", [("target", 1), ("target", 2), ("drafter", 1)])
def test_system_exit_in_a_stage_thread_is_a_stage_error(stage, workers):
    """Not only Exception: a SystemExit in a thread used to end the run as "exhausted" (or hang with two
    target workers) instead of failing it."""

    def target_fn(batch):
        if stage == "target" and batch.idx == 3:
            raise SystemExit("bye from target")
        return Item(batch.idx, torch.zeros(1))

    def drafter_fn(item):
        if stage == "drafter" and item.idx == 3:
            raise SystemExit("bye from drafter")
        return True

    t0 = time.perf_counter()
    with pytest.raises(StageError) as info:
        make(batches(None), target_fn, drafter_fn, target_workers=workers).run()
    assert info.value.stage == stage and time.perf_counter() - t0 < 10
