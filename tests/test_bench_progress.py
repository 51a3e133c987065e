"""`python -m dflash.bench pipeline` shows each phase as it runs (it printed nothing for minutes, then the table)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_pipeline_bench_reports_each_phase_before_its_table():
    args = ["steps=2", "warmup=1", "batch_size=1", "seq_len=32", "block_size=4", "num_anchors=2", "threads=1"]
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.bench", "pipeline", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr
    phases = ["build target", "target stand-alone", "drafter stand-alone", "count FLOPs", "sync pipeline (1 thread)"]
    phases.append("async pipeline (1 thread)")
    for name in phases:  # its start, and its end with what it measured
        assert f"{name}: started" in log and f"{name}: 1/1 in " in log, (name, log[-3000:])
    assert "ktok/s" in log.split("async pipeline (1 thread): 1/1 in ", 1)[1].splitlines()[0]
    assert "async / sync:" in proc.stdout  # the table follows on stdout
