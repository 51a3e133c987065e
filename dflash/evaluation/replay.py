"""Tau by exact replay of greedy verification (`eval.replay=true`): what a sweep can afford on a real target.

At temperature 0 speculative decoding emits the target's own greedy output whatever the drafter (lossless); only
how many tokens each cycle accepts depends on the drafter. So the target's greedy continuation of each prompt,
its argmax after every position and its features are computed once per (target, prompt, decode settings): a
`Trace`, cached under `<paths.cache_dir>/replay/` beside the feature store and shared by every job of a sweep.
Each drafter's accepted lengths are then `verify_generate`'s loop walked over the trace: the cycle at anchor s
accepts 1 + the leading positions where the drafter's block at s (drafted from the features of the positions
before s, as in decoding, by the family's own proposal rule: DSpark's Markov head and DFlash2's selector choose
inside the block from the anchor and their own earlier choices, which the trace does not change) matches the
target's argmax; the next anchor follows the accepted tokens; the loop ends as verify_generate's does (z-lab's
cycle rule, a stop token). A confidence head's calibration comes from its predictions at the cycles visited.
Prompt lookup replays the same way (its drafts depend on the tokens alone). A job runs no target forward, only the
drafter's blocks.

Exact up to float round-off: the trace's argmax and features come from one forward over the whole sequence,
decoding's from chunked forwards through a KV cache, and a near-tie can flip an argmax. `replay_ties` counts the
positions where the one-forward argmax differs from the greedy decode's token; tests/test_replay.py checks the
replay against full decoding. The final eval of a single run keeps full decoding (eval.replay=false), which also
measures speed and losslessness.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash.evaluation.decoding import EosIds, hf_model, lookup_draft, speculative_generate
from dflash.evaluation.intervals import tau_intervals
from dflash.evaluation.sim_tau import drafted_lengths, target_pass
from dflash.model.drafter import DFlashDraftModel

log = logging.getLogger(__name__)

TRACE_VERSION = 1  # bump when a trace's contents or the walk change: older traces are recomputed


@dataclass
class Trace:
    """The target's side of greedy decoding of one prompt, enough to replay any drafter on it."""

    prompt: list[int]
    continuation: list[int]  # greedy tokens after the prompt, max_new_tokens + block_size of them (no stop)
    target_next: torch.Tensor  # (S,) the one-forward argmax after each position of prompt + continuation
    features: torch.Tensor  # (S, n_feat * H) the drafter's context features of every position
    # the greedy decode's seconds, on whichever machine made the trace, stop token and all: cached, never reported
    # (a replayed job decodes nothing, so it has no speed of its own; eval.replay reports none)
    decode_time_s: float

    @property
    def ties(self) -> int:
        """Positions where the one-forward argmax is not the greedy decode's next token."""
        p = len(self.prompt)
        return int((self.target_next[p - 1 : p - 1 + len(self.continuation)] != torch.tensor(self.continuation)).sum())


@torch.no_grad()
def trace_prompt(target_model: nn.Module, prompt: Sequence[int], max_new_tokens: int, block_size: int,
                 layer_ids: Sequence[int]) -> Trace:  # fmt: skip
    """The target's greedy continuation (block_size tokens past max_new_tokens, past any stop token, so every
    block the loop can verify fits) through the eval's own target-only loop, then one forward for its argmax and
    features."""
    model = hf_model(target_model)
    greedy = speculative_generate(model, None, list(prompt), max_new_tokens + block_size, 1, eos_id=None)
    target_next, feats = target_pass(model, list(prompt) + greedy.tokens, layer_ids)
    return Trace(list(prompt), list(greedy.tokens), target_next[0].cpu(), feats[0].float().cpu(), greedy.decode_time_s)


