"""The process's stop request (SIGTERM/SIGINT, set by the run's signal handler) and the check every long
phase makes between its pieces: the target build, data regeneration, evals. A phase that sees it raises
`Interrupted`, so a preempted job ends in seconds, not after the phase."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)
_stop = threading.Event()
received: int | None = None  # the signal number that requested the stop (for the exit code 128 + signum)


class Interrupted(Exception):
    """A stop request ended a phase early; the message names the phase."""


def stop_event() -> threading.Event:
    """The event the signal handler sets; a new job of the same process clears it first."""
    return _stop


def check(phase: str) -> None:
    """Raise Interrupted if a stop was requested."""
    if _stop.is_set():
        raise Interrupted(f"{phase} interrupted by a stop request")


def install_signal_handlers(stop: threading.Event, before_forced_exit=None) -> dict:
    """SIGTERM and SIGINT set the stop event; the pipeline winds down, checkpoints and reports `interrupted`.
    A second signal falls back to the default behaviour (immediate exit), after `before_forced_exit()` (which
    records the status: no cleanup runs after that)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}

    def handler(signum, frame):
        if stop.is_set():
            if before_forced_exit is not None:
                try:
                    before_forced_exit(signal.Signals(signum).name)
                except Exception:  # noqa: BLE001 - the user asked to exit now
                    pass
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        log.warning("received %s: stopping after the current step", signal.Signals(signum).name)
        global received
        received = signum
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handler)
    return previous
