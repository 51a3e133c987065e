"""One job, wired: the only module that knows all the parts (docs/architecture.md). No training logic of its own.

`train(cfg, run_dir, ...)` reads as build (job.py), resume, run (the pipeline and its monitor's ticker, here),
finish (finish.py); it never touches Hydra, so tests call it directly. The process around it (status.json,
signals, exit paths, which rank writes) is `lifecycle.main`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dflash.core import determinism
from dflash.core.disk import disk_error
from dflash.core.distributed import World
from dflash.core.rundir import RunDir
from dflash.core.secrets import redact
from dflash.data.batches import rank_batches
from dflash.model.gguf_target import provenance as target_provenance
from dflash.model.plan import run_headline
from dflash.model.target import DTYPES
from dflash.runner.disaggregated import FeatureSource, serve_target
from dflash.runner.finish import TrainResult, finish
from dflash.runner.job import Job, build_job
from dflash.runner.job_info import JobInfo
from dflash.tracking import CallbackList, RunInfo, build_callbacks
from dflash.train.feature_store import StoreReader
from dflash.train.pipeline import Pipeline
from dflash.train.precision import precision_record
from dflash.train.trainer import TargetForward, TrainingDiverged, total_steps

log = logging.getLogger(__name__)


class DataRanOut(RuntimeError):
    """The pipeline's source ended before the run's last step: the run failed, it did not complete."""


def train(
    cfg: DictConfig, run_dir: Path, info: JobInfo, stop: threading.Event | None = None, world: World | None = None
) -> TrainResult:
    """Build, resume, run, finish."""
    stop, world = stop or threading.Event(), world or World()
    if world.is_target:  # parallel.target_ranks: this process only feeds drafter ranks
        serve_target(cfg, world, RunDir(run_dir))
        return TrainResult("completed", {})
    t_start, cpu_start = time.time(), time.process_time()
    determinism.apply(cfg.train.deterministic)
    torch.manual_seed(cfg.train.seed)
    run = RunDir(run_dir)
    callbacks = build_callbacks(cfg, run_dir, total_steps(cfg.train)) if world.is_main else CallbackList()
    job = build_job(cfg, run, world, callbacks, stop)
    resume(cfg, job, run)
    callbacks.on_run_start(_run_info(cfg, run, info, job))
    summary: dict = {}
    try:
        status = run_pipeline(cfg, job, stop, _ticker(job, callbacks, summary, t_start))
        result = finish(cfg, job, run, status, summary, t_start, callbacks, cpu_start)
    except BaseException:
        callbacks.on_run_end("failed", summary)  # every sink ends exactly once
        raise
    callbacks.on_run_end(result.status, summary)
    return result


def resume(cfg: DictConfig, job: Job, run: RunDir) -> None:
    """run.json's data fingerprint; with resume=RUN_DIR the newest checkpoint that verifies, metrics.jsonl cut
    back to its step; under target_ranks, where the target ranks start (rank 0's data position)."""
    world = job.world
    if world.is_main:
        run.add_run_info("data_fingerprint", job.fingerprint, resumed=bool(cfg.resume))
        run.add_run_info("optimizer", job.trainer.optimizer.describe(), resumed=bool(cfg.resume))
        ran = precision_record(cfg.train.precision, job.trainer.device)  # requested, ran, why not the requested
        run.add_run_info("precision", ran, resumed=bool(cfg.resume))  # compare, curves and the model card read it
        if (made := target_provenance(cfg.model.target)) is not None:  # a converted target: what it was made from
            run.add_run_info("target_provenance", made, resumed=bool(cfg.resume))
        if (plan := run_headline(cfg, world.size + world.target_ranks)) is not None:  # held against a GPU run
            log.info("plan: %s (python -m dflash.plan)", plan["text"])
            run.add_run_info("plan", plan, resumed=bool(cfg.resume))
    if cfg.resume and job.checkpoints.resume(job.trainer) is not None and world.is_main:
        run.truncate_metrics(job.trainer.step)  # the resumed run appends without duplicate steps
        run.add_run_info("from_step", job.trainer.step, resumed=True)  # where its `changed` keys took over
    if world.target_ranks:
        world.broadcast_to_all(job.trainer.next_data)


def _run_info(cfg: DictConfig, run: RunDir, info: JobInfo, job: Job) -> RunInfo:
    return RunInfo(
        run_dir=run.path,
        config=redact(OmegaConf.to_container(cfg, resolve=True)),
        max_steps=job.trainer.total_steps,
        job_name=info.job_name,
        sweep_dir=info.sweep_dir,
        experiment=cfg.experiment,
        wandb_run_id=job.checkpoints.resumed_meta.get("wandb_run_id"),
        start_step=job.trainer.step,
    )


def run_pipeline(cfg: DictConfig, job: Job, stop: threading.Event, on_tick) -> str:
    """Train until done or stopped; returns `completed` or `interrupted`, or raises DataRanOut when the source
    ends first. The final checkpoint is written on every way out (lose at most the current step), unless a drafter
    thread may still be changing the weights or, under data parallelism, the run failed other than by divergence
    (ranks out of step cannot save together)."""
    pipeline = outcome = None
    world = job.world
    features = FeatureSource(cfg, world, job.device) if world.target_ranks else None
    try:
        if features is not None:  # items come from a target rank; the pipeline's target stage passes them on
            source, target_fn, on_tick = features, _pass_through, _with_sample(on_tick, features.sample)
        elif job.store is not None:  # features=store: items read from the store, passed on as they are
            dtype = DTYPES[cfg.model.dtype]  # fp8 features dequantised to the training dtype on read
            source = StoreReader(job.store, job.trainer.next_data, job.device, world.rank, world.size, dtype)
            target_fn = _pass_through
        else:
            source = rank_batches(job.data.batches.iterate(*job.trainer.next_data), world.rank, world.size)
            target_fn = TargetForward(job.replicas or job.target, job.device, cfg.debug.fail_target_at_batch)
        pipeline = Pipeline(
            source,
            target_fn,
            job.trainer.train_on,
            mode=cfg.pipeline.mode,
            queue_size=cfg.pipeline.queue_size,
            queue_bytes=cfg.pipeline.queue_bytes,
            target_workers=max(cfg.pipeline.target_workers, len(job.replicas)),  # a worker per target replica
            monitor_interval_s=cfg.pipeline.monitor_interval_s,
            on_tick=on_tick,
            join_timeout_s=cfg.pipeline.join_timeout_s,
            threads_per_stage=_threads_per_stage(cfg, job.device),
            stop_event=None if world.distributed else stop,
        )
        if features is not None:
            features.abandon_on(pipeline.stopping)
        if job.trainer.done():
            log.info("nothing to train: step %d of %d already done", job.trainer.step, job.trainer.total_steps)
        else:
            outcome = pipeline.run()
        if features is not None:
            features.finish(world)  # the target rank stops sending and ends the link
        # decided before the final checkpoint: a signal during it does not make a finished run `interrupted`
        interrupted = (stop.is_set() or job.trainer.stopped_on_request) and not job.trainer.done()
        if _drafter_still_running(pipeline):
            raise RuntimeError(
                f"the drafter stage did not stop within pipeline.join_timeout_s={cfg.pipeline.join_timeout_s} s "
                "(still inside a step, a periodic eval or a checkpoint); its weights may be mid-update, so no "
                "final checkpoint or export was written. Resume from the last checkpoint; raise "
                "pipeline.join_timeout_s if steps or evals of this model take longer"
            )
    except BaseException as e:
        # ranks that failed have left the lockstep: a collective save could hang, so only one process saves;
        # except on divergence, which every rank detects at the same step (from the all-reduced loss)
        in_step = not world.distributed or _caused_by(e, TrainingDiverged)
        if in_step and not _drafter_still_running(pipeline) and disk_error(e) is None:  # a full disk stays full
            job.checkpoints.save_final(job.trainer)  # the last good state: a diverged step changes no weight
        raise
    job.checkpoints.save_final(job.trainer)
    if not interrupted and not job.trainer.done():  # the source ran out: never `completed` short of the steps
        raise DataRanOut(_ran_out(job, outcome))
    return "interrupted" if interrupted else "completed"


def _ran_out(job: Job, outcome) -> str:
    where = f"the feature store {job.store}" if job.store is not None else "the training data"
    if job.world.target_ranks:
        where = "the target ranks' features"
    how = f"pipeline stopped: {outcome.stopped_by}, {outcome.reason}" if outcome is not None else "no pipeline ran"
    return (
        f"training ended at step {job.trainer.step} of {job.trainer.total_steps}: {where} ran out ({how}); the "
        "final checkpoint is saved: give the run more data (a feature store: python -m dflash.features build with "
        "the run's overrides extends it), then resume=RUN_DIR continues"
    )


def _caused_by(error: BaseException, kind: type) -> bool:
    """`error` is `kind`, or was raised from one (a pipeline stage wraps its exception in StageError)."""
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__
    return False


def _pass_through(item):
    return item


def _with_sample(on_tick, extra):
    return lambda sample: on_tick({**sample, **extra()})


def _ticker(job: Job, callbacks: CallbackList, summary: dict, t_start: float):
    """The monitor's tick: the trainer's metrics and the pipeline's sample to every sink. Under data
    parallelism every rank's tick hands its sample to the trainer (which exchanges them each step), and rank 0
    reports the global token rate and the ranks' min/max."""
    last = {"tokens": job.trainer.tokens, "time": time.time()}

    def on_tick(sample: dict) -> None:
        sample = {**sample, **job.trainer.memory_sample()}
        job.trainer.set_local_sample(sample)
        if not job.world.is_main:
            return
        metrics = job.trainer.metrics()
        now = time.time()
        metrics["time_s"] = round(now - t_start, 3)
        metrics.update(sample)
        if job.world.distributed:
            metrics.update(job.trainer.perf_spread)
            elapsed = now - last["time"]
            if elapsed > 0:  # all ranks' tokens: the trainer counts global batches
                metrics["perf/ktok_s"] = (job.trainer.tokens - last["tokens"]) / elapsed / 1000.0
            last.update(tokens=job.trainer.tokens, time=now)
        if job.data.skipped_records:
            metrics["data/skipped_records"] = job.data.skipped_records
        metrics.update({f"data/skipped/{reason}": n for reason, n in job.data.skipped_by_reason.items()})
        summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        callbacks.on_metrics(metrics)

    return on_tick


def _drafter_still_running(pipeline) -> bool:
    """A drafter thread abandoned by the pipeline's join timeout may still change the weights."""
    return pipeline is not None and "dflash-drafter" in pipeline.leftover_threads


def _threads_per_stage(cfg, device: torch.device) -> int | None:
    """CPU: each concurrently running stage gets its share of the cores (oversubscribing them slows both)."""
    if device.type != "cpu":
        return None
    if cfg.pipeline.threads_per_stage is not None:
        return cfg.pipeline.threads_per_stage
    if cfg.train.deterministic:
        return determinism.cpu_threads_per_stage(True)
    workers = max(cfg.pipeline.target_workers, len(cfg.parallel.get("target_devices") or []))
    stages = workers + 1 if cfg.pipeline.mode == "async" else 1
    return max(1, torch.get_num_threads() // stages)
