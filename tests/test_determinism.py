"""train.deterministic: deterministic algorithms on, one CPU thread per stage, the same bits run after run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config, launch
from test_distributed import max_diff, weights

from dflash.core import determinism


def test_the_switch_turns_deterministic_algorithms_on_and_off():
    try:
        determinism.apply(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert determinism.cpu_threads_per_stage(True) == 1
    finally:
        determinism.apply(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_stage_outside_the_pipeline_gets_the_deterministic_thread_count_and_gives_it_back():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with determinism.cpu_threads(True, torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), determinism.cpu_threads(True, torch.device("cpu")):
            raise RuntimeError("a stage that fails")
        assert torch.get_num_threads() == 2  # restored on the way out of a failure too
        for enabled, device in ((False, "cpu"), (True, "cuda"), (True, "meta")):
            with determinism.cpu_threads(enabled, torch.device(device)):
                assert torch.get_num_threads() == 2  # no opinion: the threads are left alone
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_feature_store_build_runs_the_target_on_the_deterministic_runs_threads(
    deterministic, tmp_path, tiny_target, cache_dir, monkeypatch
):
    """A store read by a train.deterministic run holds the features of that run's one-thread target stage: on a
    CPU whose GEMMs add in another order on more threads, features of two threads would not be its bits."""
    from dflash.model.target import TargetModel
    from dflash.runner.feature_build import build_store

    seen = []
    features = TargetModel.features
    monkeypatch.setattr(
        TargetModel, "features", lambda self, ids: seen.append(torch.get_num_threads()) or features(self, ids)
    )
    cfg = compose_config(
        ["experiment=smoke", f"model.target={tiny_target}", f"paths.cache_dir={cache_dir}", "features=store",
         f"features.path={tmp_path / 'store'}", "train.max_steps=2", f"train.deterministic={deterministic}"]
    )  # fmt: skip
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        build_store(cfg)
        assert seen == ([1, 1] if deterministic else [2, 2])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_deterministic_runs_repeat_bit_for_bit(tmp_path, cache_dir, tiny_target):
    args = ["experiment=smoke", "train.max_steps=10", "eval.num_prompts=0", "train.deterministic=true"]
    a, b = tmp_path / "a", tmp_path / "b"
    launch([*args, f"hydra.run.dir={a}"], cache_dir, check=True)
    launch([*args, f"hydra.run.dir={b}"], cache_dir, check=True)
    assert max_diff(weights(a), weights(b)) == 0.0
    # summary.json's train metrics are the mean over the last steps: the monitor's last window depends on timing
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["train/loss"] == sb["train/loss"] and sa["train/grad_norm"] == sb["train/grad_norm"]
