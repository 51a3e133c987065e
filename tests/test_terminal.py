"""What a user sees: the live terminal (under a pseudo-terminal), plain lines without one, timing-free
summaries, the run report and the final eval's W&B charts."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import REPO, launch
from wandb_offline import find_wandb_file

SGR = re.compile(r"\x1b\[[0-9;]*m|\x1b\][^\x07]*\x07")  # colours and styles, hyperlinks: text stays in place
MOVES = re.compile(r"\x1b\[[0-9;?]*[A-Za-ln-z]")  # cursor moves, erases: what follows is drawn elsewhere
LOG_MARK = re.compile(r"\b(INFO|WARNING|ERROR)\b|\]\[dflash")


def run_in_pty(args: list[str], cache_dir: Path, cols: int = 150, timeout: float = 180) -> str:
    """Run launch.py with stdin/stdout/stderr on a pseudo-terminal of `cols` columns; returns all it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(cache_dir),
        "WANDB_MODE": "disabled",
        "TERM": "xterm-256color",
        "COLUMNS": str(cols),
    }
    proc = subprocess.Popen(
        [sys.executable, "launch.py", *args], cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True
    )
    os.close(slave)
    out, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                out.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0, b"".join(out).decode(errors="replace")[-4000:]
    return b"".join(out).decode(errors="replace")


def screen_lines(raw: str) -> list[str]:
    """What was written between cursor moves and line ends: each piece is one line as drawn."""
    return [s for s in re.split(r"[\r\n]", SGR.sub("", MOVES.sub("\n", raw))) if s.strip()]


def test_logs_never_share_a_line_with_the_progress_bar(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    raw = run_in_pty(
        [
            "experiment=smoke",
            "train.max_steps=30",
            "checkpoint.every_steps=3",
            "eval.every_steps=10",
            "pipeline.monitor_interval_s=0.05",
            "logging.log_every_s=0.1",
            f"hydra.run.dir={run_dir}",
        ],
        cache_dir,
    )
    lines = screen_lines(raw)
    bars = [s for s in lines if "━" in s]
    assert any(s.lstrip().startswith("train") for s in bars), "no training bar was drawn"
    assert any(s.lstrip().startswith("eval") for s in bars), "no eval progress was drawn"
    mixed = [s for s in bars if LOG_MARK.search(s)]
    assert not mixed, mixed[:3]
    assert any("checkpoint step 3" in s for s in lines)  # the log lines are there, on lines of their own


def test_without_a_terminal_every_line_is_plain(tmp_path, cache_dir, tiny_target):
    run_dir = tmp_path / "run"
    proc = launch(["experiment=smoke", "logging.log_every_s=0.1", f"hydra.run.dir={run_dir}"], cache_dir, check=True)
    text = proc.stdout + proc.stderr
    assert "\x1b[" not in text and "━" not in text
    assert re.search(r"step 6/6 \(100%\)", text) and re.search(r"eval: \d+/\d+ in", text)


def test_summary_train_metrics_do_not_depend_on_timing(tmp_path, cache_dir, tiny_target):
    """The same config and seed with W&B offline and with W&B disabled: identical summary.json train metrics
    (the mean over the last logging.summary_window_steps steps, not the last monitor window)."""
    common = ["experiment=smoke", "train.max_steps=12", "logging.summary_window_steps=5"]
    a, b = tmp_path / "offline", tmp_path / "disabled"
    bench = ["eval.suites=[humaneval]", "eval.suite_max_samples=1", "eval.max_new_tokens=8"]
    launch(
        [*common, *bench, "logging=wandb", "logging.wandb.mode=offline", f"hydra.run.dir={a}"],
        cache_dir,
        check=True,
        env={"WANDB_MODE": "offline"},
    )
    launch([*common, "pipeline.monitor_interval_s=0.01", f"hydra.run.dir={b}"], cache_dir, check=True)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    train = {k for k in sa if k.startswith("train/") and k not in ("train/lr", "train/noise_std")}
    assert {"train/loss", "train/avg_streak", "train/summary_window_steps"} <= train
    assert {k: sa[k] for k in train} == {k: sb[k] for k in train}
    assert sa["train/summary_window_steps"] == 5

    # the W&B run holds the same summary, and the final eval's charts and samples table
    from wandb_offline import read_offline_run

    offline = read_offline_run(a / "wandb")
    assert offline["summary"]["train/loss"] == pytest.approx(sa["train/loss"])
    media = find_wandb_file(a / "wandb").parent / "files" / "media" / "table" / "eval"
    names = sorted(p.name for p in media.glob("*.table.json"))
    for chart in ("samples_", "accept_length_hist", "accept_by_position"):
        assert any(n.startswith(chart) for n in names), (chart, names)
    samples = json.loads(next(media.glob("samples_*.table.json")).read_text())
    assert samples["columns"] == ["prompt", "output", "accept_lengths", "tau"] and len(samples["data"]) == 2
    # and the benchmark suites' table and chart (eval.suites)
    bench_media = media.parent / "bench"
    table = json.loads(next(bench_media.glob("table_*.table.json")).read_text())
    assert table["columns"][:3] == ["suite", "temperature", "tau"]
    assert [row[:2] for row in table["data"]] == [["humaneval", 0.0]]
    assert table["data"][0][2] == pytest.approx(sa["bench/humaneval/tau"])
    assert any(p.name.startswith("tau_by_suite") for p in bench_media.glob("*.table.json"))

    # python -m dflash.benchmark on the run logs into the same W&B run (resumed by the checkpoint's run id)
    env = {**os.environ, "WANDB_MODE": "offline", "DFLASH_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, "-m", "dflash.benchmark", str(a), "--suites", "humaneval", "--max-samples", "1"]
    proc = subprocess.run([*cmd, "--max-new-tokens", "8"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((a / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and runs[0].name.split("-")[-1] == runs[1].name.split("-")[-1] == offline["run_id"]
    again = read_offline_run(runs[1])
    assert again["summary"]["bench/humaneval/tau"] == pytest.approx(sa["bench/humaneval/tau"])
    assert list((runs[1] / "files" / "media" / "table" / "bench").glob("table_*.table.json"))


def test_report_draws_every_panel(tmp_path, cache_dir, tiny_target):
    from dflash.core.rundir import load_run
    from dflash.tracking.report import PANELS, figure, main

    run_dir = tmp_path / "run"
    launch(
        [
            "experiment=smoke",
            "train.max_steps=8",
            "eval.every_steps=4",
            "logging.report=true",
            "eval.suites=[humaneval]",  # the benchmarks panel
            "eval.suite_max_samples=1",
            "eval.max_new_tokens=8",
            f"hydra.run.dir={run_dir}",
        ],
        cache_dir,
        check=True,
    )
    assert (run_dir / "report.png").stat().st_size > 10_000  # the run drew its own
    fig = figure([load_run(run_dir)])
    assert [ax.get_title() for ax in fig.axes] == list(PANELS)
    assert all(ax.lines or ax.patches for ax in fig.axes), "a panel without data"
    out = tmp_path / "both.html"
    assert main([str(run_dir), str(run_dir), "--out", str(out)]) == 0
    html = out.read_text()
    assert "data:image/png;base64," in html and str(run_dir) in html
    assert main([str(tmp_path / "nope")]) == 2
