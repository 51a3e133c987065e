"""Callbacks: JSONL source of truth, fan-out, console throttle, W&B (offline for real, fakes for failures)."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from wandb_offline import read_offline_run

from dflash.core.config import Config, WandbConfig
from dflash.core.jsonio import json_safe
from dflash.tracking import build_callbacks
from dflash.tracking.base import Callback, CallbackList, RunInfo, default_job_name
from dflash.tracking.console import ConsoleCallback
from dflash.tracking.jsonl import JsonlCallback
from dflash.tracking.wandb_logger import (
    WandbCallback,
    wandb_credentials_problem,
    wandb_init_kwargs,
)


def _info(tmp_path: Path, **kw) -> RunInfo:
    base = dict(
        run_dir=tmp_path,
        config={"loss": {"kl_temperature": 2.0, "streak_alpha": 0.5}},
        max_steps=10,
        job_name="loss.kl_temperature=2",
        sweep_dir=None,
        experiment=None,
    )
    base.update(kw)
    return RunInfo(**base)


def _tick(step: int) -> dict:
    # Values chosen so each key differs per step: the last line must be the last tick, not any tick.
    return {
        "step": step,
        "tokens": 1000 * step,
        "time_s": 0.5 * step,
        "train/loss": 3.0 / step,
        "train/avg_streak": 0.25 * step,
        "perf/ktok_s": 10.0 + step,
        "perf/target_queue_depth": step % 3,
        "perf/hs_queue_depth": 1,
    }


def _strict_loads(line: str) -> dict:
    def reject(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=reject)


# ------------------------------------------------------------------------------------------- JSONL


def test_jsonl_lines_are_flushed_and_converted(tmp_path):
    cb = JsonlCallback(tmp_path)
    cb.on_run_start(_info(tmp_path))
    cb.on_metrics(
        {
            "step": 1,
            "tokens": 64,
            "time_s": 0.5,
            "train/loss": torch.tensor(2.5),
            "perf/ktok_s": np.float32(1.5),
            "train/accuracy_1": np.float64(0.25),
        }
    )
    # read while the callback still holds the file open: the line must already be on disk
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = _strict_loads(lines[0])
    assert rec == {
        "step": 1,
        "tokens": 64,
        "time_s": 0.5,
        "train/loss": 2.5,
        "perf/ktok_s": 1.5,
        "train/accuracy_1": 0.25,
    }
    assert isinstance(rec["step"], int)

    cb.on_eval({"step": 1, "eval/tau": torch.tensor(3.25), "eval/tau_baseline": 1.5})
    cb.on_run_end("completed", {})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert _strict_loads(lines[1]) == {"step": 1, "eval/tau": 3.25, "eval/tau_baseline": 1.5}

    # a resumed run appends to the same file
    cb2 = JsonlCallback(tmp_path)
    cb2.on_run_start(_info(tmp_path, start_step=1))
    cb2.on_metrics({"step": 2, "tokens": 128, "time_s": 1.0})
    cb2.on_run_end("completed", {})
    steps = [_strict_loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 1, 2]


def test_jsonl_non_finite_values_become_null(tmp_path):
    cb = JsonlCallback(tmp_path)
    cb.on_metrics(
        {
            "step": 3,
            "train/loss": float("nan"),
            "train/grad_norm": torch.tensor(float("inf")),
            "perf/ktok_s": np.float64("-inf"),
            "train/accuracy": 0.5,
        }
    )
    cb.on_run_end("failed", {})
    rec = _strict_loads((tmp_path / "metrics.jsonl").read_text().strip())
    assert rec == {"step": 3, "train/loss": None, "train/grad_norm": None, "perf/ktok_s": None, "train/accuracy": 0.5}


def test_json_safe_nested():
    assert json_safe({"a": [1.0, float("nan")], "b": torch.tensor([1.0, 2.0])}) == {"a": [1.0, None], "b": [1.0, 2.0]}


# ------------------------------------------------------------------------------------------- fan-out


class Recorder(Callback):
    def __init__(self, name: str, log: list, fail_at_end: bool = False):
        self.name, self.log, self.fail_at_end = name, log, fail_at_end

    def on_run_start(self, info):
        self.log.append((self.name, "start", info.job_name))

    def on_metrics(self, metrics):
        self.log.append((self.name, "metrics", metrics["step"]))

    def on_eval(self, results):
        self.log.append((self.name, "eval", results["eval/tau"]))

    def on_checkpoint(self, step, path):
        self.log.append((self.name, "ckpt", step, path))

    def on_run_end(self, status, summary):
        self.log.append((self.name, "end", status))
        if self.fail_at_end:
            raise OSError(f"{self.name} cannot close")

    def state(self):
        return {f"{self.name}_seen": len(self.log)}


def test_callback_list_fans_out_in_order(tmp_path):
    events: list = []
    cbs = CallbackList([Recorder("a", events), Callback(), Recorder("b", events)])
    assert len(cbs) == 3
    cbs.on_run_start(_info(tmp_path))
    cbs.on_metrics({"step": 7})
    cbs.on_eval({"step": 7, "eval/tau": 2.0})
    cbs.on_checkpoint(7, "ckpt/step_7")
    cbs.on_run_end("completed", {})
    assert events == [
        ("a", "start", "loss.kl_temperature=2"),
        ("b", "start", "loss.kl_temperature=2"),
        ("a", "metrics", 7),
        ("b", "metrics", 7),
        ("a", "eval", 2.0),
        ("b", "eval", 2.0),
        ("a", "ckpt", 7, "ckpt/step_7"),
        ("b", "ckpt", 7, "ckpt/step_7"),
        ("a", "end", "completed"),
        ("b", "end", "completed"),
    ]
    assert cbs.state() == {"a_seen": 10, "b_seen": 10}


def test_callback_list_run_end_reaches_all_then_raises():
    events: list = []
    cbs = CallbackList([Recorder("a", events, fail_at_end=True), Recorder("b", events)])
    with pytest.raises(OSError, match="a cannot close"):
        cbs.on_run_end("failed", {})
    assert events == [("a", "end", "failed"), ("b", "end", "failed")]
    with pytest.raises(ValueError, match="'done' is invalid"):
        cbs.on_run_end("done", {})


# ------------------------------------------------------------------------------------------- console


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_console_non_tty_logs_at_most_every_interval(tmp_path, caplog):
    clock = FakeClock()
    cb = ConsoleCallback(max_steps=10, log_every_s=5.0, stream=io.StringIO(), is_tty=False, clock=clock)
    caplog.set_level(logging.INFO, logger="dflash.tracking")
    cb.on_run_start(_info(tmp_path, max_steps=10))
    for step, t in [(1, 101.0), (2, 102.0), (3, 104.0), (4, 106.5), (5, 108.0)]:
        clock.t = t
        cb.on_metrics(_tick(step))
    # refreshes at t=101 (first tick) and t=106.5 (>= 5 s later); t=102, 104, 108 are inside the window
    assert cb.refreshes == 2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 2
    # step 4 at t=106.5, started at t=100: 6.5 s for 4 steps -> 6 steps left take 9.75 s -> eta 0:00:10
    assert lines[1] == (
        "step 4/10 (40%) | loss 0.7500 | streak 1.00 | 14.0 ktok/s | queues target 1 hs 1 | eta 0:00:10"
    )
    clock.t = 109.0
    cb.on_run_end("completed", {})
    assert cb.refreshes == 3  # the final state is always shown
    assert "run completed at step 5/10" in caplog.text


def test_console_tty_draws_rich_bar_and_closes(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # rich sizes a non-terminal stream from COLUMNS (default 80)
    out = io.StringIO()
    clock = FakeClock()
    cb = ConsoleCallback(max_steps=10, log_every_s=1.0, stream=out, is_tty=True, clock=clock)
    cb.on_run_start(_info(tmp_path, max_steps=10))
    cb.on_metrics(_tick(3))
    cb.on_eval({"step": 3, "eval/tau": 2.5})
    cb.on_run_end("completed", {})
    text = out.getvalue()
    assert "3/10" in text and "loss 1.0000" in text and "13.0 ktok/s" in text
    assert "tau=2.500" in text
    assert cb._progress is None


# ------------------------------------------------------------------------------------------- W&B pieces


def test_default_job_name():
    assert (
        default_job_name(["loss.kl_temperature=2", "hydra.run.dir=/x", "+train.seed=1"], "/o/d/t")
        == "loss.kl_temperature=2,+train.seed=1"
    )
    assert default_job_name([], "/outputs/2026-01-01/12-00-00-000001") == "12-00-00-000001"


def test_wandb_init_kwargs_defaults_and_env(tmp_path):
    cfg = WandbConfig(mode="offline", stats_interval_s=3.0)
    kw = wandb_init_kwargs(cfg, _info(tmp_path, experiment="smoke"), tmp_path, environ={})
    assert kw["name"] == "loss.kl_temperature=2" and kw["group"] == "smoke"
    assert kw["project"] == "dflash-train" and kw["job_type"] == "train" and kw["reinit"] == "finish_previous"
    assert kw["settings"] == {"x_stats_sampling_interval": 3.0, "init_timeout": 60.0} and kw["dir"] == str(tmp_path)
    assert "entity" not in kw and "tags" not in kw and "id" not in kw and "resume" not in kw

    sweep = _info(
        tmp_path, sweep_dir="outputs/multirun/2026-12-02/12-34-56-000001", experiment="smoke", wandb_run_id="abc123"
    )
    kw = wandb_init_kwargs(cfg, sweep, tmp_path, environ={})
    assert kw["group"] == "2026-12-02_12-34-56-000001"
    assert kw["id"] == "abc123" and kw["resume"] == "allow"

    # WANDB_NAME / WANDB_RUN_GROUP beat the derived defaults; explicit config beats both
    kw = wandb_init_kwargs(cfg, sweep, tmp_path, environ={"WANDB_NAME": "n", "WANDB_RUN_GROUP": "g"})
    assert "name" not in kw and "group" not in kw
    cfg2 = WandbConfig(name="mine", group="grp", tags=["a"], entity="team")
    kw = wandb_init_kwargs(cfg2, sweep, tmp_path, environ={"WANDB_NAME": "n", "WANDB_RUN_GROUP": "g"})
    assert (kw["name"], kw["group"], kw["tags"], kw["entity"]) == ("mine", "grp", ["a"], "team")


def test_wandb_records_no_command_that_still_holds_a_secret(tmp_path, monkeypatch):
    """W&B records sys.argv as the run's command: one with a secret in it (not redacted by launch.py) makes W&B
    record no system metadata at all."""
    cfg, info = WandbConfig(mode="offline"), _info(tmp_path)
    monkeypatch.setattr(sys, "argv", ["launch.py", "experiment=smoke", "+logging.wandb.settings.api_key=<redacted>"])
    assert "x_disable_meta" not in wandb_init_kwargs(cfg, info, tmp_path, environ={})["settings"]
    monkeypatch.setattr(sys, "argv", ["launch.py", "experiment=smoke", "+logging.wandb.settings.api_key=sk-123"])
    assert wandb_init_kwargs(cfg, info, tmp_path, environ={})["settings"]["x_disable_meta"] is True


def test_credentials_check(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    assert "no W&B API key" in wandb_credentials_problem({"HOME": str(home)})
    assert wandb_credentials_problem({"HOME": str(home), "WANDB_API_KEY": "k" * 40}) is None
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "p" * 40 + "\n")
    assert wandb_credentials_problem({"HOME": str(home)}) is None
    # a key for another host does not count
    assert wandb_credentials_problem({"HOME": str(home), "WANDB_BASE_URL": "https://wandb.example.com"})


def test_build_callbacks(tmp_path):
    cfg = OmegaConf.structured(Config)
    names = [type(c).__name__ for c in build_callbacks(cfg, tmp_path, 10)]
    assert names == ["JsonlCallback", "ConsoleCallback", "WandbCallback"]
    cfg.logging.console = False
    cfg.logging.wandb.mode = "disabled"
    assert [type(c).__name__ for c in build_callbacks(cfg, tmp_path, 10)] == ["JsonlCallback"]


# ------------------------------------------------------------------------------------------- W&B offline


def test_wandb_offline_run_matches_jsonl(tmp_path, monkeypatch):
    for var in ("WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_MODE", "WANDB_RUN_ID", "WANDB_TAGS", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    cbs = CallbackList(
        [JsonlCallback(run_dir), WandbCallback(WandbConfig(mode="offline", stats_interval_s=5.0), run_dir)]
    )
    wb = cbs.callbacks[1]
    cbs.on_run_start(_info(run_dir, experiment="smoke"))
    assert wb.run_id and cbs.state() == {"wandb_run_id": wb.run_id}
    for step in (1, 2, 3):
        cbs.on_metrics(_tick(step))
    cbs.on_eval({"step": 2, "eval/tau": 2.5, "eval/tau_baseline": 1.25})
    cbs.on_eval({"step": 3, "eval/tau": 2.0, "eval/tau_baseline": 1.25})
    cbs.on_run_end("completed", {"train/loss": 1.0})

    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    rec = read_offline_run(run_dir)
    assert rec["state"] == "finished" and rec["exit_code"] == 0
    assert rec["run_id"] == wb.run_id
    assert rec["name"] == "loss.kl_temperature=2" and rec["group"] == "smoke"
    assert rec["config"]["loss"]["kl_temperature"] == 2.0
    assert {"step", "train/loss", "perf/ktok_s", "eval/tau"} <= set(rec["history_keys"])

    lines = [_strict_loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_tick = [x for x in lines if "train/loss" in x][-1]
    train_rows = [r for r in rec["history"] if "train/loss" in r]
    assert len(train_rows) == 3
    for key in ("step", "train/loss", "perf/ktok_s", "perf/target_queue_depth"):
        assert train_rows[-1][key] == pytest.approx(last_tick[key])
    # summary: final values given at run end plus best / final tau from the evals (2.5 then 2.0)
    assert rec["summary"]["eval/tau_best"] == pytest.approx(2.5)
    assert rec["summary"]["eval/tau"] == pytest.approx(2.0)
    assert rec["summary"]["train/loss"] == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------- W&B fallbacks


def _wandb_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "W&B" in r.getMessage()]


def _exercise(cb: WandbCallback, tmp_path: Path) -> None:
    cb.on_run_start(_info(tmp_path))
    cb.on_metrics(_tick(1))
    cb.on_eval({"step": 1, "eval/tau": 2.0})
    cb.on_run_end("completed", {})


def test_wandb_not_importable_is_a_noop(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    cb = WandbCallback(WandbConfig(mode="offline"), tmp_path)
    _exercise(cb, tmp_path)
    warnings = _wandb_warnings(caplog)
    assert len(warnings) == 1 and "not importable" in warnings[0]
    assert cb.run_id is None and cb.state() == {} and not (tmp_path / "wandb").exists()


def test_wandb_online_without_key_is_a_noop(tmp_path, monkeypatch, caplog):
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cb = WandbCallback(WandbConfig(mode="online"), tmp_path)
    _exercise(cb, tmp_path)
    warnings = _wandb_warnings(caplog)
    assert len(warnings) == 1
    assert "no W&B API key" in warnings[0] and "wandb login" in warnings[0]
    assert "logging.wandb.mode=offline" in warnings[0] and "wandb sync" in warnings[0]
    assert cb.run_id is None and not (tmp_path / "wandb").exists()


class FakeRun:
    """Stands in for a wandb Run: records logs; `log` can block on an event or raise."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.id = "fake123"
        self.logged: list[dict] = []
        self.entered = threading.Event()
        self.gate, self.fail = gate, fail
        self.summary: dict = {}
        self.finished_with = None
        self.metrics: list = []

    def define_metric(self, name, **kw):
        self.metrics.append((name, kw))

    def log(self, item):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise ConnectionError("upload broke")
        self.logged.append(item)

    def finish(self, exit_code=0):
        self.finished_with = exit_code


