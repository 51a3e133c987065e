"""Run-directory files: secrets never reach them, every exit path ends status.json, files are readable."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys

from conftest import compose_config
from hydra.core.utils import _save_config
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from dflash.core.jsonio import _UMASK, write_json
from dflash.core.rundir import StatusFile
from dflash.core.secrets import REDACTED, CommandLineSecrets, redact, scrub_arguments, scrub_text, secret_arguments


def test_secret_keys_are_redacted_with_or_without_hydra_prefixes():
    overrides = [
        "hf_token=abc",
        "+hf_token=abc",
        "++wandb_api_key=abc",
        "data.hf_token=abc",
        "logging.wandb.api_key=abc",
        "+db_password=abc",
    ]
    assert redact(overrides) == [o.split("=")[0] + "=" + REDACTED for o in overrides]
    keep = ["eval.max_new_tokens=8", "model.mask_token_id=5", "model.mask_token=<|MASK|>", "loss.kl_weight=0.5"]
    assert redact(keep) == keep  # config about tokens is not a secret
    assert redact({"hf_token": "abc", "max_new_tokens": 8, "nested": {"api_key": "k"}}) == {
        "hf_token": REDACTED,
        "max_new_tokens": 8,
        "nested": {"api_key": REDACTED},
    }


def test_values_of_secret_environment_variables_are_scrubbed(monkeypatch):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GH_TOKEN", "WANDB_API_KEY"):
        monkeypatch.setenv(name, f"value-of-{name.lower()}-1234")
    text = " ".join(
        f"value-of-{n.lower()}-1234" for n in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GH_TOKEN", "WANDB_API_KEY")
    )
    assert scrub_text(text) == " ".join([REDACTED] * 4)


CLI_SECRET = "sk-cli-secret-0123456789"
SECRET_ARG = f"+logging.wandb.settings.api_key={CLI_SECRET}"


def test_command_line_secrets_leave_no_trace_in_any_string():
    args = ["experiment=smoke", SECRET_ARG, "+x.hf_token='quoted secret 42'", "+y.api_key=${oc.env:MY_KEY}"]
    assert secret_arguments(args) == {SECRET_ARG: CLI_SECRET, args[2]: "'quoted secret 42'"}  # not ${oc.env:..}
    dirname = f"experiment=smoke,{SECRET_ARG},train.seed=1"  # Hydra's hydra.job.override_dirname
    data = {
        "override_dirname": dirname,
        "note": f"run {CLI_SECRET}",
        "task": args,
        "x": {"hf_token": "quoted secret 42"},
    }
    assert scrub_arguments(data, args) == {
        "override_dirname": f"experiment=smoke,+logging.wandb.settings.api_key={REDACTED},train.seed=1",
        "note": f"run {REDACTED}",
        "task": [*args[:1], redact(SECRET_ARG), f"+x.hf_token={REDACTED}", f"+y.api_key={REDACTED}"],  # as redact()
        "x": {"hf_token": REDACTED},
    }


def _hydra_job(tmp_path, overrides, multirun=False):
    """The config of a job as Hydra's run_job hands it to on_job_start, and the files it wrote just before."""
    cfg = compose_config([*overrides, f"hydra.run.dir={tmp_path / 'run'}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "run")
        if multirun:
            cfg.hydra.mode = RunMode.MULTIRUN
            cfg.hydra.sweep.dir = str(tmp_path)
    hydra_dir = tmp_path / "run" / cfg.hydra.output_subdir
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    _save_config(task, "config.yaml", hydra_dir)
    _save_config(OmegaConf.masked_copy(cfg, ["hydra"]), "hydra.yaml", hydra_dir)
    _save_config(cfg.hydra.overrides.task, "overrides.yaml", hydra_dir)
    if multirun:
        _save_config(cfg, "multirun.yaml", tmp_path)
    return cfg, hydra_dir


def test_hydra_files_and_argv_are_redacted_at_job_start(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "experiment=smoke", SECRET_ARG, "train.seed=1"])
    cfg, hydra_dir = _hydra_job(tmp_path, ["experiment=smoke", SECRET_ARG, "train.seed=1"], multirun=True)
    assert CLI_SECRET in (hydra_dir / "hydra.yaml").read_text()  # as Hydra wrote it
    CommandLineSecrets().on_job_start(config=cfg, task_function=None)
    assert sys.argv == ["launch.py", "-m", "experiment=smoke", redact(SECRET_ARG), "train.seed=1"]
    files = [hydra_dir / n for n in ("config.yaml", "hydra.yaml", "overrides.yaml")] + [tmp_path / "multirun.yaml"]
    for f in files:
        assert CLI_SECRET not in f.read_text(), f
    hydra = OmegaConf.load(hydra_dir / "hydra.yaml").hydra
    assert hydra.job.override_dirname == f"{redact(SECRET_ARG)},experiment=smoke,train.seed=1"
    assert OmegaConf.load(hydra_dir / "config.yaml").train.seed == 1


def test_hydra_files_without_a_command_line_secret_stay_as_written(tmp_path):
    cfg, hydra_dir = _hydra_job(tmp_path, ["experiment=smoke", "+x.api_key=${oc.env:MY_KEY}"])
    before = {f: f.read_bytes() for f in hydra_dir.iterdir()}
    CommandLineSecrets().on_job_start(config=cfg, task_function=None)
    assert {f: f.read_bytes() for f in hydra_dir.iterdir()} == before


def test_a_command_line_secret_warns_once_naming_the_key_on_rank_0(tmp_path, monkeypatch, caplog):
    cfg, _ = _hydra_job(tmp_path, ["experiment=smoke", SECRET_ARG])
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.WARNING, logger="dflash.core.secrets"):
        CommandLineSecrets().on_run_start(config=cfg)
    [record] = caplog.records
    assert "logging.wandb.settings.api_key" in record.message and "${oc.env:NAME}" in record.message
    assert CLI_SECRET not in record.message
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # torchrun: rank 0 says it
    CommandLineSecrets().on_run_start(config=cfg)
    assert not caplog.records


