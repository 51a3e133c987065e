"""The original pipeline's W&B flags (--wandb-project, --wandb-run-name, --no-wandb) as aliases of Hydra keys:
the translation into overrides, and launch.py run with them as a user runs it (alone, -m, torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import compose_config, launch
from wandb_offline import read_offline_run

from dflash.core.cli_flags import FlagError, translate_wandb_flags

PROG = "launch.py"
SMALL = ["experiment=smoke", "train.max_steps=2", "eval.num_prompts=0", "checkpoint.every_steps=0"]


def translate(*args: str) -> list[str]:
    return translate_wandb_flags([PROG, *args])[1:]


# ------------------------------------------------------------------------------------------- translation


@pytest.mark.parametrize(
    "args, override",
    [
        (["--wandb-project", "foo"], "logging.wandb.project=foo"),
        (["--wandb-project=foo"], "logging.wandb.project=foo"),
        (["--wandb-run-name", "bar"], "logging.wandb.name=bar"),
        (["--wandb-run-name=bar"], "logging.wandb.name=bar"),
        (["--no-wandb"], "logging.wandb.mode=disabled"),
    ],
)
def test_each_flag_alone_in_both_forms(args, override):
    assert translate(*args) == [override]


def test_the_three_flags_together_become_overrides_before_the_others():
    args = ["--no-wandb", "--wandb-project", "foo", "--wandb-run-name=bar", "experiment=smoke"]
    assert translate(*args) == [
        "logging.wandb.mode=disabled",
        "logging.wandb.project=foo",
        "logging.wandb.name=bar",
        "experiment=smoke",
    ]


def test_no_flags_leave_argv_as_it_was():
    argv = [PROG, "-m", "train.seed=0,1", "--cfg", "job"]
    assert translate_wandb_flags(argv) == argv


@pytest.mark.parametrize(
    "args, expected",
    [
        # Hydra's parser takes one run of overrides: a flag before -m must not leave one on each side of it
        (["--no-wandb", "-m", "train.seed=0,1"], ["-m", "logging.wandb.mode=disabled", "train.seed=0,1"]),
        (["-m", "a=1", "--wandb-project", "p", "b=2"], ["-m", "logging.wandb.project=p", "a=1", "b=2"]),
        (["--no-wandb", "--cfg", "job"], ["logging.wandb.mode=disabled", "--cfg", "job"]),
    ],
)
def test_overrides_stay_in_one_run_for_hydras_parser(args, expected):
    assert translate(*args) == expected


def test_the_keys_take_effect_in_the_composed_config(monkeypatch):
    """W&B on by default (logging=wandb, WANDB_MODE=offline); the flags win, as their keys would."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_config(translate("--no-wandb", "--wandb-project", "foo", "--wandb-run-name", "bar"))
    assert (cfg.logging.wandb.mode, cfg.logging.wandb.project, cfg.logging.wandb.name) == ("disabled", "foo", "bar")


@pytest.mark.parametrize("name", ["a,b", "123", "true", "lr=1e-4, bs=8", "it's \\", " spaced "])
def test_a_name_is_taken_literally(name):
    """As argparse took it: `a,b` is one name (not a sweep), `123` a string; Hydra reads back exactly NAME."""
    overrides = translate("--wandb-run-name", name, "--wandb-project", name)
    cfg = compose_config(overrides)
    assert cfg.logging.wandb.name == name and cfg.logging.wandb.project == name


@pytest.mark.parametrize(
    "args, named",
    [
        (["--wandb-project", "a", "logging.wandb.project=b"], ["--wandb-project a", "logging.wandb.project=b"]),
        (["+logging.wandb.name=x", "--wandb-run-name=y"], ["--wandb-run-name y", "+logging.wandb.name=x"]),
        (["-m", "--wandb-run-name", "a", "logging.wandb.name=a,b"], ["--wandb-run-name a", "logging.wandb.name=a,b"]),
        (["--wandb-run-name", "a", "~logging.wandb.name"], ["--wandb-run-name a", "~logging.wandb.name"]),
        (["--no-wandb", "logging=wandb"], ["--no-wandb", "logging=wandb"]),
        (["--no-wandb", "logging.wandb.mode=offline"], ["--no-wandb", "logging.wandb.mode=offline"]),
        (["--wandb-project", "a", "--wandb-project=b"], ["--wandb-project a", "--wandb-project b"]),
    ],
)
def test_a_flag_and_a_contradicting_override_are_refused_naming_both(args, named):
    with pytest.raises(FlagError) as e:
        translate(*args)
    assert all(n in str(e.value) for n in named), str(e.value)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--wandb-project", "a", "logging.wandb.project=a"], ["logging.wandb.project=a"]),
        (["--no-wandb", "logging=jsonl"], ["logging=jsonl"]),
        (["--no-wandb", "logging.wandb.mode=disabled"], ["logging.wandb.mode=disabled"]),
        (
            ["--no-wandb", "--no-wandb", "--wandb-project", "a", "--wandb-project", "a"],
            ["logging.wandb.mode=disabled", "logging.wandb.project=a"],
        ),
    ],
)
def test_a_flag_that_agrees_with_an_override_adds_nothing(args, expected):
    assert translate(*args) == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (["--wandb-project"], "--wandb-project needs a value"),
        (["--wandb-run-name", "-m", "a=1,2"], "--wandb-run-name needs a value"),
        (["--wandb-run-name="], "--wandb-run-name needs a non-empty value"),
        (["--no-wandb=true"], "--no-wandb takes no value"),
    ],
)
def test_a_flag_without_its_value_is_refused(args, message):
    with pytest.raises(FlagError, match=message):
        translate(*args)


