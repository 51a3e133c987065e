"""The target's own continuations of stdlib prompts as training data (the paper regenerates responses with the
target), cached in the cache dir keyed by the content of the target's files (not their path: a moved cache dir,
DFLASH_CACHE_DIR, keeps it) and the settings. A stop request ends generation within a token step."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from dflash.core import interrupts
from dflash.data.corpus import Document, read_text, stdlib_files
from dflash.data.fingerprint import TOKENIZER_FILES, target_hashes
from dflash.data.generate import generate_continuations
from dflash.data.prompts import sample_prompts

log = logging.getLogger(__name__)


@torch.no_grad()
def regenerate_documents(model, tokenizer, prompts: list[list[int]], regen_cfg, seed: int) -> list[Document]:
    """The target's own continuations: prompt tokens unsupervised, generated tokens supervised.
    All prompts have the same length, so batches need no padding."""
    from dflash.core.terminal import display

    docs: list[Document] = []
    torch.manual_seed(seed)
    bs = regen_cfg.batch_size
    stop = interrupts.stop_event()
    eos = tokenizer.eos_token_id
    with display().phase("regenerate", len(prompts)) as phase:
        for i in range(0, len(prompts), bs):
            interrupts.check("data regeneration")
            batch = prompts[i : i + bs]
            outs = generate_continuations(
                model, batch, regen_cfg.max_new_tokens, regen_cfg.temperature, [eos], eos, should_stop=stop.is_set
            )
            interrupts.check("data regeneration")  # a batch cut short by the stop request is not data
            for prompt, gen in zip(batch, outs):  # the EOS stays: the drafter should learn where text ends
                docs.append(Document(prompt + gen, [False] * len(prompt) + [True] * len(gen)))
            phase.advance(len(batch), info="prompts continued by the target")
    return docs


def regenerated_corpus(
    model, tokenizer, target_path: str, data_cfg, seed: int, cache_dir: str | None
) -> list[Document]:
    """Regenerated documents, cached under cache_dir keyed by the target's files' content and the settings."""
    r = data_cfg.regenerate
    key_src = json.dumps(
        {
            # what the target is, not where: its weights and tokenizer hashed (a hub name: its cached revision)
            "target": target_hashes(target_path, extra=TOKENIZER_FILES),
            # batch_size too: with temperature > 0 it changes the sampling stream
            "regen": {
                k: getattr(r, k) for k in ("num_prompts", "prompt_len", "max_new_tokens", "temperature", "batch_size")
            },
            "holdout": data_cfg.holdout_fraction,
            "max_files": data_cfg.max_files,
            "seed": seed,
        },
        sort_keys=True,
    )
    digest = hashlib.sha1(key_src.encode()).hexdigest()[:16]
    cache = Path(cache_dir).expanduser() / f"regen-{digest}.json" if cache_dir else None
    if cache is not None and cache.exists():
        raw = json.loads(cache.read_text())
        log.info("regenerated data from cache %s (%d documents)", cache, len(raw))
        return [Document(d["ids"], [bool(m) for m in d["mask"]]) for d in raw]
    if model is None:  # a drafter rank of parallel.target_ranks holds no target: rank 0 regenerates first
        raise RuntimeError(
            "data regeneration needs the target, which this rank does not load (parallel.target_ranks); "
            "set paths.cache_dir so that rank 0's regenerated data is shared"
        )
    texts = [read_text(p) for p in stdlib_files("train", data_cfg.holdout_fraction, data_cfg.max_files)]
    prompts = sample_prompts(tokenizer, texts, r.num_prompts, r.prompt_len, seed)
    device = next(model.parameters()).device
    # its own seed, and the caller's RNG state left as it was (a cache hit must not train differently)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        docs = regenerate_documents(model, tokenizer, prompts, r, seed)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        tmp.write_text(json.dumps([{"ids": d.ids, "mask": [int(m) for m in d.loss_mask]} for d in docs]))
        tmp.replace(cache)
    return docs