def _fake_wandb(monkeypatch, run: FakeRun | None = None, init_error: Exception | None = None) -> dict:
    seen: dict = {}

    def init(**kw):
        seen.update(kw)
        if init_error is not None:
            raise init_error
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=lambda **kw: kw))
    return seen


def test_wandb_init_raising_is_a_noop(tmp_path, monkeypatch, caplog):
    _fake_wandb(monkeypatch, init_error=RuntimeError("service did not start"))
    cb = WandbCallback(WandbConfig(mode="offline"), tmp_path)
    _exercise(cb, tmp_path)
    warnings = _wandb_warnings(caplog)
    assert len(warnings) == 1 and "service did not start" in warnings[0] and "wandb sync" in warnings[0]
    assert cb.run_id is None


def test_wandb_slow_logging_never_blocks_and_drops_oldest(tmp_path, monkeypatch):
    gate = threading.Event()
    run = FakeRun(gate=gate)
    seen = _fake_wandb(monkeypatch, run)
    cb = WandbCallback(WandbConfig(mode="offline"), tmp_path, queue_size=2)
    cb.on_run_start(_info(tmp_path, wandb_run_id="fake123"))
    assert seen["id"] == "fake123" and seen["resume"] == "allow"
    assert run.metrics == [("step", {}), ("*", {"step_metric": "step"})]
    cb.on_metrics(_tick(1))
    assert run.entered.wait(5)  # the worker now sits inside a blocked run.log with step 1
    t0 = time.monotonic()
    for step in (2, 3, 4, 5):
        cb.on_metrics(_tick(step))
    assert time.monotonic() - t0 < 0.5  # the caller never waited on W&B
    assert cb.dropped == 2  # queue of 2 keeps steps 4 and 5; 2 and 3 were dropped
    gate.set()
    cb.on_run_end("interrupted", {})
    assert [x["step"] for x in run.logged] == [1, 4, 5]
    assert run.finished_with == 1
    assert run.summary["wandb/dropped_records"] == 2


