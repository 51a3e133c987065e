"""Corpora, tokenisation and packing into fixed-length training batches.

Two sources: `data=stdlib` (the Python standard library's own .py files, split into train / held-out by a
stable hash of the file name) and `data=jsonl` (records `{"text": ...}` or `{"messages": [...]}`; chat records
are rendered with the tokenizer's chat template and supervised on assistant tokens only). Documents are packed
into one token stream (separated by EOS) and cut into `seq_len` windows; each pass shuffles the windows with
a generator seeded by (seed, pass), so the data position (pass, index) is all a resume needs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)

_TEST_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
DEFAULT_HOLDOUT = 0.05  # share of stdlib files held out (data.holdout_fraction's default; the tiny target's too)


class BadRecordError(ValueError):
    """A malformed record in a data file; the message starts with `file:line`."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str, holdout_fraction: float = DEFAULT_HOLDOUT,
                 max_files: int | None = None) -> list[Path]:
    """Non-test .py files of the running Python's stdlib, sorted; `split` is "train" or "heldout".
    The split hashes each file's relative path, so it is the same on every machine with the same Python."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, not {split!r}")
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if not _TEST_DIRS & set(p.relative_to(root).parts))
    threshold = int(holdout_fraction * 10_000)

    def is_heldout(p: Path) -> bool:
        h = int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest()[:8], 16) % 10_000
        return h < threshold

    chosen = [p for p in files if is_heldout(p) == (split == "heldout")]
    return chosen[:max_files] if max_files else chosen


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@dataclass
class Document:
    ids: list[int]
    loss_mask: list[bool]


def _render_record(record: dict, tokenizer, where: str) -> Document:
    if not isinstance(record, dict):
        raise BadRecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise BadRecordError(f"{where}: 'text' must be a string")
        ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        return Document(ids, [True] * len(ids))
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise BadRecordError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
        if not any(m["role"] == "assistant" for m in msgs):
            raise BadRecordError(f"{where}: no assistant message to supervise")
        return _render_chat(msgs, tokenizer, where)
    raise BadRecordError(f"{where}: a record needs 'text' or 'messages' (keys: {sorted(record)})")


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _render_chat(messages: list[dict], tokenizer, where: str = "record") -> Document:
    """Render with the chat template; supervise exactly the tokens each assistant turn adds to the prefix.

    Turn i spans from the render of messages[:i] + generation prompt to the render of messages[:i+1]. That
    holds only where both renders are prefixes of the whole conversation's render. Some templates render the
    last turn differently (Qwen3 adds an empty <think></think> block to the final assistant turn only), so an
    earlier turn rendered alone would be longer than in the conversation and its span would run into the next
    user turn. Such turns are left unsupervised (logged once); the final turn always renders consistently.
    """
    ids = _chat_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [False] * len(ids)
    inconsistent = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _chat_ids(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        turn = _chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if ids[: len(head)] != head or ids[: len(turn)] != turn or len(turn) <= len(head):
            inconsistent += 1
            continue
        for j in range(len(head), len(turn)):
            mask[j] = True
    if inconsistent:
        _warn_inconsistent_template(inconsistent)
    if not any(mask):
        raise BadRecordError(f"{where}: the chat template renders no assistant turn as a prefix of the conversation")
    return Document(ids, mask)


_warned_template = False


def _warn_inconsistent_template(turns: int) -> None:
    global _warned_template
    if not _warned_template:
        _warned_template = True
        log.warning("the chat template renders %d assistant turn(s) of a conversation differently on their own than "
                    "inside it (e.g. Qwen3's <think> block on the last turn only): those turns are not supervised; "
                    "the conversation's last turn is. Logged once.", turns)


def jsonl_files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(p.glob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"data.path={path!r}: directory has no .jsonl files")
        return files
    if not p.is_file():
        raise FileNotFoundError(f"data.path={path!r}: no such file or directory")
    return [p]


def read_jsonl(path: str, tokenizer, on_bad_record: str = "fail") -> tuple[list[Document], int]:
    """Documents from every record; returns (documents, number of skipped bad records)."""
    docs, skipped = [], 0
    for f in jsonl_files(path):
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise FileNotFoundError(f"data.path: cannot read {f}: {e}") from e
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{f}:{lineno}"
            try:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadRecordError(f"{where}: invalid JSON ({e.msg})") from None
                docs.append(_render_record(record, tokenizer, where))
            except BadRecordError as e:
                if on_bad_record == "fail":
                    raise
                skipped += 1
                log.warning("skipping bad record %s", e)
    if skipped:
        log.warning("skipped %d bad records (data.on_bad_record=skip)", skipped)
    return docs, skipped


def stdlib_documents(tokenizer, split: str, holdout_fraction: float, max_files: int | None = None) -> list[Document]:
    texts = [read_text(p) for p in stdlib_files(split, holdout_fraction, max_files)]
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [Document(ids, [True] * len(ids)) for ids in enc]


def pack(docs: list[Document], eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token stream (docs joined by EOS) and its loss mask; the EOS after a document is supervised when
    the document's last token is (the drafter should learn where text ends)."""
    ids: list[int] = []
    mask: list[bool] = []
    for d in docs:
        ids.extend(d.ids)
        mask.extend(d.loss_mask)
        if d.ids and d.ids[-1] == eos_id:
            continue  # already ends with EOS (e.g. a regenerated answer): a second one would teach "EOS -> EOS"
        ids.append(eos_id)
        mask.append(bool(d.loss_mask[-1]) if d.loss_mask else False)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (bsz, S)
    loss_mask: torch.Tensor  # (bsz, S) bool
    num_tokens: int
    data_pass: int
    index: int  # batch index within the pass


