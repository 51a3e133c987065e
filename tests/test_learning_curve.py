"""compare --curve: tau per suite against supervised tokens and CPU-hours, a line per recipe, runs of a recipe at
one budget averaged over seeds, prompt lookup as a horizontal line; on fake run directories."""

from __future__ import annotations

import math

import pytest
from test_compare import base_config, write_run

from dflash.analysis.compare_cli import main
from dflash.analysis.learning_curve import curve_points, lookup_levels, projections
from dflash.core.rundir import find_runs


def _runs(tmp_path):
    for precision in ("fp32", "bf16-mixed"):
        for steps in (100, 300):
            for seed in (0, 1):
                tau = 1.1 + steps / 1000 + seed * 0.01 + (0.05 if precision == "bf16-mixed" else 0)
                summary = {
                    "eval/tau": tau, "eval/tau_baseline": 1.58, "tokens": steps * 1024, "step": steps,
                    "perf/drafter_cpu_s": steps * (3.0 if precision == "fp32" else 1.5), "perf/source_cpu_s": 0.0,
                    "perf/target_cpu_s": 0.0,
                    "bench/sharegpt/tau": tau + 0.1, "bench/sharegpt/tau_lookup": 1.72,
                }  # fmt: skip
                if precision == "bf16-mixed":
                    summary["cost/cpu_s"] = steps * 2.0  # make real's whole cost
                cfg = base_config(tmp_path, train={"seed": seed, "max_steps": steps, "precision": precision})
                write_run(tmp_path / f"{precision}-{steps}-{seed}", cfg, [], summary=summary)
    return find_runs([str(tmp_path)])


def test_a_recipe_is_a_line_of_budgets_averaged_over_seeds(tmp_path):
    runs = _runs(tmp_path)
    curves = curve_points(runs)
    assert set(curves) == {"precision=fp32", "precision=bf16-mixed"}  # max_steps and seed are not the recipe
    point = next(iter(curves["precision=fp32"].values()))
    assert len(curves["precision=fp32"]) == 2 and len(point.tau["held-out"]) == 2  # two budgets, two seeds each
    assert set(point.tau) == {"held-out", "sharegpt"}
    bf16 = list(curves["precision=bf16-mixed"].values())
    assert not any(p.partial_cost for p in bf16) and all(p.partial_cost for p in curves["precision=fp32"].values())
    assert sorted(h for p in bf16 for h in p.cpu_hours) == pytest.approx([200 / 3600] * 2 + [600 / 3600] * 2)
    assert lookup_levels(runs) == {"held-out": 1.58, "sharegpt": 1.72}


def test_the_cli_writes_the_picture(tmp_path):
    _runs(tmp_path / "runs")
    out = tmp_path / "curve.png"
    assert main([str(tmp_path / "runs"), "--curve", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "runs"), "--curve", str(out), "--curve-recipe", "no.such_key"]) == 1


def test_the_projection_says_how_many_cpu_hours_reach_prompt_lookup(tmp_path):
    rows = {(r["recipe"], r["panel"]): r for r in projections(_runs(tmp_path))}
    bf16 = rows["precision=bf16-mixed", "held-out"]
    # tau 1.255 at 200 s and 1.455 at 600 s (seed means): +0.2 per log2(3) of CPU; lookup 1.58 is 0.125 further
    per_doubling = 0.2 / math.log2(3)
    assert bf16["tau_per_doubling"] == pytest.approx(per_doubling)
    assert bf16["cpu_hours_to_lookup"] == pytest.approx(600 / 3600 * 2 ** (0.125 / per_doubling))


def test_the_token_axis_is_supervised_tokens_where_every_run_counted_them_else_says_all_tokens(tmp_path):
    """Issue 57: `tokens` counts every token of every batch (on chat data ~4x the supervised ones); the curve reads
    train/supervised_tokens, and where a run lacks it the axis says it counts all tokens."""
    from dflash.analysis.learning_curve import token_axis

    runs = _runs(tmp_path / "old")
    assert token_axis(runs) == ("tokens", "tokens seen (all, not only supervised)")
    for steps in (100, 300):
        summary = {"eval/tau": 1.2, "tokens": steps * 1024, "train/supervised_tokens": steps * 256, "step": steps}
        write_run(tmp_path / "new" / str(steps), base_config(tmp_path, train={"max_steps": steps}), [], summary=summary)
    new = find_runs([str(tmp_path / "new")])
    assert token_axis(new) == ("train/supervised_tokens", "supervised tokens seen")
    xs = sorted(x for p in curve_points(new)["runs"].values() for x in p.tokens)
    assert xs == [100 * 256, 300 * 256]


def test_a_recipe_is_grouped_by_the_precision_that_ran(tmp_path):
    """Issue 57: bf16-mixed that fell back to fp32 (run.json's `precision`) is not drawn or compared as bf16-mixed."""
    import json

    runs = _runs(tmp_path)
    for run in runs:
        if run.config["train.precision"] == "bf16-mixed" and run.config["train.seed"] == 1:
            info = json.loads((run.path / "run.json").read_text())
            info["precision"] = {"requested": "bf16-mixed", "ran": "fp32", "fallback": "a CPU without bf16"}
            (run.path / "run.json").write_text(json.dumps(info))
    curves = curve_points(find_runs([str(tmp_path)]))
    assert set(curves) == {"precision=fp32", "precision=bf16-mixed", "precision=fp32 (bf16-mixed requested)"}
    assert all(len(p.tau["held-out"]) == 1 for p in curves["precision=bf16-mixed"].values())
