"""compare.py and sweep.py on fake run directories written by hand (no training)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hydra.core.utils import JobStatus
from omegaconf import OmegaConf

from dflash.analysis.compare import compare_table, diff_table
from dflash.analysis.compare_cli import main, render
from dflash.analysis.seed_groups import group_runs, group_table
from dflash.analysis.sweep import SWEEP_FILE, SweepSummaryCallback
from dflash.core import rundir
from dflash.core.rundir import find_runs, load_run

REPO = Path(__file__).resolve().parents[1]

# (job, kl_temperature, streak_alpha, final eval/tau, final train/loss, avg_streak); job 3 fails
SWEEP = [
    (0, 1.0, 0.0, 2.0, 1.50, 1.2),
    (1, 1.0, 0.5, 2.6, 1.40, 1.6),
    (2, 2.0, 0.0, 2.3, 1.45, 1.4),
    (3, 2.0, 0.5, None, None, None),
]


def base_config(run_dir: Path, **changes: dict) -> dict:
    cfg = {
        "model": {"name": "tiny", "block_size": 8, "target_layer_ids": [1, 3]},
        "loss": {"name": "kl_streak", "kl_temperature": 1.0, "streak_alpha": 0.5, "decay_gamma": None},
        "train": {"seed": 0, "max_steps": 20},
        "paths": {"cache_dir": "outputs/.cache", "output_dir": str(run_dir)},  # differs per run, meaningless
    }
    for group, values in changes.items():
        cfg[group] = {**cfg[group], **values}
    return cfg


def write_run(
    run_dir: Path,
    config: dict,
    records: list[dict],
    status: str = "completed",
    summary: dict | None = None,
    wall_time_s: float | None = 10.0,
    error: str | None = None,
) -> Path:
    """A run directory in the fixed format: config_resolved.yaml, run.json, status.json, metrics.jsonl,
    and summary.json when given."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config_resolved.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "run.json").write_text(json.dumps({"argv": ["launch.py"], "overrides": [], "choices": {}}))
    (run_dir / "status.json").write_text(
        json.dumps({"status": status, "error": error, "start_time": 0, "end_time": None, "wall_time_s": wall_time_s})
    )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    """4-job fake sweep over loss.kl_temperature x loss.streak_alpha; job 3 failed without summary.json."""
    root = tmp_path / "multirun" / "2026-01-01" / "12-00-00-000000"
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    for job, temp, alpha, tau, loss, streak in SWEEP:
        d = root / str(job)
        cfg = base_config(d, loss={"kl_temperature": temp, "streak_alpha": alpha})
        # the last training record has a worse loss than summary.json: summary must win
        records = [
            {"step": 10, "tokens": 100, "time_s": 1.0, "train/loss": 3.0, "perf/ktok_s": 5.0},
            {"step": 20, "tokens": 200, "time_s": 2.0, "train/loss": 2.5, "perf/ktok_s": 6.0},
        ]
        (d / ".hydra").mkdir(parents=True)
        if tau is None:
            write_run(d, cfg, records, status="failed", error="RuntimeError: boom", wall_time_s=3.0)
        else:
            summary = {"eval/tau": tau, "train/loss": loss, "train/avg_streak": streak, "perf/ktok_s": 6.0}
            write_run(d, cfg, records, summary=summary, wall_time_s=10.0 + job)
    return root


def test_table_shows_varying_keys_and_one_row_per_run(sweep_dir: Path) -> None:
    runs = find_runs([sweep_dir.parents[1]])  # found recursively from a parent
    columns, rows = compare_table(runs)
    assert len(rows) == 4
    assert columns[:2] == ["loss.kl_temperature", "loss.streak_alpha"]
    # constant keys and values naming the run's own dir are hidden
    assert "model.block_size" not in columns and "paths.output_dir" not in columns
    assert columns[2:] == [
        "eval/tau",
        "train/avg_streak",
        "train/loss",
        "perf/ktok_s",
        "status",
        "wall_time_s",
        "run_dir",
    ]
    by_job = {Path(r[-1]).name: dict(zip(columns, r)) for r in rows}
    assert [by_job[str(j)]["loss.kl_temperature"] for j in range(4)] == [1.0, 1.0, 2.0, 2.0]
    assert by_job["0"]["train/loss"] == 1.50  # summary.json, not the last metrics.jsonl line (2.5)
    assert by_job["1"]["wall_time_s"] == 11.0


