"""Multirun sweeps through launch.py and their comparison by output directory."""

from __future__ import annotations

import csv
import io
import json

import pytest
from conftest import launch

from dflash.analysis.compare_cli import main as compare_main

pytestmark = pytest.mark.slow

SMOKE = ["experiment=smoke", "train.max_steps=4", "eval.num_prompts=1", "eval.max_new_tokens=4"]


def _compare(capsys, *args) -> str:
    assert compare_main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def test_four_job_sweep_and_compare(tmp_path, cache_dir, tiny_target, capsys):
    sweep = tmp_path / "sweep"
    launch(
        [
            "-m",
            *SMOKE,
            f"hydra.sweep.dir={sweep}",
            "loss=kl_streak",
            "loss.kl_temperature=1,2",
            "loss.streak_alpha=0,0.5",
        ],
        cache_dir,
        check=True,
        timeout=600,
    )
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(jobs) == 4 and all((j / "config_resolved.yaml").exists() for j in jobs)
    summary = json.loads((sweep / "sweep.json").read_text())
    assert len(summary["jobs"]) == 4 and all(j["status"] == "completed" for j in summary["jobs"])

    rows = list(csv.DictReader(io.StringIO(_compare(capsys, sweep, "--format", "csv"))))
    assert len(rows) == 4
    assert {"loss.kl_temperature", "loss.streak_alpha", "eval/tau", "status"} <= set(rows[0])
    assert {(r["loss.kl_temperature"], r["loss.streak_alpha"]) for r in rows} == {
        ("1.0", "0.0"),
        ("1.0", "0.5"),
        ("2.0", "0.0"),
        ("2.0", "0.5"),
    }
    table = _compare(capsys, sweep)
    assert "loss.kl_temperature" in table and "loss.streak_alpha" in table
    plot = tmp_path / "curves.png"
    _compare(capsys, sweep, "--plot", plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_with_a_failed_job_still_summarises(tmp_path, cache_dir, tiny_target, capsys):
    sweep = tmp_path / "sweep"
    proc = launch(["-m", *SMOKE, f"hydra.sweep.dir={sweep}", "debug.fail_at_step=null,2"], cache_dir, timeout=600)
    assert proc.returncode != 0  # Hydra reports the failed job after running all of them
    summary = json.loads((sweep / "sweep.json").read_text())
    assert sorted(j["status"] for j in summary["jobs"]) == ["completed", "failed"]
    rows = list(csv.DictReader(io.StringIO(_compare(capsys, sweep, "--format", "csv"))))
    assert sorted(r["status"] for r in rows) == ["completed", "failed"]


def test_seeds_group_with_mean_and_std(tmp_path, cache_dir, tiny_target, capsys):
    sweep = tmp_path / "sweep"
    launch(
        ["-m", *SMOKE, f"hydra.sweep.dir={sweep}", "train.seed=0,1,2", "eval.num_prompts=0"],
        cache_dir,
        check=True,
        timeout=600,
    )
    rows = json.loads(_compare(capsys, sweep, "--group-by", "auto", "--format", "json", "--metrics", "train/loss"))
    assert len(rows) == 1
    row = rows[0]
    assert row["n"] == 3
    # what compare's train/loss is defined to be: summary.json's, the mean over the last summary_window_steps
    # steps (not the last metrics.jsonl record, whose window depends on when the monitor last wrote)
    losses = [json.loads((sweep / str(j) / "summary.json").read_text())["train/loss"] for j in range(3)]
    mean = sum(losses) / 3
    std = (sum((x - mean) ** 2 for x in losses) / 2) ** 0.5  # sample std
    assert len(set(losses)) == 3  # the seeds really differ
    assert abs(float(row["train/loss mean"]) - mean) < 1e-6
    assert abs(float(row["train/loss std"]) - std) < 1e-6


def _live_models() -> int:
    """Drafters and HF models still reachable in this process."""
    import gc

    from transformers import PreTrainedModel

    from dflash.model.drafter import DFlashDraftModel

    gc.collect()
    return sum(issubclass(type(o), (DFlashDraftModel, PreTrainedModel)) for o in gc.get_objects())


def test_jobs_in_one_process_free_threads_and_models(tmp_path, cache_dir, tiny_target, monkeypatch):
    """The basic launcher runs a sweep's jobs one after another in one process: each job must leave no thread
    and no model behind, or a long sweep grows until it runs out of memory."""
    import threading

    from conftest import compose_config

    from dflash.runner.lifecycle import JobInfo, main

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(cache_dir))
    cfg = compose_config(SMOKE)
    threads_before = {t.ident for t in threading.enumerate()}
    models_before = _live_models()
    for job in range(2):
        run_dir = tmp_path / str(job)
        assert main(cfg, JobInfo(run_dir, job_name=str(job))) is not None
        assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
        left = [t.name for t in threading.enumerate() if t.ident not in threads_before]
        assert left == [], f"job {job} left threads running: {left}"
        assert _live_models() == models_before, f"job {job} left models alive"


def test_joblib_launcher_runs_jobs_in_parallel_processes(tmp_path, cache_dir, tiny_target):
    """The documented CPU-parallel launcher: each job a complete run dir, one sweep.json for all."""
    sweep = tmp_path / "sweep"
    launch(
        [
            "-m",
            *SMOKE,
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            f"hydra.sweep.dir={sweep}",
            "loss=kl_streak",  # the loss that reads streak_alpha: a sweep over a key no job reads is refused
            "loss.streak_alpha=0,1",
        ],
        cache_dir,
        check=True,
        timeout=600,
    )
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(jobs) == 2
    assert all(json.loads((j / "status.json").read_text())["status"] == "completed" for j in jobs)
    summary = json.loads((sweep / "sweep.json").read_text())
    assert sorted(j["status"] for j in summary["jobs"]) == ["completed", "completed"]
    assert "JoblibLauncher" in (jobs[0] / ".hydra" / "hydra.yaml").read_text()


def test_sweep_json_is_written_under_a_lock(tmp_path):
    """Jobs of a parallel launcher end in several processes: each read-scan-write holds the sweep's lock."""
    import threading
    import time

    from dflash.analysis.sweep import SWEEP_FILE, _sweep_lock, summarize_sweep

    done = threading.Event()
    with _sweep_lock(tmp_path):
        t = threading.Thread(target=lambda: (summarize_sweep(tmp_path), done.set()))
        t.start()
        time.sleep(0.3)
        assert not done.is_set() and not (tmp_path / SWEEP_FILE).exists()  # waits for the holder
    t.join(10)
    assert done.is_set() and (tmp_path / SWEEP_FILE).exists()
