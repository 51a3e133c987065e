"""model.init_from: a run starts from an exported drafter, a checkpoint or a run directory; a drafter that does not fit
is refused naming each mismatch; the imported drafter evaluates exactly as in the run that exported it; run.json
records the source; a resume continues from the run's own checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import launch
from safetensors.torch import load_file
from test_drafter import make_drafter

from dflash.core.config import ConfigError
from dflash.core.hashing import weights_sha256
from dflash.model.export import export_drafter
from dflash.train.checkpoint import DCP_FORMAT, commit, save_checkpoint
from dflash.train.init_from import find_init_source, load_init_weights


def _run_config(**changes):
    """The drafter config a run would build: make_drafter's (2 layers unless changed)."""
    config = make_drafter(layers=changes.pop("layers", 2)).config
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids", "block_size"):
            config.dflash_config = {**config.dflash_config, key: value}
            if key == "block_size":
                config.block_size = value
        else:
            setattr(config, key, value)
    return config


def test_an_export_loads_bitwise_and_is_recorded(tmp_path):
    source = make_drafter(layers=2, seed=1)
    out = export_drafter(source, tmp_path / "drafter")
    found = find_init_source(str(out), _run_config())
    assert found.kind == "drafter"
    drafter = make_drafter(layers=2, seed=2)
    record = load_init_weights(drafter, found)
    for k, v in source.state_dict().items():
        assert torch.equal(v, drafter.state_dict()[k]), k
    assert record["file_sha256"] == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert record["weights_sha256"] == weights_sha256(load_file(str(out / "model.safetensors")))
    assert record["path"] == str(out) and record["kind"] == "drafter"


