"""Eval prompts: windows of held-out text, or a prompts file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash.data.chat_dataset import ChatData, load_chat_data
from dflash.data.corpus import BadRecordError, read_text, stdlib_files
from dflash.data.fingerprint import data_fingerprint
from dflash.data.tokens import load_token_data, token_prompts


def sample_prompts(tokenizer, texts: list[str], num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """`prompt_len`-token windows that start at a line start of randomly chosen texts. Deterministic per seed."""
    g = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = []
    if not texts:
        return prompts
    attempts = 0
    while len(prompts) < num_prompts and attempts < 20 * num_prompts + 100:
        attempts += 1
        text = texts[int(torch.randint(0, len(texts), (1,), generator=g))]
        lines = text.splitlines(keepends=True)
        if len(lines) < 4:
            continue
        start = int(torch.randint(0, max(1, len(lines) - 2), (1,), generator=g))
        ids = tokenizer("".join(lines[start : start + 64]), add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_len:
            prompts.append(ids[:prompt_len])
    return prompts


def heldout_prompts(
    tokenizer,
    data_cfg,
    num_prompts: int,
    prompt_len: int,
    seed: int = 0,
    chat: ChatData | None = None,
    target: str = "",
    cache_dir: str | None = None,
) -> list[list[int]]:
    """Eval prompts from held-out data: stdlib held-out files, or the held-out last jsonl records (`chat`, the
    run's rendered records; loaded from the cache when not given)."""
    if data_cfg.name == "stdlib":
        texts = [read_text(p) for p in stdlib_files("heldout", data_cfg.holdout_fraction)]
        return sample_prompts(tokenizer, texts, num_prompts, prompt_len, seed)
    if data_cfg.name == "tokens":  # held-out records cut where their answer starts (data/tokens.py)
        return token_prompts(load_token_data(data_cfg, seq_len=2**62), num_prompts, prompt_len, seed)
    if chat is None:
        chat = load_chat_data(data_cfg, tokenizer, data_fingerprint(data_cfg, target), cache_dir)
    return chat_prompts(chat, tokenizer, num_prompts, prompt_len, seed)


def chat_prompts(chat: ChatData, tokenizer, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Held-out conversations cut where an assistant turn starts (the last `prompt_len` tokens before it), so
    the drafter is evaluated on answers, as served; text records give windows of their text instead."""
    rows = chat.heldout_rows
    if rows.size == 0:
        return []
    table = chat.table.select(rows.tolist())
    g = torch.Generator().manual_seed(seed)
    prompts, texts = [], []
    for i in torch.randperm(rows.size, generator=g).tolist():
        rec = table[i]
        starts = [s for s in rec["answer_starts"] if s >= 4]  # a few tokens of context at least
        if rec["is_chat"] and starts:
            s = starts[int(torch.randint(0, len(starts), (1,), generator=g))]
            prompts.append(rec["input_ids"][max(0, s - prompt_len) : s])
        elif not rec["is_chat"]:
            texts.append(tokenizer.decode(rec["input_ids"]))
        if len(prompts) >= num_prompts:
            return prompts
    return prompts + sample_prompts(tokenizer, texts, num_prompts - len(prompts), prompt_len, seed)


def read_prompts_file(path: str, tokenizer) -> list[list[int]]:
    """A prompts file: .jsonl with {"prompt": ...} (or {"text": ...}) per line, or plain text, one prompt per line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"eval.prompts_file={path!r}: no such file")
    prompts = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                rec = json.loads(line)
                text = rec.get("prompt", rec.get("text"))
            except (json.JSONDecodeError, AttributeError):
                text = None
            if not isinstance(text, str):
                raise BadRecordError(f'{p}:{lineno}: expected {{"prompt": str}}')
        else:
            text = line.replace("\\n", "\n")
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts
