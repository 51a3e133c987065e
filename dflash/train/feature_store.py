"""A feature store: the target's features of a run's global batches, computed once (`python -m dflash.features
build`) and read by every job of a sweep instead of running the target (`features=store`).

    <store>/manifest.json   what the features are of: target files (every shard; a hub name's revision), the
                            target's dtype and attention, layer ids, dtype, seq_len, batch size, seed,
                            the data settings and fingerprint, the tokenizer's files, the rendering version,
                            the feature definition's version, the number of batches
    <store>/index.json      the committed shards, in order: file, sha256, bytes, the (pass, index) of each batch
    <store>/shard_00000.safetensors ...   `shard_batches` global batches each: input_ids, loss_mask, lengths,
                            target_hidden, last_hidden, target_next (safetensors: memory-mapped on read, one
                            header)

target_next (int32, 4 bytes a token) is the target's argmax after each position, argmax(lm_head(last_hidden)) from
the target's own last hidden state (before the store's dtype rounds it), so a loss without the KL computes no
teacher logits. Stores built before it lack it and are read as they are: their items carry target_next=None and
the trainer computes the argmax as online. It is not in the manifest (nor FEATURE_VERSION): the features are the
same, and the store's name hashes the manifest, so adding it would orphan every store built so far; a store
extended by a newer build holds it in its newer shards only, which the reader takes per batch.

A shard is written to `*.tmp` and renamed, then its sha256 goes into index.json (rewritten atomically), so a
killed build leaves only whole shards listed; it resumes after the last one (a torn `*.tmp` is removed and redone).
Every shard's size is checked when the reader opens it and its sha256 once per process (`verify_shard`). Why
safetensors and not Arrow: the items are a few large dense tensors per batch, each rank reading a slice of
rows; safetensors maps them without a copy, slices them on read and needs no schema.

The store is keyed by global batch, in the order the run's data yields them (the seeded sequence `train.seed`
fixes), so a job reads exactly the items the target would have made; under torchrun each rank takes its rows of
each stored global batch, as a colocated rank would.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from dflash.core.disk import remove_partial
from dflash.core.hashing import file_sha256
from dflash.core.jsonio import read_json, write_json
from dflash.data.batches import Batch, rank_slice
from dflash.train.feature_codec import bytes_per_value, decode, encode, scale_bytes
from dflash.train.trainer import HiddenItem

FEATURE_VERSION = 1  # bump when what a feature is changes (layers' outputs, the final norm, the dtype cast)
MANIFEST, INDEX = "manifest.json", "index.json"


class StoreMismatch(ValueError):
    """A store made for other settings than the run's; the message names each key with both values."""


class StoreCorrupt(ValueError):
    """A shard that is missing, cut short or changed since it was written."""


def check_manifest(store: Path, expected: dict) -> dict:
    """The store's manifest, or StoreMismatch naming every key whose value differs from the run's."""
    found = read_json(Path(store) / MANIFEST, default=None)
    if not isinstance(found, dict):
        raise StoreMismatch(
            f"feature store {store}: no manifest.json (not built yet: python -m dflash.features build with the "
            "run's overrides, or features.build_missing=true)"
        )
    diffs = [
        f"{key}: store {found.get(key, 'not recorded')!r} vs run {value!r}"
        for key, value in expected.items()
        if key != "num_batches" and found.get(key) != value
    ]
    if diffs:
        raise StoreMismatch(f"feature store {store} was built for other settings: " + "; ".join(diffs))
    return found


