"""Fault injection for tests and failure drills (`+debug=faults debug.fail_at_step=3`): wrappers around the
trainer's step, installed only when a `debug.*` key is set, so the trainer itself holds no fault code.
The target stage's fault (`debug.fail_target_at_batch`) is TargetForward's own argument."""

from __future__ import annotations

import os
import signal
import time

_STEP_KEYS = ("fail_at_step", "slow_step_s", "nan_at_step", "crash_at_step")


def install(trainer, debug, rank: int) -> None:
    """Wrap `trainer.train_on` (and `compute_loss` for NaN) with the faults `debug` asks for, on `rank` only
    when `debug.fail_rank` is set (slow steps: on every rank)."""
    if all(getattr(debug, key, None) is None for key in _STEP_KEYS):
        return
    faulty = debug.fail_rank is None or debug.fail_rank == rank
    train_on, compute_loss = trainer.train_on, trainer.compute_loss

    def train_on_with_faults(item) -> bool:
        if trainer.done():
            return train_on(item)
        if faulty and debug.fail_at_step is not None and trainer.step + 1 >= debug.fail_at_step:
            raise RuntimeError(f"injected drafter-stage fault at step {trainer.step + 1} (debug.fail_at_step)")
        if debug.slow_step_s:
            time.sleep(debug.slow_step_s)  # a slow drafter (back-pressure drills)
        keep = train_on(item)
        if faulty and debug.crash_at_step is not None and trainer.step >= debug.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a node crash: no cleanup, exactly like kill -9
        return keep

    def compute_loss_with_nan(item, step: int, noise_std: float):
        out = compute_loss(item, step, noise_std)
        if step + 1 >= debug.nan_at_step:
            out.loss = out.loss * float("nan")  # a diverging run (train.max_bad_steps drills)
        return out

    trainer.train_on = train_on_with_faults
    if faulty and debug.nan_at_step is not None:
        trainer.compute_loss = compute_loss_with_nan