def test_failed_run_is_listed_with_blank_metrics(sweep_dir: Path) -> None:
    failed = load_run(sweep_dir / "3")
    assert failed.status == "failed" and failed.error == "RuntimeError: boom"
    assert failed.get("eval/tau") is None
    assert failed.get("train/loss") == 2.5  # no summary.json: last value in metrics.jsonl
    md = render(*compare_table(find_runs([sweep_dir])), "markdown")
    row3 = [line for line in md.splitlines() if line.rstrip("| ").endswith("/3")][0]
    cells = [c.strip() for c in row3.strip("|").split("|")]
    assert cells[2] == "" and "failed" in cells


def test_running_run_without_summary_and_with_torn_last_line(tmp_path: Path) -> None:
    d = write_run(
        tmp_path / "r",
        base_config(tmp_path / "r"),
        [{"step": 5, "time_s": 4.0, "train/loss": 2.0}],
        status="running",
        wall_time_s=None,
    )
    with (d / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "train/lo')  # writer killed mid-line
    run = load_run(d)
    assert run.status == "running" and run.metrics["step"] == 5 and run.wall_time_s == 4.0


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_csv_json_markdown_and_table_formats(sweep_dir: Path, capsys: pytest.CaptureFixture) -> None:
    rows = list(csv.DictReader(io.StringIO(_cli(capsys, str(sweep_dir), "--format", "csv"))))
    assert len(rows) == 4
    assert {r["loss.streak_alpha"] for r in rows} == {"0.0", "0.5"}
    assert [r["eval/tau"] for r in rows] == ["2.0", "2.6", "2.3", ""]

    recs = json.loads(_cli(capsys, str(sweep_dir), "--format", "json"))
    assert [r["status"] for r in recs] == ["completed", "completed", "completed", "failed"]
    assert recs[3]["eval/tau"] is None and recs[1]["eval/tau"] == 2.6

    md = _cli(capsys, str(sweep_dir), "--format", "markdown").splitlines()
    assert md[0].startswith("| loss.kl_temperature | loss.streak_alpha | eval/tau")
    assert set(md[1]) == {"|", "-"} and len(md) == 2 + 4

    table = _cli(capsys, str(sweep_dir))
    assert "loss.kl_temperature" in table and "failed" in table and "4 runs" in table


def test_filter(sweep_dir: Path, capsys: pytest.CaptureFixture) -> None:
    def taus(*filters: str) -> list:
        argv = [str(sweep_dir), "--format", "json"] + [f"--filter={f}" for f in filters]
        return [r["eval/tau"] for r in json.loads(_cli(capsys, *argv))]

    assert taus("loss.streak_alpha>0") == [2.6, None]
    assert taus("status==completed") == [2.0, 2.6, 2.3]
    assert taus("status==completed", "loss.kl_temperature >= 2") == [2.3]
    assert taus("eval/tau<2.5") == [2.0, 2.3]  # the failed run has no tau: not smaller than anything


def test_filter_errors(sweep_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(sweep_dir), "--filter", "loss.name!=kl_streak"]) == 1
    assert "no run matches" in capsys.readouterr().err
    assert main([str(sweep_dir), "--filter", "loss.streak_alpa>0"]) == 1
    err = capsys.readouterr().err
    assert "loss.streak_alpa" in err and "loss.streak_alpha" in err  # names the typo and suggests the key
    assert main([str(sweep_dir), "--filter", "loss.streak_alpha"]) == 1
    assert "KEY OP VALUE" in capsys.readouterr().err


def test_misspelt_metric_is_an_error(sweep_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(sweep_dir), "--metrics", "eval/tua"]) == 1  # used to print an empty column
    err = capsys.readouterr().err
    assert "--metrics" in err and "eval/tua" in err and "eval/tau" in err