def walk(lengths_at: Callable[[int], int], continuation: Sequence[int], max_new_tokens: int,
         eos: frozenset[int]) -> list[int]:  # fmt: skip
    """verify_generate's loop over a trace: lengths_at(k) = accepted length of the cycle whose anchor is the
    continuation's k-th token. The emitted tokens are the greedy continuation's (lossless)."""
    new, accept = [continuation[0]], []
    while len(new) - 1 < max_new_tokens:
        length = lengths_at(len(new) - 1)
        emit = list(continuation[len(new) : len(new) + length])
        accept.append(length)
        new.extend(emit)
        if eos.intersection(emit) or new[0] in eos:
            break
    return accept


def output_tokens(trace: Trace, max_new_tokens: int, eos: frozenset[int]) -> list[int]:
    """What the loop returns: the continuation up to the first stop token, at most max_new_tokens."""
    out = list(trace.continuation[:max_new_tokens])
    for i, tok in enumerate(out):
        if tok in eos:
            return out[: i + 1]
    return out


def replay_drafter(drafter: DFlashDraftModel, target_model: nn.Module, trace: Trace, max_new_tokens: int,
                   block_size: int, eos: frozenset[int], drafts: list | None = None,
                   confidences: list | None = None) -> list[int]:  # fmt: skip
    """The drafter's accepted lengths on the trace, as greedy speculative decoding gives them, its family's own
    proposal rule included (`drafts` and `confidences`, when given, receive the drafts and the confidence head's
    predictions of the cycles visited, in order)."""
    model = hf_model(target_model)
    p, seq = len(trace.prompt), trace.prompt + trace.continuation
    predicted: list = []
    sim, _, proposed = drafted_lengths(
        drafter, model.get_input_embeddings(), model.get_output_embeddings(), seq, trace.target_next[None],
        trace.features[None], p, p + max_new_tokens - 1, block_size, predicted,
    )  # fmt: skip

    def length(k: int) -> int:
        if drafts is not None:
            drafts.append(proposed[k])
        if confidences is not None and predicted:
            confidences.append(predicted[k])
        return sim[k]

    return walk(length, trace.continuation, max_new_tokens, eos)


def replay_lookup(trace: Trace, max_new_tokens: int, block_size: int, ngram: int, eos: frozenset[int]) -> list[int]:
    """Prompt lookup's accepted lengths on the trace."""
    p, seq = len(trace.prompt), trace.prompt + trace.continuation
    nxt = trace.target_next.tolist()

    def length(k: int) -> int:
        anchor = p + k
        drafts = lookup_draft(seq[: anchor + 1], ngram, block_size - 1)
        a = 0
        while a < len(drafts) and drafts[a] == nxt[anchor + a]:
            a += 1
        return a + 1

    return walk(length, trace.continuation, max_new_tokens, eos)


def target_identity(target: str) -> dict:
    """Who the traces are of: the target's hashed files, every weight shard included (a hub name: its revision),
    as the feature store's manifest names it."""
    from dflash.data.fingerprint import target_hashes

    return target_hashes(str(target), extra=("build_info.json",))


class TraceCache:
    """Traces on disk, one safetensors file per (target, dtype, layers, decode settings, prompt); written
    atomically, so concurrent jobs of a sweep at worst compute one twice."""

    def __init__(self, root: str | Path, target: dict, settings: dict):
        self.root = Path(root).expanduser()
        self.key = {"version": TRACE_VERSION, "target": target, **settings}
        self.hits = self.misses = 0

    def path(self, prompt: Sequence[int]) -> Path:
        blob = json.dumps({**self.key, "prompt": list(prompt)}, sort_keys=True).encode()
        return self.root / f"{hashlib.sha256(blob).hexdigest()[:32]}.safetensors"

    def get(self, target_model: nn.Module, prompt: Sequence[int]) -> Trace:
        path = self.path(prompt)
        if path.is_file():
            self.hits += 1
            t = load_file(str(path))
            meta = json.loads(bytes(t["meta"].tolist()).decode())
            return Trace(list(prompt), meta["continuation"], t["target_next"], t["features"], meta["decode_time_s"])
        self.misses += 1
        s = self.key
        trace = trace_prompt(target_model, prompt, s["max_new_tokens"], s["block_size"], s["layer_ids"])
        meta = json.dumps({"continuation": trace.continuation, "decode_time_s": trace.decode_time_s}).encode()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        tensors = {"target_next": trace.target_next.contiguous(), "features": trace.features.contiguous(),
                   "meta": torch.tensor(list(meta), dtype=torch.uint8)}  # fmt: skip
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        return trace


