"""A run records what ran, not only what was asked (issue 57): the precision after bf16-mixed's fallback (run.json,
summary.json, the model card, compare's config), the supervised tokens beside all tokens, and the loss and precision
keys a resume changes (one line, run.json's resume entry, the card)."""

from __future__ import annotations

import json
import logging

from conftest import compose_config

from dflash.core.rundir import load_run, precision_ran
from dflash.model.model_card import model_card
from dflash.train.precision import precision_record, resolve_precision


def _main(run_dir, cache_dir, monkeypatch, overrides):
    from dflash.runner.job_info import JobInfo
    from dflash.runner.lifecycle import main

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    main(compose_config(overrides), JobInfo(run_dir=run_dir, overrides=overrides))


def test_the_precision_record_names_requested_ran_and_why():
    import torch

    cpu = torch.device("cpu")
    assert precision_record("fp32", cpu, {"avx512_bf16"}) == {"requested": "fp32", "ran": "fp32", "fallback": None}
    assert precision_record("bf16-mixed", cpu, {"avx512_bf16", "avx512f"})["ran"] == "bf16-mixed"
    slow = precision_record("bf16-mixed", cpu, {"avx2"})
    assert slow["ran"] == "fp32" and "no fast bfloat16" in slow["fallback"]
    assert resolve_precision("bf16-mixed", cpu, {"avx2"})[0] is None


def test_precision_ran_reads_the_start_and_each_resume():
    rec = {"requested": "bf16-mixed", "ran": "fp32", "fallback": "slow"}
    assert precision_ran({}) is None
    assert precision_ran({"precision": rec}) == "fp32 (bf16-mixed requested)"
    same = {"requested": "fp32", "ran": "fp32"}
    assert precision_ran({"precision": same, "resumes": [{"precision": same}]}) == "fp32"
    info = {"precision": same, "resumes": [{"precision": {"requested": "bf16-mixed", "ran": "bf16-mixed"}}]}
    assert precision_ran(info) == "fp32 then bf16-mixed"


def test_a_fallback_is_recorded_and_a_resume_that_changes_the_loss_says_so(
    tmp_path, cache_dir, tiny_target, monkeypatch, caplog
):
    """`train.precision=bf16-mixed` where bfloat16 is slow: run.json, summary.json, compare's config and the model
    card say fp32 ran and why; a resume with other `loss.labels` and `train.precision` says so in one line and
    records it (run.json's resume entry, the card)."""
    import dflash.train.precision as precision

    monkeypatch.setattr(precision, "slow_cpu_dtype", lambda dtype, flags=None: True)  # any CPU: the fallback
    run_dir = tmp_path / "run"
    common = ["experiment=smoke", "eval.num_prompts=0", "train.max_steps=3", "checkpoint.every_steps=3"]
    _main(run_dir, cache_dir, monkeypatch, [*common, "train.precision=bf16-mixed"])
    info = json.loads((run_dir / "run.json").read_text())
    assert info["precision"]["requested"] == "bf16-mixed" and info["precision"]["ran"] == "fp32"
    assert "no fast bfloat16" in info["precision"]["fallback"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["precision"] == "fp32" and summary["precision_requested"] == "bf16-mixed"
    assert 0 < summary["train/supervised_tokens"] <= summary["tokens"]
    assert load_run(run_dir).get("train.precision") == "fp32 (bf16-mixed requested)"  # compare groups by it
    card = model_card(run_dir)
    assert "`train.precision=fp32 (bf16-mixed requested)` (fell back: this CPU" in card
    assert "`loss.labels=data`" in card

    monkeypatch.setattr(precision, "slow_cpu_dtype", lambda dtype, flags=None: False)
    resume = [f"resume={run_dir}", "train.max_steps=5", "loss.labels=target", "train.precision=bf16-mixed"]
    with caplog.at_level(logging.WARNING, logger="dflash.runner.lifecycle"):
        _main(run_dir, cache_dir, monkeypatch, [*common[:1], *resume])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: loss")]
    assert len(said) == 1 and "loss.labels data -> target" in said[0], said
    info = json.loads((run_dir / "run.json").read_text())
    last = info["resumes"][-1]
    assert last["changed"] == {"loss.labels": {"from": "data", "to": "target"}} and last["from_step"] == 3
    assert last["precision"]["ran"] == "bf16-mixed"
    assert load_run(run_dir).get("train.precision") == "fp32 (bf16-mixed requested) then bf16-mixed"
    card = model_card(run_dir)
    assert "resumed at step 3 with `loss.labels` data -> target" in card, card
