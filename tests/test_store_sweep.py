"""What a feature store saves: `python -m dflash.bench sweep` (measured: its table is whole, positive and adds up)
and `dflash.analysis.store_cost` (arithmetic: the drafter's parameters, the FLOPs, the GPU-hours, the bytes per token,
each checked against a count done here by hand)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

from dflash.analysis import store_cost
from dflash.benchmarks import sweep
from dflash.model import plan

Q8B, Q27B = store_cost.TARGETS["Qwen3-8B"], store_cost.TARGETS["Qwen3.6-27B"]


def test_store_bytes_per_token_at_each_dtype():
    # 5 layers' features + the last hidden state, each `hidden` values, plus an int64 id, a bool mask and the
    # target's int32 argmax
    assert store_cost.store_bytes(4096, 5, "float32") == 6 * 4096 * 4 + 13 == 98_317
    assert store_cost.store_bytes(4096, 5, "bfloat16") == 6 * 4096 * 2 + 13
    assert store_cost.store_bytes(5120, 5, "bfloat16") == 61_453
    assert store_cost.store_bytes(4096, 5, "fp8") == 6 * (4096 + 4) + 13  # a float32 scale per token and row


def test_the_planners_drafter_is_the_one_the_framework_builds():
    """The plan's formula for the drafter's parameters against the built drafter (meta device), both targets."""
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128  # attn, mlp, norms
    d = plan.drafter_shape(Q8B.model_config(), Q8B.shape)
    assert (d.layers, d.features, d.layer_params) == (5, 5, per_layer)
    for target in (Q8B, Q27B):
        built = store_cost.drafter_params(target)
        assert plan.drafter_shape(target.model_config(), target.shape).params == built
    assert 1.0e9 < store_cost.drafter_params(Q8B) < 1.1e9  # ~1.05B, the README's figure for the Qwen3-8B drafter


def test_one_flop_model_for_the_plan_and_the_store_cost():
    """store_cost's GPU-hours come from the planner's FLOPs (the two once disagreed about the target's embedding
    and LM head), and those FLOPs are the terms of flops_per_sequence's docstring, counted here by hand."""
    t, S, A, B = Q27B.shape, 3072, 512, 16
    f = plan.flops_per_sequence(Q27B.model_config(), t, seq_len=S, anchors=A)
    assert t.total_params == pytest.approx(27e9, rel=0.01)  # by its parts: 48 linear- and 16 full-attention layers
    no_heads = t.total_params - 2 * 248320 * 5120  # the features need neither the embedding nor the LM head
    # attention over the context in the 16 full-attention layers only (linear attention does not grow with it)
    assert f["target"] == pytest.approx((2 * no_heads + 2 * 16 * 24 * 256 * S) * S)
    d = plan.drafter_shape(Q27B.model_config(), t)
    by_hand = (
        6 * d.layer_params * 5 * A * B
        + 6 * (5 * 5120 * 5120 + 2 * 5120 * 8 * 128 * 5) * S  # fc and every layer's k/v over the context
        # z-lab's Qwen3.6 drafter: 32 heads of 128; its mix of sliding and full layers planned as full attention
        + 12 * 32 * 128 * 5 * A * B * (S / 2 + B)
        + 6 * 5120 * 248320 * A * (B - 1)
    )
    assert f["drafter"] == pytest.approx(by_hand)
    r = store_cost.sweep_gpu_hours(Q27B, jobs=9, tokens=1.2e9, seq_len=S, anchors=A, mfu=0.4, peak_tflops=989.4)
    sequences, rate = 1.2e9 / S, 989.4e12 * 0.4
    assert r["target_pass_h"] == pytest.approx(f["target"] * sequences / rate / 3600)
    assert r["drafter_pass_h"] == pytest.approx(f["drafter"] * sequences / rate / 3600)
    assert r["online_h"] == pytest.approx(9 * (r["target_pass_h"] + r["drafter_pass_h"]))
    assert r["store_h"] == pytest.approx(r["target_pass_h"] + 9 * r["drafter_pass_h"])
    assert r["saved_h"] == pytest.approx(r["online_h"] - r["store_h"]) and r["saved_h"] > 0
    assert r["store_tb_bf16"] == pytest.approx(1.2e9 * 61_453 / 1e12)


