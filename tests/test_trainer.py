"""The drafter training step on the tiny random target: learning, non-finite steps, determinism."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO
from hydra import compose, initialize_config_dir

from dflash.core.config import register_configs
from dflash.data.batches import Batch
from dflash.model.build import build_drafter_config
from dflash.model.drafter import DFlashDraftModel
from dflash.model.target import TargetModel
from dflash.train.trainer import DrafterTrainer, TargetForward, TrainingDiverged

register_configs()


@pytest.fixture()
def parts(tiny_target, tiny_tokenizer):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "experiment=smoke",
                f"model.target={tiny_target}",
                "train.max_bad_steps=3",
                "train.max_steps=100",
            ],
        )
    target = TargetModel.load(str(tiny_target), [1, 2])
    mask_id = tiny_tokenizer.mask_token_id
    torch.manual_seed(0)
    drafter = DFlashDraftModel(build_drafter_config(target.model.config, cfg.model, [1, 2], mask_id))
    return cfg, target, drafter, mask_id


def _batch(seed=0, seq=64, vocab=500) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (2, seq), generator=g)
    return Batch(ids, torch.ones(2, seq, dtype=torch.bool), ids.numel(), 0, seed)


def test_training_reduces_loss_on_a_repeated_batch(parts):
    cfg, target, drafter, mask_id = parts
    cfg.schedule.lr, cfg.loss.name = 1e-2, "ce_decay"  # memorise one batch quickly
    trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    item = TargetForward(target, torch.device("cpu"))(_batch())
    losses = []
    for _ in range(60):
        trainer.train_on(item)
        losses.append(trainer.metrics()["train/loss"])
    # random tokens, anchors resampled every step: memorising is slow but steady (about -0.27 nats by step 60)
    assert losses[-1] < losses[0] - 0.15
    assert trainer.step == 60 and trainer.tokens == 60 * item.num_tokens and trainer.next_data == (0, 1)


def test_a_window_without_a_step_has_no_train_metrics(parts):
    """A monitor tick between two steps writes the counters only: a train/* key there would repeat a step's
    record (a mean over records would count that step twice)."""
    cfg, target, drafter, mask_id = parts
    trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    assert not [k for k in trainer.metrics() if k.startswith("train/")]
    trainer.train_on(TargetForward(target, torch.device("cpu"))(_batch()))
    first = trainer.metrics()
    assert first["train/supervised_tokens"] > 0 and "train/loss" in first
    again = trainer.metrics()
    assert again == {"step": 1, "tokens": first["tokens"]}


def test_non_finite_steps_are_skipped_then_fail(parts):
    cfg, target, drafter, mask_id = parts
    trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    item = TargetForward(target, torch.device("cpu"))(_batch())
    trainer.train_on(item)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    bad = TargetForward(target, torch.device("cpu"))(_batch())
    bad.target_hidden[:] = float("nan")
    trainer.train_on(bad)
    trainer.train_on(bad)
    assert trainer.skipped_steps == 2 and trainer.metrics()["train/skipped_steps"] == 2
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, before[k]), k  # weights untouched by skipped steps
    trainer.train_on(item)  # a good step resets the run of bad ones
    with pytest.raises(TrainingDiverged, match="max_bad_steps=3"):
        for _ in range(3):
            trainer.train_on(bad)


def test_steps_are_deterministic(parts):
    cfg, target, _, mask_id = parts
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        drafter = DFlashDraftModel(build_drafter_config(target.model.config, cfg.model, [1, 2], mask_id))
        trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
        for i in range(3):
            trainer.train_on(TargetForward(target, torch.device("cpu"))(_batch(i)))
        results.append({k: v.clone() for k, v in drafter.state_dict().items()})
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


def test_resumed_optimizer_takes_the_resumed_configs_hyperparameters(parts):
    cfg, target, drafter, mask_id = parts
    assert cfg.optim.name == "muon"  # the default: Muon's matrices and AdamW's norms, each part's own settings
    trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    trainer.train_on(TargetForward(target, torch.device("cpu"))(_batch()))
    state = trainer.state_dict()
    # what `resume=RUN optim.weight_decay=0.3 ...` gives
    cfg.optim.weight_decay, cfg.optim.betas, cfg.optim.muon_weight_decay, cfg.optim.muon_momentum = (
        0.3,
        [0.5, 0.6],
        0.2,
        0.8,
    )
    resumed = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    resumed.load_state_dict(state)
    adamw, muon = resumed.optimizer.parts["adamw"].param_groups[0], resumed.optimizer.parts["muon"].param_groups[0]
    assert adamw["weight_decay"] == 0.3 and tuple(adamw["betas"]) == (0.5, 0.6)
    assert muon["weight_decay"] == 0.2 and muon["momentum"] == 0.8
    assert resumed.step == 1 and resumed.optimizer.state  # the moments themselves are restored


def test_logged_lr_is_the_lr_of_the_last_step_taken(parts):
    cfg, target, drafter, mask_id = parts
    cfg.schedule.warmup_ratio = 0.1  # lr rises every step of the first 10: an off-by-one shows
    trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    item = TargetForward(target, torch.device("cpu"))(_batch())
    for _ in range(3):
        trainer.train_on(item)
    assert trainer.metrics()["train/lr"] == trainer.optimizer.param_groups[0]["lr"] == trainer.lr_for(2)


def test_bench_flop_count_sees_the_fused_lm_head(parts, tiny_target):
    """The bench's MFU rests on FlopCounterMode counting the matmuls inside the chunked LM-head loss (a custom
    autograd function). kl computes the teacher's logits at every drafted position (its soft labels, and
    train/sim_tau's target argmax from them); ce_decay online only the target's argmax, once per distinct position
    (from a store, not at all), so it counts fewer: draft logits and their gradient, at least."""
    from dflash.benchmarks.pipeline import drafter_step_flops

    cfg, target, _, mask_id = parts
    item = TargetForward(target, torch.device("cpu"))(_batch())
    flops = {}
    for loss in ("ce_decay", "kl"):
        cfg.loss.name = loss
        torch.manual_seed(0)
        drafter = DFlashDraftModel(build_drafter_config(target.model.config, cfg.model, [1, 2], mask_id))
        trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=10)
        # as on CUDA, where the default is compiled FlexAttention, which FlopCounterMode cannot run (seen on an
        # H200): the count takes the sdpa path (on CPU, flex's backward would fail instead)
        trainer.attention = "flex"
        flops[loss] = drafter_step_flops(trainer, item)
    labels = item.input_ids.shape[0] * cfg.train.num_anchors * (cfg.model.block_size - 1)
    lm_head = 2 * labels * target.model.config.hidden_size * target.model.config.vocab_size
    assert flops["kl"] > flops["ce_decay"] > 2 * lm_head  # kl: draft logits, their gradient, the teacher's logits
    assert flops["kl"] > 3 * lm_head
