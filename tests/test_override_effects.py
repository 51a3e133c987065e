"""Overrides that do nothing: a key the chosen loss, schedule or pipeline does not read warns once, naming the
option that reads it; a multirun sweeping such a key is refused before its first job, naming the key."""

from __future__ import annotations

import logging
import sys

import pytest
from conftest import REPO, compose_config, launch
from hydra import initialize_config_dir
from omegaconf import open_dict

from dflash.config import OPTION_KEYS, READ_ONLY_BY, UNREAD_WHILE
from dflash.override_effects import SweepEffects, sweep_problems, unused_overrides

CONF = str(REPO / "conf")


def test_the_headline_overrides_on_the_default_loss_each_say_they_do_nothing():
    overrides = ["loss.kl_temperature=2", "loss.streak_alpha=0.5", "train.seed=3"]
    lines = unused_overrides(compose_config(overrides), overrides)
    assert len(lines) == 2
    assert lines[0].startswith("loss.kl_temperature=2 has no effect: loss.kl_weight=0 turns off")
    assert lines[1].startswith("loss.streak_alpha=0.5 has no effect: loss=dpace does not read it")
    assert "only loss=kl_streak" in lines[1]


@pytest.mark.parametrize(
    ("overrides", "unread"),
    [
        (["loss=kl_streak", "loss.kl_temperature=2", "loss.streak_alpha=0.5"], []),
        (["loss=dpace", "loss.kl_weight=0.5", "loss.kl_temperature=2"], []),
        (["loss=ce_decay", "loss.kl_weight=0.5", "loss.dpace_alpha=0.3"], ["loss.kl_weight", "loss.dpace_alpha"]),
        (["loss=kl", "loss.decay_gamma=3"], []),
        (["loss=dpace", "loss.decay_gamma=3"], ["loss.decay_gamma"]),
        (
            ["schedule=constant", "schedule.min_lr_ratio=0.5", "schedule.decay_ratio=0.3"],
            ["schedule.min_lr_ratio", "schedule.decay_ratio"],
        ),
        (["schedule=wsd", "schedule.decay_ratio=0.3"], []),
        (["pipeline=sync", "pipeline.queue_size=8", "pipeline.monitor_interval_s=1"], ["pipeline.queue_size"]),
        (["++loss.streak_alpha=0.5", "loss.name=kl_streak"], []),  # the option set by its key, not the group
        (["optim=adamw", "optim.muon_momentum=0.9", "optim.weight_decay=0.1"], ["optim.muon_momentum"]),  # no muon_*
        (["optim.muon_momentum=0.9"], []),  # the default optimizer is muon
    ],
)
def test_each_option_reads_the_keys_the_table_says(overrides, unread):
    lines = unused_overrides(compose_config(overrides), overrides)
    assert [line.split("=", 1)[0] for line in lines] == unread


def test_the_table_names_real_keys_and_options():
    from dflash.config import DRAFTER_NAMES, LOSS_NAMES, OPTIM_NAMES, PIPELINE_MODES, SCHEDULE_NAMES

    cfg = compose_config([])
    names = {
        "loss": LOSS_NAMES,
        "schedule": SCHEDULE_NAMES,
        "pipeline": PIPELINE_MODES,
        "drafter": DRAFTER_NAMES,
        "optim": OPTIM_NAMES,
    }
    for key, readers in READ_ONLY_BY.items():
        group = key.split(".")[0]
        assert key.split(".")[1] in cfg[group] and set(readers) < set(names[group]), key
    assert all(key.split(".")[1] in cfg[group] for group, key in OPTION_KEYS.items())
    assert all(key in READ_ONLY_BY for key in UNREAD_WHILE)


def _multirun(overrides: list[str]):
    """The config Hydra hands on_multirun_start: sweeps not applied, the command line in hydra.overrides.task."""
    cfg = compose_config([o for o in overrides if "," not in o and "(" not in o], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.overrides.task = overrides
    return cfg


def _problems(overrides: list[str], params: dict | None = None):
    cfg = _multirun(overrides)
    if params:
        with open_dict(cfg):
            cfg.hydra.sweeper.params = params
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):  # as during Hydra's multirun
        return sweep_problems(cfg)


