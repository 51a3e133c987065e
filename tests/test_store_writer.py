"""StoreWriter's shards dealt among ranks (what a torchrun build does, without processes): disjoint shares, the
ranks' index parts merged in order by rank 0, a build stopped with one rank's shards missing finished by one
process, and the reader reading an fp8 store back in the training dtype."""

from __future__ import annotations

import json

import pytest
import torch

from dflash.data.batches import Batch
from dflash.train.feature_store import StoreCorrupt, StoreReader, StoreWriter

MANIFEST = {"feature_version": 1, "model.target_layer_ids": [1, 2], "features.dtype": "float32"}
BATCHES, PER_SHARD = 7, 2  # 4 shards, the last one short


def batch(i: int) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 100, (4, 8), generator=g)
    return (
        Batch(ids, torch.ones(4, 8, dtype=torch.bool), 32, 0, i),
        torch.randn(4, 8, 6, generator=g),
        torch.randn(4, 8, 3),
    )


def write(writer: StoreWriter, shards: list[int]) -> None:
    for k in shards:
        for i in range(k * PER_SHARD, min((k + 1) * PER_SHARD, BATCHES)):
            writer.add(*batch(i))
        writer.commit(k)


def test_two_ranks_share_the_shards_and_rank_0_lists_them_in_order(tmp_path):
    setup = StoreWriter(tmp_path, MANIFEST, PER_SHARD)  # rank 0's setup: the manifest
    ranks = [StoreWriter(tmp_path, MANIFEST, PER_SHARD, r, 2, setup=False) for r in (0, 1)]
    shares = [w.mine(BATCHES) for w in ranks]
    assert shares == [[0, 2], [1, 3]] and setup.todo(BATCHES) == [0, 1, 2, 3]
    for w, share in zip(ranks[::-1], shares[::-1]):  # rank 1 first: the order of finishing does not matter
        write(w, share)
    assert not (tmp_path / "index.json").exists() and len(list(tmp_path.glob("index.rank*.json"))) == 2
    ranks[0].close(BATCHES)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["complete"] and [s["file"] for s in index["shards"]] == [
        f"shard_0000{k}.safetensors" for k in range(4)
    ]
    assert [s["rank"] for s in index["shards"]] == [0, 1, 0, 1] and not list(tmp_path.glob("index.rank*.json"))
    items = list(StoreReader(tmp_path, (0, 0), torch.device("cpu")))
    assert [it.index for it in items] == list(range(BATCHES))
    assert all(torch.equal(it.target_hidden, batch(it.index)[1]) for it in items)


def test_a_build_missing_one_ranks_shards_is_finished_by_one_process(tmp_path):
    StoreWriter(tmp_path, MANIFEST, PER_SHARD)
    write(StoreWriter(tmp_path, MANIFEST, PER_SHARD, 0, 2, setup=False), [0, 2])  # rank 1 never wrote
    with pytest.raises(StoreCorrupt, match=r"shards \[1, 3\] were not written"):
        StoreWriter(tmp_path, MANIFEST, PER_SHARD, 0, 2, setup=False).close(BATCHES)
    one = StoreWriter(tmp_path, MANIFEST, PER_SHARD)  # a rerun in one process: rank 0's part counts as done
    assert one.mine(BATCHES) == [1, 3]
    write(one, [1, 3])
    one.close(BATCHES)
    assert len(list(StoreReader(tmp_path, (0, 3), torch.device("cpu")))) == BATCHES - 3


