"""Schedules: lr and noise at start / middle / end, computed by hand; feature noise."""

from __future__ import annotations

import pytest
import torch

from dflash.core.config import ScheduleConfig
from dflash.train.schedules import add_feature_noise, lr_at, noise_std_at, warmup_steps

# 20 steps, warmup ceil(0.25 * 20) = 5 steps; lr 1.0, min 0.1
TOTAL = 20


def _cfg(name: str, **over) -> ScheduleConfig:
    kw = dict(name=name, lr=1.0, warmup_ratio=0.25, min_lr_ratio=0.1, decay_ratio=0.25)
    kw.update(over)
    return ScheduleConfig(**kw)


def test_warmup_steps_ignores_float_error():
    assert warmup_steps(100, 0.07) == 7  # 0.07 * 100 = 7.000000000000001
    assert warmup_steps(100, 0.071) == 8


def test_warmup_steps_rounds_up() -> None:
    assert warmup_steps(20, 0.25) == 5
    assert warmup_steps(100, 0.04) == 4
    assert warmup_steps(101, 0.04) == 5
    assert warmup_steps(10, 0.0) == 0


@pytest.mark.parametrize("name", ["cosine", "constant", "wsd"])
def test_warmup_is_linear_for_every_schedule(name: str) -> None:
    cfg = _cfg(name)
    assert lr_at(0, TOTAL, cfg) == pytest.approx(0.2)  # lr / warmup_steps
    assert lr_at(2, TOTAL, cfg) == pytest.approx(0.6)
    assert lr_at(4, TOTAL, cfg) == pytest.approx(1.0)  # last warmup step reaches lr


def test_cosine() -> None:
    cfg = _cfg("cosine")
    # cosine over steps 5..19 (span 14): step 5 -> lr, step 12 -> midpoint, step 19 -> min
    assert lr_at(5, TOTAL, cfg) == pytest.approx(1.0)
    assert lr_at(12, TOTAL, cfg) == pytest.approx(0.55)
    assert lr_at(19, TOTAL, cfg) == pytest.approx(0.1)
    assert lr_at(50, TOTAL, cfg) == pytest.approx(0.1)  # past the end: clamped


def test_constant() -> None:
    cfg = _cfg("constant")
    assert lr_at(10, TOTAL, cfg) == pytest.approx(1.0)
    assert lr_at(19, TOTAL, cfg) == pytest.approx(1.0)


def test_wsd() -> None:
    cfg = _cfg("wsd")
    # decay over the last ceil(0.25 * 20) = 5 steps (15..19), linear to 0.1 at step 19
    assert lr_at(10, TOTAL, cfg) == pytest.approx(1.0)
    assert lr_at(14, TOTAL, cfg) == pytest.approx(1.0)
    assert lr_at(15, TOTAL, cfg) == pytest.approx(1.0 - 0.9 / 5)
    assert lr_at(17, TOTAL, cfg) == pytest.approx(1.0 - 0.9 * 3 / 5)
    assert lr_at(19, TOTAL, cfg) == pytest.approx(0.1)


def test_no_warmup_starts_at_lr() -> None:
    assert lr_at(0, TOTAL, _cfg("cosine", warmup_ratio=0.0)) == pytest.approx(1.0)


def test_lr_errors() -> None:
    with pytest.raises(ValueError, match="schedule.name='linear'"):
        lr_at(0, TOTAL, _cfg("linear"))
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(0, 0, _cfg("cosine"))
    with pytest.raises(ValueError, match="step=-1"):
        lr_at(-1, TOTAL, _cfg("cosine"))


def test_noise_cosine_anneal() -> None:
    cfg = _cfg("cosine", noise_start=0.4, noise_end=0.0)
    assert noise_std_at(0, 11, cfg) == pytest.approx(0.4)
    assert noise_std_at(5, 11, cfg) == pytest.approx(0.2)
    assert noise_std_at(10, 11, cfg) == pytest.approx(0.0, abs=1e-12)


def test_noise_constant_and_off() -> None:
    assert noise_std_at(3, 11, _cfg("cosine", noise_start=0.3, noise_end=0.3)) == 0.3
    assert noise_std_at(3, 11, _cfg("cosine")) == 0.0


def test_add_feature_noise() -> None:
    x = torch.zeros(200, 500)
    assert add_feature_noise(x, 0.0) is x
    g1 = torch.Generator().manual_seed(3)
    g2 = torch.Generator().manual_seed(3)
    y = add_feature_noise(x, 0.5, generator=g1)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert y.std().item() == pytest.approx(0.5, rel=0.02)
    assert torch.equal(y, add_feature_noise(x, 0.5, generator=g2))
    assert torch.all(x == 0)  # input untouched
    with pytest.raises(ValueError, match="std"):
        add_feature_noise(x, -0.1)
