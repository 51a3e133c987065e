"""What a slow first step is doing, on the console. At Qwen3-8B's widths on a CPU one optimizer step can take
minutes, and until it ends the progress line can only say `step 0/N ... eta ?`. `watch_first_step(trainer)`
times the pieces of the trainer's first step (forward and loss, backward and clipping, the optimizer step,
checkpoint/eval after it) and, while that step runs longer than `every_s`, logs every `every_s` seconds which
piece it is in and for how long; at the end of a slow first step it logs the split. Later steps are not
watched: the wrappers remove themselves after the first."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

FORWARD, BACKWARD, OPTIMIZER, AFTER = "forward and loss", "backward and clipping", "optimizer step", "after the step"


class StepWatch:
    """The current piece of one step and the seconds each piece took; a timer thread reports a slow step."""

    def __init__(self, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.every_s, self._clock = every_s, clock
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._piece: str | None = None
        self._t0 = self._piece_t0 = clock()
        self.seconds: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._running = False

    def start(self, piece: str) -> None:
        self._t0 = self._clock()
        self._running = True
        self.enter(piece)
        self._thread = threading.Thread(target=self._report, name="step-watch", daemon=True)
        self._thread.start()

    def enter(self, piece: str) -> None:
        if not self._running:  # e.g. DCP's resume calls optimizer.step once to create the state: not the step
            return
        with self._lock:
            now = self._clock()
            if self._piece is not None:
                self.seconds[self._piece] = self.seconds.get(self._piece, 0.0) + now - self._piece_t0
            self._piece, self._piece_t0 = piece, now

    def finish(self) -> float:
        """End the step; returns its seconds (a slow step's split is logged)."""
        self.enter("")
        self._running = False
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        total = self._clock() - self._t0
        if total >= self.every_s:
            split = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items() if k)
            log.info("the first step took %.0f s: %s (later steps are usually faster)", total, split)
        return total

    def _report(self) -> None:
        while not self._done.wait(self.every_s):
            with self._lock:
                now, piece, since = self._clock(), self._piece, self._piece_t0
            log.info(
                "the first step is still running after %.0f s: %s for %.0f s (a large model on a CPU can take "
                "minutes per step)",
                now - self._t0,
                piece,
                now - since,
            )


def watch_first_step(trainer, every_s: float = 30.0) -> StepWatch:
    """Wrap `trainer`'s first `train_on` (and its `compute_loss`, `optimizer.step`, `after_step` inside it) so
    a StepWatch follows it; the wrappers are removed when that step ends."""
    watch = StepWatch(every_s)
    originals = {
        "train_on": trainer.train_on,
        "compute_loss": trainer.compute_loss,
        "after_step": trainer.after_step,
    }
    optimizer_step = trainer.optimizer.step
    watched: list[bool] = []

    def compute_loss(*args, **kwargs):
        out = originals["compute_loss"](*args, **kwargs)
        watch.enter(BACKWARD)  # train_on runs backward and clips right after the loss
        return out

    def step(*args, **kwargs):
        watch.enter(OPTIMIZER)
        return optimizer_step(*args, **kwargs)

    def after_step(t):
        watch.enter(AFTER)
        return originals["after_step"](t)

    def train_on(item):
        if watched:  # a caller that kept this wrapper (the pipeline holds the bound method) goes straight through
            return originals["train_on"](item)
        watched.append(True)
        watch.start(FORWARD)
        try:
            return originals["train_on"](item)
        finally:
            for name, fn in originals.items():  # unwrapped: later steps pay nothing
                setattr(trainer, name, fn)
            trainer.optimizer.step = optimizer_step
            watch.finish()

    trainer.train_on, trainer.compute_loss, trainer.optimizer.step = train_on, compute_loss, step
    if trainer.after_step is not None:
        trainer.after_step = after_step
    return watch
