"""Optuna search through Hydra (hydra/sweeper=dflash_optuna, experiment=optuna_loss): one run dir per trial,
sweep.json and compare list the searched keys, and a relaunch continues the study stored in the sweep dir."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import REPO, launch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from optuna.trial import TrialState

from dflash.analysis.compare_cli import main as compare_main
from dflash.analysis.sweep import (
    OPTUNA_SEARCH_ATTR,
    OptunaSearchError,
    SweepSummaryCallback,
    prepare_optuna_search,
)

SEARCHED = ["loss.kl_temperature", "loss.streak_alpha", "loss.kl_weight", "schedule.lr"]
# about experiment=smoke's sizes (it cannot be chosen alongside experiment=optuna_loss), without regenerated data
TINY = [
    "model=tiny_random",
    "logging=jsonl",
    "train.max_steps=4",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.num_anchors=4",
    "data.max_files=40",
    "data.regenerate.enabled=false",
    "pipeline.monitor_interval_s=0.5",
    "eval.num_prompts=1",
    "eval.max_new_tokens=4",
    "eval.prompt_len=16",
    "eval.baselines=false",
    "logging.report=false",
]


def _study(sweep, name="optuna_loss") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{sweep}/optuna.db")


def _job_dirs(sweep) -> list[str]:
    return sorted((p.name for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=int)


def _compare_rows(capsys, sweep) -> list[dict]:
    assert compare_main([str(sweep), "--sort", "eval/tau", "--format", "csv"]) == 0
    return list(csv.DictReader(io.StringIO(capsys.readouterr().out)))


def _check_trials_match_run_dirs(sweep, study) -> None:
    """Trial N ran in run dir N: its params are that run's config and its value that run's eval/tau."""
    for t in study.trials:
        if t.state != TrialState.COMPLETE:
            continue
        run = sweep / str(t.number)
        cfg = yaml.safe_load((run / "config_resolved.yaml").read_text())
        for key, value in t.params.items():
            group, name = key.split(".")
            assert cfg[group][name] == pytest.approx(value), (t.number, key)
        tau = json.loads((run / "summary.json").read_text())["eval/tau"]
        assert t.value == pytest.approx(tau)


@pytest.mark.slow
def test_search_has_a_run_dir_per_trial_and_a_relaunch_continues_it(tmp_path, cache_dir, tiny_target, capsys):
    sweep = tmp_path / "search"
    command = ["-m", "experiment=optuna_loss", *TINY, f"hydra.sweep.dir={sweep}"]
    launch([*command, "hydra.sweeper.n_trials=2"], cache_dir, check=True, timeout=300)

    assert _job_dirs(sweep) == ["0", "1"]
    study = _study(sweep)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert all(set(t.params) == set(SEARCHED) for t in study.trials)
    _check_trials_match_run_dirs(sweep, study)
    summary = json.loads((sweep / "sweep.json").read_text())
    assert set(SEARCHED) <= set(summary["varying_keys"])
    assert [j["run_dir"] for j in summary["jobs"]] == ["0", "1"]
    assert all(j["status"] == "completed" and set(SEARCHED) <= set(j["config"]) for j in summary["jobs"])
    rows = _compare_rows(capsys, sweep)
    assert len(rows) == 2 and set(SEARCHED) <= set(rows[0])
    assert float(rows[0]["eval/tau"]) >= float(rows[1]["eval/tau"])
    first = {n: (sweep / n / "run.json").read_bytes() + (sweep / n / "status.json").read_bytes() for n in ("0", "1")}

    # a search killed during a trial leaves that trial RUNNING in the study
    killed = study.ask()
    assert killed.number == 2

    launch([*command, "hydra.sweeper.n_trials=3"], cache_dir, check=True, timeout=300)

    trials = _study(sweep).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2 + [TrialState.FAIL, TrialState.COMPLETE]
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 3  # n_trials counts the whole study
    assert _job_dirs(sweep) == ["0", "1", "3"]  # trial 3 in its own dir; the earlier trials' dirs untouched
    assert {n: (sweep / n / "run.json").read_bytes() + (sweep / n / "status.json").read_bytes() for n in first} == first
    # the relaunched sampler does not replay the first launch's random samples (same seed, same stream)
    assert trials[3].params not in (trials[0].params, trials[1].params)
    _check_trials_match_run_dirs(sweep, _study(sweep))
    summary = json.loads((sweep / "sweep.json").read_text())
    assert [j["run_dir"] for j in summary["jobs"]] == ["0", "1", "3"]
    rows = _compare_rows(capsys, sweep)
    assert sorted(Path(r["run_dir"]).name for r in rows) == ["0", "1", "3"]
    assert all(r[k] for r in rows for k in SEARCHED)


_FAKE_APP = """
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg):
    num = HydraConfig.get().job.num
    if num == 1:
        return float("nan")
    if num == 2:
        raise RuntimeError("trial 2 fails")
    if num == 3:
        return None
    return float(cfg.x)

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_failed_or_nan_trials_do_not_stop_the_search(tmp_path):
    """The preset's objective is whatever the task returns: NaN, None or an exception fail that trial only."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "app.py").write_text(_FAKE_APP)
    sweep = tmp_path / "sweep"
    config = {
        "defaults": [{"override hydra/sweeper": "dflash_optuna"}, "_self_"],
        "x": 0.0,
        "hydra": {
            "searchpath": [f"file://{REPO / 'conf'}"],
            "sweep": {"dir": str(sweep), "subdir": "${hydra.job.num}"},
            "sweeper": {"study_name": "fake", "n_trials": 5, "params": {"x": "interval(0.0, 1.0)"}},
            "callbacks": {"sweep_summary": {"_target_": "dflash.analysis.sweep.SweepSummaryCallback"}},
        },
    }
    (tmp_path / "conf" / "config.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "app.py", "-m"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials = _study(sweep, "fake").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] + [TrialState.FAIL] * 3 + [TrialState.COMPLETE]
    assert _job_dirs(sweep) == ["0", "1", "2", "3", "4"]
    assert yaml.safe_load((sweep / "optimization_results.yaml").read_text())["best_value"] == max(
        trials[0].value, trials[4].value
    )


# prepare_optuna_search in-process, on a config as Hydra hands it to on_multirun_start


def _config(tmp_path, n_trials=3, task=("experiment=optuna_loss",), seed=0, max_steps=5):
    return OmegaConf.create(
        {
            "train": {"max_steps": max_steps, "seed": 0},
            "paths": {"cache_dir": "${oc.env:NOT_SET,outputs/.cache}"},  # stays unresolved
            "hydra": {
                "sweep": {"dir": str(tmp_path), "subdir": "${hydra.job.num}"},
                "sweeper": {
                    "_target_": "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
                    "sampler": {"_target_": "optuna.samplers.TPESampler", "seed": seed},
                    "direction": "maximize",
                    "storage": f"sqlite:///{tmp_path}/optuna.db",
                    "study_name": "s",
                    "n_trials": n_trials,
                    "params": {"a": "interval(0.0, 1.0)"},
                },
                "overrides": {"task": list(task), "hydra": []},
            },
        }
    )


def _add_trials(tmp_path, complete: int, running: int) -> None:
    study = _study(tmp_path, "s")
    for _ in range(complete):
        t = study.ask()
        study.tell(t, t.suggest_float("a", 0.0, 1.0))
    for _ in range(running):
        study.ask()


def test_a_new_study_records_its_search_and_keeps_the_config(tmp_path):
    cfg = _config(tmp_path)
    lock = prepare_optuna_search(cfg)
    lock.close()
    assert cfg.hydra.sweeper.n_trials == 3 and cfg.hydra.sweeper.sampler.seed == 0
    assert list(cfg.hydra.overrides.hydra) == []
    assert _study(tmp_path, "s").user_attrs[OPTUNA_SEARCH_ATTR] == {
        "overrides": ["a=interval(0.0, 1.0)", "experiment=optuna_loss"],
        "config": {
            "train.max_steps": 5,
            "train.seed": 0,
            "paths.cache_dir": "${oc.env:NOT_SET,outputs/.cache}",
        },
    }


def test_a_study_records_no_secret_of_the_command_line(tmp_path):
    secret = "+x.api_key=sk-secret-0123456789"
    prepare_optuna_search(_config(tmp_path, task=("experiment=optuna_loss", secret))).close()
    recorded = _study(tmp_path, "s").user_attrs[OPTUNA_SEARCH_ATTR]
    assert "+x.api_key=<redacted>" in recorded["overrides"] and "sk-secret" not in json.dumps(recorded)
    # another value of the secret is the same search
    prepare_optuna_search(_config(tmp_path, task=("experiment=optuna_loss", "+x.api_key=sk-other-01234567"))).close()


def test_a_relaunch_runs_the_missing_trials_numbered_after_the_study(tmp_path):
    prepare_optuna_search(_config(tmp_path)).close()
    _add_trials(tmp_path, complete=2, running=1)
    cfg = _config(tmp_path, n_trials=5)
    prepare_optuna_search(cfg).close()
    assert cfg.hydra.sweeper.n_trials == 3  # 5 - 2 finished; the killed trial does not count
    assert cfg.hydra.sweeper.sampler.seed == 3  # 0 + the 3 trials there
    assert [t.state for t in _study(tmp_path, "s").trials] == [TrialState.COMPLETE] * 2 + [TrialState.FAIL]
    # what Hydra does with it: each job's config is composed from these overrides, then given its job num
    (override,) = OverridesParser.create().parse_overrides(OmegaConf.to_container(cfg.hydra.overrides.hydra))
    assert override.key_or_group == "hydra.sweep.subdir"
    job = OmegaConf.create({"hydra": {"job": {"num": 1}, "sweep": {"subdir": override.value()}}})
    assert job.hydra.sweep.subdir == 4  # the launcher's second job is trial 4
    assert list(cfg.hydra.overrides.hydra) == ["hydra.sweep.subdir='3'"]  # the multirun's config still resolves

    cfg = _config(tmp_path, n_trials=2)  # fewer than the study holds: nothing to run
    prepare_optuna_search(cfg).close()
    assert cfg.hydra.sweeper.n_trials == 0


def test_a_different_search_in_the_same_sweep_dir_is_refused(tmp_path):
    prepare_optuna_search(_config(tmp_path)).close()
    with pytest.raises(OptunaSearchError, match=r"\+train.max_steps=9; train.max_steps: 5 -> 9\).*own hydra.sweep.dir"):
        prepare_optuna_search(_config(tmp_path, task=("experiment=optuna_loss", "train.max_steps=9"), max_steps=9))
    with pytest.raises(OptunaSearchError, match=r"\(train.max_steps: 5 -> 7\)"):  # an edited experiment file
        prepare_optuna_search(_config(tmp_path, max_steps=7))
    # on_multirun_start stops the launch (Hydra would only warn about a callback's exception)
    with pytest.raises(SystemExit, match="another search"):
        SweepSummaryCallback().on_multirun_start(_config(tmp_path, task=("experiment=smoke",)))


def test_a_sweep_dir_with_other_job_dirs_is_refused(tmp_path):
    (tmp_path / "0").mkdir()  # e.g. a grid sweep's first job
    with pytest.raises(OptunaSearchError, match="no trial of study 's'"):
        prepare_optuna_search(_config(tmp_path))


def test_one_search_per_sweep_dir_at_a_time(tmp_path):
    lock = prepare_optuna_search(_config(tmp_path))
    try:
        with pytest.raises(OptunaSearchError, match=r"another Optuna search is running .*pid"):
            prepare_optuna_search(_config(tmp_path))
    finally:
        lock.close()
    prepare_optuna_search(_config(tmp_path)).close()  # free again once the first search ended


def test_other_sweepers_and_searches_without_a_storage_are_left_alone(tmp_path):
    basic = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "a")}, "sweeper": {"_target_": basic}}})
    SweepSummaryCallback().on_multirun_start(cfg)
    cfg = _config(tmp_path / "b")
    cfg.hydra.sweeper.storage = None  # an in-memory study: nothing to continue
    SweepSummaryCallback().on_multirun_start(cfg)
    assert list(tmp_path.iterdir()) == []


def test_a_storage_urls_password_is_never_printed(tmp_path):
    """The storage's URL in a refusal (here the database's own error, which quotes it): without its password."""
    cfg = _config(tmp_path)
    cfg.hydra.mode = "MULTIRUN"
    cfg.hydra.sweeper.storage = f"sqlite://alice:s3cret-pw@/{tmp_path}/optuna.db"  # credentials: invalid for sqlite
    with pytest.raises(SystemExit) as refused:
        SweepSummaryCallback().on_multirun_start(config=cfg)
    message = str(refused.value)
    assert "s3cret-pw" not in message and "sqlite://<redacted>@" in message
