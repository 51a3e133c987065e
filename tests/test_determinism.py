"""train.deterministic: deterministic algorithms on, one CPU thread per stage, the same bits run after run."""

from __future__ import annotations

import pytest
import torch
from conftest import launch
from test_distributed import max_diff, train_records, weights


def test_the_switch_turns_deterministic_algorithms_on_and_off():
    from dflash import determinism

    try:
        determinism.apply(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert determinism.cpu_threads_per_stage(True) == 1
    finally:
        determinism.apply(False)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.slow
def test_deterministic_runs_repeat_bit_for_bit(tmp_path, cache_dir, tiny_target):
    args = ["experiment=smoke", "train.max_steps=10", "eval.num_prompts=0", "train.deterministic=true"]
    a, b = tmp_path / "a", tmp_path / "b"
    launch([*args, f"hydra.run.dir={a}"], cache_dir, check=True)
    launch([*args, f"hydra.run.dir={b}"], cache_dir, check=True)
    assert max_diff(weights(a), weights(b)) == 0.0
    assert train_records(a)[-1]["train/loss"] == train_records(b)[-1]["train/loss"]
