"""Where a run's numbers go: the Callback protocol (`base`) and its sinks — `metrics.jsonl` (the source of
truth that `compare` reads), the console, and Weights & Biases — all under the same metric names
(docs/architecture.md, "Metric names").

Nothing here may slow the training threads: the JSONL sink writes one short line per tick, the console
redraws at most every `logging.log_every_s`, and W&B logs from a worker thread behind a bounded queue that
drops its oldest entries rather than block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash.tracking.base import Callback, CallbackList, RunInfo, default_job_name
from dflash.tracking.console import ConsoleCallback
from dflash.tracking.jsonl import JsonlCallback
from dflash.tracking.wandb_logger import WandbCallback

__all__ = [
    "Callback",
    "CallbackList",
    "ConsoleCallback",
    "JsonlCallback",
    "RunInfo",
    "WandbCallback",
    "build_callbacks",
    "default_job_name",
]


def build_callbacks(cfg: Any, run_dir: Path | str, max_steps: int) -> CallbackList:
    """JSONL always; console when `logging.console`; W&B unless `logging.wandb.mode` is disabled."""
    lg = cfg.logging
    callbacks: list[Callback] = [JsonlCallback(run_dir)]
    if lg.console:
        callbacks.append(ConsoleCallback(max_steps, lg.log_every_s))
    if lg.wandb.mode != "disabled":
        callbacks.append(WandbCallback(lg.wandb, run_dir))
    return CallbackList(callbacks)
