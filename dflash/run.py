"""One job, wired: the only module that knows all the parts (docs/architecture.md). No training logic of its own.

`train(cfg, run_dir, ...)` reads as build, resume, run, finish; it never touches Hydra, so tests call it
directly. The process around it (status.json, signals, exit paths, which rank writes) is `lifecycle.main`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dflash import determinism, interrupts
from dflash.config import ConfigError
from dflash.data.batches import rank_batches
from dflash.data.corpus import jsonl_files, load_tokenizer
from dflash.data.fingerprint import data_fingerprint
from dflash.data.training_data import TrainingData, run_training_data
from dflash.disaggregated import FeatureSource, serve_target
from dflash.distributed import World
from dflash.evaluation.evaluator import Evaluator
from dflash.job_info import JobInfo
from dflash.model.build import build_drafter_config, init_drafter, resolve_mask_token_id, resolve_target_layer_ids
from dflash.model.export import export_drafter
from dflash.model.target import DTYPES, TargetHeads, TargetModel, load_target_config, resolve_device
from dflash.model.tiny import ensure_target
from dflash.resume import check_data_unchanged
from dflash.rundir import RunDir, cpu_features, cpu_model
from dflash.secrets import redact
from dflash.tracking import CallbackList, RunInfo, build_callbacks
from dflash.tracking.report import write_report
from dflash.train import faults
from dflash.train.checkpointer import CheckpointManager
from dflash.train.parallelize import frozen_copy, full_state_dict, parallelize_drafter
from dflash.train.pipeline import Pipeline
from dflash.train.trainer import DrafterTrainer, TargetForward, TrainingDiverged, total_steps

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """How a run ended (`completed` or `interrupted`; failures raise) and its final metrics (summary.json)."""

    status: str
    summary: dict
    reason: str | None = None


@dataclass
class Job:
    """Everything a run trains with, built from the config by `build_job`."""

    target: TargetModel | None  # None on a drafter rank of parallel.target_ranks other than rank 0 (heads only)
    drafter: torch.nn.Module
    device: torch.device
    data: TrainingData
    trainer: DrafterTrainer
    checkpoints: CheckpointManager
    evaluator: Evaluator
    world: World = field(default_factory=World)
    model: torch.nn.Module | None = None  # the drafter as wrapped for data parallelism
    replicas: list = field(default_factory=list)  # parallel.target_devices: a target per device (target first)

    def gather_drafter(self) -> torch.nn.Module | None:
        """The whole trained drafter, unwrapped, on rank 0 (None elsewhere): the drafter itself in one
        process; under ddp/fsdp its full weights gathered from the ranks (a collective)."""
        if not self.world.distributed:
            return self.drafter
        state = full_state_dict(self.model, self.world)
        return frozen_copy(self.drafter, state, self.device) if self.world.is_main else None


def train(
    cfg: DictConfig, run_dir: Path, info: JobInfo, stop: threading.Event | None = None, world: World | None = None
) -> TrainResult:
    """Build, resume, run, finish."""
    stop, world = stop or threading.Event(), world or World()
    if world.is_target:  # parallel.target_ranks: this process only feeds drafter ranks
        serve_target(cfg, world, RunDir(run_dir))
        return TrainResult("completed", {})
    t_start = time.time()
    determinism.apply(cfg.train.deterministic)
    torch.manual_seed(cfg.train.seed)
    run = RunDir(run_dir)
    job = build_job(cfg, run, world)
    fingerprint = job.checkpoints.data_fingerprint
    job.checkpoints.check_before_resume = lambda ckpt, meta: check_data_unchanged(
        cfg, run, world, ckpt, meta, fingerprint
    )
    if world.is_main:
        run.add_run_info("data_fingerprint", fingerprint, resumed=bool(cfg.resume))
    if cfg.resume and job.checkpoints.resume(job.trainer) is not None and world.is_main:
        run.truncate_metrics(job.trainer.step)  # the resumed run appends without duplicate steps
    if world.target_ranks:
        world.broadcast_to_all(job.trainer.next_data)  # where the target ranks start

    callbacks = build_callbacks(cfg, run_dir, job.trainer.total_steps) if world.is_main else CallbackList()
    job.evaluator.on_result = callbacks.on_eval
    job.evaluator.on_final = callbacks.on_final_eval
    job.checkpoints.on_saved = callbacks.on_checkpoint
    job.checkpoints.tracking_state = callbacks.state  # the W&B run id, for a resume to continue the same run
    callbacks.on_run_start(
        RunInfo(
            run_dir=run.path,
            config=redact(OmegaConf.to_container(cfg, resolve=True)),
            max_steps=job.trainer.total_steps,
            job_name=info.job_name,
            sweep_dir=info.sweep_dir,
            experiment=cfg.experiment,
            wandb_run_id=job.checkpoints.resumed_meta.get("wandb_run_id"),
            start_step=job.trainer.step,
        )
    )
    summary: dict = {}
    with _callbacks_end_with(callbacks, summary) as outcome:
        outcome.status = run_pipeline(cfg, job, stop, _ticker(job, callbacks, summary, t_start))
        outcome.reason = "stopped by signal" if outcome.status == "interrupted" else None
        summary.update(job.trainer.summary_metrics())  # not the last monitor window: that depends on timing
        final = job.gather_drafter()  # a collective under fsdp; the whole drafter on rank 0
        if world.is_main:
            export_drafter(final, run.drafter, target=cfg.model.target)
            _final_eval(job, final, stop, summary, outcome)
            summary.update(
                {
                    "step": job.trainer.step,
                    "tokens": job.trainer.tokens,
                    "wall_time_s": round(time.time() - t_start, 3),
                    "status": outcome.status,
                }
            )
            run.write_summary(summary)
            if "eval/tau" in summary:  # a result is a figure of its seed and its machine
                tau, seed = summary["eval/tau"], cfg.train.seed
                log.info("final tau %.3f (train.seed=%d, %s)", tau, seed, _machine(job.device))
            if cfg.logging.report:
                _write_report(run)
        world.barrier()  # every rank ends the job together (the next job of a multirun starts in step)
    return TrainResult(outcome.status, summary, outcome.reason)


def _machine(device: torch.device) -> str:
    """What a result is a figure of: the GPU, or the CPU with its cores and vector kernels (run.json has more)."""
    if device.type != "cpu":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {os.cpu_count() or 0} cores, torch CPU kernels {cpu_features()['torch_cpu_capability']}"


def _final_eval(job: Job, drafter, stop: threading.Event, summary: dict, outcome) -> None:
    """The final eval of a completed run; a stop request before or during it leaves the run `interrupted`,
    with the eval listed as not done (the drafter is exported: `python -m dflash.evaluate RUN_DIR` runs it)."""
    if outcome.status != "completed":
        return
    try:
        interrupts.check("the final eval")
        summary.update(job.evaluator.final(job.trainer.step, drafter))
    except interrupts.Interrupted:
        outcome.status = "interrupted"
        outcome.reason = (
            "stopped by signal after training; not done: the final eval (python -m dflash.evaluate RUN_DIR runs it)"
        )


def _write_report(run: RunDir) -> None:
    """report.png beside the run's files; a failure to draw it costs a warning, not the run."""
    try:
        path = write_report([run.path], run.path / "report.png")
    except Exception as e:  # noqa: BLE001 - the run's results are written already
        log.warning(
            "could not draw the run's report (%s: %s); python -m dflash.report RUN_DIR retries", type(e).__name__, e
        )
        return
    log.info("report: %s (python -m dflash.report compares runs)", path)