def test_sort(sweep_dir: Path, capsys: pytest.CaptureFixture) -> None:
    def col(sort: str, key: str) -> list:
        return [r[key] for r in json.loads(_cli(capsys, str(sweep_dir), "--format", "json", f"--sort={sort}"))]

    assert col("eval/tau", "eval/tau") == [2.6, 2.3, 2.0, None]  # metric: descending, missing last
    assert col("+eval/tau", "eval/tau") == [2.0, 2.3, 2.6, None]
    assert col("+train/loss", "train/loss") == [1.40, 1.45, 1.50, 2.5]
    assert col("-loss.streak_alpha,eval/tau", "eval/tau") == [2.6, None, 2.3, 2.0]
    assert col("wall_time_s", "wall_time_s") == [3.0, 10.0, 11.0, 12.0]  # a run field: ascending


@pytest.fixture
def seeds_dir(tmp_path: Path) -> Path:
    """Config A (kl_temperature 1) with seeds 0,1,2 and config B (kl_temperature 2) with seeds 0,1."""
    root = tmp_path / "seeds"
    taus = {(1.0, 0): 2.0, (1.0, 1): 2.5, (1.0, 2): 3.0, (2.0, 0): 3.0, (2.0, 1): 4.0}
    for i, ((temp, seed), tau) in enumerate(taus.items()):
        d = root / f"run{i}"
        cfg = base_config(d, loss={"kl_temperature": temp}, train={"seed": seed})
        write_run(d, cfg, [{"step": 1, "train/loss": 1.0}], summary={"eval/tau": tau, "train/loss": 1.0 + seed})
    return root


def test_group_by_seed_gives_mean_and_sample_std(seeds_dir: Path, capsys: pytest.CaptureFixture) -> None:
    recs = json.loads(
        _cli(capsys, str(seeds_dir), "--format", "json", "--metrics", "eval/tau,train/loss", "--group-by")
    )
    assert len(recs) == 2
    a, b = sorted(recs, key=lambda r: r["loss.kl_temperature"])
    assert a["n"] == 3 and a["train.seed"] == "0,1,2"
    # A: taus 2.0, 2.5, 3.0 -> mean 2.5, deviations -0.5, 0, 0.5 -> var (0.25+0+0.25)/2 = 0.25 -> std 0.5
    assert a["eval/tau mean"] == pytest.approx(2.5) and a["eval/tau std"] == pytest.approx(0.5)
    # A: losses 1, 2, 3 -> mean 2, std 1
    assert a["train/loss mean"] == pytest.approx(2.0) and a["train/loss std"] == pytest.approx(1.0)
    # B: taus 3.0, 4.0 -> mean 3.5, var (0.25+0.25)/1 = 0.5 -> std sqrt(0.5)
    assert b["n"] == 2 and b["eval/tau mean"] == pytest.approx(3.5)
    assert b["eval/tau std"] == pytest.approx(math.sqrt(0.5))
    assert a["status"] == "completed:3"


def test_group_by_key_and_sort_by_mean(sweep_dir: Path, seeds_dir: Path, capsys: pytest.CaptureFixture) -> None:
    runs = find_runs([sweep_dir])
    groups = group_runs(runs, ["loss.kl_temperature"])
    columns, rows = group_table(groups, ["eval/tau"], seed_key=None)
    assert columns[:2] == ["loss.kl_temperature", "n"]
    got = {r[0]: dict(zip(columns, r)) for r in rows}
    assert got[1.0]["eval/tau mean"] == pytest.approx(2.3)  # (2.0 + 2.6) / 2
    assert got[2.0]["eval/tau mean"] == pytest.approx(2.3) and got[2.0]["eval/tau std"] is None  # one value
    assert got[2.0]["status"] == "completed:1 failed:1"
    assert got[2.0]["n"] == 1 and got[1.0]["n"] == 2  # n: the values the mean is over, not the failed run

    recs = json.loads(_cli(capsys, str(seeds_dir), "--format", "json", "--group-by", "auto", "--sort", "eval/tau"))
    assert [r["eval/tau mean"] for r in recs] == pytest.approx([3.5, 2.5])


def test_diff(seeds_dir: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = load_run(seeds_dir / "run0"), load_run(seeds_dir / "run4")  # (T=1, seed 0) vs (T=2, seed 1)
    columns, rows = diff_table(a, b, ["eval/tau"])
    config = {r[1]: r for r in rows if r[0] == "config"}
    assert set(config) == {"loss.kl_temperature", "train.seed"}  # output_dir names the run dir: ignored
    assert config["loss.kl_temperature"][2:] == [1.0, 2.0, 1.0]
    metric = {r[1]: r for r in rows if r[0] == "metric"}
    assert metric["eval/tau"][2:] == [2.0, 4.0, 2.0]
    assert metric["train/loss"][4] == pytest.approx(1.0)  # 2.0 - 1.0

    out = _cli(capsys, "--diff", str(seeds_dir / "run0"), str(seeds_dir / "run4"), "--format", "csv")
    recs = list(csv.DictReader(io.StringIO(out)))
    assert {"loss.kl_temperature", "train.seed", "eval/tau", "status"} <= {r["key"] for r in recs}
    assert main(["--diff", str(seeds_dir), str(seeds_dir / "run0")]) == 1  # the parent is not a run


def test_plot_writes_png(sweep_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plots" / "loss.png"
    _cli(capsys, str(sweep_dir), "--plot", str(out), "--plot-metric", "train/loss")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(sweep_dir), "--plot", str(out), "--plot-metric", "eval/nope"]) == 1


def test_no_runs_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(tmp_path)]) == 1
    assert "no run directories" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 1


def test_flatten() -> None:
    assert rundir.flatten({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": None}) == {
        "a.b": 1,
        "a.c": [1, 2],
        "a.d": {},
        "e": None,
    }


# ---------------------------------------------------------------------------------------------------------
# SweepSummaryCallback


def _job_cfg(sweep: Path, job: int | None, mode: str | None = "MULTIRUN"):
    hydra = {"sweep": {"dir": str(sweep), "subdir": str(job)}}
    if job is not None:
        hydra["runtime"] = {"output_dir": str(sweep / str(job))}
    if mode is not None:
        hydra["mode"] = mode
    return OmegaConf.create({"hydra": hydra})


def _ret(status: JobStatus) -> SimpleNamespace:
    return SimpleNamespace(status=status)


def test_callback_writes_sweep_json_after_each_job(sweep_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = SweepSummaryCallback()
    cb.on_job_end(_job_cfg(sweep_dir, 0), _ret(JobStatus.COMPLETED))
    first = json.loads((sweep_dir / SWEEP_FILE).read_text())
    assert first["finished"] is False and first["jobs"][0]["hydra_status"] == "COMPLETED"

    for job in (1, 2):
        cb.on_job_end(_job_cfg(sweep_dir, job), _ret(JobStatus.COMPLETED))
    cb.on_job_end(_job_cfg(sweep_dir, 3), _ret(JobStatus.FAILED))
    # Hydra 1.3.8 skips on_multirun_end when a job failed: sweep.json must already be complete here
    data = json.loads((sweep_dir / SWEEP_FILE).read_text())
    assert data["varying_keys"] == ["loss.kl_temperature", "loss.streak_alpha"]
    jobs = {j["job_num"]: j for j in data["jobs"]}
    assert sorted(jobs) == [0, 1, 2, 3]
    assert jobs[3]["status"] == "failed" and jobs[3]["hydra_status"] == "FAILED"
    assert jobs[3]["metrics"]["eval/tau"] is None and jobs[1]["metrics"]["eval/tau"] == 2.6
    assert jobs[2]["config"] == {"loss.kl_temperature": 2.0, "loss.streak_alpha": 0.0}
    assert jobs[0]["run_dir"] == "0" and "status_stale" not in jobs[0]

    with caplog.at_level("INFO", logger="dflash.analysis.sweep"):
        cb.on_multirun_end(_job_cfg(sweep_dir, None))
    assert json.loads((sweep_dir / SWEEP_FILE).read_text())["finished"] is True
    assert "loss.streak_alpha" in caplog.text and "failed" in caplog.text


def test_callback_marks_killed_and_unsnapshotted_jobs(sweep_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # job 4: status.json still "running" though Hydra ended it; job 5: failed before writing any of our files
    write_run(
        sweep_dir / "4", base_config(sweep_dir / "4"), [{"step": 1, "time_s": 1.0}], status="running", wall_time_s=None
    )
    (sweep_dir / "5" / ".hydra").mkdir(parents=True)
    cb = SweepSummaryCallback(metrics=["eval/tau"])
    cb.on_job_end(_job_cfg(sweep_dir, 4), _ret(JobStatus.FAILED))
    cb.on_job_end(_job_cfg(sweep_dir, 5), _ret(JobStatus.FAILED))
    jobs = {j["job_num"]: j for j in json.loads((sweep_dir / SWEEP_FILE).read_text())["jobs"]}
    assert jobs[4]["status"] == "running" and jobs[4]["status_stale"] is True
    assert jobs[5]["status"] == "failed" and jobs[5]["config"]["loss.kl_temperature"] is None
    assert jobs[2]["hydra_status"] is None and jobs[2]["status"] == "completed"  # not seen by this callback
    with caplog.at_level("WARNING", logger="dflash.analysis.sweep"):
        cb.on_multirun_end(_job_cfg(sweep_dir, None))
    assert "still says running" in caplog.text


def test_callback_ignores_single_runs(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "single", base_config(tmp_path / "single"), [])
    cfg = OmegaConf.create(
        {"hydra": {"mode": "RUN", "sweep": {"dir": str(tmp_path / "sw")}, "runtime": {"output_dir": str(run_dir)}}}
    )
    cb = SweepSummaryCallback()
    cb.on_run_end(cfg)
    cb.on_job_end(cfg, _ret(JobStatus.COMPLETED))
    assert not (tmp_path / "sw").exists() and not (run_dir / SWEEP_FILE).exists()


APP = """
import json, os, hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(config_path=None, config_name=None, version_base="1.3")
def main(cfg):
    out = HydraConfig.get().runtime.output_dir
    def dump(name, obj):
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f)
    with open(os.path.join(out, "config_resolved.yaml"), "w") as f:
        f.write("loss:\\n  streak_alpha: %s\\n" % cfg.alpha)
    dump("status.json", {"status": "running"})
    if cfg.alpha == 0.5:
        dump("status.json", {"status": "failed", "error": "boom"})
        raise RuntimeError("boom")
    dump("summary.json", {"eval/tau": 1.0 + cfg.alpha})
    dump("status.json", {"status": "completed", "wall_time_s": 0.1})

if __name__ == "__main__":
    main()
"""


def test_real_hydra_multirun_with_a_failed_job(tmp_path: Path) -> None:
    """Through Hydra's basic launcher: the failed job skips on_multirun_end, sweep.json still has all jobs."""
    (tmp_path / "app.py").write_text(APP)
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [
            sys.executable,
            "app.py",
            "-m",
            "+alpha=0.0,0.5,1.0",
            f"hydra.sweep.dir={sweep}",
            "+hydra.callbacks.sweep_summary._target_=dflash.analysis.sweep.SweepSummaryCallback",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0, proc.stderr  # Hydra re-raises the failed job after the batch
    data = json.loads((sweep / SWEEP_FILE).read_text())
    assert data["finished"] is False  # written by on_job_end; on_multirun_end never ran
    assert [(j["job_num"], j["status"], j["hydra_status"]) for j in data["jobs"]] == [
        (0, "completed", "COMPLETED"),
        (1, "failed", "FAILED"),
        (2, "completed", "COMPLETED"),
    ]
    assert [j["metrics"]["eval/tau"] for j in data["jobs"]] == [1.0, None, 2.0]


def test_eval_json_metrics_fill_in_without_summary(tmp_path: Path) -> None:
    """A run without summary.json (killed before the end) still shows the tau its eval.json recorded."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config_resolved.yaml").write_text("loss:\n  name: kl\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "train/loss": 1.5}) + "\n")
    (run / "eval.json").write_text(json.dumps({"step": 5, "metrics": {"eval/tau": 3.5}, "details": {}}))
    loaded = load_run(run)
    assert loaded.metrics["eval/tau"] == 3.5 and loaded.metrics["train/loss"] == 1.5


def test_sort_keeps_numbers_before_text_in_both_directions() -> None:
    from dflash.analysis.compare import sort_items

    items = ["abc", 2, 1.0, None, "zz", float("nan")]
    assert sort_items(items, [("k", True)], lambda x, k: x)[:4] == [2, 1.0, "zz", "abc"]
    assert sort_items(items, [("k", False)], lambda x, k: x)[:4] == [1.0, 2, "abc", "zz"]


def test_seed_groups_get_confidence_intervals_error_bars_and_a_best_command(tmp_path: Path) -> None:
    """Three seeds of four configurations: mean, std and 95% t interval per group, which group is best and which
    is within noise of it (seed by seed), an error-bar PNG, and the command line that reruns the best group."""
    taus = {0.5: [3.0, 3.4, 3.2], 0.7: [3.0, 3.21, 3.39], 1.0: [3.1, 3.3, 3.5], 2.0: [2.0, 2.1, 2.2]}
    for j, (alpha, seeds) in enumerate(taus.items()):
        for s, tau in enumerate(seeds):
            cfg = base_config(tmp_path / f"{j}_{s}", loss={"streak_alpha": alpha}, train={"seed": s})
            run = write_run(tmp_path / f"{j}_{s}", cfg, [{"step": 10, "train/loss": 1.0}], summary={"eval/tau": tau})
            info = {
                "argv": ["launch.py"],
                "overrides": [f"loss.streak_alpha={alpha}", f"train.seed={s}", "experiment=sweep_loss"],
                "choices": {},
            }
            (run / "run.json").write_text(json.dumps(info))
    groups = group_runs(find_runs([tmp_path]))
    columns, rows = group_table(groups, ["eval/tau"])
    assert {"n", "eval/tau mean", "eval/tau std", "eval/tau ci95", "eval/tau vs best"} <= set(columns)
    by_alpha = {row[columns.index("loss.streak_alpha")]: row for row in rows}
    ci = by_alpha[1.0][columns.index("eval/tau ci95")]
    assert by_alpha[1.0][columns.index("eval/tau mean")] == pytest.approx(3.3)
    assert ci == pytest.approx(4.303 * 0.2 / 3**0.5, rel=1e-3)  # t(0.975, 2) * s / sqrt(n)
    marks = {a: by_alpha[a][columns.index("eval/tau vs best")] for a in taus}
    # 0.7's interval overlaps the best's, but it is 0.1 lower on every seed: paired by seed, that is no noise
    assert marks == {1.0: "best", 0.5: "within noise", 0.7: "worse", 2.0: "worse"}
    delta, half = (by_alpha[0.5][columns.index(c)] for c in ("eval/tau Δ best", "eval/tau Δ ci95"))
    assert delta == pytest.approx(-0.1) and half == pytest.approx(4.303 * 0.2 / 3**0.5, rel=1e-3)
    assert by_alpha[0.7][columns.index("eval/tau Δ best")] == pytest.approx(-0.1)
    # without a seed to pair by, only the intervals' overlap is left: 0.7 is then within noise
    _, unpaired = group_table(groups, ["eval/tau"], pair_key=None)
    assert unpaired[rows.index(by_alpha[0.7])][columns.index("eval/tau vs best")] == "within noise"

    png = tmp_path / "groups.png"
    assert main([str(tmp_path), "--group-by", "--plot", str(png), "--plot-metric", "eval/tau"]) == 0
    assert png.stat().st_size > 5_000
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert main([str(tmp_path), "--group-by", "--best", "eval/tau"]) == 0
    assert out.getvalue().splitlines()[-1] == "python launch.py loss.streak_alpha=1.0 experiment=sweep_loss"


def test_ablation_script_writes_the_grouped_table_into_the_readme(seeds_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    (seeds_dir / "sweep.json").write_text("{}")
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- ablation_loss:begin -->\nold\n<!-- ablation_loss:end -->\nafter\n")
    script = Path(__file__).resolve().parents[1] / "scripts" / "ablation_table.py"
    args = [str(seeds_dir), "--readme", str(readme), "--metrics", "eval/tau,train/loss", "--estimates", "train/loss"]
    subprocess.run([sys.executable, str(script), *args], check=True)
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    rows = [line for line in text.splitlines() if line.startswith("| 2 ") or line.startswith("| 1 ")]
    # a table per metric, each with its paired differences against its best
    assert len(rows) == 4 and "| 3.5 |" in rows[0] and "best" in rows[0]  # sorted by mean tau, best first
    assert "eval/tau ci95" in text and "train/loss Δ best" in text and "--group-by" in text
    assert "--rank-corr train/loss:eval/tau" in text and "rho (runs)" in text  # the names the runs have
