"""`python -m dflash.report RUN_DIR [RUN_DIR ...] [--out report.png|report.html]`: a picture of one run, or of
several side by side, from the run directories alone (matplotlib; W&B not needed).

Panels: training loss on a log scale (total, CE and KL); eval/tau over steps with the prompt-lookup and
untrained baselines as lines; the final eval's acceptance-length histogram; its per-position acceptance;
throughput over time; queue depths over time; tau per benchmark suite (benchmarks.json, temperature 0) with
prompt lookup's on the same prompts as a marker. `.html` embeds the picture and a table of each run's summary.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash.core.jsonio import is_number
from dflash.core.rundir import Run, load_run, read_eval_json

PANELS = (
    "Training loss (log scale)",
    "Acceptance length tau",
    "Final eval: acceptance length per cycle",
    "Final eval: acceptance by draft position",
    "Throughput",
    "Queue depths",
    "Benchmarks: tau per suite (T=0)",
)
SUMMARY_KEYS = (
    "eval/tau",
    "eval/tau_baseline",
    "eval/tau_untrained",
    "eval/speedup",
    "train/loss",
    "train/avg_streak",
    "perf/ktok_s",
    "step",
    "wall_time_s",
)


def _label(run: Run, runs: Sequence[Run]) -> str:
    return run.path.name if len({r.path.name for r in runs}) == len(runs) else str(run.path)


def _final_eval_bars(ax, runs: Sequence[Run], prefix: str, xlabel: str, ylabel: str) -> None:
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        ev = read_eval_json(run.path / "eval.json")
        if ev is None:
            continue
        points = sorted(
            (int(k.rsplit("_", 1)[1]), v) for k, v in ev["metrics"].items() if k.startswith(prefix) and is_number(v)
        )
        if points:
            xs, ys = zip(*points)
            ax.bar([x + (i - (len(runs) - 1) / 2) * width for x in xs], ys, width=width, label=_label(run, runs))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def _bench_bars(ax, runs: Sequence[Run]) -> None:
    """A bar per run and suite (bench/<suite>/tau, greedy), prompt lookup's tau as a black tick on each."""
    suites = sorted(
        {k.split("/")[1] for run in runs for k in run.metrics if k.startswith("bench/") and k.count("/") == 2}
    )
    suites = [s for s in suites if any(is_number(r.metrics.get(f"bench/{s}/tau")) for r in runs)]
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        xs, taus, lookups = [], [], []
        for j, suite in enumerate(suites):
            t = run.metrics.get(f"bench/{suite}/tau")
            if is_number(t):
                xs.append(j + (i - (len(runs) - 1) / 2) * width)
                taus.append(t)
                lookups.append(run.metrics.get(f"bench/{suite}/tau_lookup"))
        if xs:
            ax.bar(xs, taus, width=width, color=f"C{i}", label=_label(run, runs))
            pts = [(x, v) for x, v in zip(xs, lookups) if is_number(v)]
            if pts:
                ax.plot(*zip(*pts), "k_", markersize=14, label=f"{_label(run, runs)} prompt lookup")
    ax.set_xticks(range(len(suites)), suites)
    ax.set_ylabel("tau (z-lab's mean over prompts)")


def _series(ax, xs, ys, style: str, **kwargs) -> None:
    """A line; a series of one point (a run stopped after its first record) gets a marker, or it draws nothing."""
    ax.plot(xs, ys, style, marker="o" if len(xs) == 1 else None, **kwargs)


def figure(runs: Sequence[Run]):
    """The report's matplotlib Figure for these runs (one colour per run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 4, figsize=(22, 9), constrained_layout=True)
    fig.delaxes(grid.flat[-1])
    axes = grid.flat[: len(PANELS)]
    loss, tau, hist, pos, speed, queues, bench = axes
    for ax, title in zip(axes, PANELS):
        ax.set_title(title)
    for i, run in enumerate(runs):
        colour, name = f"C{i}", _label(run, runs)
        for metric, style in (("train/loss", "-"), ("train/loss_ce", "--"), ("train/loss_kl", ":")):
            xs, ys = run.history(metric)
            pts = [(x, y) for x, y in zip(xs, ys) if y > 0]  # a log axis shows positive values only
            if pts:
                _series(loss, *zip(*pts), style, color=colour, label=f"{name} {metric.removeprefix('train/')}")
        xs, ys = run.history("eval/tau")
        if xs:
            tau.plot(xs, ys, "o-", color=colour, label=f"{name} DFlash")
        for key, style, what in (
            ("eval/tau_baseline", "--", "prompt lookup"),
            ("eval/tau_untrained", ":", "untrained"),
        ):
            if is_number(run.metrics.get(key)):
                tau.axhline(run.metrics[key], linestyle=style, color=colour, label=f"{name} {what}")
        xs, ys = run.history("perf/ktok_s", x="time_s")
        if xs:
            _series(speed, xs, ys, "-", color=colour, label=name)
        for metric, style in (("perf/target_queue_depth", "-"), ("perf/hs_queue_depth", "--")):
            xs, ys = run.history(metric, x="time_s")
            if xs:
                label = f"{name} {metric.split('/')[1].removesuffix('_depth')}"
                _series(queues, xs, ys, style, color=colour, label=label)
    loss.set_yscale("log")
    loss.set_xlabel("step")
    tau.set_xlabel("step")
    tau.set_ylabel("accepted tokens per verify cycle")
    _final_eval_bars(hist, runs, "eval/acc_hist_", "accepted tokens in a cycle", "share of cycles")
    _final_eval_bars(pos, runs, "eval/acc_pos_", "draft position k", "share of cycles accepting >= k")
    speed.set_xlabel("seconds")
    speed.set_ylabel("ktok/s")
    queues.set_xlabel("seconds")
    queues.set_ylabel("items")
    _bench_bars(bench, runs)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    return fig


def write_report(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    """Write the report of these run directories to `out` (.png, or .html with the picture inside)."""
    runs = [load_run(d) for d in run_dirs]
    out = Path(out)
    fig = figure(runs)
    if out.suffix == ".html":
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        out.write_text(_html(runs, base64.b64encode(buf.getvalue()).decode()))
    else:
        fig.savefig(out, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def _html(runs: Sequence[Run], png_b64: str) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ("run", "status", *SUMMARY_KEYS))
    rows = []
    for r in runs:
        cells = [str(r.path), r.status, *(_cell(r.metrics.get(k)) for k in SUMMARY_KEYS)]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>dflash report</title></head><body>"
        f"<h1>dflash report</h1><table border='1' cellpadding='4'><tr>{head}</tr>{''.join(rows)}</table>"
        f"<p><img alt='report' src='data:image/png;base64,{png_b64}'></p></body></html>\n"
    )


def _cell(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dflash.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("runs", nargs="+", help="run directories")
    ap.add_argument(
        "--out", help="report.png or report.html (default: report.png in the run dir, or ./report.png for several runs)"
    )
    args = ap.parse_args(argv)
    missing = [d for d in args.runs if not (Path(d) / "config_resolved.yaml").is_file()]
    if missing:
        print(f"error: not a run directory (no config_resolved.yaml): {', '.join(missing)}", file=sys.stderr)
        return 2
    out = args.out or (Path(args.runs[0]) / "report.png" if len(args.runs) == 1 else Path("report.png"))
    print(f"wrote {write_report(args.runs, out)}")
    return 0
