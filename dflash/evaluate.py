"""Real speculative decoding against the target: acceptance length tau, its histogram, baselines, speedup.

One verify loop (z-lab `dflash_generate`, batch size 1) with a pluggable *proposer* that supplies the B-1
draft tokens of each cycle:

    prefill:  target(prompt, output_hidden_states) -> first token, context features of the prompt
    cycle:    drafts  = proposer.propose(seq, new context features, B - 1)
              target([last, d_1 .. d_{B-1}])  (one forward, KV cache)  -> posterior p_0 .. p_{B-1}
              accepted a = number of leading d_k == p_{k-1};  emit d_1 .. d_a, p_a  (a + 1 tokens)
              crop the target KV cache to the accepted prefix; keep the features of the a + 1 kept positions

Proposers: `DFlashProposer` (the drafter, with its own context KV cache), `PromptLookupProposer` (n-gram
lookup in prompt + output, the training-free baseline) and `NullProposer` (block size 1 = plain target-only
decoding, the speed baseline). The output is lossless by construction: every emitted token is the target's
own posterior (argmax at temperature 0, a sample from softmax(logits / T) otherwise; drafts are accepted only
where they equal it), so greedy speculative output equals greedy target decoding up to float round-off.

tau (acceptance length) = accepted drafts + 1 per verify cycle, in [1, B]; `acceptance_stats` pools the cycles
of all prompts. `evaluate` runs target-only, DFlash and the baselines on the same prompts and returns one flat
`eval/...` dict plus `details` for eval.json. CLI: `python -m dflash.evaluate RUN_DIR_OR_DRAFTER_DIR`.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from dflash.drafter import DFlashDraftModel, DraftKVCache
from dflash.snapshot import write_json

log = logging.getLogger(__name__)

__all__ = [
    "GenerationResult",
    "Proposer",
    "NullProposer",
    "DFlashProposer",
    "PromptLookupProposer",
    "lookup_draft",
    "verify_generate",
    "speculative_generate",
    "prompt_lookup_generate",
    "acceptance_stats",
    "evaluate",
    "snapshot_drafter",
    "untrained_like",
    "crop_cache",
    "main",
]

EosIds = int | Sequence[int] | None


@dataclass
class GenerationResult:
    """One prompt's generation.

    tokens: the new tokens (first token from the prefill included; truncated at EOS (kept) or max_new_tokens).
    accept_lengths: per verify cycle, accepted drafts + 1, in [1, block_size] (the last cycle's value is the
        full acceptance even when max_new_tokens truncated what it emitted).
    decode_time_s: wall time of the verify cycles (prefill and first token excluded).
    """

    tokens: list[int]
    accept_lengths: list[int]
    cycles: int
    decode_time_s: float
    prefill_time_s: float = 0.0

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by the decode cycles (all but the prefill's first token)."""
        return max(len(self.tokens) - 1, 0)


# ----------------------------------------------------------------------------------------------- helpers


def _hf_model(model: nn.Module) -> nn.Module:
    """Accept a dflash TargetModel wrapper as well as a bare HF causal LM."""
    from dflash.target import TargetModel

    return model.model if isinstance(model, TargetModel) else model


def _device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _dtype(module: nn.Module) -> torch.dtype:
    p = next(module.parameters(), None)
    return p.dtype if p is not None else torch.float32


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without a sync the timer measures launch time, not compute
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; older versions `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model: nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=getattr(model, "config", None))


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a KV cache.

    Works for `DraftKVCache` and for transformers' DynamicCache in both of its conventions: `crop(max_length)`
    (absolute, transformers < 5.2x) and `crop(tokens_to_remove)` (negative count, newer versions).
    """
    current = cache.get_seq_length()
    if current <= length:
        return
    first = next(iter(inspect.signature(cache.crop).parameters))
    if first == "tokens_to_remove":
        cache.crop(length - current)
    else:
        cache.crop(length)


def _eos_set(eos_id: EosIds) -> frozenset[int]:
    if eos_id is None:
        return frozenset()
    if isinstance(eos_id, int):
        return frozenset([eos_id])
    return frozenset(int(e) for e in eos_id)


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> list[int]:
    """logits (n, V) -> n token ids: argmax at temperature 0, else one sample each from softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist()


def _num_accepted(drafts: list[int], posterior: list[int]) -> int:
    """Leading drafts d_k (k = 1..B-1) equal to the target's posterior at the previous position p_{k-1}."""
    a = 0
    while a < len(drafts) and drafts[a] == posterior[a]:
        a += 1
    return a


def _features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """HF hidden_states (embeddings, layer 0 out, ...) -> (1, seq, n_feat * H): layer id i is hidden_states[i + 1]."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


# --------------------------------------------------------------------------------------------- proposers


class Proposer(Protocol):
    """Supplies the drafts of one verify cycle.

    `needs_features`: whether the loop must run the target with output_hidden_states and hand over context
    features; `layer_ids`: which target layers (id i = HF hidden_states[i + 1]).
    `propose(seq, new_features, num_draft)`: seq = prompt + output so far, its last token is the block's anchor
    (not yet verified into the target cache); new_features (1, n_new, n_feat * H) are the features of the
    positions not handed over before (the prompt at the first call, then the kept positions of the previous
    cycle), None when not needed. Returns exactly `num_draft` token ids.
    """

    needs_features: bool
    layer_ids: list[int]

    def propose(self, seq: list[int], new_features: torch.Tensor | None, num_draft: int) -> list[int]: ...


class NullProposer:
    """No drafts: with block size 1 the loop is plain autoregressive decoding of the target."""

    needs_features = False
    layer_ids: list[int] = []

    def propose(self, seq: list[int], new_features: torch.Tensor | None, num_draft: int) -> list[int]:
        return [seq[-1]] * num_draft


def lookup_draft(seq: Sequence[int], max_ngram: int, num_draft: int) -> list[int]:
    """Prompt-lookup drafts: find the last earlier occurrence of the trailing n-gram of `seq` (n = max_ngram,
    falling back to n - 1 ... 1) and propose the `num_draft` tokens that followed it, padded by repeating the
    last proposed token. No occurrence at all: repeat the last token."""
    if num_draft <= 0:
        return []
    seq = list(seq)
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        # candidate starts end before the trailing n-gram's own position, so a continuation token exists
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i : i + n] == tail:
                cont = seq[i + n : i + n + num_draft]
                return cont + [cont[-1]] * (num_draft - len(cont))
    return [seq[-1]] * num_draft


class PromptLookupProposer:
    """N-gram lookup in prompt + generated text (training-free baseline, `eval/tau_baseline`)."""

    needs_features = False
    layer_ids: list[int] = []

    def __init__(self, ngram: int = 3):
        if ngram < 1:
            raise ValueError(f"ngram={ngram} must be >= 1")
        self.ngram = ngram

    def propose(self, seq: list[int], new_features: torch.Tensor | None, num_draft: int) -> list[int]:
        return lookup_draft(seq, self.ngram, num_draft)


class DFlashProposer:
    """The DFlash drafter as a proposer, for one generation (it owns the drafter's context KV cache).

    Per cycle: block = [anchor, MASK x (B-1)] embedded with the target's input embeddings; the drafter sees only
    the new context features (older ones are cached), positions ctx_len .. start + B - 1; drafts = argmax of the
    target's LM head on block slots 1..B-1 (greedy even at temperature > 0, as z-lab); then the block's own K/V
    are cropped so the cache holds exactly the context.
    """

    needs_features = True

    def __init__(self, drafter: DFlashDraftModel, target_model: nn.Module):
        target_model = _hf_model(target_model)
        self.drafter = drafter
        self.layer_ids = list(drafter.target_layer_ids)
        self.mask_token_id = int(drafter.mask_token_id)
        self.embed = target_model.get_input_embeddings()
        self.lm_head = target_model.get_output_embeddings()
        self.cache = DraftKVCache()
        self.ctx_len = 0  # context positions whose K/V are in the drafter cache
        self.device, self.dtype = _device(drafter), _dtype(drafter)

    @torch.no_grad()
    def draft_logits(self, seq: list[int], new_features: torch.Tensor, num_draft: int) -> torch.Tensor:
        """Logits (num_draft, V) of the drafted slots 1..num_draft of the block anchored at seq[-1]."""
        start = len(seq) - 1  # absolute position of the anchor
        n_new = new_features.shape[1]
        if self.ctx_len + n_new != start:
            raise RuntimeError(
                f"drafter context out of sync: {self.ctx_len} cached + {n_new} new positions != anchor position {start}"
            )
        emb_device = self.embed.weight.device
        block_ids = torch.tensor([[seq[-1]] + [self.mask_token_id] * num_draft], device=emb_device)
        noise = self.embed(block_ids).to(self.device, self.dtype)  # (1, B, H)
        positions = torch.arange(self.ctx_len, start + num_draft + 1, device=self.device).unsqueeze(0)
        out = self.drafter(
            noise, new_features.to(self.device, self.dtype), positions, past_key_values=self.cache
        )  # (1, B, H)
        crop_cache(self.cache, start)  # drop the block's K/V, keep the context
        self.ctx_len = start
        head_w = self.lm_head.weight
        return self.lm_head(out[0, 1:].to(head_w.device, head_w.dtype))

    def propose(self, seq: list[int], new_features: torch.Tensor | None, num_draft: int) -> list[int]:
        if new_features is None:
            raise RuntimeError("DFlashProposer needs context features from the verify loop")
        return self.draft_logits(seq, new_features, num_draft).argmax(dim=-1).tolist()


# ---------------------------------------------------------------------------------------------- the loop


@torch.no_grad()
def verify_generate(
    target_model: nn.Module,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_id: EosIds = None,
) -> GenerationResult:
    """Speculative decoding of one prompt (batch size 1) with drafts from `proposer`; see the module docstring.

    target_model: HF causal LM (or a dflash TargetModel); its dtype and device are used as they are.
    block_size: tokens verified per cycle, anchor included (1 = target-only decoding, the proposer is unused).
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: speculative decoding needs at least one prompt token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    model = _hf_model(target_model)
    device = _device(model)
    cache = _new_cache(model)
    cache_kw = _cache_kwarg(model)
    want_features = proposer.needs_features and block_size > 1
    eos = _eos_set(eos_id)

    # prefill: only the last position's logits (a long prompt's full-vocab logits can take gigabytes)
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def forward(ids: list[int], **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=True,
                    output_hidden_states=want_features, **{cache_kw: cache}, **kwargs)
        feats = _features(out.hidden_states, proposer.layer_ids) if want_features else None
        return out.logits[0], feats  # (len, V), (1, len, n_feat * H)

    _sync(device)
    t0 = time.perf_counter()
    logits, features = forward(list(prompt_ids), **last_only)
    new = _sample(logits[-1:], temperature, generator)
    _sync(device)
    t1 = time.perf_counter()

    seq = list(prompt_ids) + new
    accept_lengths: list[int] = []
    while len(new) < max_new_tokens and new[-1] not in eos:
        start = len(seq) - 1  # the anchor's position; the target cache holds positions 0 .. start - 1
        drafts = proposer.propose(seq, features, block_size - 1) if block_size > 1 else []
        if len(drafts) != block_size - 1:
            raise RuntimeError(f"proposer returned {len(drafts)} drafts, expected {block_size - 1}")
        logits, features = forward([seq[-1], *drafts])
        posterior = _sample(logits, temperature, generator)
        a = _num_accepted(drafts, posterior)
        emit = drafts[:a] + [posterior[a]]  # accepted drafts + the target's token at the first mismatch
        crop_cache(cache, start + a + 1)  # keep anchor + accepted drafts; the bonus token is the next anchor
        if features is not None:
            features = features[:, : a + 1]
        accept_lengths.append(a + 1)
        seq.extend(emit)
        new.extend(emit)
        if eos.intersection(emit):
            break

    for i, tok in enumerate(new):  # stop right after the first EOS
        if tok in eos:
            new = new[: i + 1]
            break
    _sync(device)
    t2 = time.perf_counter()
    return GenerationResult(new[:max_new_tokens], accept_lengths, len(accept_lengths), t2 - t1, t1 - t0)


def speculative_generate(
    target_model: nn.Module,
    drafter: DFlashDraftModel | None,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_id: EosIds = None,
) -> GenerationResult:
    """DFlash speculative decoding of one prompt (z-lab's loop). block_size=1 runs target-only decoding through
    the same loop without calling the drafter (the speed baseline; `drafter` may then be None). The caller puts
    the drafter in eval mode."""
    if block_size == 1:
        proposer: Proposer = NullProposer()
    elif drafter is None:
        raise ValueError("speculative_generate: a drafter is required for block_size > 1")
    else:
        proposer = DFlashProposer(drafter, target_model)
    return verify_generate(target_model, proposer, prompt_ids, max_new_tokens, block_size, temperature, generator,
                           eos_id)


def prompt_lookup_generate(
    target_model: nn.Module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    block_size: int,
    ngram: int = 3,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_id: EosIds = None,
) -> GenerationResult:
    """Speculative decoding with prompt-lookup (n-gram) drafts: the training-free baseline for tau."""
    return verify_generate(target_model, PromptLookupProposer(ngram), prompt_ids, max_new_tokens, block_size,
                           temperature, generator, eos_id)


# ------------------------------------------------------------------------------------------- statistics


def acceptance_stats(accept_lengths_per_prompt: Sequence[Sequence[int]], block_size: int) -> dict[str, float]:
    """Acceptance statistics of verify cycles.

    tau: mean acceptance length over all cycles pooled across prompts (long generations weigh more; this is
        tokens per target forward). tau_per_prompt_mean: mean of per-prompt means (z-lab benchmark.py style;
        prompts without cycles are skipped).
    acc_hist_<k>, k = 1..B: fraction of cycles with acceptance length k.
    acc_pos_<k>, k = 1..B-1: fraction of cycles that accepted at least k drafts (length >= k + 1).
    cycles: number of cycles. With no cycles every rate is NaN.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    pooled = [int(x) for lengths in accept_lengths_per_prompt for x in lengths]
    bad = [x for x in pooled if not 1 <= x <= block_size]
    if bad:
        raise ValueError(f"acceptance lengths {bad[:5]} outside [1, block_size={block_size}]")
    n = len(pooled)
    nan = float("nan")
    stats: dict[str, float] = {"tau": sum(pooled) / n if n else nan, "cycles": float(n)}
    per_prompt = [sum(lengths) / len(lengths) for lengths in accept_lengths_per_prompt if lengths]
    stats["tau_per_prompt_mean"] = sum(per_prompt) / len(per_prompt) if per_prompt else nan
    for k in range(1, block_size + 1):
        stats[f"acc_hist_{k}"] = sum(1 for x in pooled if x == k) / n if n else nan
    for k in range(1, block_size):
        stats[f"acc_pos_{k}"] = sum(1 for x in pooled if x >= k + 1) / n if n else nan
    return stats


def _tok_s(results: Sequence[GenerationResult]) -> float:
    tokens = sum(r.decode_tokens for r in results)
    seconds = sum(r.decode_time_s for r in results)
    return tokens / seconds if seconds > 0 else float("nan")


# ------------------------------------------------------------------------------------------- evaluation


def snapshot_drafter(drafter: DFlashDraftModel) -> DFlashDraftModel:
    """A detached copy of the drafter in eval mode (same device and dtypes, no grads, no optimizer state), so an
    evaluation sees one consistent set of weights while training continues. Take it between optimizer steps
    (from the thread that steps), since copying while an update runs could mix old and new weights."""
    with torch.device("meta"):  # no random init of weights about to be overwritten
        clone = type(drafter)(copy.deepcopy(drafter.config))
    with torch.no_grad():
        state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
        clone.load_state_dict(state, assign=True, strict=True)
        # non-persistent buffers (RoPE inv_freq) are not in the state dict
        src_buffers = dict(drafter.named_buffers())
        for name, _ in list(clone.named_buffers()):
            owner_name, _, attr = name.rpartition(".")
            owner = clone.get_submodule(owner_name) if owner_name else clone
            owner._buffers[attr] = src_buffers[name].detach().clone()
    clone.requires_grad_(False)
    return clone.eval()


def untrained_like(drafter: DFlashDraftModel, seed: int = 0) -> DFlashDraftModel:
    """A freshly initialised drafter with the same config, device and dtype (the `eval/tau_untrained` baseline).
    Seeded without touching the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = type(drafter)(copy.deepcopy(drafter.config))
    fresh.requires_grad_(False)
    return fresh.to(_device(drafter), _dtype(drafter)).eval()


def _generator(device: torch.device, temperature: float, seed: int) -> torch.Generator | None:
    if temperature <= 0:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def _run_all(fn, prompts: Sequence[Sequence[int]], device: torch.device, temperature: float, seed: int,
             **kwargs) -> list[GenerationResult]:
    # the same per-prompt seed for every method: at T > 0 they sample from identically seeded generators
    return [fn(prompt_ids=p, generator=_generator(device, temperature, seed + i), temperature=temperature, **kwargs)
            for i, p in enumerate(prompts)]


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
) -> dict[str, Any]:
    """Speculative decoding of every prompt with the drafter, the target alone and the baselines.

    Returns flat metrics: eval/tau, eval/tau_per_prompt_mean, eval/cycles, eval/acc_hist_<k>, eval/acc_pos_<k>,
    eval/tok_s, eval/tok_s_target_only, eval/speedup (target-only time per decoded token / DFlash time per decoded
    token, prefill excluded; = decode-time ratio when both emit the same tokens), eval/lossless (temperature 0
    only: 1.0 if every DFlash output equals the target-only output), eval/tau_baseline and eval/speedup_baseline
    (prompt lookup, if `baselines`), eval/tau_untrained (if `untrained_drafter`), eval/num_prompts,
    eval/new_tokens, eval/time_s; plus `details` (per prompt: prompt length, tokens, accept lengths) for eval.json.

    block_size: None = the drafter's. eos_id: stop token(s); None = always generate max_new_tokens.
    tokenizer: optional, adds prompt/output text lengths and the output text to `details`.
    warmup: one short untimed generation first, so lazy initialisation does not count against the first method.
    The drafter is evaluated in eval mode under no_grad and put back in its previous mode afterwards.
    """
    if not prompts:
        raise ValueError("evaluate: no prompts (eval.num_prompts = 0 or an empty prompts file)")
    block_size = int(block_size or drafter.block_size)
    if block_size < 2:
        raise ValueError(f"block_size={block_size} must be >= 2 to evaluate a drafter")
    model = _hf_model(target_model)
    device = _device(model)
    drafters = [d for d in (drafter, untrained_drafter) if d is not None]
    modes = [d.training for d in drafters]
    t_start = time.perf_counter()
    common = dict(max_new_tokens=max_new_tokens, eos_id=eos_id)
    try:
        for d in drafters:
            d.eval()
        with torch.no_grad():
            if warmup:
                short = dict(max_new_tokens=min(max_new_tokens, 2 * block_size), eos_id=None)
                speculative_generate(model, None, prompts[0], block_size=1, **short)
                speculative_generate(model, drafter, prompts[0], block_size=block_size, **short)
            target_only = _run_all(speculative_generate, prompts, device, temperature, seed, target_model=model,
                                   drafter=None, block_size=1, **common)
            dflash = _run_all(speculative_generate, prompts, device, temperature, seed, target_model=model,
                              drafter=drafter, block_size=block_size, **common)
            lookup = (_run_all(prompt_lookup_generate, prompts, device, temperature, seed, target_model=model,
                               block_size=block_size, ngram=ngram, **common) if baselines else None)
            untrained = (_run_all(speculative_generate, prompts, device, temperature, seed, target_model=model,
                                  drafter=untrained_drafter, block_size=block_size, **common)
                         if untrained_drafter is not None else None)
    finally:
        for d, mode in zip(drafters, modes):
            d.train(mode)

    stats = acceptance_stats([r.accept_lengths for r in dflash], block_size)
    metrics: dict[str, Any] = {f"eval/{k}": v for k, v in stats.items()}
    tok_s, tok_s_target = _tok_s(dflash), _tok_s(target_only)
    metrics["eval/tok_s"] = tok_s
    metrics["eval/tok_s_target_only"] = tok_s_target
    metrics["eval/speedup"] = tok_s / tok_s_target if tok_s_target > 0 else float("nan")
    if temperature <= 0:
        mismatched = [i for i, (d, t) in enumerate(zip(dflash, target_only)) if d.tokens != t.tokens]
        metrics["eval/lossless"] = 0.0 if mismatched else 1.0
        if mismatched:
            log.warning("greedy DFlash output differs from target-only output on prompts %s (float round-off in "
                        "the batched verify forward, or a bug)", mismatched)
    if lookup is not None:
        metrics["eval/tau_baseline"] = acceptance_stats([r.accept_lengths for r in lookup], block_size)["tau"]
        metrics["eval/speedup_baseline"] = _tok_s(lookup) / tok_s_target if tok_s_target > 0 else float("nan")
    if untrained is not None:
        metrics["eval/tau_untrained"] = acceptance_stats([r.accept_lengths for r in untrained], block_size)["tau"]
    metrics["eval/num_prompts"] = len(prompts)
    metrics["eval/new_tokens"] = sum(len(r.tokens) for r in dflash)
    metrics["eval/time_s"] = time.perf_counter() - t_start
    metrics["details"] = _details(prompts, dflash, target_only, lookup, untrained, tokenizer,
                                  dict(block_size=block_size, max_new_tokens=max_new_tokens, temperature=temperature,
                                       ngram=ngram, seed=seed))
    log.info("eval: tau %.3f (prompt lookup %s, untrained %s), speedup %.2fx over %d prompts",
             metrics["eval/tau"], _fmt(metrics.get("eval/tau_baseline")), _fmt(metrics.get("eval/tau_untrained")),
             metrics["eval/speedup"], len(prompts))
    return metrics


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _details(prompts, dflash, target_only, lookup, untrained, tokenizer, settings: dict) -> dict:
    per_prompt = []
    for i, (p, d, t) in enumerate(zip(prompts, dflash, target_only)):
        row: dict[str, Any] = {
            "prompt_len": len(p), "tokens": d.tokens, "accept_lengths": d.accept_lengths,
            "decode_time_s": d.decode_time_s, "target_only_decode_time_s": t.decode_time_s,
            "matches_target_only": d.tokens == t.tokens,
        }
        if lookup is not None:
            row["baseline_accept_lengths"] = lookup[i].accept_lengths
        if untrained is not None:
            row["untrained_accept_lengths"] = untrained[i].accept_lengths
        if tokenizer is not None:
            row["prompt_chars"] = len(tokenizer.decode(list(p)))
            row["output_text"] = tokenizer.decode(d.tokens)
        per_prompt.append(row)
    return {**settings, "prompts": per_prompt}


def write_eval_json(path: str | Path, result: dict[str, Any], **extra: Any) -> Path:
    """eval.json: {"metrics": flat eval/* metrics, "details": ..., **extra}."""
    metrics = {k: v for k, v in result.items() if k != "details"}
    payload = {"metrics": metrics, "details": result.get("details", {}), **extra}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, payload)
    return path


def read_eval_json(path: str | Path) -> dict[str, Any] | None:
    """An eval.json as `write_eval_json` wrote it, or None when it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("metrics"), dict) else None


# ------------------------------------------------------------------------------------------------- CLI


@dataclass
class _Inputs:
    drafter_dir: Path
    target: str
    run_cfg: Any  # the run's resolved config (DictConfig) or None for a bare drafter directory


def _resolve_run_target(run_dir: Path, target: str) -> str:
    """A run's model.target may be relative to the directory it was launched from (recorded in run.json)."""
    looks_local = target.startswith((".", "/", "~")) or target.count("/") > 1
    if Path(target).expanduser().exists() or not looks_local:
        return target  # exists, or a hub name
    run_json = run_dir / "run.json"
    if run_json.is_file():
        try:
            cwd = json.loads(run_json.read_text()).get("cwd")
        except (json.JSONDecodeError, AttributeError):
            cwd = None
        if cwd and (Path(cwd) / target).exists():
            return str(Path(cwd) / target)
    return target


def _resolve_inputs(path: str, target_arg: str | None) -> _Inputs:
    p = Path(path).expanduser()
    if (p / "config_resolved.yaml").is_file():
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(p / "config_resolved.yaml")
        drafter_dir = p / "drafter"
        if not (drafter_dir / "config.json").is_file():
            raise FileNotFoundError(f"{p} is a run directory without an exported drafter ({drafter_dir}/config.json); "
                                    "did the run finish?")
        target = target_arg or _resolve_run_target(p, str(cfg.model.target))
        return _Inputs(drafter_dir, target, cfg)
    if (p / "config.json").is_file():
        target = target_arg or json.loads((p / "config.json").read_text()).get("dflash_target")
        if not target:
            raise ValueError(f"{p}/config.json has no dflash_target field: pass --target PATH_OR_HUB_NAME")
        return _Inputs(p, str(target), None)
    raise FileNotFoundError(f"{path}: neither a run directory (config_resolved.yaml) nor a drafter directory "
                            "(config.json)")


def _setting(cli_value, run_cfg, key: str, default):
    """CLI flag, else the run's eval.<key>, else the default."""
    if cli_value is not None:
        return cli_value
    if run_cfg is not None and run_cfg.get("eval") is not None and run_cfg.eval.get(key) is not None:
        return run_cfg.eval[key]
    return default


def _load_prompts(args, inputs: _Inputs, tokenizer) -> list[list[int]]:
    from dflash.data import heldout_prompts, read_prompts_file

    num_prompts = int(_setting(args.num_prompts, inputs.run_cfg, "num_prompts", 8))
    prompts_file = _setting(args.prompts_file, inputs.run_cfg, "prompts_file", None)
    if prompts_file:
        return read_prompts_file(prompts_file, tokenizer)[:num_prompts]
    prompt_len = int(_setting(args.prompt_len, inputs.run_cfg, "prompt_len", 64))
    if inputs.run_cfg is not None:
        data_cfg = inputs.run_cfg.data
    else:
        from dflash.config import DataConfig

        data_cfg = DataConfig(name="stdlib")  # held-out stdlib text, as the embedded default trains on
    return heldout_prompts(tokenizer, data_cfg, num_prompts, prompt_len, seed=args.seed)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dflash.evaluate",
                                 description="Speculative decoding of a DFlash drafter against its target: tau, "
                                             "acceptance histogram, prompt-lookup and untrained baselines, speedup.")
    ap.add_argument("path", help="a run directory (with drafter/) or an exported drafter directory")
    ap.add_argument("--target", help="target model path or hub name (default: the run's model.target or the "
                                     "drafter config's dflash_target)")
    ap.add_argument("--prompts-file", help=".jsonl with {\"prompt\": ...} per line, or plain text one per line")
    ap.add_argument("--num-prompts", type=int)
    ap.add_argument("--prompt-len", type=int, help="tokens per held-out prompt (when no prompts file)")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--block-size", type=int, help="default: the drafter's block_size")
    ap.add_argument("--ngram", type=int, default=3, help="prompt-lookup n-gram size")
    ap.add_argument("--no-baselines", action="store_true", help="skip prompt lookup and the untrained drafter")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto = the drafter's saved dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="eval.json", help="where to write the JSON result")
    return ap.parse_args(argv)


def _print_table(metrics: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in metrics.items():
        if k == "details":
            continue
        table.add_row(k, "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v))
                      else f"{v:.4g}" if isinstance(v, float) else str(v))
    Console().print(table)


def _run_cli(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.export import check_drafter_against
    from dflash.target import DTYPES, check_target_exists, resolve_device

    inputs = _resolve_inputs(args.path, args.target)
    check_target_exists(inputs.target)
    device = resolve_device(args.device)
    drafter = DFlashDraftModel.from_pretrained(
        str(inputs.drafter_dir), **({} if args.dtype == "auto" else {"dtype": DTYPES[args.dtype]})
    )
    drafter = drafter.to(device).eval()
    dtype = _dtype(drafter)
    target = AutoModelForCausalLM.from_pretrained(inputs.target, dtype=dtype).to(device).eval()
    try:
        check_drafter_against(drafter.config, target_config=target.config)
    except ValueError as e:
        raise ValueError(f"target {inputs.target} does not fit drafter {inputs.drafter_dir}: {e}") from None
    tokenizer = AutoTokenizer.from_pretrained(inputs.target)
    prompts = _load_prompts(args, inputs, tokenizer)
    temperature = float(_setting(args.temperature, inputs.run_cfg, "temperature", 0.0))
    max_new_tokens = int(_setting(args.max_new_tokens, inputs.run_cfg, "max_new_tokens", 64))
    baselines = not args.no_baselines
    result = evaluate(
        target, drafter, prompts, max_new_tokens=max_new_tokens, block_size=args.block_size,
        temperature=temperature, baselines=baselines, ngram=args.ngram,
        untrained_drafter=untrained_like(drafter, args.seed) if baselines else None, seed=args.seed,
        eos_id=tokenizer.eos_token_id, tokenizer=tokenizer,
    )
    write_eval_json(args.out, result, drafter=str(inputs.drafter_dir), target=inputs.target,
                    device=str(device), dtype=str(dtype).removeprefix("torch."))
    _print_table(result, f"DFlash eval: {inputs.drafter_dir}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m dflash.evaluate`; returns the exit status (2 for a user error)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parse_args(argv)
    try:
        _run_cli(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
