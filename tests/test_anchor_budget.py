"""train.anchor_budget: the rule that spreads a batch's anchors over its rows, the cap with mixed sequence lengths,
the trainer drawing by it, and the memory plan following it."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO
from hydra import compose, initialize_config_dir

from dflash.core.config import ConfigError, register_configs
from dflash.core.validation import validate
from dflash.model.anchor_budget import anchor_counts
from dflash.model.blocks import sample_anchors
from dflash.model.plan import TargetShape, memory_parts, planned_anchors

register_configs()
B = 4


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=smoke", *overrides])


def test_the_rule_by_hand():
    # capacities min(e, 64) = 64, 10, 0, 50; one each to the rows with any, 37 left shared by 63 : 9 : 0 : 49 of
    # 121: floors 19, 2, 0, 14 (35), remainders 32, 91, 0, 119: the 2 left go to rows 3 and 1
    assert anchor_counts([100, 10, 0, 50], 64, 40) == [20, 4, 0, 16]
    assert anchor_counts([100, 10, 0, 50], 64, None) == [64, 10, 0, 50]  # no budget: num_anchors per row
    assert anchor_counts([3, 2, 5], 64, 100) == [3, 2, 5]  # a budget above what the rows hold takes them all
    assert anchor_counts([7, 7, 7, 7], 64, 10) == [3, 3, 2, 2]  # ties: the lower rows first


def _mixed_mask(lengths: list[int], seq_len: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, 1:n] = True  # row b's supervised tokens end at its length (padding after)
    return mask


@pytest.mark.parametrize("budget", [5, 9, 24, 61, 500])
def test_the_total_never_exceeds_the_budget_with_mixed_lengths(budget):
    lengths, S = [200, 17, 5, 120, 64], 200
    mask = _mixed_mask(lengths, S)
    eligible = [min(n - 1, S - B + 1) for n in lengths]  # a + 1 supervised (a <= n - 2), the block fits (a <= S - B)
    for seed in range(5):
        anchors, valid = sample_anchors(mask, 32, B, torch.Generator().manual_seed(seed), budget=budget)
        counts = valid.sum(dim=1).tolist()
        assert sum(counts) == min(budget, sum(min(e, 32) for e in eligible)) <= budget
        assert all(min(1, e) <= c <= min(e, 32) for c, e in zip(counts, eligible))
        assert valid.shape[1] == max(counts)  # the width is the largest row's count, not num_anchors
        for b in range(len(lengths)):  # every anchor's first predicted token is supervised, its block fits
            assert all(mask[b, a + 1] and a + B <= S for a in anchors[b][valid[b]].tolist())
        again, _ = sample_anchors(mask, 32, B, torch.Generator().manual_seed(seed), budget=budget)
        assert torch.equal(again, anchors)  # deterministic given the seed
    assert counts == anchor_counts(eligible, 32, budget)  # the counts depend on the masks only


def test_the_budget_must_give_every_row_one():
    validate(_compose("train.anchor_budget=4", "train.batch_size=4"))
    with pytest.raises(ConfigError, match=r"train.anchor_budget=3 is invalid: must be >= train.batch_size \(4"):
        validate(_compose("train.anchor_budget=3", "train.batch_size=4"))


def test_the_trainer_draws_within_the_budget(tiny_target, tiny_tokenizer, monkeypatch):
    from dflash.data.batches import Batch
    from dflash.model.build import build_drafter_config
    from dflash.model.drafter import DFlashDraftModel
    from dflash.model.target import TargetModel
    from dflash.train import trainer as trainer_mod

    cfg = _compose(f"model.target={tiny_target}", "train.anchor_budget=6", "train.num_anchors=8")
    target, mask_id = TargetModel.load(str(tiny_target), [1, 2]), tiny_tokenizer.mask_token_id
    drafter = DFlashDraftModel(build_drafter_config(target.model.config, cfg.model, [1, 2], mask_id))
    seen = []
    real = trainer_mod.sample_anchors
    monkeypatch.setattr(trainer_mod, "sample_anchors", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    ids = torch.randint(5, 500, (3, 64), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, _mixed_mask([64, 20, 40], 64), 3 * 64, 0, 0)
    item = trainer_mod.TargetForward(target, torch.device("cpu"))(batch)
    trainer_mod.DrafterTrainer(cfg, target, drafter, mask_id, total_steps=4).train_on(item)
    _, valid = seen[0]
    assert valid.sum().item() == 6 and valid.sum(dim=1).tolist() == anchor_counts([61, 19, 39], 8, 6)


def test_the_memory_plan_follows_the_budget():
    """The plan's anchors per row are the sampler's width for its batch of full rows; its drafter memory falls with
    the budget and stays put as the batch grows."""
    t = TargetShape(256, 6, 4, 2, 64, 512, 2048, True)
    S, bsz = 256, 8
    plain = _compose("model.target=x", f"train.seq_len={S}", f"train.batch_size={bsz}", "train.num_anchors=32")
    budget = _compose(
        "model.target=x",
        f"train.seq_len={S}",
        f"train.batch_size={bsz}",
        "train.num_anchors=32",
        "train.anchor_budget=64",
    )
    full_rows = torch.ones(bsz, S, dtype=torch.bool)
    _, valid = sample_anchors(full_rows, 32, plain.model.block_size, torch.Generator().manual_seed(0), budget=64)
    assert planned_anchors(budget, bsz, S) == valid.shape[1] == 8 and valid.sum().item() == 64
    assert planned_anchors(plain, bsz, S) == 32

    def drafter_mb(cfg, batch_size=bsz):
        return memory_parts(cfg, t, batch_size=batch_size, device="cpu")["drafter activations"] / 2**20

    assert drafter_mb(budget) < drafter_mb(plain)
    eight = _compose(
        "model.target=x", f"train.seq_len={S}", f"train.batch_size={bsz}", "train.num_anchors=8"
    )  # 8 anchors per row, by num_anchors: the same drafter memory as the budget's 64 over 8 rows
    assert drafter_mb(budget) == drafter_mb(eight)
    # twice the rows under the same budget: half the anchors per row, the block tokens unchanged
    assert planned_anchors(budget, 2 * bsz, S) == 4
    four = _compose("model.target=x", f"train.seq_len={S}", "train.num_anchors=4")
    assert drafter_mb(budget, 2 * bsz) == drafter_mb(four, 2 * bsz) < drafter_mb(plain, 2 * bsz)