def build_job(cfg: DictConfig, run: RunDir, world: World | None = None) -> Job:
    """Target, tokenizer, data, drafter, trainer and the managers; every cheap check before the heavy loads.
    Every rank builds the same job; the drafter is wrapped for data parallelism after its untrained copy."""
    world = world or World()
    # rank 0 builds the embedded target first (transformers writes a model only on rank 0 under torch.distributed)
    world.main_first(lambda: ensure_target(cfg.model))
    target_config = load_target_config(cfg.model.target)
    layer_ids = resolve_target_layer_ids(cfg.model, target_config.num_hidden_layers)
    tokenizer = load_tokenizer(cfg.model.target)
    mask_id = resolve_mask_token_id(cfg.model, tokenizer, target_config.vocab_size)
    if cfg.data.name == "jsonl":  # a bad data file fails before the target loads
        jsonl_files(cfg.data.path)
    if world.distributed and cfg.train.batch_size % world.size:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is the global batch: it must divide by the {world.size} ranks"
        )
    par = cfg.parallel
    device = world.device if world.distributed else resolve_device(par.get("drafter_device") or cfg.model.device)
    places = par.get("target_devices") or [str(world.device if world.distributed else resolve_device(cfg.model.device))]
    # parallel.target_ranks: a drafter rank that runs no evals needs only the embedding and LM head (the target
    # ranks compute its features); a 27B target must not share a GPU with the drafter's optimizer
    lean = bool(world.target_ranks) and not world.is_main
    replicas = [] if lean else [TargetModel.load(cfg.model.target, layer_ids, cfg.model.dtype, d) for d in places]
    target = replicas[0] if replicas else None
    # hashed once (rank 0), not by every rank: the files can be gigabytes
    fingerprint = world.broadcast_object(data_fingerprint(cfg.data, cfg.model.target) if world.is_main else None)

    def build_data() -> TrainingData:
        if world.is_main and cfg.debug.main_first_sleep_s:  # a slow first render (parallel.init_timeout_s drills)
            interrupts.stop_event().wait(cfg.debug.main_first_sleep_s)
            interrupts.check("the data build")
        return run_training_data(cfg, tokenizer, target.model if target else None, fingerprint)

    data = world.main_first(build_data)  # data=jsonl under torchrun: rank 0 renders into the cache, then the others
    drafter_config = build_drafter_config(target_config, cfg.model, layer_ids, mask_id)
    drafter = init_drafter(drafter_config, cfg.train.seed, device, DTYPES[cfg.model.dtype])
    log.info(
        "drafter: %d layers, %.2fM trainable params, block %d, mask id %d",
        drafter_config.num_hidden_layers,
        sum(p.numel() for p in drafter.parameters()) / 1e6,
        cfg.model.block_size,
        mask_id,
    )
    evaluator = Evaluator(cfg, target, drafter, tokenizer, run, world, data.chat)  # copies the untrained drafter first
    model = parallelize_drafter(drafter, world, cfg.parallel.mixed_precision)
    evaluator.model = model
    checkpoints = CheckpointManager(cfg.checkpoint, run.path, drafter, cfg.model.target, world, model)
    checkpoints.data_fingerprint = fingerprint
    first_step = [True]

    def after_step(trainer: DrafterTrainer) -> None:
        if first_step[0]:  # the first collectives may wait for slow preprocessing; later ones need less
            world.set_timeout(cfg.parallel.timeout_s)
            first_step[0] = False
        checkpoints.maybe_save(trainer)
        evaluator.maybe_eval(trainer)

    if target is None:
        heads = TargetHeads.load(cfg.model.target, cfg.model.dtype, device)  # what the trainer reads of the target
    else:
        heads = target if target.device == device else TargetHeads(target, device)
    trainer = DrafterTrainer(cfg, heads, drafter, mask_id, total_steps(cfg.train), after_step, world, model)
    faults.install(trainer, cfg.debug, world.rank)  # +debug=faults drills; nothing without a debug key
    return Job(target, drafter, device, data, trainer, checkpoints, evaluator, world, model, replicas)


