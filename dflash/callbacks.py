"""Where a run's numbers go: the Callback protocol and its JSONL, console and W&B sinks.

The monitor loop (pipeline.py) hands every callback one flat dict per tick; evaluation hands them a flat
dict of `eval/*` values. `metrics.jsonl` in the run directory is the source of truth that `compare` reads;
the console and W&B are views of the same numbers under the same names (DESIGN.md, "Metric names").

Nothing here may slow the training threads: the JSONL sink writes one short line per tick, the console
redraws at most every `logging.log_every_s`, and W&B logging happens on a worker thread behind a bounded
queue that drops its oldest entries rather than block. A W&B that cannot start (not installed, no API key
in online mode, `wandb.init` raising) costs one warning and turns its callback into a no-op.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import netrc
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TextIO
from urllib.parse import urlsplit

from dflash.snapshot import json_safe, to_python

log = logging.getLogger(__name__)

STATUSES = ("completed", "failed", "interrupted")


@dataclasses.dataclass
class RunInfo:
    """What a callback needs to know about the job when it starts.

    `job_name` is the W&B run name unless `logging.wandb.name` is set: the Hydra override string
    ("loss.kl_temperature=2,loss.streak_alpha=0.5") or, for a run without overrides, the run dir's name
    (see `default_job_name`). `sweep_dir` is set only for multirun jobs. `wandb_run_id` comes from a
    checkpoint when a run resumes, so W&B continues the same run instead of starting a new one.
    """

    run_dir: Path
    config: dict  # the resolved config as plain Python containers (config.to_container)
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

    def on_run_end(self, status: str, summary: dict) -> None:
        if status not in STATUSES:
            raise ValueError(f"run status {status!r} is invalid: must be one of {', '.join(STATUSES)}")
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


# ---------------------------------------------------------------------------------------------- values


# ---------------------------------------------------------------------------------------------- JSONL


class JsonlCallback(Callback):
    """Appends one JSON object per metrics tick and per eval to `run_dir/metrics.jsonl`.

    Append mode, so a resumed run continues the same file; each line is flushed as it is written, so a
    crashed run keeps every tick up to the crash. Eval lines carry `step` and the `eval/*` keys only, which is
    how readers tell them apart from training ticks. Non-finite floats are written as null (`json_safe`).
    """

    FILENAME = "metrics.jsonl"

    def __init__(self, run_dir: Path | str) -> None:
        self.path = Path(run_dir) / self.FILENAME
        self._file: TextIO | None = None
        self._lock = threading.Lock()  # the monitor thread and the eval caller may both write

    def on_run_start(self, info: RunInfo) -> None:
        self._open()

    def on_metrics(self, metrics: dict) -> None:
        self._write(metrics)

    def on_eval(self, results: dict) -> None:
        self._write(results)

    def on_run_end(self, status: str, summary: dict) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _open(self) -> TextIO:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        return self._file

    def _write(self, record: dict) -> None:
        line = json.dumps(json_safe(record), allow_nan=False, separators=(",", ":"))
        with self._lock:
            f = self._open()
            f.write(line + "\n")
            f.flush()


# ---------------------------------------------------------------------------------------------- console


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _stats_text(m: Mapping[str, Any]) -> str:
    """The short status shown after the bar: loss, avg streak, throughput, queue depths (when present)."""
    parts = []
    if (v := m.get("train/loss")) is not None:
        parts.append(f"loss {float(v):.4f}")
    if (v := m.get("train/avg_streak")) is not None:
        parts.append(f"streak {float(v):.2f}")
    if (v := m.get("perf/ktok_s")) is not None:
        parts.append(f"{float(v):.1f} ktok/s")
    tq, hq = m.get("perf/target_queue_depth"), m.get("perf/hs_queue_depth")
    if tq is not None or hq is not None:
        parts.append("queues " + " ".join(
            f"{name} {float(v):g}" for name, v in (("target", tq), ("hs", hq)) if v is not None))
    return " | ".join(parts)


class ConsoleCallback(Callback):
    """Progress on stderr: a rich bar on a terminal, plain `logging` lines otherwise (CI logs).

    Either is redrawn at most once per `log_every_s` (plus once at the end), so a fast monitor tick costs a
    dict update, not a terminal write. `stream`, `is_tty` and `clock` exist for tests.
    """

    def __init__(self, max_steps: int, log_every_s: float = 5.0, *, stream: TextIO | None = None,
                 is_tty: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if log_every_s <= 0:
            raise ValueError(f"logging.log_every_s={log_every_s!r} is invalid: must be > 0")
        self.max_steps = max_steps
        self.log_every_s = log_every_s
        self._stream = stream if stream is not None else sys.stderr
        self._is_tty = self._stream.isatty() if is_tty is None else is_tty
        self._clock = clock
        self._progress = None  # rich.progress.Progress while running on a terminal
        self._task = None
        self._last_refresh: float | None = None
        self._start_step = 0
        self._t0 = clock()
        self._latest: dict = {}
        self.refreshes = 0  # how many times the display was redrawn (tests check the throttle)

    def on_run_start(self, info: RunInfo) -> None:
        self.max_steps = info.max_steps
        self._start_step = info.start_step
        self._t0 = self._clock()
        if self._is_tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            console = Console(file=self._stream, force_terminal=True)
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(bar_width=20), MofNCompleteColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[stats]}"),
                console=console, auto_refresh=False,  # no redraw thread: we refresh on our own schedule
            )
            self._task = self._progress.add_task("train", total=self.max_steps, completed=info.start_step,
                                                 stats="")
            self._progress.start()

    def on_metrics(self, metrics: dict) -> None:
        self._latest = {k: to_python(v) for k, v in metrics.items()}
        now = self._clock()
        if self._last_refresh is None or now - self._last_refresh >= self.log_every_s:
            self._refresh(now)

    def on_eval(self, results: dict) -> None:
        evals = " ".join(f"{k.removeprefix('eval/')}={float(to_python(v)):.3f}"
                         for k, v in sorted(results.items())
                         if k in ("eval/tau", "eval/tau_baseline") and v is not None)
        line = f"eval at step {results.get('step', '?')}: {evals or 'done'}"
        if self._progress is not None:
            self._progress.console.print(line, highlight=False, markup=False)
        else:
            log.info(line)

    def on_run_end(self, status: str, summary: dict) -> None:
        if self._latest:
            self._refresh(self._clock())
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        log.info("run %s at step %s/%s", status, self._latest.get("step", self._start_step), self.max_steps)

    def _eta_s(self, step: int, now: float) -> float | None:
        done = step - self._start_step
        if done <= 0:
            return None
        return (self.max_steps - step) * (now - self._t0) / done

    def _refresh(self, now: float) -> None:
        self._last_refresh = now
        self.refreshes += 1
        step = int(self._latest.get("step", self._start_step))
        stats = _stats_text(self._latest)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats)
            self._progress.refresh()
        else:
            pct = 100.0 * step / self.max_steps if self.max_steps else 0.0
            log.info("step %d/%d (%.0f%%) | %s | eta %s", step, self.max_steps, pct, stats or "-",
                     _fmt_eta(self._eta_s(step, now)))


# ---------------------------------------------------------------------------------------------- W&B

_FIX_HINT = ("run `wandb login` (or set WANDB_API_KEY), or log locally with logging.wandb.mode=offline and "
             "upload later with `wandb sync <run_dir>/wandb/offline-run-*`")


def wandb_credentials_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """Why online W&B would have no API key, or None when one is configured. Never touches the network.

    Looks where wandb 0.31 looks first: WANDB_API_KEY / WANDB_IDENTITY_TOKEN_FILE, then the .netrc entry
    for the W&B host (NETRC, ~/.netrc, ~/_netrc) that `wandb login` writes. A key kept only in wandb's
    settings file is not seen: the callback then warns although init would work (use WANDB_API_KEY then).
    """
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    candidates = [Path(env["NETRC"]).expanduser()] if env.get("NETRC") else [
        Path(env.get("HOME", "~")).expanduser() / name for name in (".netrc", "_netrc")]
    for path in candidates:
        if not path.is_file():
            continue
        try:
            if netrc.netrc(str(path)).authenticators(host):
                return None
        except (netrc.NetrcParseError, OSError) as e:
            return f"mode=online but {path} cannot be read ({e})"
    return f"mode=online but no W&B API key is configured (WANDB_API_KEY unset, no {host} entry in .netrc)"


def sweep_group_name(sweep_dir: str) -> str:
    """`outputs/multirun/2026-12-02/12-34-56-123456` -> `2026-12-02_12-34-56-123456`: unique per sweep."""
    p = Path(sweep_dir)
    return f"{p.parent.name}_{p.name}" if p.parent.name else p.name


def wandb_init_kwargs(wandb_cfg: Any, info: RunInfo, run_dir: Path | str,
                      environ: Mapping[str, str] | None = None) -> dict:
    """The keyword arguments for `wandb.init` (settings as a plain dict; the caller builds wandb.Settings).

    Only values that are set are passed, so WANDB_* environment variables keep their meaning unless the
    config overrides them. The derived defaults (name = job name, group = sweep or experiment) give way to
    WANDB_NAME / WANDB_RUN_GROUP when those are set.
    """
    env = os.environ if environ is None else environ
    name = wandb_cfg.name or (None if env.get("WANDB_NAME") else info.job_name)
    group = wandb_cfg.group
    if not group and not env.get("WANDB_RUN_GROUP"):
        group = sweep_group_name(info.sweep_dir) if info.sweep_dir else info.experiment
    config = info.config
    if not isinstance(config, dict):  # a DictConfig here would make wandb.init raise TypeError
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(config, resolve=True)
    kwargs: dict[str, Any] = {
        "project": wandb_cfg.project,
        "entity": wandb_cfg.entity,
        "name": name,
        "group": group,
        "job_type": wandb_cfg.job_type,
        "tags": list(wandb_cfg.tags) if wandb_cfg.tags else None,
        "dir": str(run_dir),
        "config": config,
        "mode": wandb_cfg.mode,
        "reinit": "finish_previous",  # an in-process multirun must never log job 2 into job 1's run
        # system metrics sampling; an x_ setting since 0.19 (was _stats_sample_rate_seconds)
        "settings": {"x_stats_sampling_interval": float(wandb_cfg.stats_interval_s)},
    }
    if info.wandb_run_id:
        kwargs.update(id=info.wandb_run_id, resume="allow")
    return {k: v for k, v in kwargs.items() if v is not None}


class WandbCallback(Callback):
    """Logs to Weights & Biases from a worker thread; never blocks or fails the run.

    `on_metrics`/`on_eval` append to a bounded in-memory queue (oldest entries are dropped when it is full,
    counted in `dropped`); a daemon thread calls `run.log`. The first exception in that thread is logged once
    and stops W&B logging for the rest of the run. Every record is plotted against our `step` (not W&B's
    internal `_step`), so resumed runs and eval records line up with training ticks.
    """

    def __init__(self, wandb_cfg: Any, run_dir: Path | str, *, queue_size: int = 1000,
                 flush_timeout_s: float = 30.0) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size={queue_size!r} is invalid: must be >= 1")
        self.cfg = wandb_cfg
        self.run_dir = Path(run_dir)
        self.flush_timeout_s = flush_timeout_s
        self.run = None  # the wandb Run while active
        self.disabled_reason: str | None = None  # set when W&B could not start or failed mid-run
        self.dropped = 0
        self._queue: collections.deque = collections.deque()
        self._queue_size = queue_size
        self._cond = threading.Condition()
        self._busy = False  # the worker holds an item it has not finished logging
        self._closing = False
        self._worker: threading.Thread | None = None
        self._run_id: str | None = None
        self._tau_best: float | None = None
        self._tau_last: float | None = None
        self._logged_up_to: float | None = None  # resumed run: the last step W&B already has

    @property
    def run_id(self) -> str | None:
        """The W&B run id (stored in checkpoints so a resumed job continues the same W&B run)."""
        return self._run_id

    @property
    def active(self) -> bool:
        return self.run is not None and self.disabled_reason is None

    def state(self) -> dict:
        return {"wandb_run_id": self._run_id} if self._run_id else {}

    # -- lifecycle

    def on_run_start(self, info: RunInfo) -> None:
        try:
            import wandb
        except ImportError as e:
            self._disable(f"wandb is not importable ({e}); install it with `pip install wandb`, or set "
                          "logging=jsonl to run without W&B")
            return
        if self.cfg.mode == "disabled":
            self._disable("logging.wandb.mode=disabled", warn=False)
            return
        if self.cfg.mode == "online" and (problem := wandb_credentials_problem()):
            self._disable(f"{problem}; {_FIX_HINT}")
            return
        kwargs = wandb_init_kwargs(self.cfg, info, self.run_dir)
        run = None
        try:
            kwargs["settings"] = wandb.Settings(**kwargs["settings"])
            self.run_dir.mkdir(parents=True, exist_ok=True)
            run = wandb.init(**kwargs)
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
        except Exception as e:  # wandb raises many types (UsageError, CommError, ValidationError, ...)
            if run is not None:  # init worked, setting it up did not: do not leave that run open
                try:
                    run.finish(exit_code=1)
                except Exception:  # noqa: BLE001
                    pass
            self._disable(f"wandb.init failed ({type(e).__name__}: {e}); {_FIX_HINT}")
            return
        self.run = run
        self._run_id = run.id
        if info.wandb_run_id:
            self._continue_from(run)
        self._worker = threading.Thread(target=self._work, name="wandb-logger", daemon=True)
        self._worker.start()
        log.info("W&B run %s (%s) logging to %s", run.id, self.cfg.mode, self.run_dir / "wandb")

    def _continue_from(self, run) -> None:
        """A resumed run retrains the steps after its checkpoint that W&B already has: skip logging those
        again (the values are the same: steps are deterministic), and keep the best eval/tau so far.
        Offline runs know nothing of what was synced, so they log everything."""
        try:
            last_step = run.summary.get("step")
            best = run.summary.get("eval/tau_best")
        except Exception:  # noqa: BLE001 - a summary we cannot read means nothing to skip
            return
        if isinstance(last_step, (int, float)):
            self._logged_up_to = last_step
        if isinstance(best, (int, float)):
            self._tau_best = float(best)

    def on_metrics(self, metrics: dict) -> None:
        step = metrics.get("step")
        if self._logged_up_to is not None and isinstance(step, (int, float)) and step <= self._logged_up_to:
            return
        self._enqueue(metrics)

    def on_eval(self, results: dict) -> None:
        tau = results.get("eval/tau")
        if tau is not None:
            tau = float(to_python(tau))
            if math.isfinite(tau):
                self._tau_last = tau
                self._tau_best = tau if self._tau_best is None else max(self._tau_best, tau)
        self._enqueue(results)

    def on_run_end(self, status: str, summary: dict) -> None:
        if self.run is None:
            return
        if not self.flush(self.flush_timeout_s):
            log.warning("W&B: %d records not logged within %.0f s at run end; dropping them",
                        len(self._queue), self.flush_timeout_s)
        self._stop_worker()
        run, self.run = self.run, None
        try:
            if self.disabled_reason is None:
                run.summary.update(self._final_summary(summary))
            run.finish(exit_code=0 if status == "completed" else 1)
        except Exception as e:
            log.warning("W&B: finishing the run failed (%s: %s); local files are unaffected", type(e).__name__, e)

    # -- queue and worker

    def flush(self, timeout_s: float) -> bool:
        """Wait until the worker has logged everything queued so far; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                if self._worker is None or not self._worker.is_alive():
                    return not self._queue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _enqueue(self, record: dict) -> None:
        if not self.active:
            return
        item = {k: to_python(v) for k, v in record.items()}
        with self._cond:
            if len(self._queue) >= self._queue_size:
                self._queue.popleft()  # keep the newest: a late view is better than a stalled trainer
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("W&B is not keeping up; dropping the oldest queued records (counted in "
                                "wandb/dropped_records)")
            self._queue.append(item)
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:  # closing and drained
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                if self.disabled_reason is None:
                    self.run.log(item)
            except Exception as e:
                self._disable(f"run.log failed ({type(e).__name__}: {e}); W&B logging is off for the rest of "
                              "this run, metrics.jsonl is complete")
            finally:
                with self._cond:
                    self._busy = False
                    if self.disabled_reason is not None:
                        self._queue.clear()
                    self._cond.notify_all()

    def _stop_worker(self) -> None:
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=5.0)
            self._worker = None

    def _disable(self, reason: str, warn: bool = True) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            if warn:
                log.warning("W&B disabled: %s", reason)

    def _final_summary(self, summary: dict) -> dict:
        out = {k: v for k, v in to_python(summary).items() if isinstance(v, (int, float, str, bool))}
        if self._tau_best is not None:
            out["eval/tau_best"] = self._tau_best
        if self._tau_last is not None:
            out["eval/tau"] = self._tau_last
        if self.dropped:
            out["wandb/dropped_records"] = self.dropped
        return out


# ---------------------------------------------------------------------------------------------- wiring


def build_callbacks(cfg: Any, run_dir: Path | str, max_steps: int) -> CallbackList:
    """JSONL always; console when `logging.console`; W&B unless `logging.wandb.mode` is disabled."""
    lg = cfg.logging
    callbacks: list[Callback] = [JsonlCallback(run_dir)]
    if lg.console:
        callbacks.append(ConsoleCallback(max_steps, lg.log_every_s))
    if lg.wandb.mode != "disabled":
        callbacks.append(WandbCallback(lg.wandb, run_dir))
    return CallbackList(callbacks)
