"""The process around one job: `main(cfg)` (called by launch.py inside Hydra) knows who this process is before
anything is written (`launch_identity`: rank 0 alone writes the run directory, under torchrun and submitit
alike), owns the job's exit paths (status.json is `running` first and always ends `completed`, `failed` with the
error of the rank that failed first, or `interrupted`), installs the signal handlers and runs `run.train`.
"""

from __future__ import annotations

import gc
import logging
import signal
import traceback

import torch
from omegaconf import DictConfig

from dflash.core import interrupts
from dflash.core.distributed import RankFailed, init_world, launch_identity
from dflash.core.override_effects import warn_unused_overrides
from dflash.core.rundir import RunDir, StatusFile
from dflash.core.terminal import display, install_logging, uninstall_logging
from dflash.core.validation import validate
from dflash.runner.job_info import JobInfo, hydra_job_info
from dflash.runner.resume import resume_changes, resume_config
from dflash.runner.run import train

log = logging.getLogger(__name__)


class RunInterrupted(Exception):
    """SIGINT / SIGTERM stopped the run (after a checkpoint)."""


def main(cfg: DictConfig, info: JobInfo | None = None) -> float | None:
    """Run one job in its Hydra run directory. Returns the final eval/tau (Hydra sweepers may use it).
    Under torchrun every rank runs this; rank 0 alone writes the run directory."""
    info = info or hydra_job_info()
    run = RunDir(info.run_dir)
    changed = {}  # the loss and precision keys a resume changes: said in one line, recorded in run.json
    if cfg.resume:  # checked before anything is written: a refused resume leaves RUN_DIR as it was
        composed, cfg = cfg, resume_config(cfg, info.run_dir, info.overrides)
        validate(cfg)
        changed = resume_changes(composed, cfg)
    # known before the World exists (joining it may fail, and that is recorded), the same under torchrun and submitit
    me = launch_identity(cfg.parallel)
    is_main = me.is_main
    replaced_handlers = install_logging()  # on a terminal, logs scroll above the live progress rows
    if is_main:  # loss.streak_alpha=0.5 under loss=dpace: said once, naming the option that reads it
        warn_unused_overrides(cfg, info.overrides)
    if is_main and changed:
        said = ", ".join(f"{k} {v['from']} -> {v['to']}" for k, v in changed.items())
        log.warning("resume: %s from the checkpoint's step on (run.json's resumes record it)", said)
    if not is_main:  # its file is launch.rank<r>.log (rank_hydra_overrides); say whose it is
        log.warning("rank %d of %d (%s): this rank's warnings and errors", me.rank, me.size, me.role)
    status = StatusFile(run.path) if is_main else None
    if is_main:
        run.path.mkdir(parents=True, exist_ok=True)
        status.running()
    stop = interrupts.stop_event()  # the long phases (target build, regeneration, evals) watch it too
    stop.clear()
    previous = interrupts.install_signal_handlers(
        stop,
        lambda name: (
            status and status.finish("interrupted", error=f"second {name}: exited at once, without a final checkpoint")
        ),
    )
    interrupts.exit_with_launcher()  # torchrun: a rank whose launcher died stops, then exits
    world = None
    try:
        if is_main:
            run.write_config(cfg)
            if cfg.resume:
                run.append_resume(info.overrides)
                if changed:
                    run.add_run_info("changed", changed, resumed=True)
            else:
                run.write_run_info(info.overrides, info.choices)
        if not cfg.resume:  # after the files above: a fresh run's bad config still leaves status.json = failed
            validate(cfg)
        world = init_world(cfg.parallel, cfg.model.device)
        if is_main:
            run.add_run_info("world", world.describe(), resumed=bool(cfg.resume))
        result = train(cfg, run.path, info, stop, world)
        if is_main:
            status.finish(result.status, error=result.reason)
        if result.status == "interrupted":
            raise RunInterrupted(result.reason or "interrupted")
        return result.summary.get("eval/tau")
    except RunInterrupted:
        raise
    except interrupts.Interrupted as e:  # before training started (target build, data regeneration)
        first = world.first_failure() if world is not None else None
        if first:  # torchrun stops this rank because another one failed: that failure is the job's
            if is_main:
                status.finish("failed", error=first)
            raise RankFailed(first) from None
        if is_main:
            status.finish("interrupted", error=f"{e}; not done: training, export, final eval")
        raise RunInterrupted(str(e)) from None
    except KeyboardInterrupt:
        if is_main:
            status.finish("interrupted", error="KeyboardInterrupt")
        raise
    except BaseException as e:  # noqa: BLE001 - status.json must say failed for every way a job dies
        error = f"{type(e).__name__}: {e}"
        first = None
        if world is not None and world.several_processes:
            if is_main:  # the first rank that failed, which is often not rank 0 (the others fail in a collective)
                first = world.first_failure()
                error = first or f"rank 0: {error}"
            else:
                world.report_failure(error)
        if is_main:
            status.finish("failed", error=error, traceback=traceback.format_exc(limit=20))
        if first and not first.startswith("rank 0:") and isinstance(e, Exception):
            raise RankFailed(first) from e  # what the launcher (torchrun, submitit) reports: the job's own error
        raise
    finally:
        display().stop()
        uninstall_logging(replaced_handlers)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
