"""Overrides that do nothing: a key the chosen loss, schedule or pipeline does not read warns once, naming the
option that reads it; a multirun sweeping such a key is refused before its first job, naming the key."""

from __future__ import annotations

import logging
import sys

import pytest
from conftest import REPO, compose_config, launch
from hydra import initialize_config_dir
from omegaconf import MISSING, OmegaConf, open_dict

from dflash.core.cli_flags import translate_wandb_flags
from dflash.core.override_effects import SweepEffects, sweep_problems, unused_overrides
from dflash.core.read_keys import OPTION_KEYS, READ_ONLY_BY, UNREAD_WHILE

CONF = str(REPO / "conf")


def test_the_headline_overrides_on_the_default_loss_each_say_they_do_nothing():
    overrides = ["loss.kl_temperature=2", "loss.streak_alpha=0.5", "train.seed=3"]
    lines = unused_overrides(compose_config(overrides), overrides)
    assert len(lines) == 2
    assert lines[0].startswith("loss.kl_temperature=2 has no effect: loss.kl_weight=0 turns it off")
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
    from dflash.core.config import (
        DRAFTER_NAMES,
        LOSS_NAMES,
        OPTIM_NAMES,
        PIPELINE_MODES,
        SCHEDULE_NAMES,
        WANDB_MODES,
    )

    cfg = compose_config([])
    names = {
        "loss": LOSS_NAMES,
        "schedule": SCHEDULE_NAMES,
        "pipeline": PIPELINE_MODES,
        "drafter": DRAFTER_NAMES,
        "optim": OPTIM_NAMES,
        "logging": WANDB_MODES,
    }
    for key, readers in READ_ONLY_BY.items():
        group = key.split(".")[0]
        assert OmegaConf.select(cfg, key, default=MISSING) is not MISSING and set(readers) < set(names[group]), key
    assert all(OmegaConf.select(cfg, key, default=MISSING) is not MISSING for key in OPTION_KEYS.values())
    assert all(key in READ_ONLY_BY and other in READ_ONLY_BY for key, (other, _) in UNREAD_WHILE.items())


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


def test_target_labels_under_a_kl_loss_without_its_ce_term_say_they_do_nothing():
    """Issue 57: loss=kl at kl_weight=1 has no CE term, the only reader of loss.labels there: a run warns and a sweep
    over it is refused; kl_streak and dpace (position weights), kl_weight < 1 and DFlash2 (its selector) read it."""
    overrides = ["loss=kl", "loss.kl_weight=1.0", "loss.labels=target"]
    [line] = unused_overrides(compose_config(overrides), overrides)
    assert line.startswith("loss.labels=target has no effect: loss=kl with loss.kl_weight=1 has no CE term")
    for reads in (["loss=kl", "loss.kl_weight=0.5"], ["loss=kl_streak", "loss.kl_weight=1.0"], ["loss=dpace"],
                  ["loss=kl", "loss.kl_weight=1.0", "drafter=dflash2"]):  # fmt: skip
        overrides = [*reads, "loss.labels=target"]
        assert unused_overrides(compose_config(overrides), overrides) == [], reads
    refusals, _ = _problems(["loss=kl", "loss.kl_weight=1.0", "loss.labels=data,target"])
    assert refusals and refusals[0].startswith("loss.labels is swept (data,target) but no job reads it: loss=kl")
    refusals, [warning] = _problems(["loss=kl", "loss.kl_weight=0.5,1.0", "loss.labels=data,target"])
    assert refusals == [] and "the jobs with loss.kl_weight=1.0 do not read it" in warning
    assert _problems(["loss=kl", "loss.kl_weight=interval(0.0,1.0)", "loss.labels=data,target"]) == ([], [])


def test_a_swept_group_choice_with_no_reader_is_refused():
    refusals, _ = _problems(["schedule=cosine,constant", "schedule.decay_ratio=0.1,0.3"])
    assert refusals == [
        "schedule.decay_ratio is swept (0.1,0.3) but no job reads it: schedule=cosine does not read it "
        "(only schedule=wsd)"
    ]


