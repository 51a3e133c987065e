"""The Callback protocol: what a sink of run events implements, and the list that fans events out."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path

from dflash.core.rundir import END_STATUSES

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunInfo:
    """What a callback needs to know about the job when it starts.

    `job_name` is the W&B run name unless `logging.wandb.name` is set: the Hydra override string
    ("loss.kl_temperature=2,loss.streak_alpha=0.5") or, for a run without overrides, the run dir's name
    (see `default_job_name`). `sweep_dir` is set only for multirun jobs. `wandb_run_id` comes from a
    checkpoint when a run resumes, so W&B continues the same run instead of starting a new one.
    """

    run_dir: Path
    config: dict  # the resolved config as plain Python containers, secrets redacted
    max_steps: int
    job_name: str
    sweep_dir: str | None = None
    experiment: str | None = None
    wandb_run_id: str | None = None
    start_step: int = 0


def default_job_name(overrides: Iterable[str], run_dir: Path | str) -> str:
    """The user's task overrides joined by commas (Hydra's override_dirname style), else the run dir's name.

    Overrides of Hydra's own keys (`hydra.run.dir=...`) say where a run went, not what it was, so they are
    left out; the rest keep the user's order.
    """
    kept = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    return ",".join(kept) if kept else Path(run_dir).name


class Callback:
    """No-op base: subclasses override the events they care about.

    Metric dicts are flat. `on_metrics` always carries `step`, `tokens`, `time_s` plus `train/*` and `perf/*`
    values; `on_eval` carries `step` and `eval/*` values. Values may be Python numbers, numpy scalars or
    0-d tensors; sinks convert them. `on_run_end`'s status is one of completed | failed | interrupted and its
    summary holds the run's final values (what summary.json gets).
    """

    def on_run_start(self, info: RunInfo) -> None:
        pass

    def on_metrics(self, metrics: dict) -> None:
        pass

    def on_eval(self, results: dict) -> None:
        pass

    def on_checkpoint(self, step: int, path: str) -> None:
        pass

    def on_final_eval(self, step: int, metrics: dict, details: dict) -> None:
        """The final eval in full: its flat metrics and eval.json's `details` (settings, per-prompt texts and
        acceptance lengths), for sinks that draw charts and tables of it."""

    def on_benchmarks(self, step: int, data: dict) -> None:
        """The benchmark suites run at the end of training (eval.suites): benchmarks.json's content."""

    def on_run_end(self, status: str, summary: dict) -> None:
        pass

    def state(self) -> dict:
        """Anything to store in a checkpoint so that a resumed run can continue (e.g. the W&B run id)."""
        return {}


class CallbackList(Callback):
    """Fans every event out to its callbacks, in order.

    An exception from a sink propagates (a JSONL file that cannot be written is a real failure), except at
    `on_run_end`, where every callback still gets its chance to close before the first error is re-raised.
    """

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks: list[Callback] = list(callbacks)

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def on_run_start(self, info: RunInfo) -> None:
        for cb in self.callbacks:
            cb.on_run_start(info)

    def on_metrics(self, metrics: dict) -> None:
        for cb in self.callbacks:
            cb.on_metrics(metrics)

    def on_eval(self, results: dict) -> None:
        for cb in self.callbacks:
            cb.on_eval(results)

    def on_checkpoint(self, step: int, path: str) -> None:
        for cb in self.callbacks:
            cb.on_checkpoint(step, path)

    def on_final_eval(self, step: int, metrics: dict, details: dict) -> None:
        for cb in self.callbacks:
            cb.on_final_eval(step, metrics, details)

    def on_benchmarks(self, step: int, data: dict) -> None:
        for cb in self.callbacks:
            cb.on_benchmarks(step, data)

    def on_run_end(self, status: str, summary: dict) -> None:
        if status not in END_STATUSES:
            raise ValueError(f"run status {status!r} is invalid: must be one of {', '.join(END_STATUSES)}")
        first_error: BaseException | None = None
        for cb in self.callbacks:
            try:
                cb.on_run_end(status, summary)
            except Exception as e:  # close the others first, then report the first failure
                log.error("callback %s failed at run end: %s", type(cb).__name__, e)
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def state(self) -> dict:
        merged: dict = {}
        for cb in self.callbacks:
            merged.update(cb.state())
        return merged
