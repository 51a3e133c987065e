"""Bounded channels between pipeline stages: a thread-safe FIFO capped by items and bytes, with backpressure.

``BoundedChannel`` (put/get/close/depth) is the seam where, on many nodes, a stage's input or output becomes a
cross-process transport (``dflash/train/transport.py`` uses it as its receiver's local queue); no stage touches
another stage's objects. ``get`` returns ``END`` once the channel is closed and drained, or when the stop event
is set. ``InOrder`` puts into a channel in sequence order, for several workers that feed one consumer.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["END", "POLL_S", "BoundedChannel", "ChannelClosed", "InOrder", "item_nbytes"]

# How often blocked waits re-check the stop event; bounds the shutdown latency of a blocked stage.
POLL_S = 0.1


class _EndOfStream:
    """Type of the ``END`` sentinel returned by ``BoundedChannel.get``."""

    def __repr__(self) -> str:
        return "END"


END = _EndOfStream()


class ChannelClosed(RuntimeError):
    """``put`` on a channel whose producer side was already closed (a programming error)."""


def item_nbytes(item: Any) -> int:
    """Bytes held by the tensors of ``item``: ``numel() * element_size()`` summed over tensor fields.

    Looks into dataclass fields, mappings, lists and tuples (recursively); other values count 0.
    Views that share storage are counted once per view (an upper bound, which is what a cap wants).
    """
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return sum(item_nbytes(getattr(item, f.name)) for f in dataclasses.fields(item))
    if isinstance(item, Mapping):
        return sum(item_nbytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(item_nbytes(v) for v in item)
    return 0


class BoundedChannel:
    """Thread-safe FIFO bounded by ``max_items`` and optionally ``max_bytes`` (see ``item_nbytes``).

    - ``put(item, stop_event)`` blocks while the channel is full (backpressure). Returns ``True`` once queued,
      ``False`` if the stop event is (or becomes) set; the producer should then exit. An item larger than
      ``max_bytes`` is accepted when the channel is empty, so one oversized item cannot deadlock the pipeline.
    - ``get(stop_event)`` blocks while empty. Returns the next item, or ``END`` when the channel is closed and
      drained, or when the stop event is set (a consumer exits on ``END`` either way).
    - ``close()``: the producer is done; consumers drain what is left, then get ``END``.
    - ``depth()`` / ``nbytes()``: current items and bytes; ``peak_depth`` / ``peak_bytes``: their maxima.

    Blocked calls re-check the stop event every ``poll_s`` seconds; ``wake()`` makes them re-check at once.
    """

    def __init__(
        self,
        max_items: int,
        max_bytes: int | None = None,
        *,
        name: str = "channel",
        sizeof: Callable[[Any], int] = item_nbytes,
        poll_s: float = POLL_S,
    ) -> None:
        if max_items < 1:
            raise ValueError(f"{name}: max_items={max_items!r} must be >= 1")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"{name}: max_bytes={max_bytes!r} must be >= 1 (or None for no byte cap)")
        self.name = name
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._sizeof = sizeof
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._items: deque[tuple[Any, int]] = deque()
        self._bytes = 0
        self._closed = False
        self.peak_depth = 0
        self.peak_bytes = 0

    def _has_room(self, nbytes: int) -> bool:
        if not self._items:
            return True  # an empty channel takes anything, even an item over max_bytes
        if len(self._items) >= self.max_items:
            return False
        return self.max_bytes is None or self._bytes + nbytes <= self.max_bytes

    def put(self, item: Any, stop_event: threading.Event | None = None) -> bool:
        """Queue ``item``; block while full. ``False`` (item dropped) if the stop event is set."""
        nbytes = self._sizeof(item)
        with self._cond:
            while True:
                if self._closed:
                    raise ChannelClosed(f"put on closed channel {self.name!r}")
                if stop_event is not None and stop_event.is_set():
                    return False
                if self._has_room(nbytes):
                    break
                self._cond.wait(self._poll_s)
            self._items.append((item, nbytes))
            self._bytes += nbytes
            self.peak_depth = max(self.peak_depth, len(self._items))
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            self._cond.notify_all()
        return True

    def get(self, stop_event: threading.Event | None = None) -> Any:
        """Next item (FIFO); ``END`` once closed and drained or when the stop event is set."""
        with self._cond:
            while True:
                if stop_event is not None and stop_event.is_set():
                    return END
                if self._items:
                    break
                if self._closed:
                    return END
                self._cond.wait(self._poll_s)
            item, nbytes = self._items.popleft()
            self._bytes -= nbytes
            self._cond.notify_all()
        return item

    def close(self) -> None:
        """Producer side is done. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Make blocked ``put``/``get`` calls re-check their stop event now instead of at the next poll."""
        with self._cond:
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> int:
        with self._cond:
            return len(self._items)

    def nbytes(self) -> int:
        with self._cond:
            return self._bytes


class InOrder:
    """Puts into ``channel`` in sequence order (0, 1, 2, ...) whatever order its producers finish in: the put of
    ``seq`` waits until every earlier one is in, so several workers keep their source's order."""

    def __init__(self, channel: BoundedChannel, poll_s: float = POLL_S) -> None:
        self.channel = channel
        self._poll_s = poll_s
        self._turn = threading.Condition()
        self._next_seq = 0

    def put(self, seq: int, item: Any, stop_event: threading.Event | None = None) -> bool:
        """Queue ``item`` once its turn comes (blocking while the channel is full); ``False`` (item dropped) if
        the stop event is set first."""
        with self._turn:
            while self._next_seq != seq:
                if stop_event is not None and stop_event.is_set():
                    return False
                self._turn.wait(self._poll_s)
        ok = self.channel.put(item, stop_event)
        with self._turn:
            self._next_seq += 1
            self._turn.notify_all()
        return ok
