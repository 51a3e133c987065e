"""Progress on stderr: a rich bar on a terminal, plain log lines otherwise (CI and SLURM logs)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from dflash.core.jsonio import to_python
from dflash.core.terminal import Display
from dflash.core.terminal import display as default_display
from dflash.tracking.base import Callback, RunInfo

log = logging.getLogger(__name__)


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _stats_text(m: Mapping[str, Any], evaluating: bool = False) -> str:
    """The short status shown after the bar: loss, avg streak, throughput (or that an eval runs), queues."""
    parts = []
    if (v := m.get("train/loss")) is not None:
        parts.append(f"loss {float(v):.4f}")
    if (v := m.get("train/avg_streak")) is not None:
        parts.append(f"streak {float(v):.2f}")
    if evaluating:
        parts.append("evaluating")
    elif (v := m.get("perf/ktok_s")) is not None:
        parts.append(f"{float(v):.1f} ktok/s")
    tq, hq = m.get("perf/target_queue_depth"), m.get("perf/hs_queue_depth")
    if tq is not None or hq is not None:
        parts.append(
            "queues " + " ".join(f"{name} {float(v):g}" for name, v in (("target", tq), ("hs", hq)) if v is not None)
        )
    if (wait := m.get("perf/link_wait")) is not None:  # parallel.target_ranks: which side holds the other up
        side = "target ranks" if wait > 0.2 else "drafters"
        parts.append(f"link {float(m.get('perf/link_mb_s', 0.0)):.0f} MB/s, waits {100 * wait:.0f}% (slower: {side})")
    return " | ".join(parts)


class ConsoleCallback(Callback):
    """Training progress: a row of the terminal's live display on a TTY, plain `logging` lines otherwise.

    Either is redrawn at most once per `log_every_s` (plus once at the end), so a fast monitor tick costs a
    dict update, not a terminal write. While an eval runs the row says so instead of showing a throughput
    that is zero only because training waits. `stream`, `is_tty` and `clock` exist for tests.
    """

    def __init__(
        self,
        max_steps: int,
        log_every_s: float = 5.0,
        *,
        stream: TextIO | None = None,
        is_tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        display: Display | None = None,
    ) -> None:
        if log_every_s <= 0:
            raise ValueError(f"logging.log_every_s={log_every_s!r} is invalid: must be > 0")
        self.max_steps = max_steps
        self.log_every_s = log_every_s
        if display is None:
            display = Display(stream, is_tty) if stream is not None or is_tty is not None else default_display()
        self.display = display
        self._is_tty = display.is_tty
        self._clock = clock
        self._progress = None  # the display's Progress while running on a terminal
        self._task = None
        self._last_refresh: float | None = None
        self._start_step = 0
        self._t0 = clock()
        self._latest: dict = {}
        self.refreshes = 0  # how many times the display was redrawn (tests check the throttle)

    def on_run_start(self, info: RunInfo) -> None:
        self.max_steps = info.max_steps
        self._start_step = info.start_step
        self._t0 = self._clock()
        if self._is_tty:
            self._progress = self.display.progress()
            self._task = self._progress.add_task("train", total=self.max_steps, completed=info.start_step, info="")
            self.display.refresh()

    def on_metrics(self, metrics: dict) -> None:
        self._latest = {k: to_python(v) for k, v in metrics.items()}
        now = self._clock()
        if self._last_refresh is None or now - self._last_refresh >= self.log_every_s:
            self._refresh(now)

    def on_eval(self, results: dict) -> None:
        evals = " ".join(
            f"{k.removeprefix('eval/')}={float(to_python(v)):.3f}"
            for k, v in sorted(results.items())
            if k in ("eval/tau", "eval/tau_baseline") and v is not None
        )
        line = f"eval at step {results.get('step', '?')}: {evals or 'done'}"
        if self._progress is not None:
            self.display.console.print(line, highlight=False, markup=False)
        else:
            log.info(line)

    def on_run_end(self, status: str, summary: dict) -> None:
        if self._latest:
            self._refresh(self._clock())
        if self._progress is not None:
            self._progress.remove_task(self._task)
            self.display.stop()
            self._progress = None
        log.info("run %s at step %s/%s", status, self._latest.get("step", self._start_step), self.max_steps)

    def _eta_s(self, step: int, now: float) -> float | None:
        done = step - self._start_step
        if done <= 0:
            return None
        return (self.max_steps - step) * (now - self._t0) / done

    def _refresh(self, now: float) -> None:
        self._last_refresh = now
        self.refreshes += 1
        step = int(self._latest.get("step", self._start_step))
        stats = _stats_text(self._latest, evaluating=self.display.active("eval"))
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=stats)
            self.display.refresh()
        else:
            pct = 100.0 * step / self.max_steps if self.max_steps else 0.0
            log.info(
                "step %d/%d (%.0f%%) | %s | eta %s",
                step,
                self.max_steps,
                pct,
                stats or "-",
                _fmt_eta(self._eta_s(step, now)),
            )
