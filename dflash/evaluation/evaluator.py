"""Evaluation of a drafter: `evaluate` runs target-only, DFlash and the baselines (prompt lookup, the
untrained drafter) on the same prompts and returns one flat `eval/...` dict plus `details` for eval.json;
`Evaluator` is the training run's manager of it: the prompts, when to evaluate, the baselines and eval.json.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.core import interrupts
from dflash.core.distributed import World
from dflash.core.repetition import degenerate_share, is_degenerate
from dflash.core.rundir import RunDir
from dflash.core.terminal import display
from dflash.data.chat_dataset import ChatData
from dflash.data.prompts import heldout_prompts, read_prompts_file
from dflash.evaluation.calibration import confidence_calibration
from dflash.evaluation.decoding import (
    EosIds,
    GenerationResult,
    acceptance_stats,
    hf_model,
    module_device,
    module_dtype,
    prompt_lookup_generate,
    speculative_generate,
)
from dflash.evaluation.intervals import tau_intervals
from dflash.evaluation.replay import TraceCache, replay_evaluate, target_identity
from dflash.evaluation.sim_tau import sim_tau_metrics
from dflash.model.build import init_drafter
from dflash.model.drafter import DFlashDraftModel
from dflash.model.families import check_block_size
from dflash.train.parallelize import frozen_copy, full_state_dict

log = logging.getLogger(__name__)


def _tok_s(results: Sequence[GenerationResult]) -> float:
    tokens = sum(r.decode_tokens for r in results)
    seconds = sum(r.decode_time_s for r in results)
    return tokens / seconds if seconds > 0 else float("nan")


def untrained_like(drafter: DFlashDraftModel, seed: int = 0) -> DFlashDraftModel:
    """The drafter as a run with this seed initialised it (`init_drafter`): the `eval/tau_untrained` baseline.
    The caller's global RNG state is left as it was."""
    fresh = init_drafter(copy.deepcopy(drafter.config), seed, module_device(drafter), module_dtype(drafter))
    if getattr(drafter, "d2t", None) is not None:  # a draft vocabulary: the run's maps and head (never trained)
        head = drafter.lm_head.weight
        with torch.no_grad():
            fresh.t2d.copy_(drafter.t2d)
            fresh.d2t.copy_(drafter.d2t)
            fresh.lm_head.weight.copy_(head.full_tensor() if hasattr(head, "full_tensor") else head)
    fresh.requires_grad_(False)
    return fresh.eval()


def _generator(device: torch.device, temperature: float, seed: int) -> torch.Generator | None:
    if temperature <= 0:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def _run_interleaved(
    methods: dict[str, dict],
    prompts: Sequence[Sequence[int]],
    device: torch.device,
    temperature: float,
    seed: int,
    phase=None,
) -> dict[str, list[GenerationResult]]:
    """Each prompt through every method in turn (not each method through every prompt): a change in the machine's
    load while the eval runs (another job starting or ending) then reaches every method's timing alike, so the
    speedups compare like with like. The same per-prompt seed for every method: at T > 0 they sample from
    identically seeded generators."""
    calls = {label: (kw["fn"], {k: v for k, v in kw.items() if k != "fn"}) for label, kw in methods.items()}
    results: dict[str, list[GenerationResult]] = {label: [] for label in methods}
    for i, p in enumerate(prompts):
        interrupts.check("eval")
        for label, (fn, kwargs) in calls.items():
            generator = _generator(device, temperature, seed + i)
            results[label].append(fn(prompt_ids=p, generator=generator, temperature=temperature, **kwargs))
            if phase is not None:
                phase.advance(info=f"{label} {_tok_s(results[label]):.0f} tok/s")
    return results