def test_the_goal_verdict_follows_the_numbers():
    opts = {**sweep.DEFAULTS, "jobs": "2", "steps": "10", "goal": "0.10"}
    stages = dict(zip(sweep.STAGES, ((2.0, 2.0), (3.0, 3.0), (0.5, 0.5), (0.5, 0.5))))
    limit = 2.0 + 0.5 + 2 * (3.0 + 0.5)  # 9.5 CPU s
    for store_cpu, verdict in ((limit * 1.05, "PASS"), (limit * 1.2, "MISS")):
        runs = {"online": (20.0, 20.0), "store build": (1.0, 1.0), "store jobs": (store_cpu - 1, store_cpu - 1)}
        runs["store"] = (store_cpu, store_cpu)
        line = sweep.report(opts, stages, {"sync": runs})[-1]
        assert line.startswith(f"sync: store sweep CPU / limit = {store_cpu / limit:.3f} (goal <= 1.10): {verdict}")


def test_the_job_length_from_which_the_total_meets_the_goal():
    """A store sweep costs fixed + b x steps CPU s against a limit of l x steps: with 10 s fixed and steps at
    1.0 of the limit's, 10% of room per step is used up by the fixed costs at 100 steps, not before."""
    assert sweep.goal_from(10.0, 1.0, 1.0, 0.10).endswith("from about 100 steps per job on")
    for fixed, b, lim in ((16.38, 0.654, 0.628), (3.0, 0.5, 0.6)):  # run D's async figures (docs), and another
        steps = int(sweep.goal_from(fixed, b, lim, 0.10).split("about ")[1].split()[0])
        assert (fixed + b * steps) / (lim * steps) <= 1.10 < (fixed + b * (steps - 1)) / (lim * (steps - 1))
    assert "at no job length" in sweep.goal_from(10.0, 1.2, 1.0, 0.10)  # each step alone is beyond the goal
    assert "at no job length" in sweep.goal_from(10.0, -0.1, 1.0, 0.10)  # a step's cost below the noise


def test_the_checks_of_the_bench_output_hold_for_a_report_of_known_numbers():
    """check_sweep_output (used on a real run below) against report() of numbers chosen here, both verdicts."""
    opts = {**sweep.DEFAULTS, "jobs": "2", "steps": "2", "modes": "sync"}
    stages = dict(zip(sweep.STAGES, ((0.15, 0.055), (0.232, 0.085), (0.007, 0.003), (0.01, 0.002))))
    runs = {"online": (32.0, 12.43), "store build": (18.3, 7.31), "store jobs": (28.5, 11.02), "store": (46.8, 18.33)}
    runs["account"] = {"drafter steps": 0.4, "store reads": 0.01, "jobs": 3.2}
    for small_store in (18.71, 18.0):  # below the noise (store at 1 step costs more), then a positive difference
        small = {"online": (25.4, 10.11), "store": (48.2, small_store)}
        check_sweep_output("\n".join(sweep.report(opts, stages, {"sync": runs}, {"sync": small})))
    with pytest.raises(AssertionError, match="store build"):  # a store row that is not its build plus its jobs
        wrong = {"sync": {**runs, "store": (46.8, 20.0)}}
        check_sweep_output("\n".join(sweep.report(opts, stages, wrong, {"sync": small})))
    out = sweep.report(opts, stages, {"sync": runs})
    row = out[out.index(sweep.ACCOUNT_HEADER) + 2]
    assert row == "| sync | 0.400 | 0.010 | 2.790 | 7.820 | 11.020 |"  # rest: 3.2 - 0.41; outside: 11.02 - 3.2
    # a step in the jobs: 0.4 s over 2 jobs x 2 steps = 100 ms, against the probe's 0.085 s / 2 steps = 42.5 ms
    assert "sync: a drafter step in the jobs 100.0 CPU ms, in the probe 42.5 (2.353)" in "\n".join(out)


