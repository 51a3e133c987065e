"""A feature store shorter than the run: a longer build extends it (its short last shard redone, the manifest's
num_batches raised), a run is refused before training when the store holds fewer batches than its steps, and a run
whose source runs out anyway ends failed with a final checkpoint, never `completed` short of its steps."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_config, launch
from test_distributed import status, train_records
from test_feature_store import SETTINGS, build, shard_hashes
from test_store_writer import MANIFEST, batch

from dflash.core.distributed import World
from dflash.train.feature_store import StoreReader, StoreWriter, stored_batches

PER_SHARD = 3


def write(writer: StoreWriter, batches: int) -> None:
    """What a build of `batches` batches writes: the shards it still lacks, each whole."""
    for k in writer.todo(batches):
        for i in range(k * PER_SHARD, min((k + 1) * PER_SHARD, batches)):
            writer.add(*batch(i))
        writer.commit(k)
    writer.close(batches)


def test_a_longer_build_extends_the_store_redoing_its_short_last_shard(tmp_path):
    write(StoreWriter(tmp_path, {**MANIFEST, "num_batches": 4}, PER_SHARD), 4)  # shards: 0-2, 3
    assert stored_batches(tmp_path) == 4
    longer = StoreWriter(tmp_path, {**MANIFEST, "num_batches": 8}, PER_SHARD)
    assert json.loads((tmp_path / "manifest.json").read_text())["num_batches"] == 8
    assert longer.todo(8) == [1, 2]  # shard 1 held batch 3 alone; it now holds 3-5
    write(longer, 8)
    assert stored_batches(tmp_path) == 8
    items = list(StoreReader(tmp_path, (0, 0), torch.device("cpu")))
    assert [it.index for it in items] == list(range(8))
    assert all(torch.equal(it.target_hidden, batch(it.index)[1]) for it in items)
    # a shorter build afterwards finds it complete and leaves the manifest's count alone
    assert StoreWriter(tmp_path, {**MANIFEST, "num_batches": 2}, PER_SHARD).todo(2) == []
    assert json.loads((tmp_path / "manifest.json").read_text())["num_batches"] == 8


def test_stored_batches_stop_at_a_gap_or_a_short_shard(tmp_path):
    """A complete index may list shards past a gap (a longer build stopped part-way, then a shorter one closed
    it): only the batches in order from the first count."""
    writer = StoreWriter(tmp_path, MANIFEST, PER_SHARD)
    for k in (0, 2):
        for i in range(k * PER_SHARD, (k + 1) * PER_SHARD):
            writer.add(*batch(i))
        writer.commit(k)
    writer.close(PER_SHARD)
    assert stored_batches(tmp_path) == PER_SHARD
    index = json.loads((tmp_path / "index.json").read_text())
    index["complete"] = False
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert stored_batches(tmp_path) == 0


class _Trainer:
    """Counts steps of a run of `total` steps as DrafterTrainer does (train_on False once done)."""

    def __init__(self, total: int):
        self.step, self.total_steps, self.next_data, self.stopped_on_request = 0, total, (0, 0), False

    def done(self) -> bool:
        return self.step >= self.total_steps

    def train_on(self, item) -> bool:
        self.step += 1
        return not self.done()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_whose_store_runs_out_fails_after_its_final_checkpoint(tmp_path, mode):
    from dflash.runner.run import DataRanOut, run_pipeline

    write(StoreWriter(tmp_path, MANIFEST, PER_SHARD), 5)
    cfg = compose_config(["experiment=smoke", f"pipeline={mode}"])
    saved = []
    job = SimpleNamespace(
        world=World(), store=tmp_path, device=torch.device("cpu"), trainer=_Trainer(8), replicas=[],
        checkpoints=SimpleNamespace(save_final=lambda trainer: saved.append(trainer.step)),
    )  # fmt: skip
    with pytest.raises(DataRanOut, match=rf"training ended at step 5 of 8: the feature store {tmp_path} ran out"):
        run_pipeline(cfg, job, threading.Event(), lambda sample: None)
    assert saved == [5]  # resume=RUN_DIR continues from here once the store holds more
    job.trainer = _Trainer(5)
    assert run_pipeline(cfg, job, threading.Event(), lambda sample: None) == "completed"


@pytest.mark.slow
def test_a_short_store_is_refused_before_training_and_build_missing_extends_it(tmp_path, cache_dir, tiny_target):
    """A 4-batch store, a run of 8 steps: refused naming both counts and the fix; with features.build_missing=true
    the store is extended to 8 batches (the same shards as a store built for 8 at once) and the run completes."""
    store, fresh = tmp_path / "store", tmp_path / "fresh"
    short = [*SETTINGS[:-1], "features.shard_batches=3"]
    build([*short, "train.max_steps=4", f"features.path={store}"], cache_dir)
    run_dir = tmp_path / "refused"
    args = [*short, "train.max_steps=8", "features=store", f"features.path={store}"]
    proc = launch([*args, f"hydra.run.dir={run_dir}"], cache_dir)
    assert proc.returncode != 0
    error = status(run_dir)["error"]
    assert status(run_dir)["status"] == "failed" and "holds 4 batches; the run takes 8 steps" in error, error
    assert "python -m dflash.features build" in error and "features.build_missing=true" in error
    assert not (run_dir / "metrics.jsonl").exists() or not train_records(run_dir)  # refused before training

    run_dir = tmp_path / "extended"
    launch([*args, "features.build_missing=true", f"hydra.run.dir={run_dir}"], cache_dir, check=True)
    assert status(run_dir)["status"] == "completed" and train_records(run_dir)[-1]["step"] == 8
    assert json.loads((store / "manifest.json").read_text())["num_batches"] == 8
    build([*short, "train.max_steps=8", f"features.path={fresh}"], cache_dir)
    assert shard_hashes(store) == shard_hashes(fresh)