# ------------------------------------------------------------------------------------------- launch.py


def _overrides_yaml(run_dir: Path) -> list[str]:
    return yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())


def _resolved(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config_resolved.yaml").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, named",
    [
        (["--wandb-project", "a", "logging.wandb.project=b"], ["--wandb-project a", "logging.wandb.project=b"]),
        (["-m", "--no-wandb", "logging=wandb", "train.seed=0,1"], ["--no-wandb", "logging=wandb"]),
    ],
)
def test_launch_refuses_a_contradiction_with_one_line_before_any_run_dir(tmp_path, cache_dir, args, named):
    out = tmp_path / "out"
    proc = launch([*args, f"hydra.run.dir={out}", f"hydra.sweep.dir={out}"], cache_dir)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(n in lines[0] for n in named), lines[0]
    assert not out.exists()


@pytest.mark.slow
def test_launch_with_the_three_flags_records_the_keys(tmp_path, cache_dir, tiny_target):
    """The issue's command: the keys the flags stand for are in the resolved config, overrides.yaml and run.json."""
    run_dir = tmp_path / "run"
    flags = ["--no-wandb", "--wandb-project", "foo", "--wandb-run-name", "bar"]
    launch([*flags, *SMALL, f"hydra.run.dir={run_dir}"], cache_dir, check=True, env={"WANDB_MODE": "offline"})
    wandb = _resolved(run_dir)["logging"]["wandb"]
    assert (wandb["mode"], wandb["project"], wandb["name"]) == ("disabled", "foo", "bar")
    keys = ["logging.wandb.mode=disabled", "logging.wandb.project=foo", "logging.wandb.name=bar"]
    assert _overrides_yaml(run_dir)[:3] == keys
    run_info = json.loads((run_dir / "run.json").read_text())
    assert run_info["overrides"][:3] == keys and not any(a.startswith("--") for a in run_info["argv"])
    assert not (run_dir / "wandb").exists()


@pytest.mark.slow
def test_multirun_jobs_take_the_flags_name_and_project(tmp_path, cache_dir, tiny_target):
    """Each job's W&B run is named by --wandb-run-name, as logging.wandb.name names every job of a sweep (the
    sweep is the W&B group); the flags come before -m, as a user of the original pipeline types them."""
    sweep = tmp_path / "sweep"
    args = ["--wandb-project=foo", "--wandb-run-name", "bar", "-m", *SMALL, "logging=wandb", "train.seed=0,1"]
    launch([*args, f"hydra.sweep.dir={sweep}"], cache_dir, check=True, env={"WANDB_MODE": "offline"})
    recs = [read_offline_run(sweep / str(job)) for job in (0, 1)]
    assert [(r["name"], r["project"]) for r in recs] == [("bar", "foo"), ("bar", "foo")]
    assert recs[0]["run_id"] != recs[1]["run_id"] and recs[0]["group"] == recs[1]["group"]
    for job in (0, 1):
        assert {"logging.wandb.project=foo", "logging.wandb.name=bar"} <= set(_overrides_yaml(sweep / str(job)))
        assert _resolved(sweep / str(job))["logging"]["wandb"]["name"] == "bar"


@pytest.mark.slow
def test_torchrun_ranks_translate_the_flags_alike(tmp_path, cache_dir, tiny_target):
    """2 gloo ranks: every rank gets the same overrides (a rank that did not would fail in Hydra's parser), one
    offline W&B run with the flags' project and name."""
    from test_distributed import torchrun

    run_dir = tmp_path / "run"
    args = ["--wandb-project", "foo", "--wandb-run-name=bar", *SMALL, "parallel=ddp", "pipeline=sync"]
    args += ["train.batch_size=4", "logging=wandb", f"hydra.run.dir={run_dir}"]
    torchrun(args, cache_dir, check=True, env={"WANDB_MODE": "offline"})
    rec = read_offline_run(run_dir)
    assert (rec["name"], rec["project"]) == ("bar", "foo")
    assert _overrides_yaml(run_dir)[:2] == ["logging.wandb.project=foo", "logging.wandb.name=bar"]
    assert json.loads((run_dir / "run.json").read_text())["world"]["size"] == 2
