"""Eval prompts: windows of held-out text, or a prompts file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash.data.corpus import (
    BadRecordError,
    Document,
    read_jsonl,
    read_text,
    stdlib_files,
)


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


def split_heldout(docs: list[Document], holdout_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, held out): the last `holdout_fraction` of the records (at least one when there are two or more)
    are kept out of training, so eval prompts are text the drafter has not seen."""
    if len(docs) < 2:
        return docs, []
    k = max(1, int(len(docs) * holdout_fraction))
    return docs[:-k], docs[-k:]


def heldout_prompts(tokenizer, data_cfg, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Eval prompts from held-out text: stdlib held-out files, or for jsonl the held-out last records."""
    if data_cfg.name == "stdlib":
        texts = [read_text(p) for p in stdlib_files("heldout", data_cfg.holdout_fraction)]
    else:  # reads the data again: the held-out records are few, but finding them needs the record count
        docs, _ = read_jsonl(data_cfg.path, tokenizer, "skip")
        texts = [tokenizer.decode(d.ids) for d in split_heldout(docs, data_cfg.holdout_fraction)[1]]
    return sample_prompts(tokenizer, texts, num_prompts, prompt_len, seed)


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