def evaluate(
    target_model: nn.Module,
    drafter: DFlashDraftModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    block_size: int | None = None,
    temperature: float = 0.0,
    baselines: bool = True,
    ngram: int = 3,
    untrained_drafter: DFlashDraftModel | None = None,
    seed: int = 0,
    eos_id: EosIds = None,
    tokenizer: Any = None,
    warmup: bool = True,
    sim_tau: bool = False,
) -> dict[str, Any]:
    """Speculative decoding of every prompt with the drafter, the target alone and the baselines.

    Returns flat metrics: eval/tau, eval/tau_per_prompt_mean, eval/cycles, eval/acc_hist_<k>, eval/acc_pos_<k>,
    eval/tok_s, eval/tok_s_target_only, eval/speedup (target-only time per decoded token / DFlash time per decoded
    token, prefill excluded; = decode-time ratio when both emit the same tokens), eval/lossless (temperature 0
    only: 1.0 if every DFlash output equals the target-only output), eval/tau_baseline and eval/speedup_baseline
    (prompt lookup, if `baselines`), eval/tau_untrained (if `untrained_drafter`), eval/num_prompts,
    eval/new_tokens, eval/time_s, eval/degenerate_target_only (share of the target's own outputs that end in a loop of a
    short pattern: dflash/core/repetition.py); plus `details` (per prompt: prompt length, tokens, accept lengths)
    for eval.json.

    block_size: None = the drafter's. eos_id: stop token(s); None = always generate max_new_tokens.
    tokenizer: optional, adds prompt/output text lengths and the output text to `details`.
    warmup: one short untimed generation first, so lazy initialisation does not count against the first method.
    sim_tau: add the teacher-forced estimates eval/sim_tau, eval/avg_streak_data (prompt text) and
    eval/sim_tau_greedy (prompt + the target-only output), `dflash.evaluation.sim_tau`.
    The drafter is evaluated in eval mode under no_grad and put back in its previous mode afterwards.
    """
    if not prompts:
        raise ValueError("evaluate: no prompts (eval.num_prompts = 0 or an empty prompts file)")
    block_size = int(block_size or drafter.block_size)
    check_block_size(drafter, block_size)  # >= 2, and one the family can run (DFlash2: its training block only)
    model = hf_model(target_model)
    device = module_device(model)
    drafters = [d for d in (drafter, untrained_drafter) if d is not None]
    modes = [d.training for d in drafters]
    t_start = time.perf_counter()
    common = dict(max_new_tokens=max_new_tokens, eos_id=eos_id)
    try:
        for d in drafters:
            d.eval()
        runs = 2 + bool(baselines) + (untrained_drafter is not None)
        with torch.no_grad(), display().phase("eval", runs * len(prompts)) as phase:
            if warmup:
                short = dict(max_new_tokens=min(max_new_tokens, 2 * block_size), eos_id=None)
                speculative_generate(model, None, prompts[0], block_size=1, **short)
                speculative_generate(model, drafter, prompts[0], block_size=block_size, **short)
            # every method decodes the same prompts through the same loop (block size 1 = the target alone)
            spec = dict(fn=speculative_generate, target_model=model, block_size=block_size)
            methods = {
                "target only": dict(spec, drafter=None, block_size=1),
                "dflash": dict(spec, drafter=drafter),
                "prompt lookup": dict(fn=prompt_lookup_generate, target_model=model, block_size=block_size, ngram=ngram)
                if baselines
                else None,
                "untrained": dict(spec, drafter=untrained_drafter) if untrained_drafter is not None else None,
            }
            wanted = {label: {**kw, **common} for label, kw in methods.items() if kw is not None}
            results = _run_interleaved(wanted, prompts, device, temperature, seed, phase=phase)
            target_only, dflash = results["target only"], results["dflash"]
            lookup, untrained = results.get("prompt lookup"), results.get("untrained")
            estimates = {}
            # after the timed runs: the same prompts, the target's own continuations of them; each block drafted
            # by the family's own proposal rule (sim_tau.drafted_lengths)
            if sim_tau:
                estimates = sim_tau_metrics(model, drafter, prompts, [r.tokens for r in target_only], block_size)
    finally:
        for d, mode in zip(drafters, modes):
            d.train(mode)

    stats = acceptance_stats([r.accept_lengths for r in dflash], block_size)
    metrics: dict[str, Any] = {f"eval/{k}": v for k, v in stats.items()}
    metrics.update(estimates)
    if any(r.confidences is not None for r in dflash):  # a confidence head (DSpark): predicted vs observed
        metrics.update(confidence_calibration([r.confidences for r in dflash], [r.accept_lengths for r in dflash]))
    tok_s, tok_s_target = _tok_s(dflash), _tok_s(target_only)
    metrics["eval/tok_s"] = tok_s
    metrics["eval/tok_s_target_only"] = tok_s_target
    metrics["eval/speedup"] = tok_s / tok_s_target if tok_s_target > 0 else float("nan")
    if temperature <= 0:
        mismatched = [i for i, (d, t) in enumerate(zip(dflash, target_only)) if d.tokens != t.tokens]
        metrics["eval/lossless"] = 0.0 if mismatched else 1.0
        if mismatched:
            log.warning(
                "greedy DFlash output differs from target-only output on prompts %s (float round-off in "
                "the batched verify forward, or a bug)",
                mismatched,
            )
    if lookup is not None:
        metrics["eval/tau_baseline"] = acceptance_stats([r.accept_lengths for r in lookup], block_size)["tau"]
        metrics["eval/speedup_baseline"] = _tok_s(lookup) / tok_s_target if tok_s_target > 0 else float("nan")
    if untrained is not None:
        metrics["eval/tau_untrained"] = acceptance_stats([r.accept_lengths for r in untrained], block_size)["tau"]
    # 95% intervals over prompts (dflash/evaluation/intervals.py): tau, and tau minus prompt lookup's, paired
    lookup_units = None if lookup is None else [[r.accept_lengths] for r in lookup]
    metrics.update(tau_intervals([[r.accept_lengths] for r in dflash], lookup_units, prefix="eval/"))
    metrics["eval/num_prompts"] = len(prompts)
    metrics["eval/new_tokens"] = sum(len(r.tokens) for r in dflash)
    # of the target's own answers (what the drafter is asked to match), not the drafter's
    metrics["eval/degenerate_target_only"] = degenerate_share([r.tokens for r in target_only], _stop_ids(eos_id))
    metrics["eval/time_s"] = time.perf_counter() - t_start
    metrics["details"] = _details(
        prompts,
        dflash,
        target_only,
        lookup,
        untrained,
        tokenizer,
        dict(block_size=block_size, max_new_tokens=max_new_tokens, temperature=temperature, ngram=ngram, seed=seed),
        _stop_ids(eos_id),
    )
    log.info(
        "eval: tau %.3f, prompt lookup %s (both pooled over cycles), untrained %s, speedup %.2fx over %d prompts",
        metrics["eval/tau"],
        _fmt(metrics.get("eval/tau_baseline")),
        _fmt(metrics.get("eval/tau_untrained")),
        metrics["eval/speedup"],
        len(prompts),
    )
    return metrics


def _stop_ids(eos_id: EosIds) -> tuple[int, ...]:
    return () if eos_id is None else (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _details(prompts, dflash, target_only, lookup, untrained, tokenizer, settings: dict, stop_ids=()) -> dict:
    per_prompt = []
    for i, (p, d, t) in enumerate(zip(prompts, dflash, target_only)):
        row: dict[str, Any] = {
            "prompt_len": len(p),
            "tokens": d.tokens,
            "accept_lengths": d.accept_lengths,
            "decode_time_s": d.decode_time_s,
            "target_only_decode_time_s": t.decode_time_s,
            "target_only_decode_tokens": t.decode_tokens,
            "matches_target_only": d.tokens == t.tokens,
            "target_only_degenerate": is_degenerate(t.tokens, stop_ids),
        }
        if lookup is not None:
            row["baseline_accept_lengths"] = lookup[i].accept_lengths
        if untrained is not None:
            row["untrained_accept_lengths"] = untrained[i].accept_lengths
        if tokenizer is not None:
            row["prompt_text"] = tokenizer.decode(list(p))
            row["prompt_chars"] = len(row["prompt_text"])
            row["output_text"] = tokenizer.decode(d.tokens)
        per_prompt.append(row)
    return {**settings, "prompts": per_prompt}


def on_device_of(drafter: nn.Module, model: nn.Module) -> nn.Module:
    """The drafter on `model`'s device: a copy when it trains elsewhere (parallel.drafter_device), else itself."""
    device = module_device(model)
    return drafter if module_device(drafter) == device else copy.deepcopy(drafter).to(device)


def choose_prompts(eval_cfg, data_cfg, tokenizer, seed: int, **heldout) -> list[list[int]]:
    """A run's eval prompts (token ids): `eval.prompts_file`, else `eval.num_prompts` prompts from the held-out
    part of the run's data (`heldout`: `heldout_prompts`' chat, target and cache_dir). The one place that
    chooses them; eval.json records the result."""
    if eval_cfg.prompts_file:
        prompts = read_prompts_file(eval_cfg.prompts_file, tokenizer)
    else:
        prompts = heldout_prompts(tokenizer, data_cfg, eval_cfg.num_prompts, eval_cfg.prompt_len, seed, **heldout)
    return prompts[: eval_cfg.num_prompts]


def trace_cache_for(cfg, layer_ids: Sequence[int]) -> TraceCache:
    """eval.replay's traces: under <paths.cache_dir>/replay, keyed by the target's files and the decode settings
    (every job of a sweep over the drafter's training shares them)."""
    settings = {"max_new_tokens": cfg.eval.max_new_tokens, "block_size": cfg.model.block_size,
                "layer_ids": list(layer_ids), "dtype": cfg.model.dtype}  # fmt: skip
    return TraceCache(Path(cfg.paths.cache_dir) / "replay", target_identity(cfg.model.target), settings)


class Evaluator:
    """A training run's evaluations: the prompts (chosen once), when to evaluate (`should_eval`), the baselines
    (prompt lookup and the drafter as initialised, at the final eval), and eval.json with the prompts' token
    ids, so `python -m dflash.evaluate RUN_DIR` can repeat the final eval exactly.

    Under data parallelism rank 0 evaluates; every rank takes part in gathering the weights first (a
    collective under fsdp), and the others go on to the next step, where they wait for rank 0.
    `on_result(metrics)` receives every eval's flat metrics with `step` (the run points it at its callbacks).
    """

    def __init__(
        self,
        cfg,
        target,
        drafter: DFlashDraftModel,
        tokenizer,
        run: RunDir,
        world: World | None = None,
        chat: ChatData | None = None,
        *,
        model: nn.Module | None = None,
        on_result: Callable[[dict], None] | None = None,
        on_final: Callable[[int, dict, dict], None] | None = None,
    ):
        self.cfg = cfg.eval
        self.block_size = cfg.model.block_size
        self.seed = cfg.eval.seed
        self.world = world or World()
        self.target, self.drafter, self.tokenizer, self.run = target, drafter, tokenizer, run
        self.model = model if model is not None else drafter  # the DDP/FSDP-wrapped drafter (weights gathered)
        main = self.world.is_main
        heldout = {"chat": chat, "target": cfg.model.target, "cache_dir": cfg.paths.cache_dir}
        choose = main and self.cfg.num_prompts
        self.prompts = choose_prompts(cfg.eval, cfg.data, tokenizer, self.seed, **heldout) if choose else []
        # the drafter before training, the baseline that shows what training bought: initialised again from
        # train.seed, as `python -m dflash.evaluate RUN_DIR` does, so the CLI replays it exactly
        want = main and self.cfg.baselines and self.prompts
        self.untrained = on_device_of(untrained_like(drafter, cfg.train.seed), target.model) if want else None
        self.trace_cache = trace_cache_for(cfg, self.target_layer_ids()) if cfg.eval.replay and main else None
        self.on_result = on_result or (lambda metrics: None)  # every eval's metrics (the run's callbacks.on_eval)
        self.on_final = on_final or (lambda step, metrics, details: None)  # callbacks.on_final_eval

    def target_layer_ids(self) -> list[int]:
        return list(self.drafter.target_layer_ids)

    def should_eval(self, step: int, done: bool) -> bool:
        """Periodic evals at every `eval.every_steps`; the last step gets the final eval instead. Decided from
        the config alone, so every rank decides the same."""
        return bool(self.cfg.num_prompts and self.cfg.every_steps and step % self.cfg.every_steps == 0 and not done)

    def maybe_eval(self, trainer) -> None:
        if self.should_eval(trainer.step, trainer.done()):
            try:
                self.run_eval(trainer.step)
            except interrupts.Interrupted:  # training stops after this step anyway; the eval is just dropped
                log.warning("eval at step %d abandoned: a stop was requested", trainer.step)

    def _current_weights(self) -> DFlashDraftModel | None:
        """A consistent copy of the drafter's weights (training may go on in other threads); rank 0 only."""
        if not self.world.distributed:
            return frozen_copy(self.drafter)
        state = full_state_dict(self.model, self.world)  # every rank: a collective under fsdp
        return frozen_copy(self.drafter, state, module_device(self.target.model)) if self.world.is_main else None

    def run_eval(self, step: int, final: bool = False, drafter: DFlashDraftModel | None = None) -> dict[str, float]:
        """Evaluate the drafter's current weights (or `drafter`); the final eval adds the baselines and writes
        eval.json."""
        snapshot = drafter if drafter is not None else self._current_weights()
        if snapshot is None or not self.prompts:
            return {}
        snapshot = on_device_of(snapshot, self.target.model)
        log.info("eval at step %d: %d prompts%s", step, len(self.prompts), " with baselines" if final else "")
        t0 = time.time()
        if self.trace_cache is not None:  # eval.replay: no decoding, the target's cached greedy outputs
            result = replay_evaluate(
                self.target.model,
                snapshot,
                self.prompts,
                self.trace_cache,
                max_new_tokens=self.cfg.max_new_tokens,
                block_size=self.block_size,
                eos_id=self.tokenizer.eos_token_id,
                baselines=self.cfg.baselines and final,
                ngram=self.cfg.prompt_lookup_ngram,
                untrained_drafter=self.untrained if final else None,
            )
        else:
            result = self._decode(snapshot, final)
        details = result.pop("details", None)
        metrics = {k: float(v) for k, v in result.items() if isinstance(v, (int, float))}
        log.info(
            "eval at step %d: tau %.3f%s (%.1fs)",
            step,
            metrics.get("eval/tau", float("nan")),
            f", prompt-lookup {metrics['eval/tau_baseline']:.3f}" if "eval/tau_baseline" in metrics else "",
            time.time() - t0,
        )
        self.on_result({"step": step, **metrics})
        if final:
            self.on_final(step, metrics, details or {})
            self.run.write_eval(
                {**metrics, "details": details},
                step=step,
                block_size=self.block_size,
                seed=self.seed,
                prompts=self.prompts,
            )
        return metrics

    def _decode(self, snapshot: DFlashDraftModel, final: bool) -> dict:
        """Full speculative decoding of the prompts: tau, speed, losslessness and the teacher-forced estimates."""
        return evaluate(
            self.target.model,
            snapshot,
            self.prompts,
            max_new_tokens=self.cfg.max_new_tokens,
            block_size=self.block_size,
            temperature=self.cfg.temperature,
            baselines=self.cfg.baselines and final,
            ngram=self.cfg.prompt_lookup_ngram,
            untrained_drafter=self.untrained if final else None,
            seed=self.seed,
            eos_id=self.tokenizer.eos_token_id,
            tokenizer=self.tokenizer,
            sim_tau=True,
        )

    def final(self, step: int, drafter: DFlashDraftModel | None = None) -> dict[str, float]:
        """The final eval, once per step: a resumed, already completed run finds it in eval.json. Rank 0 only;
        `drafter` is the whole trained drafter (gathered from the ranks under data parallelism)."""
        if not self.cfg.final or not self.prompts:
            return {}
        done = self.run.read_eval()
        if done is not None and done.get("step") == step:
            log.info("final eval at step %d already in eval.json; not repeated", step)
            return {k: v for k, v in done["metrics"].items() if isinstance(v, (int, float))}
        if drafter is not None and not self.world.distributed:
            drafter = frozen_copy(drafter)  # as the periodic evals: a detached copy in eval mode
        return self.run_eval(step, final=True, drafter=drafter)
