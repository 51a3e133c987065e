"""python -m dflash.bench peer: speculators' DFlash trained on our run's feature-store rows by its own recipe, its
checkpoint read through our converter, and both drafters evaluated by replay per suite (the tiny target, a few
steps)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import compose_config

pytest.importorskip("speculators", reason="the test-only install: pip install --no-deps speculators==0.9.0 ...")

STEPS = 3


@pytest.fixture(scope="module")
def run_from_store(tmp_path_factory, tiny_target, cache_dir):
    """One of our runs (the default recipe at smoke size) trained from a feature store built in-process."""
    from dflash.runner.feature_build import build_store
    from dflash.runner.lifecycle import JobInfo, main

    root = tmp_path_factory.mktemp("peer")
    suite = root / "suite.jsonl"
    suite.write_text('{"turns": ["def f(x):", "again"]}\n{"prompt": "import os"}\n')
    cfg = compose_config(
        ["experiment=smoke", f"model.target={tiny_target}", f"paths.cache_dir={cache_dir}", "features=store",
         f"features.path={root / 'store'}", f"train.max_steps={STEPS}", "train.seed=1", "eval.replay=true",
         f"eval.suites=[jsonl:{suite}]", "eval.max_new_tokens=8", "checkpoint.every_steps=0"]
    )  # fmt: skip
    build_store(cfg)
    main(cfg, JobInfo(root / "run"))
    return root


def test_the_peer_bench_trains_speculators_on_the_runs_rows_and_evaluates_both(run_from_store, capsys):
    from dflash.benchmarks import main
    from dflash.model.drafter import DFlashDraftModel
    from dflash.model.export import load_drafter

    out = run_from_store / "bench"
    main(["peer", str(run_from_store / "run"), f"out={out}"])
    work = out / f"{run_from_store.name}-run"
    raw = json.loads((work / "peer" / "config.json").read_text())  # its own save_pretrained
    assert raw["speculators_model_type"] == "dflash" and raw["aux_hidden_state_layer_ids"] == [2, 3]
    peer, ours = load_drafter(work / "peer"), load_drafter(run_from_store / "run" / "drafter")
    # our export also states the block's causality there (dflash_config.causal, for vLLM), speculators' its flag
    ours_fields = {k: v for k, v in ours.config.dflash_config.items() if k != "causal"}
    assert type(peer) is DFlashDraftModel and peer.config.dflash_config == ours_fields
    assert not torch.equal(peer.fc.weight, ours.fc.weight)  # its own init and steps
    steps = [json.loads(line) for line in (work / "peer_train.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)) and all(math.isfinite(s["loss"]) for s in steps)
    assert steps[0]["lr"] == 1e-3 and steps[1]["lr"] == pytest.approx(1e-3 * (STEPS - 1) / STEPS)  # no warmup at 3
    result = json.loads((out / "peer.json").read_text())
    (row,) = result["runs"]
    assert row["seed"] == 1 and row["steps"] == STEPS
    suite = f"jsonl:{run_from_store / 'suite.jsonl'}"
    for side in ("ours", "peer"):  # both evaluated, held-out prompts and the suite, by replay
        assert set(row[side]) == {"held-out", suite} and all(1.0 <= t <= 8.0 for t in row[side].values())
    summary = json.loads((run_from_store / "run" / "summary.json").read_text())
    assert row["ours"]["held-out"] == summary["eval/tau"]  # our side is the run's own eval, repeated
    table = capsys.readouterr().out
    assert "| held-out |" in table and f"| {suite} |" in table and "muon lr 0.001" in table
    trained = (work / "peer" / "model.safetensors").stat().st_mtime_ns
    main(["peer", str(run_from_store / "run"), f"out={out}"])  # a second bench reuses the trained peer
    assert (work / "peer" / "model.safetensors").stat().st_mtime_ns == trained
    assert json.loads((out / "peer.json").read_text())["runs"] == result["runs"]
