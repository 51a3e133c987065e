"""No process outlives its test (issue 57): the tests' subprocess helper ends a command's whole process group on a
timeout (torchrun's ranks too), and a torchrun rank whose launcher died stops and exits on its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, alive, descendants, end_process_group, run_process_group


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_a_timed_out_command_ends_with_its_whole_process_group(tmp_path):
    """subprocess.run(timeout=...) kills only its child: a grandchild (a torchrun rank) ran on with parent PID 1."""
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_process_group([sys.executable, "-c", script], dict(os.environ), timeout=5)
    grandchild = int(pid_file.read_text())
    assert _wait_for(lambda: not alive(grandchild), 10), "the grandchild ran on"


def test_a_finished_command_leaves_nothing_of_its_group_behind(tmp_path):
    pid_file = tmp_path / "orphan.pid"
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
    )
    proc = run_process_group([sys.executable, "-c", script], dict(os.environ), timeout=60)
    assert proc.returncode == 0
    assert _wait_for(lambda: not alive(int(pid_file.read_text())), 10), "the command's orphan ran on"


@pytest.mark.slow
def test_a_rank_whose_launcher_died_stops_and_exits(tmp_path, cache_dir, tiny_target):
    """torchrun --standalone hosts the rendezvous store: SIGKILL it, and its two ranks (now children of init) stop
    as on SIGTERM and exit within DFLASH_LAUNCHER_GRACE_S (dflash/core/interrupts.py: exit_with_launcher)."""
    from test_distributed import SMALL

    run_dir = tmp_path / "run"
    env = {
        **os.environ, "DFLASH_CACHE_DIR": str(cache_dir), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
        "DFLASH_LAUNCHER_GRACE_S": "10",
    }  # fmt: skip
    args = [*SMALL, "parallel=ddp", "train.max_steps=100000", "checkpoint.every_steps=0", f"hydra.run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch.py", *args]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        metrics = run_dir / "metrics.jsonl"

        def training() -> bool:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            return any("train/loss" in json.loads(line) for line in lines if line.strip())

        assert _wait_for(training, 240), "the ranks never trained"
        ranks = descendants(proc.pid)  # in sessions of their own (torchrun's start_new_session)
        assert len(ranks) >= 2, ranks
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: its ranks are orphaned, as under a killed test
        proc.wait()
        # poll (2 s) + grace (10 s) + a loaded machine's margin
        assert _wait_for(lambda: not any(alive(pid) for pid in ranks), 60), "a rank ran on without its launcher"
    finally:
        end_process_group(proc)