@pytest.mark.parametrize(
    "change,named",
    [
        ({"layers": 3}, "num_hidden_layers 2 there, 3 here (model.num_draft_layers)"),
        ({"hidden_size": 128}, "hidden_size 64 there, 128 here (the target's hidden size)"),
        ({"vocab_size": 1024}, "vocab_size 512 there, 1024 here (the target's vocabulary)"),
        ({"intermediate_size": 256}, "intermediate_size 128 there, 256 here (model.draft_intermediate_size)"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 1 there, 2 here (model.draft_num_key_value_heads)"),
        ({"block_size": 8}, "block_size 4 there, 8 here (model.block_size)"),
        ({"mask_token_id": 7}, "mask_token_id 1 there, 7 here (model.mask_token_id)"),
        ({"target_layer_ids": [1, 3]}, "target_layer_ids [1, 2] there, [1, 3] here (model.target_layer_ids)"),
    ],
)
def test_a_drafter_that_does_not_fit_is_refused_naming_the_mismatch(tmp_path, change, named):
    out = export_drafter(make_drafter(layers=2), tmp_path / "drafter")
    with pytest.raises(ConfigError, match="does not fit this run") as e:
        find_init_source(str(out), _run_config(**change))
    assert named in str(e.value) and "\n" not in str(e.value)


def test_several_mismatches_are_named_in_one_line(tmp_path):
    out = export_drafter(make_drafter(layers=2), tmp_path / "drafter")
    with pytest.raises(ConfigError) as e:
        find_init_source(str(out), _run_config(layers=1, mask_token_id=9))
    assert "num_hidden_layers 2 there, 1 here" in str(e.value) and "mask_token_id 1 there, 9 here" in str(e.value)


def test_paths_that_hold_no_drafter_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        find_init_source(str(tmp_path / "missing"), _run_config())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a drafter directory"):
        find_init_source(str(tmp_path / "empty"), _run_config())
    run = tmp_path / "run"
    run.mkdir()
    (run / "config_resolved.yaml").write_text("model: {}\n")
    with pytest.raises(ConfigError, match="without a complete checkpoint or drafter/"):
        find_init_source(str(run), _run_config())


def test_a_run_directory_gives_its_newest_checkpoint_else_its_export(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config_resolved.yaml").write_text("model: {}\n")
    exported, trained = make_drafter(layers=2, seed=1), make_drafter(layers=2, seed=3)
    export_drafter(exported, run / "drafter")
    assert find_init_source(str(run), _run_config()).path == run / "drafter"
    save_checkpoint(run, trained, {"step": 5, "tokens": 10}, {}, keep_last=2)
    found = find_init_source(str(run), _run_config())
    assert (found.kind, found.path.name) == ("checkpoint", "step_5")
    drafter = make_drafter(layers=2, seed=2)
    load_init_weights(drafter, found)
    assert torch.equal(drafter.fc.weight, trained.fc.weight)


def test_a_sharded_checkpoint_loads_in_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp

    trained = make_drafter(layers=2, seed=3)
    tmp, final = tmp_path / "checkpoints" / "step_4.tmp", tmp_path / "checkpoints" / "step_4"
    tmp.mkdir(parents=True)
    dcp.save({"model": trained.state_dict()}, checkpoint_id=str(tmp), no_dist=True)
    meta = {"step": 4, "format": DCP_FORMAT, "drafter_config": trained.config.to_dict(), "complete": True}
    commit(tmp, final, meta, keep_last=1)
    found = find_init_source(str(final), _run_config())
    assert found.kind == "sharded"
    drafter = make_drafter(layers=2, seed=2)
    load_init_weights(drafter, found)
    for k, v in trained.state_dict().items():
        assert torch.equal(v, drafter.state_dict()[k]), k


def _eval(run_dir: Path) -> dict:
    return json.loads((run_dir / "eval.json").read_text())


TIMED = ("eval/tok_s", "eval/tok_s_target_only", "eval/speedup", "eval/time_s")
# 40 steps at a high lr on the tiny random target: the drafter's teacher-forced estimate is above a fresh one's (1.0)
# AdamW: at 40 steps on the tiny random target it has learnt (sim_tau > 1); Muon, the default, has not yet
EXPORTER = ["experiment=smoke", "train.max_steps=40", "schedule.lr=3e-3", "checkpoint.every_steps=0", "optim=adamw"]


@pytest.mark.slow
def test_the_imported_drafter_evaluates_as_in_the_run_that_exported_it(tmp_path, cache_dir, tiny_target):
    exporter = tmp_path / "exporter"
    launch([*EXPORTER, "eval.baselines=false", f"hydra.run.dir={exporter}"], cache_dir, check=True)
    want = _eval(exporter)
    assert want["metrics"]["eval/sim_tau"] > 1.0  # what a fresh drafter would not score: the weights matter
    for source in (exporter / "drafter", exporter):  # the export, and the run directory (its final checkpoint)
        importer = tmp_path / f"importer_{source.name}"
        launch(
            [
                "experiment=smoke",
                "train.max_steps=0",  # no training: the final eval at step 0 is the imported drafter's
                f"model.init_from={source}",
                "eval.baselines=false",
                f"hydra.run.dir={importer}",
            ],
            cache_dir,
            check=True,
        )
        got = _eval(importer)
        assert got["step"] == 0 and got["prompts"] == want["prompts"]
        assert {k: v for k, v in got["metrics"].items() if k not in TIMED} == {
            k: v for k, v in want["metrics"].items() if k not in TIMED
        }
        accepted = [[p["accept_lengths"] for p in r["details"]["prompts"]] for r in (got, want)]
        assert accepted[0] == accepted[1]
        recorded = json.loads((importer / "run.json").read_text())["init_from"]
        assert recorded["path"] == str(source)
        assert recorded["weights_sha256"] == weights_sha256(load_file(str(exporter / "drafter" / "model.safetensors")))


@pytest.mark.slow
def test_a_resumed_init_from_run_continues_from_its_own_checkpoint(tmp_path, cache_dir, tiny_target):
    exporter = tmp_path / "exporter"
    launch(["experiment=smoke", "eval.num_prompts=0", f"hydra.run.dir={exporter}"], cache_dir, check=True)
    source = tmp_path / "released"
    shutil.copytree(exporter / "drafter", source)
    common = ["experiment=smoke", "eval.num_prompts=0", f"model.init_from={source}", "checkpoint.every_steps=2"]
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    launch([*common, f"hydra.run.dir={full}"], cache_dir, check=True)
    proc = launch([*common, "+debug=faults", "debug.crash_at_step=3", f"hydra.run.dir={crashed}"], cache_dir)
    assert proc.returncode != 0
    shutil.rmtree(source)  # the resume needs its own checkpoint only
    launch([f"resume={crashed}", "debug.crash_at_step=null"], cache_dir, check=True)
    a, b = (load_file(str(d / "drafter" / "model.safetensors")) for d in (full, crashed))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    info = json.loads((crashed / "run.json").read_text())
    assert info["init_from"]["path"] == str(source) and "init_from" not in info["resumes"][-1]