def run_pipeline(cfg: DictConfig, job: Job, stop: threading.Event, on_tick) -> str:
    """Train until done or stopped; returns `completed` or `interrupted`. The final checkpoint is written on
    every way out (lose at most the current step), unless a drafter thread may still be changing the weights
    or, under data parallelism, the run failed other than by divergence (ranks out of step cannot save together)."""
    pipeline = None
    world = job.world
    features = FeatureSource(cfg, world, job.device) if world.target_ranks else None
    try:
        if world.distributed:  # a stop is agreed by all ranks at a step boundary (the trainer), never one alone
            job.trainer.stop_requested = stop.is_set
        if features is not None:  # items come from a target rank; the pipeline's target stage passes them on
            source, target_fn, on_tick = features, _pass_through, _with_sample(on_tick, features.sample)
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
            pipeline.run()
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
        if in_step and not _drafter_still_running(pipeline):
            job.checkpoints.save_final(job.trainer)  # the last good state: a diverged step changes no weight
        raise
    job.checkpoints.save_final(job.trainer)
    return "interrupted" if interrupted else "completed"


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
        job.trainer.local_perf = sample
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
        summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        callbacks.on_metrics(metrics)

    return on_tick


class _Outcome:
    status = "completed"
    reason: str | None = None


@contextlib.contextmanager
def _callbacks_end_with(callbacks: CallbackList, summary: dict):
    """Every sink ends exactly once: with the outcome's status, or `failed` when the block raises."""
    outcome = _Outcome()
    try:
        yield outcome
    except BaseException:
        callbacks.on_run_end("failed", summary)
        raise
    callbacks.on_run_end(outcome.status, summary)


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
