"""Building one job: the target (or its heads), the data, the drafter, its trainer and the managers, each
complete when constructed (its collaborators and the run's callbacks passed in), every cheap check before the
heavy loads. Every rank builds the same job (a target rank of parallel.target_ranks builds none: it serves)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from dflash.core.config import ConfigError
from dflash.core.distributed import World, resolve_device
from dflash.core.machine import slow_cpu_dtype
from dflash.core.rundir import RunDir
from dflash.data.corpus import jsonl_files
from dflash.data.training_data import TrainingData
from dflash.evaluation.evaluator import Evaluator
from dflash.model.build import build_drafter_config, init_drafter, resolve_mask_token_id
from dflash.model.families import configure_family
from dflash.model.rendering import trained_rendering, warn_if_rendered_otherwise
from dflash.model.target import DTYPES, TargetHeads, TargetModel
from dflash.runner.draft_vocab import counted_maps, put_into, record
from dflash.runner.feature_build import build_store, check_long_enough
from dflash.runner.resume import check_data_unchanged
from dflash.runner.sources import target_and_data, target_files
from dflash.tracking import CallbackList
from dflash.train import faults
from dflash.train.checkpoint import latest_checkpoint
from dflash.train.checkpointer import CheckpointManager
from dflash.train.feature_store import check_manifest, manifest_for, store_path
from dflash.train.init_from import InitSource, find_init_source, load_init_weights
from dflash.train.parallelize import frozen_copy, full_state_dict, parallelize_drafter
from dflash.train.step_watch import watch_first_step
from dflash.train.trainer import DrafterTrainer, total_steps

log = logging.getLogger(__name__)


@dataclass
class Job:
    """Everything a run trains with, built from the config by `build_job`. `drafter` is the module trained
    (and exported), `model` the same drafter as wrapped for data parallelism (DDP/FSDP: what forward,
    backward and checkpoints go through), `target` the frozen target LLM (TargetModel; `target.model` is the
    Hugging Face module)."""

    target: TargetModel | None  # None on a drafter rank of parallel.target_ranks other than rank 0 (heads only)
    drafter: torch.nn.Module
    device: torch.device
    data: TrainingData
    trainer: DrafterTrainer
    checkpoints: CheckpointManager
    evaluator: Evaluator
    world: World = field(default_factory=World)
    model: torch.nn.Module | None = None
    replicas: list = field(default_factory=list)  # parallel.target_devices: a target per device (target first)
    store: Path | None = None  # features=store: the feature store read instead of running the target

    @property
    def fingerprint(self) -> dict | None:
        return self.checkpoints.data_fingerprint

    def gather_drafter(self) -> torch.nn.Module | None:
        """The whole trained drafter, unwrapped, on rank 0 (None elsewhere): the drafter itself in one
        process; under ddp/fsdp its full weights gathered from the ranks (a collective)."""
        if not self.world.distributed:
            return self.drafter
        state = full_state_dict(self.model, self.world)
        return frozen_copy(self.drafter, state, self.device) if self.world.is_main else None


def build_job(
    cfg: DictConfig,
    run: RunDir,
    world: World | None = None,
    callbacks: CallbackList | None = None,
    stop: threading.Event | None = None,
) -> Job:
    """Target, tokenizer, data, drafter, trainer and the managers. `callbacks` receive evals and checkpoints;
    `stop` is the stop request every rank agrees on at a step boundary under data parallelism."""
    world, callbacks = world or World(), callbacks or CallbackList()
    files = target_files(cfg, world)
    mask_id = resolve_mask_token_id(cfg.model, files.tokenizer, files.config.vocab_size)
    if cfg.data.name == "jsonl":  # a bad data file fails before the target loads
        jsonl_files(cfg.data.path)
    if world.distributed and cfg.train.batch_size % world.size:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is the global batch: it must divide by the {world.size} ranks"
        )
    init_source = _init_source(cfg, run, world, files, mask_id)  # checked before the target loads
    par = cfg.parallel
    device = world.device if world.distributed else resolve_device(par.get("drafter_device") or cfg.model.device)
    places = par.get("target_devices") or [str(world.device if world.distributed else resolve_device(cfg.model.device))]
    on_cpu = device.type == "cpu" or any(torch.device(p).type == "cpu" for p in places)
    if on_cpu and (why := slow_cpu_dtype(cfg.model.dtype)):  # said before minutes of silence in the first step
        log.warning(why)
    # parallel.target_ranks: a drafter rank that runs no evals needs only the embedding and LM head (the target
    # ranks compute its features); a 27B target must not share a GPU with the drafter's optimizer
    # features=store: the target runs nowhere but in the evals (rank 0)
    store_mode = cfg.features.name == "store"
    evals_here = world.is_main and bool(cfg.eval.num_prompts or cfg.eval.get("suites"))
    lean = (bool(world.target_ranks) and not world.is_main) or (store_mode and not evals_here)
    loaded = target_and_data(cfg, world, files, [] if lean else places)
    target, fingerprint = loaded.target, loaded.fingerprint
    store = None
    if store_mode:
        if cfg.features.build_missing:  # the ranks share the build (shards dealt round-robin); no one re-hashes
            build_store(cfg, world, files, fingerprint)
        manifest = manifest_for(cfg, files.layer_ids, fingerprint)
        store = store_path(cfg, manifest)
        check_manifest(store, manifest)  # before training: a store of other settings is refused, naming the keys
        check_long_enough(store, cfg)  # and one shorter than the run (it would end the run early)

    drafter_config = build_drafter_config(files.config, cfg.model, files.layer_ids, mask_id)
    configure_family(drafter_config, cfg.drafter)  # drafter=: the family's class and settings
    drafter = init_drafter(drafter_config, cfg.train.seed, device, DTYPES[cfg.model.dtype])
    if target is None:
        heads = TargetHeads.load(cfg.model.target, cfg.model.dtype, device)  # what the trainer reads of the target
    else:
        heads = target if target.device == device else TargetHeads(target, device)
    maps = counted_maps(cfg, world, loaded.data, fingerprint, files.config.vocab_size, store)  # draft_vocab_size
    put_into(drafter, maps, heads.lm_head.weight)
    if init_source is not None:
        init_record = load_init_weights(drafter, init_source)
        if world.is_main:
            run.add_run_info("init_from", init_record, resumed=bool(cfg.resume))
    if world.is_main and (vocab := record(drafter, maps)) is not None:
        run.add_run_info("draft_vocab", vocab, resumed=bool(cfg.resume))
    log.info(
        "drafter: %d layers, %.2fM trainable params, block %d, mask id %d",
        drafter_config.num_hidden_layers,
        sum(p.numel() for p in drafter.parameters()) / 1e6,
        cfg.model.block_size,
        mask_id,
    )
    model = parallelize_drafter(drafter, world, cfg.parallel.mixed_precision)
    evaluator = Evaluator(
        cfg, target, drafter, files.tokenizer, run, world, loaded.data.chat,
        model=model, on_result=callbacks.on_eval, on_final=callbacks.on_final_eval,
    )  # fmt: skip
    checkpoints = CheckpointManager(
        cfg.checkpoint, run.path, drafter, cfg.model.target, world, model,
        data_fingerprint=fingerprint,
        check_before_resume=lambda ckpt, meta: check_data_unchanged(cfg, run, world, ckpt, meta, fingerprint),
        on_saved=callbacks.on_checkpoint,
        tracking_state=callbacks.state,  # the W&B run id, for a resume to continue the same run
    )  # fmt: skip
    first_step = [True]

    def after_step(trainer: DrafterTrainer) -> None:
        if first_step[0]:  # the first collectives may wait for slow preprocessing; later ones need less
            world.set_timeout(cfg.parallel.timeout_s)
            first_step[0] = False
        checkpoints.maybe_save(trainer)
        evaluator.maybe_eval(trainer)

    # under data parallelism a stop is agreed by all ranks at a step boundary (the trainer), never one alone
    stop_requested = stop.is_set if stop is not None and world.distributed else None
    trainer = DrafterTrainer(
        cfg, heads, drafter, mask_id, total_steps(cfg.train), after_step, world, model, stop_requested
    )
    faults.install(trainer, cfg.debug, world.rank)  # +debug=faults drills; nothing without a debug key
    watch_first_step(trainer)  # a first step of minutes (large shapes on a CPU) says what it is doing
    return Job(
        target, drafter, device, loaded.data, trainer, checkpoints, evaluator, world, model, loaded.replicas, store
    )


def _init_source(cfg: DictConfig, run: RunDir, world: World, files, mask_id: int) -> InitSource | None:
    """model.init_from, checked against the drafter this run builds; None when unset, or when a resume finds a
    checkpoint of its own (the run continues from its own weights, not from init_from's)."""
    if not cfg.model.get("init_from"):
        return None
    if cfg.resume and world.broadcast_object(latest_checkpoint(run.path) is not None if world.is_main else None):
        return None
    config = build_drafter_config(files.config, cfg.model, files.layer_ids, mask_id)
    source = find_init_source(cfg.model.init_from, config)
    if world.is_main:  # fine-tuning in another chat rendering than the drafter was trained in (thinking on/off)
        here = dict(cfg.data.get("chat_template_kwargs") or {})
        trained = trained_rendering(cfg.model.init_from)
        warn_if_rendered_otherwise(cfg.model.init_from, trained, here, "this run (model.init_from)")
    return source
