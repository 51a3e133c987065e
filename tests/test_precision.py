"""train.precision=bf16-mixed: bfloat16 autocast for the drafter's forward and loss, float32 weights and optimizer
state, a bfloat16 copy of the frozen LM head for the loss, and fp32 with one warning where bfloat16 is slow."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import REPO
from hydra import compose, initialize_config_dir

from dflash.core.config import ConfigError, register_configs
from dflash.core.validation import validate
from dflash.data.batches import Batch
from dflash.model.build import build_drafter_config, init_drafter
from dflash.model.target import TargetModel
from dflash.train.precision import autocast_dtype
from dflash.train.trainer import DrafterTrainer, TargetForward

register_configs()
FAST_BF16 = {"avx512f", "avx512_bf16"}


def _cfg(tiny_target, *overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=smoke", f"model.target={tiny_target}", *overrides])


def _trainer(tiny_target, tiny_tokenizer, *overrides: str):
    cfg = _cfg(tiny_target, "train.max_steps=10", *overrides)
    target = TargetModel.load(str(tiny_target), [1, 2])
    drafter_cfg = build_drafter_config(target.model.config, cfg.model, [1, 2], tiny_tokenizer.mask_token_id)
    from dflash.model.families import configure_family

    configure_family(drafter_cfg, cfg.drafter)
    drafter = init_drafter(drafter_cfg, seed=0)
    return DrafterTrainer(cfg, target, drafter, tiny_tokenizer.mask_token_id, total_steps=10), target


def _item(target):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (2, 64), generator=g)
    return TargetForward(target, torch.device("cpu"))(Batch(ids, torch.ones(2, 64, dtype=torch.bool), 128, 0, 0))


def test_autocast_dtype_by_precision_and_machine(caplog):
    cpu = torch.device("cpu")
    assert autocast_dtype("fp32", cpu, FAST_BF16) is None
    assert autocast_dtype("bf16-mixed", cpu, FAST_BF16) is torch.bfloat16
    with caplog.at_level(logging.WARNING, logger="dflash.train.precision"):
        assert autocast_dtype("bf16-mixed", cpu, {"avx2", "fma"}) is None  # no fast bf16 kernels: fp32
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "falls back to fp32" in lines[0] and "avx512_bf16" in lines[0], lines
    with pytest.raises(ValueError, match="fp32 or bf16-mixed"):
        autocast_dtype("fp16", cpu)


def test_bad_precision_is_refused(tiny_target):
    with pytest.raises(ConfigError, match="train.precision"):
        validate(_cfg(tiny_target, "train.precision=bf16"))
    with pytest.raises(ConfigError, match="model.dtype=float32"):
        validate(_cfg(tiny_target, "train.precision=bf16-mixed", "model.dtype=bfloat16"))


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_bf16_mixed_keeps_float32_state_and_close_losses(tiny_target, tiny_tokenizer, monkeypatch, family):
    monkeypatch.setattr("dflash.train.precision.slow_cpu_dtype", lambda dtype, flags=None: None)  # any CPU
    losses = {}
    for precision in ("fp32", "bf16-mixed"):
        trainer, target = _trainer(tiny_target, tiny_tokenizer, f"drafter={family}", f"train.precision={precision}")
        item = _item(target)
        calls = []
        hook = trainer.drafter.register_forward_hook(
            lambda m, a, out, calls=calls: calls.append(torch.is_autocast_enabled("cpu"))
        )
        for _ in range(3):
            trainer.train_on(item)
        hook.remove()
        losses[precision] = trainer.metrics()["train/loss"]
        assert calls == [precision == "bf16-mixed"] * 3  # the forward ran under autocast only when mixed
        head = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
        assert trainer.loss_head_weight.dtype == head and trainer.lm_head_weight.dtype == torch.float32
        assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters())  # master weights
        states = [v for s in trainer.optimizer.state.values() for v in s.values()]
        assert states and all(v.dtype == torch.float32 for v in states if torch.is_tensor(v) and v.is_floating_point())
    assert losses["bf16-mixed"] != losses["fp32"]  # really computed in another precision ...
    assert abs(losses["bf16-mixed"] - losses["fp32"]) < 0.02 * losses["fp32"]  # ... and close to it


def test_the_plan_counts_the_bf16_loss_head(tiny_target):
    from dflash.model.plan import memory_parts, target_shape

    shape = target_shape(str(tiny_target))
    fp32 = memory_parts(_cfg(tiny_target), shape)["bf16 loss head"]
    mixed = memory_parts(_cfg(tiny_target, "train.precision=bf16-mixed"), shape)["bf16 loss head"]
    assert fp32 == 0 and mixed == shape.vocab * shape.hidden * 2
