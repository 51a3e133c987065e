"""What a target is, as the data fingerprint, the feature store's manifest and regeneration record it: every
weights shard its index names (hashed), a hub name's revision (read from the local hub cache), and for a store
the target's dtype and attention implementation."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from dflash.core.config import Config
from dflash.data.fingerprint import data_fingerprint, differences
from dflash.train.feature_store import StoreMismatch, check_manifest, manifest_for

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture
def sharded(tmp_path):
    """A sharded target's files as the hub lays them out: config, index and the two shards the index names."""
    root = tmp_path / "target"
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "qwen3"}')
    weight_map = {"model.embed_tokens.weight": SHARDS[0], "lm_head.weight": SHARDS[1], "model.norm.weight": SHARDS[1]}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for i, name in enumerate(SHARDS):
        (root / name).write_bytes(bytes([i]) * 4096)
    return root


def _store_cfg(target, **model):
    cfg = OmegaConf.structured(Config)
    cfg.model.target = str(target)
    cfg.model.update(model)
    cfg.data.name = "stdlib"
    return cfg


def target_hashes(target) -> dict:
    """The target's files as the store's manifest records them (regeneration records the same helper's)."""
    return manifest_for(_store_cfg(target), [1], None)["target_files"]


def test_every_shard_the_index_names_is_hashed(sharded):
    before = target_hashes(str(sharded))
    assert set(SHARDS) <= set(before)
    (sharded / SHARDS[1]).write_bytes(b"\x07" * 4096)  # new weights in the second shard, same size
    assert target_hashes(str(sharded))[SHARDS[1]] != before[SHARDS[1]]


def test_a_store_of_a_sharded_target_whose_weights_changed_is_refused(sharded, tmp_path):
    cfg = _store_cfg(sharded)
    manifest = manifest_for(cfg, [1], None)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (sharded / SHARDS[0]).write_bytes(b"\x09" * 4096)
    with pytest.raises(StoreMismatch, match=rf"target_files: .*{SHARDS[0]}"):
        check_manifest(tmp_path, manifest_for(cfg, [1], None))


def _hub_cache(root, repo: str, commit: str):
    """The hub cache's layout for `repo` at `commit`: refs/main names the commit, the snapshot holds its files."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (folder / "snapshots" / commit / "config.json").write_text("{}")


def test_a_hub_target_is_recorded_with_the_revision_the_local_cache_resolves(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo, first, second = "org/model", "a" * 40, "b" * 40
    _hub_cache(tmp_path, repo, first)
    assert target_hashes(repo) == {"hub": repo, "revision": first}
    data = OmegaConf.create({"name": "stdlib", "holdout_fraction": 0.05})
    recorded = data_fingerprint(data, repo)
    cfg = _store_cfg(repo)
    manifest = manifest_for(cfg, [1], recorded)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))

    _hub_cache(tmp_path, repo, second)  # the hub moved on and the cache followed it
    assert differences(recorded, data_fingerprint(data, repo)) == ["the tokenizer files changed"]
    with pytest.raises(StoreMismatch, match=f"target_files: store .*{first}.* vs run .*{second}"):
        check_manifest(tmp_path, manifest_for(cfg, [1], data_fingerprint(data, repo)))


def test_a_hub_target_recorded_without_a_revision_still_resumes(tmp_path, monkeypatch):
    """Runs recorded before revisions were: the same hub name is the same tokenizer (no refused resume)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    _hub_cache(tmp_path, "org/model", "c" * 40)
    data = OmegaConf.create({"name": "stdlib", "holdout_fraction": 0.05})
    current = data_fingerprint(data, "org/model")
    old = {**current, "tokenizer": {"hub": "org/model"}}
    assert differences(old, current) == []
    assert differences({**current, "tokenizer": {"hub": "org/other"}}, current) == ["the tokenizer files changed"]


@pytest.mark.parametrize(
    ("key", "store_value", "run_model"),
    [("model.dtype", "bfloat16", {"dtype": "float32"}), ("target.attn_implementation", "eager", {})],
)
def test_a_store_of_another_target_dtype_or_attention_is_refused_naming_both(
    sharded, tmp_path, key, store_value, run_model
):
    manifest = manifest_for(_store_cfg(sharded, **run_model), [1], None)
    run_value = manifest[key]
    assert run_value != store_value
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, key: store_value}))
    with pytest.raises(StoreMismatch, match=rf"{key}: store '{store_value}' vs run '{run_value}'"):
        check_manifest(tmp_path, manifest)


def test_a_store_built_before_dtype_was_recorded_says_so(sharded, tmp_path):
    manifest = manifest_for(_store_cfg(sharded), [1], None)
    (tmp_path / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "model.dtype"}))
    with pytest.raises(StoreMismatch, match=r"model.dtype: store 'not recorded' vs run 'float32'"):
        check_manifest(tmp_path, manifest)


def test_the_recorded_attention_is_the_one_the_target_loads_with(tiny_target):
    from dflash.model.target import TargetModel

    recorded = manifest_for(_store_cfg(tiny_target), [1], None)["target.attn_implementation"]
    assert TargetModel.load(str(tiny_target), [1], "float32", "cpu").model.config._attn_implementation == recorded