def test_an_fp8_store_reads_back_in_the_training_dtype(tmp_path):
    writer = StoreWriter(tmp_path, {**MANIFEST, "features.dtype": "fp8"}, PER_SHARD)
    write(writer, writer.mine(BATCHES))
    writer.close(BATCHES)
    for dtype in (torch.float32, torch.bfloat16):
        items = list(StoreReader(tmp_path, (0, 0), torch.device("cpu"), dtype=dtype))
        assert {it.target_hidden.dtype for it in items} == {it.last_hidden.dtype for it in items} == {dtype}
        want = batch(0)[1]
        assert float((items[0].target_hidden.float() - want).norm() / want.norm()) < 0.05
    from safetensors import safe_open

    with safe_open(str(tmp_path / "shard_00000.safetensors"), framework="pt") as f:  # fp8 on disk, scales beside
        assert f.get_tensor("0/target_hidden").dtype == torch.float8_e4m3fn
        assert f.get_tensor("0/target_hidden_scale").shape == (4, 8, 2)  # a scale per token and layer


def test_the_manifest_records_the_tokenizer_and_rendering_and_a_change_is_named(tmp_path, tiny_target):
    """The manifest holds the tokenizer files' hashes and the rendering version, and a store whose rendering
    version differs from the run's is refused naming that key with both values."""
    from omegaconf import OmegaConf

    from dflash.core.config import Config
    from dflash.data.chat_dataset import RENDER_VERSION
    from dflash.train.feature_store import StoreMismatch, check_manifest, manifest_for

    cfg = OmegaConf.structured(Config)
    cfg.model.target = str(tiny_target)
    manifest = manifest_for(cfg, [1, 3], None)
    assert set(manifest["tokenizer"]) >= {"tokenizer.json", "tokenizer_config.json"}
    assert manifest["data.render_version"] == RENDER_VERSION
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "data.render_version": RENDER_VERSION - 1}))
    with pytest.raises(
        StoreMismatch, match=rf"data.render_version: store {RENDER_VERSION - 1} vs run {RENDER_VERSION}"
    ):
        check_manifest(tmp_path, manifest)


def test_each_rank_reads_only_its_rows_and_the_ranks_hash_each_shard_once(tmp_path, monkeypatch):
    """Under DDP a rank reads its rows of the features (slices), not whole tensors; the ranks hash the store once
    between them (shard k by rank k mod N), and a process hashes a shard once: a second reader trusts it while
    the file keeps its size and time, and a changed shard is still found."""
    from dflash.train import feature_store

    writer = StoreWriter(tmp_path, MANIFEST, PER_SHARD)
    write(writer, writer.mine(BATCHES))
    writer.close(BATCHES)
    hashed, whole_reads = [], []
    sha256 = feature_store.file_sha256
    monkeypatch.setattr(feature_store, "file_sha256", lambda p: hashed.append(p.name) or sha256(p))
    monkeypatch.setattr(feature_store, "_VERIFIED", set(), raising=False)  # none hashed yet in this process
    from safetensors import safe_open

    class Recording:  # safe_open's handle, counting the features read whole
        def __init__(self, path, framework):
            self.f = safe_open(path, framework=framework)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            if key.endswith("_hidden"):
                whole_reads.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr("safetensors.safe_open", Recording)
    for rank in (0, 1):
        items = list(StoreReader(tmp_path, (0, 0), torch.device("cpu"), rank=rank, world_size=2))
        rows = slice(2 * rank, 2 * rank + 2)  # 4 rows a batch, 2 a rank
        assert all(torch.equal(it.target_hidden, batch(it.index)[1][rows]) for it in items)
        assert all(it.last_hidden.shape == (2, 8, 3) for it in items)  # (batch()'s last_hidden is unseeded)
    assert whole_reads == []  # every feature read as its rank's slice
    assert sorted(hashed) == [f"shard_0000{k}.safetensors" for k in range(4)]  # each shard by one rank
    hashed.clear()  # this process has hashed every shard (as the two ranks' readers): a new reader trusts them
    assert len(list(StoreReader(tmp_path, (0, 0), torch.device("cpu")))) == BATCHES and hashed == []
    shard = tmp_path / "shard_00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))  # the same size, a new modification time
    with pytest.raises(StoreCorrupt, match="shard_00002.safetensors is missing or does not match its sha256"):
        list(StoreReader(tmp_path, (0, 0), torch.device("cpu")))
