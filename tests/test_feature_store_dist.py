"""The feature store under torchrun (2 gloo ranks on CPU): a build whose ranks share the shards equals a
one-process build, a fault on rank 1 ends the build on both ranks, and a data-parallel run reads its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, launch
from safetensors.torch import load_file
from test_distributed import diff_report, max_diff, summary, torchrun, train_records, weights

pytestmark = pytest.mark.slow

# 16 global batches of 4 rows in shards of 2 batches: 8 shards, 4 for each rank
SETTINGS = ["experiment=smoke", "pipeline=sync", "train.batch_size=4", "eval.num_prompts=0", "train.max_steps=16"]
BUILD = [*SETTINGS, "features.shard_batches=2"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # torchrun's workers' default: a GEMM's bits may depend on its threads


def env(cache_dir: Path, **extra) -> dict:
    return {**os.environ, "DFLASH_CACHE_DIR": str(cache_dir), "WANDB_MODE": "disabled", **ONE_THREAD, **extra}


def build(args: list[str], cache_dir: Path, nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    runner = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    cmd = [sys.executable, *runner, "-m", "dflash.features", "build", *args]
    return subprocess.run(cmd, cwd=REPO, env=env(cache_dir), capture_output=True, text=True, timeout=timeout)


def index(store: Path) -> dict:
    return json.loads((store / "index.json").read_text())


@pytest.fixture(scope="module")
def one_process_store(tmp_path_factory, cache_dir, tiny_target) -> Path:
    store = tmp_path_factory.mktemp("one") / "store"
    proc = build([*BUILD, f"features.path={store}"], cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return store


def test_a_torchrun_build_writes_the_one_process_store(one_process_store, tmp_path, cache_dir):
    store = tmp_path / "two"
    proc = build([*BUILD, f"features.path={store}"], cache_dir, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = index(one_process_store), index(store)
    assert two["complete"] and len(two["shards"]) == 8
    assert [s["sha256"] for s in two["shards"]] == [s["sha256"] for s in one["shards"]]
    assert [s["batches"] for s in two["shards"]] == [s["batches"] for s in one["shards"]]
    assert [s["rank"] for s in two["shards"]] == [0, 1] * 4  # each shard written by one rank, both ranks wrote
    manifests = [json.loads((p / "manifest.json").read_text()) for p in (one_process_store, store)]
    assert manifests[0] == manifests[1]
    assert not list(store.glob("index.rank*.json")) and not list(store.glob("*.tmp"))


def test_a_fault_on_rank_1_ends_the_build_on_both_ranks_and_a_rerun_finishes_it(one_process_store, tmp_path, cache_dir):
    """Rank 1 raises at its first batch; rank 0 stops after its shard in progress (not at the collective
    timeout) naming rank 1's error; the store is left incomplete, and a one-process rerun completes it."""
    store = tmp_path / "faulty"
    fault = ["+debug=faults", "debug.fail_target_at_batch=2", "debug.fail_rank=1"]  # batch 2: shard 1, rank 1's
    start = time.monotonic()
    proc = build([*BUILD, *fault, f"features.path={store}", "parallel.init_timeout_s=600"], cache_dir, nproc=2)
    assert proc.returncode != 0
    assert time.monotonic() - start < 240  # well under the 600 s a rank would wait in a collective
    assert "RankFailed: rank 1: RuntimeError: injected fault building batch 2" in proc.stderr, proc.stderr[-3000:]
    assert not (store / "index.json").exists() or not index(store)["complete"]
    assert "shard_00001.safetensors" not in {s["file"] for s in _listed(store)}
    proc = build([*BUILD, f"features.path={store}"], cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s["sha256"] for s in index(store)["shards"]] == [s["sha256"] for s in index(one_process_store)["shards"]]


def _listed(store: Path) -> list[dict]:
    parts = [store / "index.json", *store.glob("index.rank*.json")]
    return [s for p in parts if p.exists() for s in json.loads(p.read_text())["shards"]]


