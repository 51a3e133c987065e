"""`loss.labels=target`: the hard labels are the target's argmax after each position (its own choice, also on text
it did not write) instead of the text's next tokens, for the online path and a store's item, with and without the
KL; refused for DSpark and for an unknown source."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config

from dflash.core.validation import ConfigError, validate
from dflash.data.batches import Batch
from dflash.model import families
from dflash.model.build import build_drafter_config, init_drafter
from dflash.model.families import configure_family
from dflash.model.target import TargetModel, greedy_tokens
from dflash.train import trainer as trainer_module
from dflash.train.trainer import DrafterTrainer, HiddenItem, TargetForward

MASK = 3


def _trainer(tiny_dir, overrides):
    cfg = compose_config(["experiment=smoke", f"model.target={tiny_dir}", "train.num_anchors=6", *overrides])
    target = TargetModel.load(str(tiny_dir), [1, 2])
    config = build_drafter_config(target.model.config, cfg.model, [1, 2], MASK)
    configure_family(config, cfg.drafter)
    return DrafterTrainer(cfg, target, init_drafter(config, 0), MASK, total_steps=10), target


def _item(target, stored: bool) -> HiddenItem:
    ids = torch.randint(5, 500, (2, 48), generator=torch.Generator().manual_seed(0))  # random text: the target's
    batch = Batch(ids, torch.ones(2, 48, dtype=torch.bool), ids.numel(), 0, 0)  # argmax differs from it
    item = TargetForward(target, torch.device("cpu"))(batch)
    if stored:  # what a feature store's item carries
        item.target_next = greedy_tokens(item.last_hidden, target.lm_head.weight).to(torch.int32)
    return item


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
@pytest.mark.parametrize("loss", ["loss=dpace", "loss=kl"])
@pytest.mark.parametrize("stored", [False, True])
def test_the_loss_takes_the_targets_argmax_as_its_labels(family, loss, stored, tiny_dir, monkeypatch):
    extra = ["drafter.selector_rank=8", "drafter.selector_top_k=4"] if family == "dflash2" else []
    seen, real_loss, real_family = {}, families.dflash_loss, trainer_module.family_loss

    def spy(draft_hidden, labels, valid, *args, **kwargs):
        seen.setdefault("labels", []).append((labels.clone(), valid.clone()))
        return real_loss(draft_hidden, labels, valid, *args, **kwargs)

    def blocks_spy(drafter, draft_hidden, blocks, *args, **kwargs):
        seen["positions"] = blocks.teacher_positions.clone()  # anchor + k - 1: where the label's prediction is made
        return real_family(drafter, draft_hidden, blocks, *args, **kwargs)

    monkeypatch.setattr(families, "dflash_loss", spy)
    monkeypatch.setattr(trainer_module, "family_loss", blocks_spy)
    for source in ("data", "target"):
        trainer, target = _trainer(tiny_dir, [f"drafter={family}", loss, f"loss.labels={source}", *extra])
        item = _item(target, stored)
        out = trainer.compute_loss(item, 0, 0.0)
        assert torch.isfinite(out.loss)
        out.loss.backward()
    (data_labels, valid), (target_labels, valid_t) = seen["labels"]
    assert torch.equal(valid, valid_t)  # the same anchors and supervised positions: only the labels differ
    # the target's argmax at each drafted position: its LM head on its last hidden state one position before
    argmax = greedy_tokens(item.last_hidden, target.lm_head.weight)  # (bsz, S): the token after each position
    positions = seen["positions"]
    expected = torch.gather(argmax, 1, positions.reshape(positions.shape[0], -1)).view_as(target_labels)
    assert valid.sum() > 20 and torch.equal(target_labels[valid], expected[valid])
    assert (data_labels[valid] != target_labels[valid]).float().mean() > 0.5  # random text: the sources differ


def test_the_target_labels_are_the_argmax_one_position_before(tiny_dir):
    """On text the target wrote greedily itself, its argmax is the text's next token: both sources agree."""
    trainer, target = _trainer(tiny_dir, ["loss.labels=target"])
    ids = torch.randint(5, 500, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(40):  # the target's own greedy continuation
            _, last = target.features(ids)
            ids = torch.cat([ids, target.logits(last[:, -1:]).argmax(-1)], dim=1)
    written = torch.arange(ids.shape[1]) >= 8  # supervise only what the target wrote
    batch = Batch(ids, written.expand_as(ids).clone(), ids.numel(), 0, 0)
    item = TargetForward(target, torch.device("cpu"))(batch)
    losses = {}
    for source in ("data", "target"):
        trainer.cfg.loss.labels = source
        losses[source] = trainer.compute_loss(item, 0, 0.0).loss
    torch.testing.assert_close(losses["target"], losses["data"], rtol=1e-5, atol=1e-6)


def test_an_unknown_source_and_dspark_are_refused(tiny_dir):
    with pytest.raises(ConfigError, match="loss.labels"):
        validate(compose_config(["experiment=smoke", "loss.labels=teacher"]))
    with pytest.raises(ConfigError, match="loss.labels.*dspark"):
        validate(compose_config(["experiment=smoke", "drafter=dspark", "loss.labels=target"]))
