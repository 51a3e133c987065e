"""Hidden-state items between processes: a target rank sends, a drafter rank receives, over torch.distributed
point-to-point (`isend`/`irecv`; gloo on CPU, NCCL on GPUs).

One link joins one sender and one receiver, over two process groups of those two ranks (`Link`): on `items` only
the target sends (item headers, tensors, the end header), on `credits` only the drafter sends (credits, the stop
credit). NCCL runs a communicator's point-to-point operations in the order they were posted and ignores tags;
with one direction per communicator, each side posts its operations on it in the order the other side posts the
matching ones, so no wait can be circular (a credit receive posted early never holds back an item send, which
runs on the other communicator). Both groups exchange one message at start-up, so their
communicators exist before either side posts a long-lived receive (dflash.core.distributed.open_links).

An item travels as a fixed-size int64 header (sequence number,
integer fields, then each tensor's dtype and shape) followed by its tensors in order. Flow control is by
credits, like `BoundedChannel`'s capacity: the sender has at most `bound` items in flight (sent, not yet taken
by the drafter); the receiver returns one credit per item taken, so a slow drafter back-pressures its target
rank and neither side's memory grows. A receiver thread prefetches into a local queue of `bound` items, so the
transfer overlaps the drafter's step. The receiver ends the link with a stop credit; the sender then sends an
end header. Every wait has a timeout; a peer that dies fails the wait with the peer named.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dflash.core.distributed import Link
from dflash.train.channel import END, BoundedChannel
from dflash.train.trainer import HiddenItem

HEADER_LEN = 64
_MAGIC, _END_MAGIC = 0x0DF1A5, 0x0DF1A6
STOP_CREDIT = -1
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.int8]


class TransportError(RuntimeError):
    """A link failed: the peer died, timed out or sent something unreadable."""


@dataclasses.dataclass
class LinkStats:
    """Counters of one link, read by the monitor (thread-safe enough: ints and floats assigned whole)."""

    items: int = 0
    bytes: int = 0
    in_flight: int = 0
    in_flight_bytes: int = 0
    wait_s: float = 0.0  # the sender waiting for credit (drafter slower) / the receiver waiting for items

    def window(self, last: tuple[int, int, float], interval_s: float) -> dict[str, float]:
        items, nbytes, wait = last
        return {
            "items_s": (self.items - items) / interval_s,
            "mb_s": (self.bytes - nbytes) / interval_s / 2**20,
            "wait": (self.wait_s - wait) / interval_s,
        }


def pack_header(seq: int, ints: list[int], tensors: list[torch.Tensor]) -> torch.Tensor:
    """[magic, seq, n_ints, *ints, n_tensors, (dtype code, ndim, *shape) per tensor], zero-padded."""
    fields = [_MAGIC, seq, len(ints), *ints, len(tensors)]
    for t in tensors:
        fields += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(f"an item's header needs {len(fields)} fields, more than {HEADER_LEN}")
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


def unpack_header(header: torch.Tensor) -> tuple[int, list[int], list[tuple[torch.dtype, tuple[int, ...]]]] | None:
    """(seq, ints, tensor specs), or None for the end header."""
    h = header.tolist()
    if h[0] == _END_MAGIC:
        return None
    if h[0] != _MAGIC:
        raise TransportError(f"unreadable item header (magic {h[0]:#x}): the two sides are out of step")
    seq, n_ints = h[1], h[2]
    ints = h[3 : 3 + n_ints]
    at = 3 + n_ints
    specs = []
    for _ in range(h[at]):
        code, ndim = h[at + 1], h[at + 2]
        specs.append((_DTYPES[code], tuple(h[at + 3 : at + 3 + ndim])))
        at += 2 + ndim
    return seq, ints, specs


def _wait(work, timeout_s: float, what: str) -> None:
    """Wait for a p2p op (`work`, or a function that starts it: starting can fail too when the peer is gone)."""
    try:
        if callable(work):
            work = work()
        ok = work.wait(timeout=dt.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - gloo raises on a closed connection: the peer is gone
        raise TransportError(f"{what}: {e}") from e
    if ok is False:
        raise TransportError(f"{what}: no answer in {timeout_s:.0f} s")


class Sender:
    """The target rank's end of a link to drafter rank `peer`. `send` blocks while `bound` items are in flight;
    it returns False once the receiver has asked to stop."""

    def __init__(
        self, peer: int, bound: int, timeout_s: float, link: Link | None = None, device: torch.device | str = "cpu"
    ):
        self.peer, self.bound, self.timeout_s, self.link = peer, bound, timeout_s, link or Link()
        self.device = torch.device(device)  # where the tensors travel from: cpu for gloo, the rank's GPU for nccl
        self.stats = LinkStats()
        self.seq = 0
        self.stopped = False
        self._sizes: list[int] = []  # bytes of the items in flight, oldest first
        self._credit = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._credit_work = self._post_credit_recv()

    def _post_credit_recv(self):
        try:
            return dist.irecv(self._credit, self.peer, group=self.link.credits)
        except Exception as e:  # noqa: BLE001
            raise TransportError(f"target <- drafter rank {self.peer}: {e}") from e

    def _take_credits(self, block: bool) -> None:
        while self._credit_work is not None:
            if not block and not self._credit_work.is_completed():
                return
            t0 = time.perf_counter()
            _wait(self._credit_work, self.timeout_s, f"target -> drafter rank {self.peer}: waiting for credit")
            self.stats.wait_s += time.perf_counter() - t0
            value = int(self._credit.item())
            if value == STOP_CREDIT:
                self.stopped, self._credit_work = True, None
                return
            for _ in range(value):
                self.stats.in_flight_bytes -= self._sizes.pop(0)
            self.stats.in_flight = len(self._sizes)
            self._credit_work = self._post_credit_recv()
            block = False  # one credit was what a blocked sender needed; take any others that are there

    def send(self, ints: list[int], tensors: list[torch.Tensor]) -> bool:
        self._take_credits(block=False)
        while not self.stopped and len(self._sizes) >= self.bound:
            self._take_credits(block=True)
        if self.stopped:
            return False
        tensors = [t.to(self.device).contiguous() for t in tensors]
        nbytes = HEADER_LEN * 8 + sum(t.numel() * t.element_size() for t in tensors)
        what = f"target -> drafter rank {self.peer}: sending item {self.seq}"
        try:
            header = pack_header(self.seq, ints, tensors).to(self.device)
            works = [dist.isend(header, self.peer, group=self.link.items)]
            works += [dist.isend(t, self.peer, group=self.link.items) for t in tensors]
        except Exception as e:  # noqa: BLE001
            raise TransportError(f"{what}: {e}") from e
        for w in works:
            _wait(w, self.timeout_s, what)
        self.seq += 1
        self._sizes.append(nbytes)
        self.stats.items, self.stats.bytes = self.stats.items + 1, self.stats.bytes + nbytes
        self.stats.in_flight, self.stats.in_flight_bytes = len(self._sizes), self.stats.in_flight_bytes + nbytes
        return True

    def wait_for_stop(self) -> None:
        """After the last item: wait for the receiver's stop, then end the link."""
        while not self.stopped:
            self._take_credits(block=True)
        end = torch.zeros(HEADER_LEN, dtype=torch.int64)
        end[0] = _END_MAGIC
        end = end.to(self.device)
        _wait(lambda: dist.isend(end, self.peer, group=self.link.items), self.timeout_s, "ending the link")