def test_wandb_flags_that_no_sink_reads_say_so_and_a_sweep_refuses_them(monkeypatch):
    """experiment=smoke chooses logging=jsonl: --wandb-project and --wandb-run-name would name no W&B run."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # logging=wandb's mode follows it; CI sets it to disabled
    argv = translate_wandb_flags(["launch.py", "experiment=smoke", "--wandb-project", "P", "--wandb-run-name", "N"])
    lines = unused_overrides(compose_config(argv[1:]), argv[1:])
    assert lines == [
        f"logging.wandb.{key}={value} ({flag}) has no effect: logging.wandb.mode=disabled does not read it (only "
        "logging.wandb.mode=online or logging.wandb.mode=offline: logging=wandb turns W&B on)"
        for key, value, flag in (("project", "P", "--wandb-project"), ("name", "N", "--wandb-run-name"))
    ]
    on = translate_wandb_flags(["launch.py", "experiment=smoke", "logging=wandb", "--wandb-project", "P"])[1:]
    assert unused_overrides(compose_config(on), on) == []
    off = translate_wandb_flags(["launch.py", "--no-wandb", "logging.wandb.tags=[a]"])[1:]
    assert [line.split(" ", 1)[0] for line in unused_overrides(compose_config(off), off)] == ["logging.wandb.tags=[a]"]

    refusals, _ = _problems(["experiment=smoke", "logging.wandb.project=P", "train.seed=0,1"])
    assert refusals == [
        "logging.wandb.project=P (--wandb-project) is set but no job reads it: logging.wandb.mode=disabled does not "
        "read it (only logging.wandb.mode=online or logging.wandb.mode=offline: logging=wandb turns W&B on)"
    ]
    refusals, [warning] = _problems(["experiment=smoke", "logging=jsonl,wandb", "logging.wandb.name=N"])
    assert refusals == [] and warning.startswith("logging.wandb.name=N (--wandb-run-name) is set but the jobs with")
    assert _problems(["logging.wandb.project=P", "train.seed=0,1"]) == ([], [])  # the default logs to W&B


def test_a_family_key_another_of_its_keys_turns_off_says_so():
    overrides = ["drafter=dspark", "drafter.markov_rank=0", "drafter.confidence_head_with_markov=false"]
    lines = unused_overrides(
        compose_config([*overrides, "drafter.markov_head_type=gated"]), ["drafter.markov_head_type=gated"]
    )
    assert lines == [
        "drafter.markov_head_type=gated has no effect: drafter.markov_rank=0 turns it off (drafter=dspark; set "
        "drafter.markov_rank > 0)"
    ]
    lines = unused_overrides(compose_config(["drafter.markov_head_type=rnn"]), ["drafter.markov_head_type=rnn"])
    assert lines == [
        "drafter.markov_head_type=rnn has no effect: drafter=dflash does not read it (only drafter=dspark with "
        "drafter.markov_rank > 0)"
    ]
    off = ["drafter=dspark", "drafter.confidence_head=false", "drafter.confidence_head_with_markov=false"]
    assert unused_overrides(compose_config(off), off[2:]) == [
        "drafter.confidence_head_with_markov=false has no effect: drafter.confidence_head=false turns it off "
        "(drafter=dspark; set drafter.confidence_head=true)"
    ]
    refusals, _ = _problems([*overrides, "drafter.markov_head_type=gated,rnn"])
    assert refusals == [
        "drafter.markov_head_type is swept (gated,rnn) but no job reads it: drafter.markov_rank=0 turns it off "
        "(drafter=dspark; set drafter.markov_rank > 0)"
    ]
    assert _problems(["drafter=dspark", "drafter.markov_rank=0,8", "drafter.markov_head_type=gated,rnn"])[0] == []


@pytest.mark.slow
def test_launch_refuses_the_headline_sweep_before_any_job_and_a_run_warns(tmp_path, cache_dir):
    sweep = tmp_path / "sweep"
    proc = launch(["-m", "loss.kl_temperature=1,2,4", "loss.streak_alpha=0,0.5", f"hydra.sweep.dir={sweep}"], cache_dir)
    assert proc.returncode != 0
    assert "error: loss.kl_temperature is swept (1,2,4) but no job reads it" in proc.stderr
    assert not sweep.exists() or not [p for p in sweep.iterdir() if p.is_dir()]  # no job started


def test_a_run_warns_once_about_each_override_it_does_not_read(tmp_path, monkeypatch, caplog):
    """lifecycle.main says it before anything else of the run (here the run then fails on a missing target)."""
    from dflash.runner.job_info import JobInfo
    from dflash.runner.lifecycle import main

    overrides = ["loss.streak_alpha=0.5", f"model.target={tmp_path / 'none'}", "model.build.kind=none"]
    cfg = compose_config(["experiment=smoke", "logging=jsonl", *overrides])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["launch.py"])
    with caplog.at_level(logging.WARNING, logger="dflash.core.override_effects"), pytest.raises(Exception):  # noqa: B017
        main(cfg, JobInfo(run_dir=tmp_path / "run", overrides=overrides))
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash.core.override_effects"]
    assert lines == [
        "loss.streak_alpha=0.5 has no effect: loss=dpace does not read it (only loss=kl_streak)",
    ]


def test_a_run_given_wandb_flags_under_logging_jsonl_warns_naming_the_flags(tmp_path, monkeypatch, caplog):
    """The issue's command, `launch.py experiment=smoke --wandb-project P --wandb-run-name N`, as lifecycle.main
    receives it: a warning per flag before anything else (here the run then fails on a missing target)."""
    from dflash.runner.job_info import JobInfo
    from dflash.runner.lifecycle import main

    missing = [f"model.target={tmp_path / 'none'}", "model.build.kind=none"]
    argv = translate_wandb_flags(["launch.py", "experiment=smoke", "--wandb-project", "P", "--wandb-run-name", "N"])
    overrides = [*argv[1:], *missing]
    cfg = compose_config(overrides)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["launch.py"])
    with caplog.at_level(logging.WARNING, logger="dflash.core.override_effects"), pytest.raises(Exception):  # noqa: B017
        main(cfg, JobInfo(run_dir=tmp_path / "run", overrides=overrides))
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash.core.override_effects"]
    assert [line.split(" has no effect")[0] for line in lines] == [
        "logging.wandb.project=P (--wandb-project)",
        "logging.wandb.name=N (--wandb-run-name)",
    ]