def test_failed_status_scrubs_error_and_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETVALUE123")
    st = StatusFile(tmp_path)
    st.running()
    st.finish("failed", error="401 for token=hf_SECRETVALUE123", traceback="  ... token=hf_SECRETVALUE123\n")
    text = (tmp_path / "status.json").read_text()
    assert "hf_SECRETVALUE123" not in text and json.loads(text)["status"] == "failed"


def test_run_files_get_the_umask_mode_not_0600(tmp_path):
    write_json(tmp_path / "summary.json", {"a": 1})
    mode = stat.S_IMODE(os.stat(tmp_path / "summary.json").st_mode)
    assert mode == 0o666 & ~_UMASK and mode & stat.S_IRUSR


def test_a_multiruns_launcher_logs_each_job_without_the_secret(tmp_path, caplog):
    cfg, _ = _hydra_job(tmp_path, ["experiment=smoke", SECRET_ARG], multirun=True)
    launcher_log = logging.getLogger("hydra._internal.core_plugins.basic_launcher")
    with caplog.at_level(logging.INFO):
        CommandLineSecrets().on_multirun_start(config=cfg)
        launcher_log.info(f"\t#0 : experiment=smoke {SECRET_ARG}")
    assert caplog.records[-1].getMessage() == f"\t#0 : experiment=smoke {redact(SECRET_ARG)}"
    CommandLineSecrets().on_multirun_start(config=_hydra_job(tmp_path, ["experiment=smoke"], multirun=True)[0])
    assert not launcher_log.filters  # a multirun without a secret leaves the launcher's log alone


def test_swept_keys_are_read_beside_a_redacted_secret(tmp_path, monkeypatch):
    """A multirun job names itself by the keys the command line sweeps: still so once sys.argv is redacted."""
    from hydra.core.hydra_config import HydraConfig

    from dflash.runner.job_info import _swept_keys

    cfg, _ = _hydra_job(tmp_path, ["experiment=smoke"], multirun=True)
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "loss.kl_temperature=1,2", redact(SECRET_ARG)])
    before = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        assert _swept_keys() == {"loss.kl_temperature"}
    finally:
        HydraConfig.instance().cfg = before


URL_SECRET = "s3cret-pw-0123"
URL_ARG = f"eval.prompts_file=https://alice:{URL_SECRET}@host.example/prompts.jsonl"


def test_url_credentials_are_redacted_in_any_string_value():
    storage = f"hydra.sweeper.storage=postgresql://alice:{URL_SECRET}@db.example:5432/optuna"
    assert redact([storage, URL_ARG, "data.path=sqlite:///outputs/optuna.db"]) == [
        f"hydra.sweeper.storage=postgresql://{REDACTED}@db.example:5432/optuna",
        f"eval.prompts_file=https://{REDACTED}@host.example/prompts.jsonl",
        "data.path=sqlite:///outputs/optuna.db",  # no credentials: as it was
    ]
    assert redact({"data": {"path": f"https://user:{URL_SECRET}@host/x.jsonl"}}) == {
        "data": {"path": f"https://{REDACTED}@host/x.jsonl"}
    }
    assert scrub_text(f"could not connect to postgresql://alice:{URL_SECRET}@db/optuna") == (
        f"could not connect to postgresql://{REDACTED}@db/optuna"
    )
    assert secret_arguments([URL_ARG, "train.seed=1"]) == {URL_ARG: f"alice:{URL_SECRET}"}


def test_secret_keys_beyond_tokens_and_api_keys():
    keys = ["private_key", "ssh.private_key", "wandb_key", "hf_auth", "logging.wandb.key", "+x.token", "db_password"]
    assert redact({k: "v" for k in keys}) == {k: REDACTED for k in keys}
    assert redact([f"{k}=v" for k in keys]) == [f"{k}={REDACTED}" for k in keys]
    keep = {"model.mask_token": "<|MASK|>", "mask_token_id": 5, "sort_key": "tau", "max_new_tokens": 8}
    assert redact(keep) == keep


def test_url_credentials_on_the_command_line_leave_no_trace_in_hydras_files(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["launch.py", "experiment=smoke", URL_ARG])
    cfg, hydra_dir = _hydra_job(tmp_path, ["experiment=smoke", URL_ARG])
    assert URL_SECRET in (hydra_dir / "overrides.yaml").read_text()  # as Hydra wrote it
    CommandLineSecrets().on_job_start(config=cfg, task_function=None)
    assert URL_SECRET not in " ".join(sys.argv)
    for f in hydra_dir.iterdir():
        assert URL_SECRET not in f.read_text(), f
    assert (
        OmegaConf.load(hydra_dir / "config.yaml").eval.prompts_file == f"https://{REDACTED}@host.example/prompts.jsonl"
    )