class PackedBatches:
    """Windows of `seq_len` tokens from a packed stream, shuffled per pass; resumable at (pass, index)."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, seq_len: int, batch_size: int, seed: int,
                 min_supervised: int = 1):
        n = ids.numel() // seq_len
        if n < batch_size:
            raise ValueError(
                f"the corpus has {ids.numel()} tokens: fewer than one batch of train.batch_size={batch_size} x "
                f"train.seq_len={seq_len}; use more data or smaller values"
            )
        windows = ids[: n * seq_len].view(n, seq_len)
        masks = mask[: n * seq_len].view(n, seq_len)
        keep = masks.sum(1) >= min_supervised  # windows with too little to supervise teach nothing
        self.windows, self.masks = windows[keep], masks[keep]
        if self.windows.shape[0] < batch_size:
            raise ValueError("too few windows with supervised tokens for one batch; check the data's loss mask")
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_pass = self.windows.shape[0] // batch_size

    def __len__(self) -> int:
        return self.batches_per_pass

    def iterate(self, start_pass: int = 0, start_index: int = 0) -> Iterator[Batch]:
        data_pass, index = start_pass, start_index
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + data_pass)
            order = torch.randperm(self.windows.shape[0], generator=g)
            while index < self.batches_per_pass:
                sel = order[index * self.batch_size : (index + 1) * self.batch_size]
                yield Batch(self.windows[sel], self.masks[sel], int(sel.numel() * self.windows.shape[1]),
                            data_pass, index)
                index += 1
            data_pass, index = data_pass + 1, 0


def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def build_batches(data_cfg, train_cfg, tokenizer, block_size: int, target_model=None, target_path: str = "",
                  cache_dir: str | None = None) -> tuple[PackedBatches, int]:
    """The training batches for a run: (PackedBatches, number of skipped records)."""
    skipped = 0
    if data_cfg.name == "stdlib" and data_cfg.regenerate.enabled:
        docs = regenerated_corpus(target_model, tokenizer, target_path, data_cfg, train_cfg.seed, cache_dir)
    elif data_cfg.name == "stdlib":
        docs = stdlib_documents(tokenizer, "train", data_cfg.holdout_fraction, data_cfg.max_files)
    else:
        docs, skipped = read_jsonl(data_cfg.path, tokenizer, data_cfg.on_bad_record)
        docs, held = split_heldout(docs, data_cfg.holdout_fraction)
        log.info("data=jsonl: the last %d of %d records are held out for eval prompts (data.holdout_fraction)",
                 len(held), len(docs) + len(held))
    if not docs:
        raise ValueError(f"data={data_cfg.name}: no documents")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids, mask = pack(docs, eos)
    min_sup = data_cfg.min_supervised_tokens or 2 * block_size
    log.info("data=%s: %d documents, %.2fM tokens (%.0f%% supervised)", data_cfg.name, len(docs), ids.numel() / 1e6,
             100 * mask.float().mean().item())
    return PackedBatches(ids, mask, train_cfg.seq_len, train_cfg.batch_size, train_cfg.seed, min_sup), skipped


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


@torch.no_grad()
def regenerate_documents(model, tokenizer, prompts: list[list[int]], regen_cfg, seed: int) -> list[Document]:
    """The target's own continuations: prompt tokens unsupervised, generated tokens supervised.
    All prompts have the same length, so batches need no padding."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    docs: list[Document] = []
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    bs = regen_cfg.batch_size
    sample = regen_cfg.temperature > 0
    with Progress(TextColumn("regenerating data with the target"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} prompts"), TimeRemainingColumn()) as bar:
        task = bar.add_task("regen", total=len(prompts))
        for i in range(0, len(prompts), bs):
            x = torch.tensor(prompts[i : i + bs], device=device)
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=regen_cfg.max_new_tokens, do_sample=sample,
                temperature=regen_cfg.temperature if sample else None, top_p=None, top_k=None,
                pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            )
            for row in out.tolist():
                gen = row[x.shape[1] :]
                if tokenizer.eos_token_id in gen:  # keep the EOS itself: the drafter should learn where text ends
                    gen = gen[: gen.index(tokenizer.eos_token_id) + 1]
                docs.append(Document(row[: x.shape[1]] + gen, [False] * x.shape[1] + [True] * len(gen)))
            bar.update(task, advance=len(x))
            log.info("regenerated %d/%d prompts", min(i + bs, len(prompts)), len(prompts))
    return docs


