"""The process's stop request (SIGTERM/SIGINT, set by the run's signal handler) and the check every long
phase makes between its pieces: the target build, data regeneration, evals. A phase that sees it raises
`Interrupted`, so a preempted job ends in seconds, not after the phase."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

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


_watcher: threading.Thread | None = None
LAUNCHER_GRACE_S = 60.0  # a rank whose launcher died: seconds to stop as on SIGTERM before it exits anyway


def exit_with_launcher(poll_s: float = 2.0, grace_s: float | None = None) -> threading.Thread | None:
    """Under torchrun (TORCHELASTIC_RUN_ID): a rank whose launcher died (its parent process changed: reparented to
    init or a subreaper) stops as on SIGTERM (the ranks that still agree checkpoint and end) and, `grace_s` later
    (DFLASH_LAUNCHER_GRACE_S, default 60), exits whatever it is doing: with --standalone the launcher held the
    rendezvous store, so a rank left in a collective would otherwise run on with no one to end it (issue 57).
    Returns the watching thread, one per process (None outside torchrun)."""
    global _watcher
    if "TORCHELASTIC_RUN_ID" not in os.environ or _watcher is not None:  # one per process (a multirun's jobs)
        return _watcher
    grace = float(os.environ.get("DFLASH_LAUNCHER_GRACE_S", LAUNCHER_GRACE_S)) if grace_s is None else grace_s
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        log.error("the launcher (pid %d) is gone: stopping, exiting in %.0f s at the latest", launcher, grace)
        os.kill(os.getpid(), signal.SIGTERM)  # the run's handler: stop after the current step
        time.sleep(grace)
        log.error("the launcher (pid %d) is gone: exiting now", launcher)
        logging.shutdown()
        os._exit(128 + signal.SIGTERM)

    _watcher = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    _watcher.start()
    return _watcher