class Receiver:
    """The drafter rank's end of a link from target rank `peer`: a thread receives items into a local queue of
    `bound`; `get` takes the next one (and returns its credit), None once the link ended."""

    def __init__(
        self,
        peer: int,
        bound: int,
        timeout_s: float,
        build: Callable[[int, list, list], Any],
        link: Link | None = None,
        device: torch.device | str = "cpu",
    ):
        self.peer, self.bound, self.timeout_s, self.link, self.build = peer, bound, timeout_s, link or Link(), build
        self.device = torch.device(device)
        # set when the consumer stops taking items: a get blocked on an empty queue returns None
        self.abandon: threading.Event | None = None
        self.stats = LinkStats()
        self.queue = BoundedChannel(bound + 1, name=f"from target rank {peer}")
        self.error: BaseException | None = None
        self.expected_seq = 0
        self._thread = threading.Thread(target=self._receive, name=f"recv-from-{peer}", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            while True:
                header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
                t0 = time.perf_counter()
                _wait(
                    lambda h=header: dist.irecv(h, self.peer, group=self.link.items),
                    self.timeout_s,
                    f"drafter <- target rank {self.peer}: waiting for an item",
                )
                self.stats.wait_s += time.perf_counter() - t0
                parsed = unpack_header(header)
                if parsed is None:
                    break
                seq, ints, specs = parsed
                if seq != self.expected_seq:
                    raise TransportError(f"item {seq} from target rank {self.peer}, expected {self.expected_seq}")
                tensors = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in specs]
                for t in tensors:
                    what = f"drafter <- target rank {self.peer}: receiving item {seq}"
                    _wait(lambda t=t: dist.irecv(t, self.peer, group=self.link.items), self.timeout_s, what)
                self.expected_seq += 1
                nbytes = HEADER_LEN * 8 + sum(t.numel() * t.element_size() for t in tensors)
                self.stats.items, self.stats.bytes = self.stats.items + 1, self.stats.bytes + nbytes
                self.queue.put(self.build(seq, ints, tensors))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self.error = e
        finally:
            self.queue.close()

    def get(self) -> Any:
        """The next item; None once the link ended (or `abandon` is set)."""
        item = self.queue.get(self.abandon)
        if item is END:
            if self.error is not None:
                raise self.error
            return None
        credit = torch.ones(1, dtype=torch.int64, device=self.device)
        what = f"drafter -> target rank {self.peer}: returning credit"
        _wait(lambda: dist.isend(credit, self.peer, group=self.link.credits), self.timeout_s, what)
        return item

    def close(self) -> None:
        """Ask the sender to stop and wait for the link's end (items still arriving are dropped)."""
        if self.error is None:
            stop = torch.full((1,), STOP_CREDIT, dtype=torch.int64, device=self.device)
            what = f"drafter -> target rank {self.peer}: stopping"
            _wait(lambda: dist.isend(stop, self.peer, group=self.link.credits), self.timeout_s, what)
        while self.queue.get() is not END:
            pass
        self._thread.join(self.timeout_s)


# --- HiddenItem on the wire -----------------------------------------------------------------------------------


def item_to_wire(item) -> tuple[list[int], list[torch.Tensor]]:
    """A HiddenItem's integer fields and tensors (the whole batch's mask last, when there is one)."""
    ints = [item.data_pass, item.index, item.num_tokens, item.row_start]
    ints.append(-1 if item.global_tokens is None else item.global_tokens)
    tensors = [item.input_ids, item.loss_mask, item.target_hidden, item.last_hidden]
    if item.global_loss_mask is not None:
        tensors.append(item.global_loss_mask)
    return ints, tensors


def item_from_wire(seq: int, ints: list[int], tensors: list[torch.Tensor], device: torch.device | str = "cpu"):
    data_pass, index, num_tokens, row_start, global_tokens = ints
    moved = [t.to(device, non_blocking=True) for t in tensors]
    return HiddenItem(
        input_ids=moved[0],
        loss_mask=moved[1],
        target_hidden=moved[2],
        last_hidden=moved[3],
        num_tokens=num_tokens,
        data_pass=data_pass,
        index=index,
        global_loss_mask=moved[4] if len(moved) > 4 else None,
        row_start=row_start,
        global_tokens=None if global_tokens < 0 else global_tokens,
    )