class StoreWriter:
    """Writes a store's shards: shard k holds global batches k * shard_batches onwards. `todo` names the shards a
    resumed build still lacks; under torchrun each rank writes the shards `mine` gives it (no two ranks one shard),
    records them in its own `index.rank<r>.json`, and rank 0 merges those into index.json once all are done.
    Only the setup writer (rank 0) writes the manifest and removes torn shards (`*.tmp`), before the others open."""

    def __init__(
        self, store: Path, manifest: dict, shard_batches: int, rank: int = 0, world_size: int = 1, setup: bool = True
    ):
        self.store, self.manifest, self.shard_batches = Path(store), manifest, shard_batches
        self.rank, self.world_size = rank, world_size
        self.store.mkdir(parents=True, exist_ok=True)
        found = check_manifest(self.store, manifest) if (self.store / MANIFEST).exists() or not setup else None
        # a longer build extends the store: the manifest says how many batches it is built to hold
        if setup and (found is None or found.get("num_batches", 0) < manifest.get("num_batches", 0)):
            write_json(self.store / MANIFEST, manifest)
        if setup:
            for partial in self.store.glob("*.tmp"):  # a shard a killed build was writing
                remove_partial(partial, "a shard a killed build left half-written")
        self.entries = {_number(e): e for e in _committed(self.store)}
        self._pending: list[tuple[tuple[int, int], dict[str, torch.Tensor]]] = []

    def num_shards(self, batches: int) -> int:
        return -(-batches // self.shard_batches)

    def todo(self, batches: int) -> list[int]:
        """The shards not yet committed, in order; a shorter build's last shard too, when this build fills it."""
        want = {
            k: min((k + 1) * self.shard_batches, batches) - k * self.shard_batches
            for k in range(self.num_shards(batches))
        }
        return [k for k, n in want.items() if k not in self.entries or len(self.entries[k]["batches"]) < n]

    def mine(self, batches: int) -> list[int]:
        """This rank's share of `todo`, dealt round-robin (a resumed build's remainder splits evenly too)."""
        return self.todo(batches)[self.rank :: self.world_size]

    def add(
        self,
        batch: Batch,
        target_hidden: torch.Tensor,
        last_hidden: torch.Tensor,
        target_next: torch.Tensor | None = None,
    ) -> None:
        """One global batch's features; `target_next` (bsz, S): the target's argmax (feature_build always has it)."""
        dtype, layers = self.manifest["features.dtype"], len(self.manifest["model.target_layer_ids"])
        lengths = batch.lengths if batch.lengths is not None else torch.full((batch.input_ids.shape[0],), -1)
        tensors = {
            "input_ids": batch.input_ids,
            "loss_mask": batch.loss_mask,
            "lengths": lengths.to(torch.int64),
            **encode("target_hidden", target_hidden, dtype, layers),
            **encode("last_hidden", last_hidden, dtype, 1),
        }
        if target_next is not None:
            tensors["target_next"] = target_next.to(torch.int32)
        self._pending.append(((batch.data_pass, batch.index), {k: v.detach().cpu() for k, v in tensors.items()}))

    def commit(self, number: int) -> None:
        """The pending batches as shard `number`: write to *.tmp, rename, then record it (with its sha256)."""
        from safetensors.torch import save_file

        name = f"shard_{number:05d}.safetensors"
        tmp = self.store / (name + ".tmp")
        tensors = {f"{i}/{k}": v.contiguous() for i, (_, item) in enumerate(self._pending) for k, v in item.items()}
        try:
            save_file(tensors, str(tmp))
            tmp.replace(self.store / name)
        except BaseException:
            remove_partial(tmp)
            raise
        path = self.store / name
        entry = {"file": name, "sha256": file_sha256(path), "bytes": path.stat().st_size}
        self.entries[number] = {**entry, "batches": [list(key) for key, _ in self._pending], "rank": self.rank}
        self._pending = []
        if self.world_size == 1:
            self._write_index(complete=False)
        else:  # each rank its own file: no two processes write one
            write_json(self.store / f"index.rank{self.rank}.json", {"shards": self._sorted()})

    def close(self, batches: int) -> None:
        """After every rank's shards are committed (one writer, rank 0): index.json lists them all, complete."""
        self.entries = {_number(e): e for e in _committed(self.store)}
        missing = self.todo(batches)
        if missing:
            raise StoreCorrupt(f"feature store {self.store}: shards {missing} were not written")
        self._write_index(complete=True)
        for part in self.store.glob("index.rank*.json"):
            part.unlink()

    def _sorted(self) -> list[dict]:
        return [self.entries[k] for k in sorted(self.entries)]

    def _write_index(self, complete: bool) -> None:
        write_json(self.store / INDEX, {"shards": self._sorted(), "complete": complete})


def stored_batches(store: Path) -> int:
    """The batches a complete store holds in order from the first (0 when its build is not complete): the
    shards 0, 1, ... up to the first missing one or the first short one (a shorter build's last shard)."""
    index = read_json(Path(store) / INDEX, default=None)
    if not isinstance(index, dict) or not index.get("complete"):
        return 0
    shards = sorted(index.get("shards", []), key=_number)
    full, held = max((len(s["batches"]) for s in shards), default=0), 0
    for k, shard in enumerate(shards):
        if _number(shard) != k:
            break
        held += len(shard["batches"])
        if len(shard["batches"]) < full:
            break
    return held


def _number(entry: dict) -> int:
    return int(entry["file"].removeprefix("shard_").removesuffix(".safetensors"))


def _committed(store: Path) -> list[dict]:
    """The shards index.json and every rank's index.rank<r>.json list (a torchrun build killed before its merge)."""
    parts = [store / INDEX, *sorted(store.glob("index.rank*.json"))]
    return [e for p in parts for e in (read_json(p, default=None) or {}).get("shards", [])]


_VERIFIED: set[tuple[str, int, int, str]] = set()  # (path, bytes, mtime_ns, sha256) this process has hashed


def verify_shard(store: Path, shard: dict, hash_it: bool = True) -> None:
    """StoreCorrupt unless the shard is there at its recorded size and, when `hash_it`, of its recorded sha256.
    A shard is hashed once per process (the jobs of a multirun share one): later opens of the same file at the
    same size and modification time trust that hash."""
    path = store / shard["file"]
    st = path.stat() if path.is_file() else None
    bad = StoreCorrupt(f"feature store {store}: {shard['file']} is missing or does not match its sha256")
    if st is None or st.st_size != shard["bytes"]:
        raise bad
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, shard["sha256"])
    if not hash_it or key in _VERIFIED:
        return
    if file_sha256(path) != shard["sha256"]:
        raise bad
    _VERIFIED.add(key)


