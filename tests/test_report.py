"""The run's picture (dflash/tracking/report.py) on runs that logged little."""

from __future__ import annotations

from pathlib import Path

from test_compare import base_config, write_run


def test_a_one_point_series_is_drawn_as_a_point(tmp_path: Path) -> None:
    """A run that stopped after its first monitor record: each panel's one-point series shows a marker (a line
    through one point draws nothing: the panel looked empty although it had a legend)."""
    from dflash.core.rundir import load_run
    from dflash.tracking.report import figure

    record = {"step": 1, "time_s": 2.0, "train/loss": 3.0, "train/loss_ce": 2.5, "perf/ktok_s": 1.5}
    record |= {"perf/target_queue_depth": 2.0, "perf/hs_queue_depth": 1.0}
    run_dir = write_run(tmp_path / "run", base_config(tmp_path / "run"), [record, {"step": 1, "eval/tau": 2.0}])
    fig = figure([load_run(run_dir)])
    lines = [line for ax in fig.axes for line in ax.lines if len(line.get_xdata()) == 1]
    assert len(lines) >= 5  # train/loss, loss_ce, eval/tau, ktok/s, two queue depths
    invisible = [line.get_label() for line in lines if line.get_marker() in (None, "None", "", " ")]
    assert not invisible, f"one-point series drawn as empty lines: {invisible}"
