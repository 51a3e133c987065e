"""The process's stop request (SIGTERM/SIGINT, set by the run's signal handler) and the check every long
phase makes between its pieces: the target build, data regeneration, evals. A phase that sees it raises
`Interrupted`, so a preempted job ends in seconds, not after the phase."""

from __future__ import annotations

import threading

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