class StoreReader:
    """The stored HiddenItems from the batch at `start` = (pass, index) on, this rank's rows of each (read as
    slices: N ranks read the store's features once between them), on `device`, the features in `dtype` (the
    training dtype; None: as stored, fp8 dequantised to float32). Each shard's size is checked when it is
    opened and its sha256 verified once per process, by one rank of N (shard k by rank k mod N: the ranks hash
    the store once between them; a rank that finds a changed shard fails the job at the step's collective)."""

    def __init__(
        self,
        store: Path,
        start: tuple[int, int],
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        dtype: torch.dtype | None = None,
    ):
        self.store, self.device, self.rank, self.world_size = Path(store), device, rank, world_size
        self.dtype = dtype
        index = read_json(self.store / INDEX, default=None)
        if not isinstance(index, dict) or not index.get("complete"):
            raise StoreCorrupt(f"feature store {store}: its build is not complete (python -m dflash.features build)")
        self.shards = index["shards"]
        keys = [tuple(k) for s in self.shards for k in s["batches"]]
        if tuple(start) not in keys:
            raise StoreMismatch(
                f"feature store {store}: holds {len(keys)} batches, not the run's batch {tuple(start)} "
                "(train.max_steps beyond the store's build? build it for this run's settings)"
            )
        self.position = keys.index(tuple(start))

    def _open(self, number: int, shard: dict):
        from safetensors import safe_open

        verify_shard(self.store, shard, hash_it=number % self.world_size == self.rank)
        return safe_open(str(self.store / shard["file"]), framework="pt")

    def __iter__(self) -> Iterator[HiddenItem]:
        seen = 0
        for number, shard in enumerate(self.shards):
            if seen + len(shard["batches"]) <= self.position:
                seen += len(shard["batches"])
                continue
            with self._open(number, shard) as f:
                keys = set(f.keys())
                for i, (data_pass, index) in enumerate(shard["batches"]):
                    if seen + i >= self.position:
                        yield self._item(f, keys, i, data_pass, index)
            seen += len(shard["batches"])

    def _item(self, f, keys: set[str], i: int, data_pass: int, index: int) -> HiddenItem:
        t = {k: f.get_tensor(f"{i}/{k}") for k in ("input_ids", "loss_mask", "lengths")}
        lengths = None if int(t["lengths"][0]) < 0 else t["lengths"]
        ids = t["input_ids"]
        tokens = ids.numel() if lengths is None else int(lengths.sum())
        whole = Batch(ids, t["loss_mask"], tokens, data_pass, index, lengths=lengths)
        part = rank_slice(whole, self.rank, self.world_size) if self.world_size > 1 else whole
        rows = slice(part.row_start, part.row_start + part.input_ids.shape[0])
        shard_keys = {k.split("/", 1)[1] for k in keys if k.startswith(f"{i}/")}

        def read(name: str) -> torch.Tensor:  # this rank's rows only, read as a slice, before fp8 is dequantised
            return f.get_slice(f"{i}/{name}")[rows]

        t["target_hidden"], t["last_hidden"] = (
            decode(read, n, self.dtype, shard_keys) for n in ("target_hidden", "last_hidden")
        )
        target_next = read("target_next").to(self.device) if "target_next" in shard_keys else None  # an older store
        return HiddenItem(
            input_ids=part.input_ids.to(self.device),
            loss_mask=part.loss_mask.to(self.device),
            target_hidden=t["target_hidden"].to(self.device),
            last_hidden=t["last_hidden"].to(self.device),
            num_tokens=part.num_tokens,
            data_pass=data_pass,
            index=index,
            global_loss_mask=None if part.global_loss_mask is None else part.global_loss_mask.to(self.device),
            row_start=part.row_start,
            global_tokens=part.global_tokens,
            target_next=target_next,
        )


