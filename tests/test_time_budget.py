"""train.max_minutes: training stops at its wall-clock budget (status completed, the reason recorded), the schedules
run over the budget, and a resumed run keeps the seconds it trained."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO
from hydra import compose, initialize_config_dir

from dflash.core.config import ConfigError, register_configs
from dflash.core.validation import validate
from dflash.data.batches import Batch
from dflash.model.build import build_drafter_config
from dflash.model.drafter import DFlashDraftModel
from dflash.model.target import TargetModel
from dflash.train import time_budget
from dflash.train.trainer import DrafterTrainer, TargetForward

register_configs()


def _cfg(tiny_target, *overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=smoke", f"model.target={tiny_target}", *overrides])


@pytest.fixture()
def parts(tiny_target, tiny_tokenizer):
    target = TargetModel.load(str(tiny_target), [1, 2])
    mask_id = tiny_tokenizer.mask_token_id
    item = TargetForward(target, torch.device("cpu"))(
        Batch(torch.randint(5, 500, (2, 32)), torch.ones(2, 32, dtype=torch.bool), 64, 0, 0)
    )

    def make(cfg):
        torch.manual_seed(0)
        drafter = DFlashDraftModel(build_drafter_config(target.model.config, cfg.model, [1, 2], mask_id))
        return DrafterTrainer(cfg, target, drafter, mask_id, total_steps=cfg.train.max_steps)

    return make, item


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


def test_training_stops_at_its_time_budget_and_says_why(parts, tiny_target, monkeypatch):
    make, item = parts
    clock = Clock()
    monkeypatch.setattr(time_budget, "time", clock)
    trainer = make(_cfg(tiny_target, "train.max_steps=1000", "train.max_minutes=1"))
    steps = 0
    while trainer.train_on(item):
        steps += 1
        clock.now += 20.0  # a step takes 20 s: the minute is up after the third step
    assert trainer.step == 4 and trainer.done() and time_budget.stop_reason(trainer) == "max_minutes"
    assert not trainer.stopped_on_request  # ended by its budget: the run is `completed`, not interrupted
    # the schedule ran over the budget: at 80 s of 60 the cosine is at its end, not at step 4 of 1000
    assert trainer.lr_for(trainer.step - 1) == pytest.approx(
        trainer.cfg.schedule.lr * trainer.cfg.schedule.min_lr_ratio
    )
    state = trainer.counters()
    assert state["trained_s"] == pytest.approx(60.0)  # up to the last step's start: 3 x 20 s after the first

    resumed = make(_cfg(tiny_target, "train.max_steps=1000", "train.max_minutes=1"))
    resumed.load_counters(state)
    assert resumed.done() and not resumed.train_on(item)  # a spent budget stays spent
    longer = make(_cfg(tiny_target, "train.max_steps=1000", "train.max_minutes=2"))
    longer.load_counters(state)
    assert not longer.done() and longer.budget.elapsed_s() == pytest.approx(60.0)


def test_without_a_budget_the_steps_decide(parts, tiny_target):
    make, item = parts
    trainer = make(_cfg(tiny_target, "train.max_steps=2"))
    while trainer.train_on(item):
        pass
    assert trainer.step == 2 and time_budget.stop_reason(trainer) == "max_steps"


def test_a_budget_must_be_positive(tiny_target):
    with pytest.raises(ConfigError, match="train.max_minutes"):
        validate(_cfg(tiny_target, "train.max_minutes=0"))


def test_the_schedules_read_the_ranks_agreed_clock_not_this_processs(monkeypatch):
    """Ranks start their clocks at different moments: each rank's learning rate must come from the clock they agreed
    on at the last step (the mean in the step's all-reduce), or data-parallel replicas would step apart."""
    clock = Clock()
    monkeypatch.setattr(time_budget, "time", clock)
    early, late = time_budget.TimeBudget(1), time_budget.TimeBudget(1)
    early.start()
    clock.now += 12.0
    late.start()  # this rank began 12 s later
    clock.now += 18.0  # early's clock 30 s, late's 18 s: both report, the all-reduce gives the mean 24 s
    for budget in (early, late):
        budget.agree(False, 1, (early.elapsed_s() + late.elapsed_s()) / 2)
    clock.now += 25.0  # a local clock moving on alone changes nothing until the next agreement
    assert early.schedule_step(1, 100) == late.schedule_step(1, 100) == 40  # 24 of 60 s: 40 of 100 steps
    assert early.agreed_s == late.agreed_s == 24.0