def replay_evaluate(
    target_model: nn.Module,
    drafter: DFlashDraftModel,
    prompts: Sequence[Sequence[int]],
    cache: TraceCache,
    *,
    max_new_tokens: int,
    block_size: int,
    eos_id: EosIds = None,
    baselines: bool = True,
    ngram: int = 3,
    untrained_drafter: DFlashDraftModel | None = None,
) -> dict:
    """evaluate()'s tau metrics by replay: eval/tau (and its acceptance statistics), eval/tau_baseline (prompt
    lookup), eval/tau_untrained, eval/replay_ties, a confidence head's calibration (eval/conf_*, from its
    predictions at the cycles visited); `details` per prompt (tokens, accept lengths). No speed and no
    losslessness: nothing is decoded (the traces' decode times are another job's, maybe another machine's)."""
    from dflash.core.terminal import display
    from dflash.evaluation.calibration import confidence_calibration
    from dflash.evaluation.decoding import _eos_set, acceptance_stats

    eos = _eos_set(eos_id)
    drafters = [d for d in (drafter, untrained_drafter) if d is not None]
    modes = [d.training for d in drafters]
    rows, confidences = [], []
    has_confidence = getattr(drafter, "confidence_head", None) is not None  # DSpark's, as decoding's proposer asks
    try:
        for d in drafters:
            d.eval()
        with torch.no_grad(), display().phase("eval (replay)", len(prompts)) as phase:
            for prompt in prompts:
                trace = cache.get(target_model, prompt)
                predicted: list | None = [] if has_confidence else None
                lengths = replay_drafter(drafter, target_model, trace, max_new_tokens, block_size, eos,
                                         confidences=predicted)  # fmt: skip
                confidences.append(predicted)
                row = {"prompt_len": len(prompt), "tokens": output_tokens(trace, max_new_tokens, eos),
                       "accept_lengths": lengths, "ties": trace.ties}  # fmt: skip
                if baselines:
                    row["baseline_accept_lengths"] = replay_lookup(trace, max_new_tokens, block_size, ngram, eos)
                if untrained_drafter is not None:
                    args = (untrained_drafter, target_model, trace, max_new_tokens, block_size, eos)
                    row["untrained_accept_lengths"] = replay_drafter(*args)
                rows.append(row)
                phase.advance()
    finally:
        for d, mode in zip(drafters, modes):
            d.train(mode)
    metrics: dict = {
        f"eval/{k}": v for k, v in acceptance_stats([r["accept_lengths"] for r in rows], block_size).items()
    }
    if has_confidence:
        metrics.update(confidence_calibration(confidences, [r["accept_lengths"] for r in rows]))
    if baselines:
        metrics["eval/tau_baseline"] = acceptance_stats([r["baseline_accept_lengths"] for r in rows], block_size)["tau"]
    if untrained_drafter is not None:
        untrained = [r["untrained_accept_lengths"] for r in rows]
        metrics["eval/tau_untrained"] = acceptance_stats(untrained, block_size)["tau"]
    lookup_units = [[r["baseline_accept_lengths"]] for r in rows] if baselines else None
    metrics.update(tau_intervals([[r["accept_lengths"]] for r in rows], lookup_units, prefix="eval/"))  # 95%, paired
    metrics["eval/replay_ties"] = float(sum(r["ties"] for r in rows))
    metrics["eval/num_prompts"] = len(prompts)
    metrics["eval/new_tokens"] = sum(len(r["tokens"]) for r in rows)
    log.info("replay: %d traces reused, %d computed in %s", cache.hits, cache.misses, cache.root)
    metrics["details"] = {"replay": True, "block_size": block_size, "max_new_tokens": max_new_tokens, "prompts": rows}
    return metrics
