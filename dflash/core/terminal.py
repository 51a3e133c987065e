"""One terminal for logs and progress: on a TTY every long phase (target build, data regeneration, training,
eval) is a row of one live rich display, and log records are printed through the same console, so they scroll
above the bars instead of breaking into them. Without a TTY (CI, SLURM logs, `| tee`) there is no live
display: a phase logs a plain line at most every `log_every_s` seconds and once at its end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

log = logging.getLogger(__name__)


class Display:
    """A rich Progress (one row per active phase) on a console over `stream`, started on first use."""

    def __init__(self, stream: TextIO | None = None, is_tty: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty() if is_tty is None else is_tty
        self._lock = threading.Lock()
        self._progress = None
        self._console = None
        self._phases: dict[str, int] = {}  # phase name -> active count

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.stream, force_terminal=self.is_tty)
        return self._console

    def progress(self):
        """The live Progress (TTY only); started on first use, stopped by `stop`."""
        with self._lock:
            if self._progress is None:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

                self._progress = Progress(
                    TextColumn("[bold]{task.description:<8}"),
                    BarColumn(bar_width=20),
                    MofNCompleteColumn(),
                    TextColumn("eta"),
                    TimeRemainingColumn(),
                    TextColumn("{task.fields[info]}"),
                    console=self.console,
                    auto_refresh=False,  # redrawn when a phase updates, not by a thread of its own
                )
                self._progress.start()
            return self._progress

    def refresh(self) -> None:
        with self._lock:
            if self._progress is not None:
                self._progress.refresh()

    def stop(self) -> None:
        """End the live display (its last frame stays on screen)."""
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None

    def active(self, phase: str) -> bool:
        return self._phases.get(phase, 0) > 0

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None, log_every_s: float = 10.0) -> Iterator[Phase]:
        """A long piece of work with a row of its own: `with display.phase("eval", 12) as p: p.advance()`."""
        tracker = Phase(self, name, total, log_every_s)
        self._phases[name] = self._phases.get(name, 0) + 1
        try:
            yield tracker
        finally:
            self._phases[name] -= 1
            tracker.close()


class Phase:
    """Progress of one phase: a live row on a TTY, else a log line at most every `log_every_s` seconds."""

    def __init__(self, display: Display, name: str, total: int | None, log_every_s: float):
        self.display, self.name, self.total, self.log_every_s = display, name, total, log_every_s
        self.completed = 0
        self.info = ""
        self._t0 = self._last_log = time.monotonic()
        self._task = None
        if display.is_tty:
            self._task = display.progress().add_task(name, total=total, info="")
            display.refresh()
        else:
            log.info("%s: started%s", name, f" ({total} to do)" if total else "")

    def advance(self, n: int = 1, info: str | None = None) -> None:
        self.update(self.completed + n, info)

    def update(self, completed: int, info: str | None = None) -> None:
        self.completed = completed
        if info is not None:
            self.info = info
        if self._task is not None:
            self.display.progress().update(self._task, completed=completed, info=self.info)
            self.display.refresh()
        elif time.monotonic() - self._last_log >= self.log_every_s:
            self._log_line()

    def close(self) -> None:
        if self._task is not None:
            progress = self.display.progress()
            progress.update(self._task, completed=self.completed, info=self.info)
            self.display.refresh()
            progress.remove_task(self._task)  # a finished phase leaves the live rows; its log line stays
            self._task = None
        log.info("%s: %s", self.name, self._summary(done=True))

    def _log_line(self) -> None:
        self._last_log = time.monotonic()
        log.info("%s: %s", self.name, self._summary(done=False))

    def _summary(self, done: bool) -> str:
        elapsed = time.monotonic() - self._t0
        text = f"{self.completed}/{self.total}" if self.total else f"{self.completed}"
        if not done and self.total and self.completed:
            eta = elapsed * (self.total - self.completed) / self.completed
            text += f" ({100 * self.completed / self.total:.0f}%, eta {_hms(eta)})"
        elif done:
            text += f" in {_hms(elapsed)}"
        return text + (f" | {self.info}" if self.info else "")


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


_default: Display | None = None


def display() -> Display:
    """The process's display on stderr."""
    global _default
    if _default is None:
        # under torchrun only rank 0 draws: the others' phases are log lines in their own log files
        _default = Display(is_tty=False) if int(os.environ.get("RANK", 0)) > 0 else Display()
    return _default


def install_logging(target: Display | None = None) -> list[logging.Handler]:
    """On a terminal, print the root logger's terminal output through the display's console (a RichHandler),
    so log records scroll above the live rows. Handlers writing to files or pipes stay as they are. Returns
    the handlers replaced, for `uninstall_logging`."""
    target = target or display()
    if not target.is_tty:
        return []
    from rich.logging import RichHandler

    root = logging.getLogger()
    replaced = []
    for h in list(root.handlers):
        stream = getattr(h, "stream", None)
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and _tty(stream):
            rich = RichHandler(console=target.console, show_path=False, markup=False, log_time_format="[%X]")
            rich.setLevel(h.level)
            rich.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            rich._dflash_replaces = h  # noqa: SLF001 - remembered for uninstall_logging
            root.removeHandler(h)
            root.addHandler(rich)
            replaced.append(h)
    return replaced


def uninstall_logging(replaced: list[logging.Handler]) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        original = getattr(h, "_dflash_replaces", None)
        if original is not None and original in replaced:
            root.removeHandler(h)
            root.addHandler(original)


def _tty(stream) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (ValueError, OSError):  # a closed stream
        return False
