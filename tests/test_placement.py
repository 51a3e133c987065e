"""parallel.target_devices / parallel.drafter_device: target replicas and the drafter placed in one process."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config, launch
from test_distributed import max_diff, train_records, weights

from dflash.model.target import TargetHeads, TargetModel

COMMON = ["experiment=smoke", "train.batch_size=4", "train.max_steps=12", "eval.num_prompts=0"]


@pytest.mark.slow
def test_two_target_replicas_train_like_one_target(tmp_path, cache_dir, tiny_target):
    """Two replicas (two target workers, each keeping its replica) feed the drafter the same batches in the same
    order as one target does."""
    one, two = tmp_path / "one", tmp_path / "two"
    launch([*COMMON, "pipeline.threads_per_stage=1", f"hydra.run.dir={one}"], cache_dir, check=True)
    placed = ["parallel.target_devices=[cpu,cpu]", "parallel.drafter_device=cpu", "pipeline.threads_per_stage=1"]
    proc = launch([*COMMON, *placed, f"hydra.run.dir={two}"], cache_dir, check=True)
    assert max_diff(weights(one), weights(two)) < 1e-6
    assert train_records(one)[-1]["tokens"] == train_records(two)[-1]["tokens"]
    assert proc.returncode == 0


def test_target_heads_are_frozen_copies_on_the_drafters_device(tiny_target):
    target = TargetModel.load(str(tiny_target), [1, 2], "float32", "cpu")
    heads = TargetHeads(target, torch.device("cpu"))
    ids = torch.tensor([[1, 5, 9]])
    torch.testing.assert_close(heads.embed_tokens(ids), target.embed_tokens(ids))
    torch.testing.assert_close(heads.lm_head.weight, target.lm_head.weight)
    assert heads.embed_tokens.weight.data_ptr() != target.embed_tokens.weight.data_ptr()  # a copy, not a view
    assert not any(p.requires_grad for p in heads.parameters())


def test_placement_needs_one_process():
    from dflash.core.config import ConfigError
    from dflash.core.validation import validate

    cfg = compose_config(["parallel=ddp", "parallel.drafter_device=cuda:1"])
    with pytest.raises(ConfigError, match="parallel.target_devices/drafter_device"):
        validate(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_target_heads_load_reads_only_the_embedding_and_lm_head(tmp_path, tied):
    """A drafter rank of parallel.target_ranks reads the two tensors from the target's files (the rest of the
    model is never materialised): the same values as the loaded target's, tied or not (Qwen3-8B is untied)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    target = TargetModel.load(str(tmp_path), [0], "float32", "cpu")
    assert (target.lm_head.weight is target.embed_tokens.weight) == tied
    heads = TargetHeads.load(str(tmp_path), "float32", torch.device("cpu"))
    assert torch.equal(heads.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(heads.lm_head.weight, target.lm_head.weight)
    assert (heads.lm_head is heads.embed_tokens) == tied
    assert not any(p.requires_grad for p in heads.parameters())
    assert sum(p.numel() for p in heads.parameters()) == (1 if tied else 2) * 96 * 32
