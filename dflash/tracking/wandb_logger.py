"""Weights & Biases sink: the same metric names as metrics.jsonl, logged from a worker thread behind a
bounded queue. A W&B that cannot start (not installed, no API key in online mode, `wandb.init` raising) costs
one warning and turns the callback into a no-op.
"""

from __future__ import annotations

import collections
import logging
import math
import netrc
import os
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dflash.core.jsonio import to_python
from dflash.core.secrets import redact, scrub
from dflash.tracking.base import Callback, RunInfo
from dflash.tracking.wandb_media import MEDIA, bench_rows, build_media

log = logging.getLogger(__name__)


_FIX_HINT = (
    "run `wandb login` (or set WANDB_API_KEY), or log locally with logging.wandb.mode=offline and "
    "upload later with `wandb sync <run_dir>/wandb/offline-run-*`"
)


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
    candidates = (
        [Path(env["NETRC"]).expanduser()]
        if env.get("NETRC")
        else [Path(env.get("HOME", "~")).expanduser() / name for name in (".netrc", "_netrc")]
    )
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


def wandb_init_kwargs(
    wandb_cfg: Any, info: RunInfo, run_dir: Path | str, environ: Mapping[str, str] | None = None
) -> dict:
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
    config = scrub(config)  # as config_resolved.yaml: secret keys, URLs' credentials, secret environment values
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
        "settings": {
            "x_stats_sampling_interval": float(wandb_cfg.stats_interval_s),
            "init_timeout": float(getattr(wandb_cfg, "init_timeout_s", 60.0)),
        },
    }
    if redact(list(sys.argv)) != list(sys.argv):
        # W&B records sys.argv as the run's command; launch.py's jobs have it redacted (dflash.core.secrets.
        # CommandLineSecrets), another caller may not: then W&B records no system metadata at all
        kwargs["settings"]["x_disable_meta"] = True
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

    def __init__(
        self, wandb_cfg: Any, run_dir: Path | str, *, queue_size: int = 1000, flush_timeout_s: float = 30.0
    ) -> None:
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
        self._starting = False  # wandb.init is running on the worker thread

    @property
    def run_id(self) -> str | None:
        """The W&B run id (stored in checkpoints so a resumed job continues the same W&B run)."""
        return self._run_id

    @property
    def active(self) -> bool:
        return (self.run is not None or self._starting) and self.disabled_reason is None

    def state(self) -> dict:
        return {"wandb_run_id": self._run_id} if self._run_id else {}

    # -- lifecycle

    def on_run_start(self, info: RunInfo) -> None:
        try:
            import wandb
        except ImportError as e:
            self._disable(
                f"wandb is not importable ({e}); install it with `pip install wandb`, or set "
                "logging=jsonl to run without W&B"
            )
            return
        if self.cfg.mode == "disabled":
            self._disable("logging.wandb.mode=disabled", warn=False)
            return
        if self.cfg.mode == "online" and (problem := wandb_credentials_problem()):
            self._disable(f"{problem}; {_FIX_HINT}")
            return
        kwargs = wandb_init_kwargs(self.cfg, info, self.run_dir)
        # our own id, known now (checkpoints store it) although W&B starts on the worker thread
        kwargs.setdefault("id", uuid.uuid4().hex[:8])
        self._run_id = kwargs["id"]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._starting = True  # records queue up while W&B starts: training never waits for it
        self._worker = threading.Thread(
            target=self._start_and_work, args=(wandb, kwargs, info), name="wandb-logger", daemon=True
        )
        self._worker.start()

    def _start_and_work(self, wandb, kwargs: dict, info: RunInfo) -> None:
        run = None
        try:
            kwargs["settings"] = wandb.Settings(**kwargs["settings"])
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
            with self._cond:
                self._run_id = info.wandb_run_id  # no new run exists; a resumed one keeps its id
                self._starting = False
                self._queue.clear()
                self._cond.notify_all()
            return
        with self._cond:
            closing = self._closing
            self._run_id = run.id  # the id we asked for, unless W&B chose (test doubles do)
            if not closing:
                self.run = run
            self._starting = False
            self._cond.notify_all()
        if closing:  # the job ended while W&B was starting: close the late run here
            run.finish(exit_code=1)
            return
        if info.wandb_run_id:
            self._continue_from(run)
        log.info("W&B run %s (%s) logging to %s", run.id, self.cfg.mode, self.run_dir / "wandb")
        self._work()

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

    def on_final_eval(self, step: int, metrics: dict, details: dict) -> None:
        """Charts and a table of the final eval: the acceptance-length histogram, per-position acceptance and
        the samples (prompt, output, acceptance lengths). Built on the worker thread like every record."""
        self._enqueue({MEDIA: {"kind": "final_eval", "step": step, "metrics": metrics, "details": details}})

    def on_benchmarks(self, step: int, data: dict) -> None:
        """A table of the benchmark suites (a row per suite and temperature) and a bar chart of their tau."""
        self._enqueue({MEDIA: {"kind": "benchmarks", "step": step, "rows": bench_rows(data)}})

    def on_run_end(self, status: str, summary: dict) -> None:
        """Flush, then finish the W&B run; every wait is bounded (an unreachable server must not hold the job:
        `logging.wandb.finish_timeout_s`), and what was not uploaded stays in the run dir for `wandb sync`."""
        if self.run is None and not self._starting:
            return
        if not self.flush(self.flush_timeout_s):
            log.warning(
                "W&B: %d records not logged within %.0f s at run end; dropping them (metrics.jsonl has them)",
                len(self._queue),
                self.flush_timeout_s,
            )
        self._stop_worker()
        run, self.run = self.run, None
        if run is None:
            if self.disabled_reason is None:  # else its warning was given already
                log.warning(
                    "W&B did not start before the run ended (server unreachable?); nothing was uploaded, "
                    "metrics.jsonl is complete; %s",
                    _FIX_HINT,
                )
            return

        def finish() -> None:
            try:
                if self.disabled_reason is None:
                    run.summary.update(self._final_summary(summary))
                run.finish(exit_code=0 if status == "completed" else 1)
            except Exception as e:
                log.warning("W&B: finishing the run failed (%s: %s); local files are unaffected", type(e).__name__, e)

        finisher = threading.Thread(target=finish, name="wandb-finish", daemon=True)
        finisher.start()
        timeout_s = float(getattr(self.cfg, "finish_timeout_s", 60.0))
        finisher.join(timeout_s)
        if finisher.is_alive():
            log.warning(
                "W&B: the run did not finish within %.0f s (logging.wandb.finish_timeout_s; server "
                "unreachable or slow); its files stay in %s: upload them later with `wandb sync %s`",
                timeout_s,
                self.run_dir / "wandb",
                self.run_dir / "wandb" / "latest-run",
            )

    # -- queue and worker

    def flush(self, timeout_s: float) -> bool:
        """Wait until the worker has logged everything queued so far; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy or self._starting:
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
                    log.warning(
                        "W&B is not keeping up; dropping the oldest queued records (counted in wandb/dropped_records)"
                    )
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
                    self.run.log(build_media(item[MEDIA]) if MEDIA in item else item)
            except Exception as e:
                self._disable(
                    f"run.log failed ({type(e).__name__}: {e}); W&B logging is off for the rest of "
                    "this run, metrics.jsonl is complete"
                )
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