# every rank dumps its drafter's weights at exit (DDP keeps a reference to the module it wraps)
SITECUSTOMIZE = """
import atexit, os
from torch.nn.parallel import DistributedDataParallel

_wrapped = []
_init = DistributedDataParallel.__init__

def _keep(self, module, *a, **kw):
    _wrapped.append(module)
    _init(self, module, *a, **kw)

DistributedDataParallel.__init__ = _keep

@atexit.register
def _dump():
    if _wrapped:
        from safetensors.torch import save_file
        state = {k: v.detach().contiguous() for k, v in _wrapped[-1].state_dict().items()}
        save_file(state, os.path.join(os.environ["DUMP_DIR"], f"rank{os.environ['RANK']}.safetensors"))
"""


def test_a_ddp_run_reads_its_rows_of_the_store(one_process_store, tmp_path, cache_dir):
    """features=store parallel=ddp on 2 ranks: both ranks end with the same weights, and those are the weights of
    a one-process run from the store (up to the float round-off of summing the gradient in two halves)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    read = [*SETTINGS, "features=store", f"features.path={one_process_store}", "pipeline.monitor_interval_s=1000"]
    read.append("optim=adamw")  # within 1e-5 of one process: AdamW's update (test_distributed.SMALL says why)
    read.append("train.deterministic=true")  # one thread in each process, as torchrun's workers have
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    launch([*read, f"hydra.run.dir={single}"], cache_dir, check=True)
    path = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    torchrun(
        [*read, "parallel=ddp", f"hydra.run.dir={ddp}"],
        cache_dir,
        check=True,
        env={"PYTHONPATH": path, "DUMP_DIR": str(tmp_path), **ONE_THREAD},
    )
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1)]
    assert max_diff(ranks[0], ranks[1]) == 0.0  # the same weights on both ranks
    assert max_diff(weights(ddp), {k.removeprefix("module."): v for k, v in ranks[0].items()}) == 0.0
    a, b = weights(single), weights(ddp)
    assert max_diff(a, b) < 1e-5, diff_report(a, b, single, ddp)
    one, two = summary(single), summary(ddp)  # the last steps' mean, not the monitor's last window
    assert one["step"] == two["step"] == 16 and one["tokens"] == two["tokens"]
    assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-5)


COUNT_HASHES = """
import os
import dflash.data.fingerprint as fingerprint

_hash = fingerprint.data_fingerprint

def _counted(*a, **kw):
    with open(os.path.join(os.environ["HASH_LOG"], "rank" + os.environ.get("RANK", "0")), "a") as f:
        f.write("hashed\\n")
    return _hash(*a, **kw)

fingerprint.data_fingerprint = _counted
"""


def test_a_ddp_job_shares_a_missing_build_and_hashes_the_data_once(one_process_store, tmp_path, cache_dir):
    """features.build_missing=true under parallel=ddp: both ranks build their shards of the store (a rank does
    not wait out a whole build on rank 0 within parallel.init_timeout_s), the store is the one-process build's,
    and the data set is hashed once, by rank 0 (counted by a hook on data_fingerprint in each process)."""
    hook, log = tmp_path / "hook", tmp_path / "hashes"
    hook.mkdir(), log.mkdir()
    (hook / "sitecustomize.py").write_text(COUNT_HASHES)
    store, run_dir = tmp_path / "store", tmp_path / "run"
    args = [*BUILD, "features=store", f"features.path={store}", "features.build_missing=true", "parallel=ddp"]
    path = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    torchrun(
        [*args, f"hydra.run.dir={run_dir}"],
        cache_dir,
        check=True,
        env={"PYTHONPATH": path, "HASH_LOG": str(log), **ONE_THREAD},
    )
    built = index(store)
    assert built["complete"] and [s["rank"] for s in built["shards"]] == [0, 1] * 4  # both ranks built
    assert [s["sha256"] for s in built["shards"]] == [s["sha256"] for s in index(one_process_store)["shards"]]
    assert sorted(p.name for p in log.iterdir()) == ["rank0"] and (log / "rank0").read_text() == "hashed\n"
    assert train_records(run_dir)[-1]["step"] == 16