def test_a_sweep_over_keys_the_default_loss_does_not_read_is_refused_naming_them():
    cfg = _multirun(["loss.kl_temperature=1,2,4", "loss.streak_alpha=0,0.5"])
    with initialize_config_dir(config_dir=CONF, version_base="1.3"), pytest.raises(SystemExit) as refused:
        SweepEffects().on_multirun_start(config=cfg)
    message = str(refused.value)
    assert message.startswith("error: loss.kl_temperature is swept (1,2,4) but no job reads it")
    assert "loss.streak_alpha is swept (0,0.5) but no job reads it: loss=dpace does not read it" in message


@pytest.mark.parametrize(
    ("overrides", "params"),
    [
        (["loss=kl_streak", "loss.kl_temperature=1,2,4", "loss.streak_alpha=0,0.5"], None),
        (["loss.name=kl_streak", "loss.kl_weight=0.5", "loss.streak_alpha=0,0.5"], None),
        (["experiment=sweep_loss"], None),  # its params sweep kl_streak's keys
        (["experiment=optuna_loss"], None),  # intervals of kl_streak's keys and kl_weight
        (["loss.kl_weight=interval(0.0,1.0)", "loss.kl_temperature=interval(0.5,4.0)"], None),  # an Optuna search
        (["train.seed=0,1,2"], None),
        ([], {"loss": "kl,kl_streak", "loss.kl_temperature": "1,2"}),
    ],
)
def test_sweeps_whose_keys_every_job_reads_pass(overrides, params):
    assert _problems(overrides, params) == ([], [])


def test_a_swept_key_some_jobs_do_not_read_warns_naming_them(caplog):
    refusals, warnings = _problems(["loss=kl_streak,dpace", "loss.streak_alpha=0,0.5"])
    assert refusals == []
    [warning] = warnings
    assert warning.startswith("loss.streak_alpha is swept (0,0.5) but the jobs with loss=dpace do not read it")
    refusals, [warning] = _problems(["loss.kl_weight=0,0.5", "loss.kl_temperature=1,2"])
    assert "the jobs with loss.kl_weight=0 do not read it" in warning


def test_a_swept_group_choice_with_no_reader_is_refused():
    refusals, _ = _problems(["schedule=cosine,constant", "schedule.decay_ratio=0.1,0.3"])
    assert refusals == [
        "schedule.decay_ratio is swept (0.1,0.3) but no job reads it: schedule=cosine does not read it "
        "(only schedule=wsd)"
    ]


@pytest.mark.slow
def test_launch_refuses_the_headline_sweep_before_any_job_and_a_run_warns(tmp_path, cache_dir):
    sweep = tmp_path / "sweep"
    proc = launch(["-m", "loss.kl_temperature=1,2,4", "loss.streak_alpha=0,0.5", f"hydra.sweep.dir={sweep}"], cache_dir)
    assert proc.returncode != 0
    assert "error: loss.kl_temperature is swept (1,2,4) but no job reads it" in proc.stderr
    assert not sweep.exists() or not [p for p in sweep.iterdir() if p.is_dir()]  # no job started


def test_a_run_warns_once_about_each_override_it_does_not_read(tmp_path, monkeypatch, caplog):
    """lifecycle.main says it before anything else of the run (here the run then fails on a missing target)."""
    from dflash.job_info import JobInfo
    from dflash.lifecycle import main

    overrides = ["loss.streak_alpha=0.5", f"model.target={tmp_path / 'none'}", "model.build.kind=none"]
    cfg = compose_config(["experiment=smoke", "logging=jsonl", *overrides])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["launch.py"])
    with caplog.at_level(logging.WARNING, logger="dflash.override_effects"), pytest.raises(Exception):  # noqa: B017
        main(cfg, JobInfo(run_dir=tmp_path / "run", overrides=overrides))
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash.override_effects"]
    assert lines == [
        "loss.streak_alpha=0.5 has no effect: loss=dpace does not read it (only loss=kl_streak)",
    ]
