"""optim=muon through the sharded (DCP) checkpoints of ddp/fsdp runs and a one-process checkpoint resumed under
ddp (torchrun, gloo on CPU, 2 processes): Muon's momentum buffers are saved and loaded like AdamW's moments."""

from __future__ import annotations

import shutil

import pytest
from conftest import launch
from test_distributed import SMALL, max_diff, status, torchrun, weights

COMMON = [*SMALL, "optim=muon", "train.max_steps=8", "checkpoint.every_steps=3", "pipeline.monitor_interval_s=0.01"]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_killed_muon_ranks_resume_bitwise(parallel, tmp_path, cache_dir, tiny_target):
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    torchrun([*COMMON, f"parallel={parallel}", f"hydra.run.dir={full}"], cache_dir, check=True)
    proc = torchrun(
        [*COMMON, f"parallel={parallel}", "+debug=faults", "debug.crash_at_step=5", f"hydra.run.dir={crashed}"],
        cache_dir,
    )
    assert proc.returncode != 0 and status(crashed)["status"] == "running"
    assert sorted(p.name for p in (crashed / "checkpoints").iterdir()) == ["step_3"]
    one_process = tmp_path / "one_process"
    shutil.copytree(crashed, one_process)
    torchrun([f"resume={crashed}", "debug.crash_at_step=null"], cache_dir, check=True)
    assert status(crashed)["status"] == "completed"
    assert max_diff(weights(full), weights(crashed)) == 0.0  # the momentum buffers came back exactly
    launch([f"resume={one_process}", "debug.crash_at_step=null"], cache_dir, check=True)  # DCP into one process
    assert status(one_process)["status"] == "completed"


@pytest.mark.slow
def test_a_one_process_muon_checkpoint_resumes_under_ddp(tmp_path, cache_dir, tiny_target):
    """Each part's state is keyed by its own parameter index in state.pt: load_full_into names them part by part."""
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    launch([*COMMON, f"hydra.run.dir={full}"], cache_dir, check=True)
    proc = launch([*COMMON, "+debug=faults", "debug.crash_at_step=5", f"hydra.run.dir={crashed}"], cache_dir)
    assert proc.returncode != 0 and status(crashed)["status"] == "running"
    torchrun([f"resume={crashed}", "debug.crash_at_step=null", "parallel=ddp"], cache_dir, check=True)
    assert status(crashed)["status"] == "completed"
    # ddp's gradient all-reduce rounds differently than one process, and Muon's bf16 Newton-Schulz passes that on
    resumed = max_diff(weights(full), weights(crashed))
    assert resumed < 1e-4, resumed
