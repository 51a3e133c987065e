"""compare --rank-corr: Spearman's rho by hand (ties too) and over fake run directories."""

from __future__ import annotations

import json

import pytest
from test_compare import base_config, write_run

from dflash.analysis.compare_cli import main
from dflash.analysis.rank_corr import rank_corr_table, ranks, spearman
from dflash.core.rundir import find_runs


def test_ranks_and_spearman_by_hand() -> None:
    assert ranks([10.0, 30.0, 20.0, 20.0]) == [1.0, 4.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swap of 4: d = (0, 1, -1, 0), rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 2], [1, 2]) is None  # too few points
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # a constant side ranks nothing
    with pytest.raises(ValueError):
        spearman([1, 2, 3], [1, 2])


def test_rank_corr_over_runs_and_eval_records(tmp_path, capsys) -> None:
    # estimate and tau per (run, step): the final values rank the runs alike; the step-100 evals do not
    data = {0: [(1.5, 2.0), (2.0, 2.4)], 1: [(1.8, 1.9), (2.2, 2.6)], 2: [(1.2, 2.1), (1.6, 2.2)]}
    for run, points in data.items():
        records = [{"step": 50, "train/loss": 1.0}]
        records += [{"step": 100 * (i + 1), "eval/sim": s, "eval/tau": t} for i, (s, t) in enumerate(points)]
        cfg = base_config(tmp_path / str(run), train={"seed": run, "max_steps": 200})
        write_run(tmp_path / str(run), cfg, records)
    runs = find_runs([tmp_path])
    columns, rows = rank_corr_table(runs, ["eval/sim"], ["eval/tau"])
    row = dict(zip(columns, rows[0]))
    assert row["runs"] == 3 and row["rho (runs)"] == pytest.approx(1.0)  # finals (2.0, 2.4) (2.2, 2.6) (1.6, 2.2)
    xs = [1.5, 2.0, 1.8, 2.2, 1.2, 1.6]
    ys = [2.0, 2.4, 1.9, 2.6, 2.1, 2.2]
    assert row["evals"] == 6 and row["rho (evals)"] == pytest.approx(spearman(xs, ys))
    assert row["rho (evals)"] < 1.0
    assert main([str(tmp_path), "--rank-corr", "eval/sim:eval/tau", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["estimate"] == "eval/sim" and out[0]["evals"] == 6
    assert main([str(tmp_path), "--rank-corr", "eval/sim"]) == 1  # no ':' between estimates and real metrics
    assert main([str(tmp_path), "--rank-corr", "eval/simm:eval/tau"]) == 1  # unknown name