def target_label_counts(store: Path, vocab_size: int, batches: int) -> torch.Tensor:
    """[vocab_size] int64: the target's labels (loss.labels=target: its argmax at the position before each token
    under the loss mask, as the loss reads them) in the store's first `batches` batches, read without the features."""
    from safetensors import safe_open

    index = read_json(Path(store) / INDEX, default=None)
    if not isinstance(index, dict) or not index.get("complete"):
        raise StoreCorrupt(f"feature store {store}: its build is not complete (python -m dflash.features build)")
    counts, seen = torch.zeros(vocab_size, dtype=torch.long), 0
    for shard in index["shards"]:
        with safe_open(str(Path(store) / shard["file"]), framework="pt") as f:
            for i in range(len(shard["batches"])):
                if seen >= batches:
                    return counts
                if f"{i}/target_next" not in f.keys():
                    raise StoreMismatch(f"feature store {store}: an older store without the target's argmax")
                mask = f.get_tensor(f"{i}/loss_mask").bool()
                labels = f.get_tensor(f"{i}/target_next")[:, :-1][mask[:, 1:]].long()
                counts += torch.bincount(labels.clamp(0, vocab_size - 1), minlength=vocab_size)[:vocab_size]
                seen += 1
    return counts


def store_bytes_per_token(hidden_size: int, num_layers: int, dtype: str) -> int:
    """Bytes a token takes in a store: the layers' features and the last hidden state (with fp8 their per-token
    scales), plus its id (int64), loss mask (bool) and the target's argmax (int32)."""
    return (num_layers + 1) * (hidden_size * bytes_per_value(dtype) + scale_bytes(dtype)) + 13


def manifest_for(cfg, layer_ids: list[int], data_fingerprint: dict | None) -> dict:
    """What a run's features are of: the store it may read must say the same (num_batches aside)."""
    from omegaconf import OmegaConf

    from dflash.core.config import data_seed
    from dflash.data.chat_dataset import RENDER_VERSION
    from dflash.data.fingerprint import TOKENIZER_FILES, hashed_files, hub_entry, target_hashes
    from dflash.model.target import target_attention

    target = Path(cfg.model.target).expanduser()
    tokenizer = hashed_files(target, TOKENIZER_FILES) or hub_entry(str(target))
    return {
        "feature_version": FEATURE_VERSION,
        "model.target": str(cfg.model.target),
        "target_files": target_hashes(str(target)),  # every shard the index names; a hub name's revision
        "model.target_layer_ids": list(layer_ids),
        "model.dtype": cfg.model.dtype,  # the target's: its features in bfloat16 are not its features in float32
        "target.attn_implementation": target_attention(str(cfg.model.target)),
        "features.dtype": cfg.features.dtype,
        "train.seq_len": cfg.train.seq_len,
        "train.batch_size": cfg.train.batch_size,
        "train.data_seed": data_seed(cfg.train),  # the data order (train.seed unless set): not the drafter's seed
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "data_fingerprint": data_fingerprint,
        "tokenizer": tokenizer,  # also inside the data fingerprint; here on its own so a refusal names it
        "data.render_version": RENDER_VERSION,  # how data=jsonl conversations become token ids and masks
    }


def store_path(cfg, manifest: dict) -> Path:
    """features.path, or a directory under paths.cache_dir named by the manifest: the jobs of a sweep that
    differ only in what the store does not record (losses, schedules, evals) share one store."""
    if cfg.features.path:
        return Path(cfg.features.path).expanduser()
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cfg.paths.cache_dir).expanduser() / "features" / key