def test_the_jobs_count_their_own_cpu_by_stage(tmp_path):
    """job_account sums what each job wrote in its summary.json."""
    for i, (drafter, reads, job) in enumerate(((1.5, 0.25, 4.0), (2.5, 0.5, 6.0))):
        (tmp_path / str(i)).mkdir()
        summary = {"perf/drafter_cpu_s": drafter, "perf/source_cpu_s": reads, "perf/job_cpu_s": job}
        (tmp_path / str(i) / "summary.json").write_text(json.dumps(summary))
    assert sweep.job_account(tmp_path) == {"drafter steps": 4.0, "store reads": 0.75, "jobs": 10.0}


def _table(out: str, header: str) -> list[list[str]]:
    lines = out.splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.mark.slow
def test_the_sweep_bench_prints_a_whole_consistent_table():
    # base_steps=0: the second size's rows and line are checked on known numbers above; three processes, not six
    args = ["steps=2", "jobs=2", "modes=sync", "batch_size=2", "seq_len=64", "num_anchors=4", "base_steps=0"]
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.bench", "sweep", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_sweep_output(proc.stdout)


def check_sweep_output(out: str) -> None:
    """`python -m dflash.bench sweep steps=2 jobs=2 modes=sync`'s output: whole, positive, adding up."""
    stages = _table(out, "| stage | wall s | CPU s | CPU ms per batch |")
    assert [r[0] for r in stages] == list(sweep.STAGES)
    assert all(float(v) > 0 for r in stages for v in r[1:])
    cost = {r[0]: float(r[2]) for r in stages}
    rows = {r[1]: [float(v) for v in r[2:]] for r in _table(out, sweep.SWEEP_HEADER)}
    measured = ["online", "store build", "store jobs", "store", "limit"]
    assert list(rows) in (measured, [*measured, "online, 1 step(s)", "store, 1 step(s)"])
    assert all(v > 0 for r in rows.values() for v in r)
    for i in (0, 1):  # the store sweep is its build plus its jobs; each ratio is the row over its online row
        whole = rows["store build"][i] + rows["store jobs"][i]
        assert rows["store"][i] == pytest.approx(whole, abs=0.011), "store != store build + store jobs"
        for name, r in rows.items():
            online = rows["online, 1 step(s)" if "step(s)" in name else "online"][i]
            rounding = 0.002 + r[i] / online * (0.0051 / r[i] + 0.0051 / online)  # costs printed to 0.01 s
            assert r[2 + i] == pytest.approx(r[i] / online, abs=rounding)
    limit = cost["target pass"] + cost["store write"] + 2 * (cost["drafter step"] + cost["store read"])
    assert rows["limit"][1] == pytest.approx(limit, abs=0.06)
    account = {r[0]: [float(v) for v in r[1:]] for r in _table(out, sweep.ACCOUNT_HEADER)}
    drafter, reads, rest, outside, jobs_cpu = account["sync"]
    assert jobs_cpu == pytest.approx(rows["store jobs"][1], abs=0.006)
    assert drafter > 0 and reads > 0 and rest > 0 and outside > 0
    assert drafter + reads + rest + outside == pytest.approx(jobs_cpu, abs=0.03)
    m = re.search(r"sync: store sweep CPU / limit = ([\d.]+) \(goal <= 1.10\): (PASS|MISS)", out)
    assert m, out
    assert float(m.group(1)) == pytest.approx(rows["store"][1] / rows["limit"][1], rel=0.05, abs=0.01)
    assert m.group(2) == ("PASS" if float(m.group(1)) <= 1.10 else "MISS")
    if "store, 1 step(s)" not in rows:
        return
    # per step beyond 1: (store at 2 steps - store at 1 step) / 1 over the limit's per step (limit / 2)
    m = re.search(
        r"store sweep \(CPU at 2 - at 1 steps\) / 1 = (-?[\d.]+) CPU s, limit ([\d.]+): ratio (-?[\d.]+)", out
    )
    assert m, out
    assert float(m.group(1)) == pytest.approx(rows["store"][1] - rows["store, 1 step(s)"][1], abs=0.011)
    assert float(m.group(2)) == pytest.approx(rows["limit"][1] / 2, abs=0.03)
    ratio = float(m.group(3))
    assert ratio == pytest.approx(float(m.group(1)) / float(m.group(2)), rel=0.01, abs=0.002)
    verdict = "n/a (below the noise" if ratio <= 0 else "PASS" if ratio <= 1.10 else "MISS"
    assert f"(goal <= 1.10): {verdict}" in out
