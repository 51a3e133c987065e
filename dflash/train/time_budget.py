"""train.max_minutes: a wall-clock budget for training, and what ended a run's training (summary.json's
`stop_reason`).

The clock runs from a process's first step, on top of the seconds a resumed checkpoint had trained (`trained_s` in
its counters), so a resume spends only what is left. Every rank reports whether its clock is past the budget, and
its elapsed seconds, in the step's all-reduce: all stop after the same step (the run ends `completed`), and the
schedules follow the ranks' mean clock as of the last step (`agreed_s`), so every rank sets the same learning rate and
noise (ranks' clocks differ by their start) and a resume reads the seconds every rank saved alike. A time-bound run
warms up and decays within its budget, whatever its train.max_steps.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class TimeBudget:
    def __init__(self, minutes: float | None):
        self.seconds = float(minutes) * 60 if minutes else None
        self.trained_s = 0.0  # a resumed checkpoint's seconds of training
        self._start: float | None = None
        self.agreed_s = 0.0  # the ranks' mean elapsed seconds at the last step: what schedules and checkpoints read
        self.spent = False  # every rank agreed the budget is spent (set after a step)

    def start(self) -> None:
        if self._start is None:
            self._start = time.monotonic()

    def elapsed_s(self) -> float:
        return self.trained_s + (time.monotonic() - self._start if self._start is not None else 0.0)

    def time_up(self) -> bool:
        """This process's clock is past the budget (what it reports in the step's all-reduce)."""
        return self.seconds is not None and self.elapsed_s() >= self.seconds

    def agree(self, any_rank_time_up: bool, step: int, mean_elapsed_s: float) -> None:
        self.agreed_s = mean_elapsed_s
        if any_rank_time_up and not self.spent:
            self.spent = True
            log.info("train.max_minutes=%g reached after step %d", self.seconds / 60, step)

    def schedule_step(self, step: int, total_steps: int) -> int:
        """The step the schedules read: `step`, or as far into total_steps as the clock is into the budget, when
        that is further; clamped to the last step (a resumed run that overshoots keeps the final values)."""
        if self.seconds is not None:
            step = max(step, int(self.agreed_s / self.seconds * total_steps))
        return min(step, total_steps - 1)

    def load(self, trained_s: float) -> None:
        """A resumed checkpoint's seconds; a budget spent before it stays spent."""
        self.trained_s, self._start, self.agreed_s = float(trained_s), None, float(trained_s)
        self.spent = self.time_up()


def stop_reason(trainer) -> str | None:
    """What ends the trainer's training: max_steps, max_tokens or max_minutes (None: not yet)."""
    if trainer.step >= trainer.total_steps:
        return "max_steps"
    if trainer.max_tokens is not None and trainer.tokens >= trainer.max_tokens:
        return "max_tokens"
    return "max_minutes" if trainer.budget.spent else None
