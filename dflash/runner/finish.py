"""The end of a run that trained: the summary, the whole drafter gathered (a collective under fsdp), the export,
the final eval, summary.json, the tau line and report.png (rank 0), and every rank leaving together."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from dflash.core import interrupts
from dflash.core.disk import check_free
from dflash.core.machine import cpu_features, cpu_model
from dflash.core.rundir import RunDir, bench_metrics
from dflash.model.export import export_drafter
from dflash.model.model_card import write_model_card
from dflash.runner.job import Job
from dflash.tracking import CallbackList
from dflash.tracking.report import write_report
from dflash.train.precision import precision_ran
from dflash.train.time_budget import stop_reason

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """How a run ended (`completed` or `interrupted`; failures raise) and its final metrics (summary.json)."""

    status: str
    summary: dict
    reason: str | None = None


def finish(
    cfg: DictConfig,
    job: Job,
    run: RunDir,
    status: str,
    summary: dict,
    t_start: float,
    callbacks: CallbackList,
    cpu_start: float = 0.0,
) -> TrainResult:
    """`status` is how training ended; a stop during the final eval makes a completed run `interrupted`.
    `callbacks` get the benchmarks' results (the final eval reaches them through the evaluator). `cpu_start`:
    `time.process_time()` when the job started, for `perf/job_cpu_s`."""
    reason = "stopped by signal" if status == "interrupted" else None
    summary.update(job.trainer.summary_metrics())  # not the last monitor window: that depends on timing
    final = job.gather_drafter()  # a collective under fsdp; the whole drafter on rank 0
    if job.checkpoints.skipped_disk_full:  # checkpoint.on_disk_full=skip: say it where results are read
        summary["checkpoint/skipped_disk_full"] = job.checkpoints.skipped_disk_full
    if job.world.is_main:
        weights = sum(p.numel() * p.element_size() for p in final.parameters())
        check_free(run.drafter.parent, weights, "the export (drafter/)")  # the final checkpoint is on disk already
        rendering = dict(OmegaConf.select(cfg, "data.chat_template_kwargs") or {})  # recorded: another use warns
        export_drafter(final, run.drafter, target=cfg.model.target, rendering=rendering)
        if status == "completed":
            status, reason = _final_eval(job, final, summary)
        if status == "completed" and cfg.eval.get("suites"):
            status, reason = _benchmarks(cfg, job, final, run, summary, callbacks)
        summary.update(
            {
                "step": job.trainer.step,
                "tokens": job.trainer.tokens,
                "train/supervised_tokens": job.trainer.supervised_tokens,
                # the precision that ran, and the one asked for (bf16-mixed falls back to fp32 where bf16 is slow)
                "precision": precision_ran(job.trainer.autocast_dtype),
                "precision_requested": cfg.train.precision,
                "wall_time_s": round(time.time() - t_start, 3),
                # every thread of this process since the job started (a multirun's jobs share one process)
                "perf/job_cpu_s": round(time.process_time() - cpu_start, 3),
                "status": status,
            }
        )
        if (reason_stopped := stop_reason(job.trainer)) is not None:  # max_steps, max_tokens or max_minutes
            summary["stop_reason"] = reason_stopped
        run.write_summary(summary)
        write_model_card(run.path, run.drafter)  # the export states its evidence (dflash/model/model_card.py)
        if "eval/tau" in summary:  # a result is a figure of its seed and its machine
            tau, seed = summary["eval/tau"], cfg.train.seed
            log.info("final tau %.3f (train.seed=%d, %s)", tau, seed, _machine(job.device))
        if cfg.logging.report:
            _write_report(run)
    job.world.barrier()  # every rank ends the job together (the next job of a multirun starts in step)
    return TrainResult(status, summary, reason)


def _final_eval(job: Job, drafter, summary: dict) -> tuple[str, str | None]:
    """The final eval of a completed run; a stop request before or during it leaves the run `interrupted`,
    with the eval listed as not done (the drafter is exported: `python -m dflash.evaluate RUN_DIR` runs it)."""
    try:
        interrupts.check("the final eval")
        summary.update(job.evaluator.final(job.trainer.step, drafter))
    except interrupts.Interrupted:
        return "interrupted", (
            "stopped by signal after training; not done: the final eval (python -m dflash.evaluate RUN_DIR runs it)"
        )
    return "completed", None


def _benchmarks(
    cfg: DictConfig, job: Job, drafter, run: RunDir, summary: dict, callbacks: CallbackList
) -> tuple[str, str | None]:
    """eval.suites after the final eval: benchmarks.json and benchmarks.md in the run directory, the bench/*
    metrics in the summary. A stop leaves the run `interrupted` (python -m dflash.benchmark RUN_DIR resumes the
    suites not done); a suite whose data cannot be found costs a warning, and summary.json's `suites_not_run`
    names it (the run stays `completed`: the others' results stand)."""
    from dflash.evaluation.benchmark import run_benchmarks
    from dflash.evaluation.evaluator import on_device_of
    from dflash.train.parallelize import frozen_copy

    ev = job.evaluator
    try:
        data = run_benchmarks(
            ev.target.model,
            on_device_of(frozen_copy(drafter), ev.target.model),
            ev.tokenizer,
            run.path,
            suites=list(cfg.eval.suites),
            temperatures=[cfg.eval.temperature],
            # the suites render as the training data did (data.chat_template_kwargs, e.g. enable_thinking)
            template_kwargs=dict(OmegaConf.select(cfg, "data.chat_template_kwargs") or {}),
            max_samples=cfg.eval.suite_max_samples,
            max_new_tokens=cfg.eval.max_new_tokens,
            ngram=cfg.eval.prompt_lookup_ngram,
            seed=cfg.eval.seed,
            cache_dir=cfg.paths.cache_dir,
            info={"drafter": str(run.drafter), "target": str(cfg.model.target), "step": job.trainer.step},
            step=job.trainer.step,
            trace_cache=ev.trace_cache,
        )
    except interrupts.Interrupted:
        return "interrupted", "stopped by signal during the benchmarks (python -m dflash.benchmark RUN_DIR resumes)"
    except FileNotFoundError as e:
        log.warning("benchmarks not run: %s", e)
        summary["suites_not_run"] = ",".join(cfg.eval.suites)
        return "completed", None
    summary.update(bench_metrics(data))
    if data.get("missing"):
        summary["suites_not_run"] = ",".join(data["missing"])
        log.warning(
            "suites not run (no data): %s; python -m dflash.benchmark %s --suites %s runs them",
            summary["suites_not_run"], run.path, summary["suites_not_run"],
        )  # fmt: skip
    callbacks.on_benchmarks(job.trainer.step, data)
    return "completed", None


def _machine(device: torch.device) -> str:
    """What a result is a figure of: the GPU, or the CPU with its cores and vector kernels (run.json has more)."""
    if device.type != "cpu":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {os.cpu_count() or 0} cores, torch CPU kernels {cpu_features()['torch_cpu_capability']}"


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
