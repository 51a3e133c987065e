"""Learning-rate and feature-noise schedules as pure functions of (step, total_steps, cfg).

`cfg` is anything with the fields of `dflash.core.config.ScheduleConfig` (the dataclass or a DictConfig node).
Steps are 0-based: step 0 is the first optimizer step, step total_steps - 1 the last; steps past the end
are clamped to the last step (so a resumed run that overshoots keeps the final value).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dflash.core.config import SCHEDULE_NAMES


def _check_step(step: int, total_steps: int) -> int:
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} is invalid: must be >= 1")
    if step < 0:
        raise ValueError(f"step={step} is invalid: must be >= 0")
    return min(step, total_steps - 1)


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """ceil(warmup_ratio * total_steps): the number of steps spent in linear warmup."""
    return math.ceil(round(warmup_ratio * total_steps, 9))  # 0.07 * 100 = 7.000000000000001 is 7 steps


def lr_at(step: int, total_steps: int, cfg: Any) -> float:
    """Learning rate at `step`.

    Warmup (all schedules): lr * (step + 1) / warmup_steps for step < warmup_steps, so step 0 gets
    lr / warmup_steps and step warmup_steps - 1 gets lr. After warmup:
      cosine:   cosine from lr (first step after warmup) to min_lr_ratio * lr (step total_steps - 1).
      constant: lr.
      wsd:      lr, then a linear decay over the last ceil(decay_ratio * total_steps) steps that reaches
                min_lr_ratio * lr at the last step (warmup wins where the two overlap).
    """
    if cfg.name not in SCHEDULE_NAMES:
        raise ValueError(f"schedule.name={cfg.name!r} is invalid: must be one of {', '.join(SCHEDULE_NAMES)}")
    step = _check_step(step, total_steps)
    lr = float(cfg.lr)
    n_warm = warmup_steps(total_steps, cfg.warmup_ratio)
    if step < n_warm:
        return lr * (step + 1) / n_warm
    min_lr = lr * float(cfg.min_lr_ratio)
    if cfg.name == "constant":
        return lr
    if cfg.name == "cosine":
        span = total_steps - 1 - n_warm
        progress = (step - n_warm) / span if span > 0 else 1.0
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd
    n_decay = math.ceil(round(float(cfg.decay_ratio) * total_steps, 9))
    decay_start = total_steps - n_decay
    if n_decay == 0 or step < decay_start:
        return lr
    progress = (step - decay_start + 1) / n_decay  # 1 / n_decay at the first decay step, 1 at the last
    return lr + (min_lr - lr) * progress


def noise_std_at(step: int, total_steps: int, cfg: Any) -> float:
    """Std of the Gaussian noise on target features: cosine from noise_start (step 0) to noise_end (last step).

    Equal ends give a constant; both 0 disables noise.
    """
    step = _check_step(step, total_steps)
    start, end = float(cfg.noise_start), float(cfg.noise_end)
    if start < 0 or end < 0:
        raise ValueError(f"schedule.noise_start={start} / noise_end={end} are invalid: must be >= 0")
    if start == end:
        return start
    progress = step / (total_steps - 1) if total_steps > 1 else 1.0
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def add_feature_noise(features: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """features + N(0, std^2) noise of the same shape, dtype and device; `features` itself when std == 0.

    generator: optional, must live on features' device (reproducible noise per stage).
    """
    if std < 0:
        raise ValueError(f"noise std={std} is invalid: must be >= 0")
    if std == 0:
        return features
    noise = torch.randn(features.shape, generator=generator, device=features.device, dtype=features.dtype)
    return features + noise * std


__all__ = ["SCHEDULE_NAMES", "add_feature_noise", "lr_at", "noise_std_at", "warmup_steps"]
