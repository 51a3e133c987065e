"""One job, wired: the only module that knows all the parts. No training logic of its own.

`main(cfg)` (called by launch.py inside Hydra) owns the run directory's self-description and the exit paths:
status.json is `running` first and always ends `completed`, `failed` (with the error) or `interrupted`.
`train(cfg, run_dir, ...)` builds target, drafter, data, callbacks and the pipeline and never touches Hydra,
so tests can call it directly.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dflash.config import ConfigError, resolve_target_layer_ids, validate
from dflash.snapshot import (
    StatusFile,
    append_resume_info,
    redact,
    write_config_snapshot,
    write_json,
    write_run_info,
    write_text_atomic,
)

log = logging.getLogger(__name__)


class RunInterrupted(Exception):
    """SIGINT / SIGTERM stopped the run (after a checkpoint)."""


@dataclass
class JobInfo:
    run_dir: Path
    job_name: str = ""
    sweep_dir: str | None = None
    overrides: list[str] = field(default_factory=list)
    choices: dict = field(default_factory=dict)


def hydra_job_info() -> JobInfo:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    is_multirun = hc.mode == RunMode.MULTIRUN
    from dflash.callbacks import default_job_name

    own = [o for o in overrides if not o.startswith(("hydra.", "resume="))]
    if is_multirun:  # name a sweep's job by what varies: its values of the swept keys
        swept = _swept_keys()
        own = [o for o in own if o.split("=", 1)[0].lstrip("+~") in swept] or own
    job_name = default_job_name(redact(own), run_dir)  # the W&B run name: no secret from the command line
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    return JobInfo(run_dir, job_name, hc.sweep.dir if is_multirun else None, overrides, choices)


def _swept_keys() -> set[str]:
    """Keys the command line sweeps over (`key=a,b`, `range(...)`, `choice(...)`), read from sys.argv, plus
    those of `hydra.sweeper.params` in the config."""

    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]
    keys: set[str] = set()
    try:
        for o in OverridesParser.create().parse_overrides(args):
            if o.is_sweep_override():
                keys.add(o.key_or_group)
    except Exception:  # noqa: BLE001 - naming is cosmetic; never fail a job over it
        pass
    params = HydraConfig.get().sweeper.get("params") or {}
    keys.update(str(k) for k in params)
    return keys


def main(cfg: DictConfig, info: JobInfo | None = None) -> float | None:
    """Run one job in its Hydra run directory. Returns the final eval/tau (Hydra sweepers may use it)."""
    info = info or hydra_job_info()
    run_dir = info.run_dir
    if cfg.resume:  # checked before anything is written: a refused resume leaves RUN_DIR as it was
        cfg = resume_config(cfg, info)
        validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    status = StatusFile(run_dir)
    status.running()
    stop = threading.Event()
    previous = _install_signal_handlers(stop, lambda name: status.finish(
        "interrupted", error=f"second {name}: exited at once, without a final checkpoint"))
    try:
        write_config_snapshot(run_dir, cfg)
        if cfg.resume:
            append_resume_info(run_dir, info.overrides)
        else:
            write_run_info(run_dir, info.overrides, info.choices)
            validate(cfg)  # here, not above: a fresh run's bad config still leaves status.json = failed
        summary = train(cfg, run_dir, info, stop)
        final = summary.get("_status", "completed")
        status.finish(final, error=summary.get("_reason"))
        if final == "interrupted":
            raise RunInterrupted(summary.get("_reason") or "interrupted")
        return summary.get("eval/tau")
    except RunInterrupted:
        raise
    except KeyboardInterrupt:
        status.finish("interrupted", error="KeyboardInterrupt")
        raise
    except BaseException as e:  # noqa: BLE001 - status.json must say failed for every way a job dies
        status.finish("failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=20))
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def _install_signal_handlers(stop: threading.Event, before_forced_exit=None) -> dict:
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
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handler)
    return previous


# Keys a resume may not change: the model (the checkpoint's weights fit only it), and the data stream (the
# checkpoint's data position counts batches of this stream). Groups are refused by name too (`model=...`).
_DATA_STREAM = "would change the data stream (the checkpoint's data position counts its batches) of"
_FROZEN_ON_RESUME = {
    "model": "would change the model of",
    "data": _DATA_STREAM,
    "train.batch_size": _DATA_STREAM,
    "train.seq_len": _DATA_STREAM,
    "train.seed": "would change the data order and per-step randomness of",
}


def _frozen_reason(key: str) -> str | None:
    for frozen, reason in _FROZEN_ON_RESUME.items():
        if key == frozen or key.startswith(frozen + "."):
            return reason
    return None


def resume_config(cfg: DictConfig, info: JobInfo) -> DictConfig:
    """Continue RUN_DIR with its saved config; explicit overrides of this command may change anything but the
    model and the data stream (e.g. `train.max_steps` to train longer, `logging.*`, `eval.*`)."""
    run_dir = Path(cfg.resume).expanduser()
    saved_path = run_dir / "config_resolved.yaml"
    if not saved_path.exists():
        raise FileNotFoundError(f"resume={cfg.resume!r}: no config_resolved.yaml there (not a run directory)")
    if run_dir.resolve() != Path(info.run_dir).resolve():
        raise ConfigError(
            f"resume={cfg.resume!r} continues that run in its own directory, but this job's directory is "
            f"{info.run_dir}: drop hydra.run.dir, and resume one run per command (not with -m)"
        )
    saved = OmegaConf.load(saved_path)
    overrides = [o for o in info.overrides if not o.startswith(("hydra.", "resume=", "+resume="))]
    changes = [o.lstrip("+~") for o in overrides]
    refused = {}
    for o in changes:
        reason = _frozen_reason(o.split("=", 1)[0])
        if reason:
            refused.setdefault(reason, []).append(o)
    if refused:
        raise ConfigError("; ".join(
            f"resume: {', '.join(keys)} {reason} {run_dir}" for reason, keys in refused.items())
            + "; a resumed run keeps its model and data (start a new run instead)")
    merged = OmegaConf.merge(cfg, saved)  # typed node from this composition, values from the saved run
    for o in changes:
        key = o.split("=", 1)[0]
        # the value as this command's composition parsed it (types, null, lists)
        OmegaConf.update(merged, key, OmegaConf.select(cfg, key), merge=False)
    merged.resume = str(run_dir)
    return merged


def _mask_token_id(cfg, tokenizer, vocab_size: int) -> int:
    mid = cfg.model.mask_token_id
    if mid is None:
        tok_id = tokenizer.convert_tokens_to_ids(cfg.model.mask_token)
        if tok_id is None or tok_id == tokenizer.unk_token_id:
            raise ConfigError(
                f"model.mask_token_id=None and the tokenizer has no {cfg.model.mask_token!r} token: set "
                "model.mask_token_id to an unused embedding row (Qwen3: 151669)"
            )
        mid = tok_id
    if not 0 <= mid < vocab_size:
        raise ConfigError(f"model.mask_token_id={mid} is invalid: outside the target's vocabulary of {vocab_size}")
    return int(mid)


def _total_steps(cfg) -> int:
    steps = cfg.train.max_steps
    if cfg.train.max_tokens:
        per_step = cfg.train.batch_size * cfg.train.seq_len
        steps = min(steps, -(-cfg.train.max_tokens // per_step))
    return int(steps)


def train(cfg: DictConfig, run_dir: Path, info: JobInfo, stop: threading.Event | None = None) -> dict:
    """Build everything from cfg and train. Returns summary.json's content."""
    from dflash.callbacks import RunInfo, build_callbacks
    from dflash.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from dflash.data import build_batches, heldout_prompts, load_tokenizer, read_prompts_file
    from dflash.evaluate import read_eval_json
    from dflash.drafter import DFlashDraftModel
    from dflash.export import build_drafter_config, export_drafter
    from dflash.pipeline import Pipeline
    from dflash.target import DTYPES, TargetModel, load_target_config, resolve_device
    from dflash.tiny import ensure_target
    from dflash.trainer import DrafterTrainer, TargetStep

    stop = stop or threading.Event()
    t_start = time.time()
    torch.manual_seed(cfg.train.seed)

    # --- target, tokenizer, ids (all checks before the heavy loads) ---
    ensure_target(cfg.model)
    target_config = load_target_config(cfg.model.target)
    layer_ids = resolve_target_layer_ids(cfg.model, target_config.num_hidden_layers)
    tokenizer = load_tokenizer(cfg.model.target)
    mask_id = _mask_token_id(cfg, tokenizer, target_config.vocab_size)
    if cfg.data.name == "jsonl":  # a bad data file fails before the target loads
        from dflash.data import jsonl_files

        jsonl_files(cfg.data.path)
    device = resolve_device(cfg.model.device)
    target = TargetModel.load(cfg.model.target, layer_ids, cfg.model.dtype, cfg.model.device)
    batches, skipped_records = build_batches(cfg.data, cfg.train, tokenizer, cfg.model.block_size,
                                             target_model=target.model, target_path=cfg.model.target,
                                             cache_dir=cfg.paths.cache_dir)

    drafter_config = build_drafter_config(target_config, cfg.model, layer_ids, mask_id)
    drafter = DFlashDraftModel(drafter_config).to(device=device, dtype=DTYPES[cfg.model.dtype])
    log.info("drafter: %d layers, %.2fM trainable params, block %d, mask id %d", drafter_config.num_hidden_layers,
             sum(p.numel() for p in drafter.parameters()) / 1e6, cfg.model.block_size, mask_id)
    # the untrained drafter is the baseline that shows what training bought
    untrained = copy.deepcopy(drafter).eval() if cfg.eval.baselines and cfg.eval.num_prompts else None

    total_steps = _total_steps(cfg)
    prompts = (read_prompts_file(cfg.eval.prompts_file, tokenizer) if cfg.eval.prompts_file else
               heldout_prompts(tokenizer, cfg.data, cfg.eval.num_prompts, cfg.eval.prompt_len, cfg.train.seed))
    prompts = prompts[: cfg.eval.num_prompts]

    # --- resume ---
    wandb_run_id = None
    resume_ckpt = latest_checkpoint(run_dir) if cfg.resume else None
    callbacks = None

    def run_eval(trainer_step: int, final: bool = False) -> dict:
        if not prompts:
            return {}
        from dflash.evaluate import evaluate, snapshot_drafter, write_eval_json

        snap = snapshot_drafter(drafter)  # a consistent copy; training may go on in other threads
        t0 = time.time()
        res = evaluate(target.model, snap, prompts, max_new_tokens=cfg.eval.max_new_tokens,
                       block_size=cfg.model.block_size, temperature=cfg.eval.temperature,
                       baselines=cfg.eval.baselines and final, ngram=cfg.eval.prompt_lookup_ngram,
                       untrained_drafter=untrained if final else None, seed=cfg.train.seed,
                       eos_id=tokenizer.eos_token_id, tokenizer=tokenizer)
        details = res.pop("details", None)
        res = {k: float(v) for k, v in res.items() if isinstance(v, (int, float))}
        log.info("eval at step %d: tau %.3f%s (%.1fs)", trainer_step, res.get("eval/tau", float("nan")),
                 f", prompt-lookup {res['eval/tau_baseline']:.3f}" if "eval/tau_baseline" in res else "",
                 time.time() - t0)
        callbacks.on_eval({"step": trainer_step, **res})
        if final:
            write_eval_json(run_dir / "eval.json", {**res, "details": details}, step=trainer_step,
                            block_size=cfg.model.block_size)
        return res

    def checkpoint(trainer) -> Path:
        path = save_checkpoint(run_dir, drafter, trainer.state_dict(),
                               # a resumed job without W&B keeps the id for the next resume that has it
                               {"wandb_run_id": callbacks.state().get("wandb_run_id") or wandb_run_id,
                                "target": cfg.model.target},
                               cfg.checkpoint.keep_last)
        callbacks.on_checkpoint(trainer.step, str(path))
        return path

    def after_step(trainer) -> None:
        if cfg.checkpoint.enabled and cfg.checkpoint.every_steps and trainer.step % cfg.checkpoint.every_steps == 0:
            checkpoint(trainer)
        if cfg.eval.every_steps and trainer.step % cfg.eval.every_steps == 0 and not trainer.done():
            run_eval(trainer.step)

    trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps, after_step)
    if resume_ckpt is not None:
        meta = load_checkpoint(resume_ckpt, drafter, trainer)
        wandb_run_id = meta.get("wandb_run_id")
        log.info("resuming %s from %s (step %d)", run_dir, resume_ckpt.name, trainer.step)
        _truncate_metrics(run_dir / "metrics.jsonl", trainer.step)
    elif cfg.resume:
        log.warning("resume=%s: no complete checkpoint, starting from step 0", cfg.resume)

    callbacks = build_callbacks(cfg, run_dir, total_steps)
    callbacks.on_run_start(RunInfo(
        run_dir=run_dir, config=redact(OmegaConf.to_container(cfg, resolve=True)), max_steps=total_steps,
        job_name=info.job_name, sweep_dir=info.sweep_dir, experiment=cfg.experiment, wandb_run_id=wandb_run_id,
        start_step=trainer.step,
    ))
    status, reason = "completed", None
    summary: dict = {}
    pipeline = None
    try:
        def on_tick(sample: dict) -> None:
            metrics = trainer.metrics()
            metrics["time_s"] = round(time.time() - t_start, 3)
            metrics.update(sample)
            if skipped_records:
                metrics["data/skipped_records"] = skipped_records
            summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
            callbacks.on_metrics(metrics)

        pipeline = Pipeline(
            batches.iterate(*trainer.next_data),
            TargetStep(target, device, cfg.train.fail_target_at_batch),
            trainer.step_fn,
            mode=cfg.pipeline.mode, queue_size=cfg.pipeline.queue_size, queue_bytes=cfg.pipeline.queue_bytes,
            target_workers=cfg.pipeline.target_workers, monitor_interval_s=cfg.pipeline.monitor_interval_s,
            on_tick=on_tick, join_timeout_s=cfg.pipeline.join_timeout_s,
            threads_per_stage=_threads_per_stage(cfg, device), stop_event=stop,
        )
        if trainer.done():
            log.info("nothing to train: step %d of %d already done", trainer.step, total_steps)
        else:
            pipeline.run()
        if _drafter_still_running(pipeline):
            raise RuntimeError(
                f"the drafter stage did not stop within pipeline.join_timeout_s={cfg.pipeline.join_timeout_s} s "
                "(still inside a step, a periodic eval or a checkpoint); its weights may be mid-update, so no "
                "final checkpoint or export was written. Resume from the last checkpoint; raise "
                "pipeline.join_timeout_s if steps or evals of this model take longer")
        if stop.is_set():
            status, reason = "interrupted", "stopped by signal"
    except BaseException:
        status = "failed"
        raise
    finally:
        try:
            last = latest_checkpoint(run_dir)
            if (trainer.step > 0 and cfg.checkpoint.enabled and not _drafter_still_running(pipeline)
                    and (last is None or last.name != f"step_{trainer.step}")):
                checkpoint(trainer)  # on every exit path: lose at most the current step
        except BaseException:
            status = "failed"  # e.g. a full disk: the callbacks below end as failed, not never
            raise
        finally:
            if status != "completed":
                callbacks.on_run_end("failed" if status == "failed" else status, summary)
    # --- completed (or interrupted) ---
    try:
        export_drafter(drafter, run_dir / "drafter", target=cfg.model.target)
        if status == "completed" and cfg.eval.final:
            done_before = read_eval_json(run_dir / "eval.json")
            if done_before is not None and done_before.get("step") == trainer.step:  # resumed a completed run
                log.info("final eval at step %d already in eval.json; not repeated", trainer.step)
                summary.update({k: v for k, v in done_before["metrics"].items() if isinstance(v, (int, float))})
            else:
                summary.update(run_eval(trainer.step, final=True))
        summary.update({"step": trainer.step, "tokens": trainer.tokens,
                        "wall_time_s": round(time.time() - t_start, 3), "status": status})
        write_json(run_dir / "summary.json", summary)
    except BaseException:
        if status == "completed":  # an interrupted run has ended its callbacks already
            callbacks.on_run_end("failed", summary)
        raise
    if status == "completed":
        callbacks.on_run_end(status, summary)
    return {**summary, "_status": status, "_reason": reason}


def _drafter_still_running(pipeline) -> bool:
    """A drafter thread abandoned by the pipeline's join timeout may still change the weights."""
    return pipeline is not None and "dflash-drafter" in pipeline.leftover_threads


def _threads_per_stage(cfg, device: torch.device) -> int | None:
    """CPU: each concurrently running stage gets its share of the cores (oversubscribing them slows both)."""
    if device.type != "cpu":
        return None
    if cfg.pipeline.threads_per_stage is not None:
        return cfg.pipeline.threads_per_stage
    stages = cfg.pipeline.target_workers + 1 if cfg.pipeline.mode == "async" else 1
    return max(1, torch.get_num_threads() // stages)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines past the resumed checkpoint's step, so the resumed run appends without duplicates."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the crash
        if isinstance(record, dict) and record.get("step", 0) <= step:
            keep.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in keep))