def test_wandb_worker_error_disables_logging_once(tmp_path, monkeypatch, caplog):
    run = FakeRun(fail=True)
    _fake_wandb(monkeypatch, run)
    cb = WandbCallback(WandbConfig(mode="offline"), tmp_path)
    cb.on_run_start(_info(tmp_path))
    for step in (1, 2, 3):
        cb.on_metrics(_tick(step))
        cb.flush(5)
    assert cb.disabled_reason and "upload broke" in cb.disabled_reason
    warnings = _wandb_warnings(caplog)
    assert len(warnings) == 1 and "ConnectionError" in warnings[0]
    cb.on_run_end("completed", {"train/loss": 1.0})
    assert run.finished_with == 0
    assert run.summary == {}  # a broken W&B is not written to again, only finished
    assert cb.run_id == "fake123"


def test_wandb_resumed_run_skips_steps_it_already_has(tmp_path, monkeypatch):
    """Killed at step 7 after a checkpoint at 5: the resumed run retrains 6 and 7, which W&B already has."""
    run = FakeRun()
    run.summary.update({"step": 7, "eval/tau_best": 3.5})
    _fake_wandb(monkeypatch, run)
    cb = WandbCallback(WandbConfig(mode="online"), tmp_path)
    monkeypatch.setattr("dflash.tracking.wandb_logger.wandb_credentials_problem", lambda: None)
    cb.on_run_start(_info(tmp_path, wandb_run_id="fake123"))
    for step in (6, 7, 8, 9):
        cb.on_metrics(_tick(step))
    cb.on_eval({"step": 9, "eval/tau": 3.0})
    cb.on_run_end("completed", {})
    assert [x["step"] for x in run.logged] == [8, 9, 9]
    assert run.summary["eval/tau_best"] == 3.5 and run.summary["eval/tau"] == 3.0


def test_the_wandb_config_is_scrubbed_as_config_resolved_is(tmp_path, monkeypatch):
    """Secret keys, a URL's credentials and a secret environment variable's value in any config string: W&B's
    config holds none of them (config_resolved.yaml does not either)."""
    monkeypatch.setenv("HF_TOKEN", "hf_envsecret_0123456789")
    config = {
        "data": {"path": "https://alice:url-secret-0123@host/data.jsonl"},
        "eval": {"prompts_file": "/data/hf_envsecret_0123456789/prompts.jsonl"},
        "x": {"private_key": "pk-0123456789", "wandb_key": "wk-0123456789"},
        "train": {"seed": 3},
    }
    info = RunInfo(run_dir=tmp_path, config=config, max_steps=10, job_name="j")
    recorded = wandb_init_kwargs(WandbConfig(mode="offline"), info, tmp_path, environ={})["config"]
    text = json.dumps(recorded)
    for secret in ("url-secret-0123", "hf_envsecret_0123456789", "pk-0123456789", "wk-0123456789"):
        assert secret not in text
    assert recorded["data"]["path"] == "https://<redacted>@host/data.jsonl" and recorded["train"]["seed"] == 3