def regenerated_corpus(model, tokenizer, target_path: str, data_cfg, seed: int, cache_dir: str | None) -> list[Document]:
    """Regenerated documents, cached under cache_dir keyed by the target's files and the settings."""
    r = data_cfg.regenerate
    key_src = json.dumps({
        "target": str(Path(target_path).expanduser().resolve()) if Path(target_path).expanduser().exists() else target_path,
        "config": _file_fingerprint(Path(target_path) / "config.json"),
        "weights": _file_fingerprint(Path(target_path) / "model.safetensors"),
        # batch_size too: with temperature > 0 it changes the sampling stream
        "regen": {k: getattr(r, k) for k in ("num_prompts", "prompt_len", "max_new_tokens", "temperature",
                                             "batch_size")},
        "tokenizer": [_file_fingerprint(Path(target_path) / f) for f in ("tokenizer.json", "tokenizer_config.json")],
        "holdout": data_cfg.holdout_fraction, "max_files": data_cfg.max_files, "seed": seed,
    }, sort_keys=True)
    digest = hashlib.sha1(key_src.encode()).hexdigest()[:16]
    cache = Path(cache_dir).expanduser() / f"regen-{digest}.json" if cache_dir else None
    if cache is not None and cache.exists():
        raw = json.loads(cache.read_text())
        log.info("regenerated data from cache %s (%d documents)", cache, len(raw))
        return [Document(d["ids"], [bool(m) for m in d["mask"]]) for d in raw]
    texts = [read_text(p) for p in stdlib_files("train", data_cfg.holdout_fraction, data_cfg.max_files)]
    prompts = sample_prompts(tokenizer, texts, r.num_prompts, r.prompt_len, seed)
    docs = regenerate_documents(model, tokenizer, prompts, r, seed)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        tmp.write_text(json.dumps([{"ids": d.ids, "mask": [int(m) for m in d.loss_mask]} for d in docs]))
        tmp.replace(cache)
    return docs


def _file_fingerprint(path: Path) -> list | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, int(st.st_mtime)]


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
                raise BadRecordError(f"{p}:{lineno}: expected {{\"prompt\": str}}")
        else:
            text = line.replace("\\n", "\n")
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts
