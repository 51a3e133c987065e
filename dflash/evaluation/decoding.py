"""Real speculative decoding against the target: the verify loop, its proposers and acceptance statistics.

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
of all prompts. Cycles are counted as z-lab's loop counts them (CYCLE_RULE): a cycle runs while fewer than
max_new_tokens tokens precede its anchor (z-lab: `while start < max_length`), so a generation that reaches the
limit exactly verifies one more block, whose acceptance counts in full though its tokens are cut at the limit;
a stop token ends the loop after the cycle that emits it, or after the first cycle when the prefill's token is one.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from dflash.core import interrupts
from dflash.evaluation.target_cache import crop_cache, new_target_cache, start_recording
from dflash.model.draft_vocab import decoding_head
from dflash.model.drafter import DFlashDraftModel, DraftKVCache

EosIds = int | Sequence[int] | None
CYCLE_RULE = "zlab"  # which cycles count (module docstring); benchmarks.json's settings record it


@dataclass
class GenerationResult:
    """One prompt's generation.

    tokens: the new tokens (first token from the prefill included; truncated at EOS (kept) or max_new_tokens).
    accept_lengths: per verify cycle, accepted drafts + 1, in [1, block_size] (the last cycle's value is the
        full acceptance even when max_new_tokens truncated what it emitted; cycles as z-lab counts them).
    decode_time_s: wall time of the verify cycles (prefill and first token excluded).
    """

    tokens: list[int]
    accept_lengths: list[int]
    cycles: int
    decode_time_s: float
    prefill_time_s: float = 0.0
    # a proposer with a confidence head (DSpark): per cycle, each draft's predicted acceptance probability
    confidences: list[list[float]] | None = None

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by the decode cycles (all but the prefill's first token)."""
        return max(len(self.tokens) - 1, 0)


def hf_model(model: nn.Module) -> nn.Module:
    """Accept a dflash TargetModel wrapper as well as a bare HF causal LM."""
    from dflash.model.target import TargetModel

    return model.model if isinstance(model, TargetModel) else model


def module_device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def module_dtype(module: nn.Module) -> torch.dtype:
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
        target_model = hf_model(target_model)
        self.drafter = drafter
        self.layer_ids = list(drafter.target_layer_ids)
        self.mask_token_id = int(drafter.mask_token_id)
        self.embed = target_model.get_input_embeddings()
        # the target's head, or the drafter's over its draft vocabulary, mapped back to target ids (draft_vocab.py)
        self.lm_head = decoding_head(drafter, target_model.get_output_embeddings())
        self.cache = DraftKVCache()
        self.ctx_len = 0  # context positions whose K/V are in the drafter cache
        self.device, self.dtype = module_device(drafter), module_dtype(drafter)
        # a drafter family with a confidence head (DSpark): per cycle, its drafts' predicted acceptance
        self.confidences: list[list[float]] | None = [] if getattr(drafter, "confidence_head", None) else None

    @torch.no_grad()
    def draft_logits(self, seq: list[int], new_features: torch.Tensor, num_draft: int) -> torch.Tensor:
        """Logits (num_draft, V) of the drafted slots 1..num_draft of the block anchored at seq[-1]."""
        out = self.block_hidden(seq, new_features, num_draft + 1)
        head_w = self.lm_head.weight
        return self.lm_head(out[1:].to(head_w.device, head_w.dtype))

    @torch.no_grad()
    def block_hidden(self, seq: list[int], new_features: torch.Tensor, slots: int) -> torch.Tensor:
        """The drafter's output (slots, H) for the block [seq[-1], MASK x (slots - 1)] at the anchor's position."""
        num_draft = slots - 1
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
        return out[0]

    def propose(self, seq: list[int], new_features: torch.Tensor | None, num_draft: int) -> list[int]:
        if new_features is None:
            raise RuntimeError("DFlashProposer needs context features from the verify loop")
        choose = getattr(self.drafter, "choose_drafts", None)  # a family's own proposal rule (model/families/)
        if choose is None:
            return self.draft_logits(seq, new_features, num_draft).argmax(dim=-1).tolist()
        hidden = self.block_hidden(seq, new_features, self.drafter.slots_for(num_draft))
        drafts, confidences = choose(hidden, self.lm_head, seq[-1])
        if self.confidences is not None:
            self.confidences.append(confidences)
        return drafts


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
    model = hf_model(target_model)
    device = module_device(model)
    cache = new_target_cache(model)
    cache_kw = _cache_kwarg(model)
    want_features = proposer.needs_features and block_size > 1
    eos = _eos_set(eos_id)

    # prefill: only the last position's logits (a long prompt's full-vocab logits can take gigabytes)
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def forward(ids: list[int], **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = model(
            input_ids=torch.tensor([ids], device=device),
            use_cache=True,
            output_hidden_states=want_features,
            **{cache_kw: cache},
            **kwargs,
        )
        feats = _features(out.hidden_states, proposer.layer_ids) if want_features else None
        return out.logits[0], feats  # (len, V), (1, len, n_feat * H)

    _sync(device)
    t0 = time.perf_counter()
    logits, features = forward(list(prompt_ids), **last_only)
    recording = start_recording(cache, block_size)  # sliding or linear-attention layers: rolled back by recording
    new = _sample(logits[-1:], temperature, generator)
    _sync(device)
    t1 = time.perf_counter()

    seq = list(prompt_ids) + new
    accept_lengths: list[int] = []
    while len(new) - 1 < max_new_tokens:  # z-lab's `start < max_length`: the tokens before the anchor
        interrupts.check("eval")  # a stop request ends even a long generation within a cycle
        start = len(seq) - 1  # the anchor's position; the target cache holds positions 0 .. start - 1
        drafts = proposer.propose(seq, features, block_size - 1) if block_size > 1 else []
        if len(drafts) != block_size - 1:
            raise RuntimeError(f"proposer returned {len(drafts)} drafts, expected {block_size - 1}")
        logits, features = forward([seq[-1], *drafts])
        posterior = _sample(logits, temperature, generator)
        a = _num_accepted(drafts, posterior)
        emit = drafts[:a] + [posterior[a]]  # accepted drafts + the target's token at the first mismatch
        # keep anchor + accepted drafts; the bonus token is the next anchor
        crop_cache(cache, start + a + 1, recording, current=start + block_size)
        if features is not None:
            features = features[:, : a + 1]
        accept_lengths.append(a + 1)
        seq.extend(emit)
        new.extend(emit)
        if eos.intersection(emit) or new[0] in eos:  # z-lab checks for a stop token after a cycle only
            break

    for i, tok in enumerate(new):  # stop right after the first EOS
        if tok in eos:
            new = new[: i + 1]
            break
    _sync(device)
    t2 = time.perf_counter()
    confidences = getattr(proposer, "confidences", None)  # one list per cycle, from a confidence head
    return GenerationResult(new[:max_new_tokens], accept_lengths, len(accept_lengths), t2 - t1, t1 - t0, confidences)


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
    return verify_generate(
        target_model, proposer, prompt_ids, max_new_tokens, block_size, temperature, generator, eos_id
    )


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
    return verify_generate(
        target_model,
        PromptLookupProposer(ngram),
        prompt_ids,
        max_new_tokens,
        block_size,
        temperature,
        generator,
        eos_id,
    )


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
