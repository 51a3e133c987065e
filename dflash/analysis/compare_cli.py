"""`python -m dflash.compare DIR [DIR...]`: the table, CSV/JSON/markdown rendering, plots and the CLI.

A run is any directory holding `config_resolved.yaml`. For each run only small text files are read: the resolved
config (flattened to dotted keys), `status.json`, the final metrics (`summary.json` over `eval.json` over the
last value of each key in `metrics.jsonl`) and `run.json`. W&B files are never read. Missing or half-written
files give blank cells, never a crash.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash.analysis.compare import (
    DEFAULT_IGNORE,
    DEFAULT_METRICS,
    DEFAULT_SEED_KEY,
    canon,
    check_keys,
    compare_table,
    config_cell,
    diff_table,
    filter_runs,
    human,
    is_ignored,
    machine_value,
    parse_sort,
    sort_items,
    varying_keys,
)
from dflash.analysis.learning_curve import plot_curves, projection_table, projections
from dflash.analysis.rank_corr import rank_corr_table
from dflash.analysis.seed_groups import group_ci95, group_mean, group_runs, group_table, lower_is_better
from dflash.core.jsonio import is_number
from dflash.core.rundir import CONFIG_FILE, Run, find_runs, load_run

log = logging.getLogger(__name__)


FORMATS = ("table", "csv", "json", "markdown")


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "table", title: str | None = None) -> str:
    """Text of a table in `fmt` (table | csv | json | markdown). Missing values are blank / null."""
    if fmt == "json":
        recs = [{c: machine_value(v) for c, v in zip(columns, row)} for row in rows]
        return json.dumps(recs, indent=2, default=str)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        for row in rows:
            w.writerow(
                [
                    "" if (x := machine_value(v)) is None else (canon(x) if isinstance(x, (list, dict)) else x)
                    for v in row
                ]
            )
        return buf.getvalue()
    if fmt == "markdown":
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines = ["| " + " | ".join(esc(c) for c in columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(esc(human(v, c)) for c, v in zip(columns, row)) + " |" for row in rows]
        return "\n".join(lines) + "\n"
    if fmt == "table":
        return _rich_table(columns, rows, title)
    raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")


def _rich_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for i, c in enumerate(columns):
        numeric = any(is_number(row[i]) for row in rows)
        table.add_column(c, justify="right" if numeric else "left", overflow="fold")
    for row in rows:
        style = {"failed": "red", "running": "yellow", "interrupted": "magenta"}.get(
            str(row[columns.index("status")]) if "status" in columns else "", None
        )
        table.add_row(*(human(v, c) for c, v in zip(columns, row)), style=style)
    # a wide virtual console: the table takes the width it needs instead of folding cells
    console = Console(file=io.StringIO(), width=max(80, _terminal_width()), color_system=None, force_terminal=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines()) + "\n"


def _terminal_width() -> int:
    """The terminal's width on a tty; otherwise (pipes, logs) wide enough that no cell folds."""
    if sys.stdout.isatty():
        try:
            return os.get_terminal_size().columns
        except OSError:
            pass
    return 1000


def _save(fig, out: str | os.PathLike) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_runs(
    runs: Sequence[Run], metric: str, out: str | os.PathLike, x: str = "step", ignore: Sequence[str] = DEFAULT_IGNORE
) -> Path:
    """One curve of `metric` vs `x` per run (from metrics.jsonl), labelled by the varying config keys."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    keys = varying_keys(runs, ignore)
    fig, ax = plt.subplots(figsize=(9, 5))
    plotted = 0
    for r in runs:
        xs, ys = r.history(metric, x)
        if not xs:
            continue
        label = ", ".join(f"{k}={human(config_cell(r, k), k)}" for k in keys) or r.name
        if r.status != "completed":
            label += f" [{r.status}]"
        ax.plot(xs, ys, label=label, linewidth=1.2, marker="o" if len(xs) < 3 else None)  # a lone point shows
        plotted += 1
    if not plotted:
        plt.close(fig)
        raise ValueError(f"--plot-metric {metric!r}: no run has it (with {x!r}) in metrics.jsonl")
    ax.set_xlabel(x)
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # long labels beside the axes
    return _save(fig, out)


def plot_groups(groups: Sequence, metric: str, out: str | os.PathLike) -> Path:
    """The final `metric` of each group as its mean with a 95% confidence interval (error bar) over its runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, means, errors = [], [], []
    for g in groups:
        mean = group_mean(g, metric)
        if mean is None:
            continue
        # one key per line: long override lists stay readable under their own bar
        labels.append("\n".join([*(f"{k}={human(v, k)}" for k, v in g.key.items()), f"n={len(g.runs)}"]))
        means.append(mean)
        errors.append(group_ci95(g, metric) or 0.0)
    if not means:
        raise ValueError(f"--plot-metric {metric!r}: no group has a final value of it")
    lines = max(label.count("\n") + 1 for label in labels)
    fig, ax = plt.subplots(figsize=(max(6, 2.0 * len(means) + 1), 4 + 0.2 * lines))
    ax.errorbar(range(len(means)), means, yerr=errors, fmt="o", capsize=6)
    ax.set_xticks(range(len(means)), labels, fontsize="small")
    ax.set_ylabel(f"{metric} (mean, 95% CI over seeds)")
    ax.set_title(f"{metric} by group")
    ax.grid(alpha=0.3)
    return _save(fig, out)


def best_command(runs: Sequence[Run], groups: Sequence | None, key: str, seed_key: str) -> str:
    """The command line that reruns the best run by `key` (with groups: the best group's mean, without its
    seed), from the overrides its run.json recorded."""
    if groups is None:
        scored = [(float(r.get(key)), [r]) for r in runs if is_number(r.get(key))]
    else:
        scored = [(group_mean(g, key), g.runs) for g in groups if group_mean(g, key) is not None]
    if not scored:
        raise ValueError(f"--best {key}: no run has a number for it")
    score, members = (min if lower_is_better(key) else max)(scored, key=lambda s: s[0])
    drop = ("hydra.", "resume=") + ((seed_key + "=",) if groups is not None else ())
    overrides = [o for o in members[0].overrides if not o.lstrip("+~").startswith(drop)]
    what = f"mean of {len(members)} runs" if groups is not None else members[0].name
    return f"# best by {key}: {score:.4g} ({what})\npython launch.py {' '.join(overrides)}".rstrip()


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash.compare",
        description="Compare dflash runs by their output directories (any dir with config_resolved.yaml, "
        "searched recursively). Shows the config keys that differ, chosen metrics, status, wall time, run dir.",
        epilog="Keys for --sort/--filter/--group-by: dotted config keys (loss.streak_alpha), metric names "
        "(eval/tau), status, wall_time_s, run_dir.",
    )
    p.add_argument("dirs", nargs="*", metavar="DIR", help="run dirs, sweep dirs or any parent of them")
    p.add_argument(
        "--metrics",
        type=_split,
        default=list(DEFAULT_METRICS),
        help=f"comma-separated metric names (default: {','.join(DEFAULT_METRICS)})",
    )
    p.add_argument(
        "--sort",
        metavar="KEY[,KEY]",
        help="sort rows; a metric (name with '/') sorts descending, other keys ascending; "
        "prefix + for ascending, - for descending (write --sort=-KEY: a bare -KEY reads as an "
        "option)",
    )
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="EXPR",
        help="keep runs where KEY OP VALUE holds, OP in == != > >= < <= (numbers compare "
        "numerically); repeat to AND (e.g. 'loss.streak_alpha>0' 'status==completed')",
    )
    p.add_argument(
        "--group-by",
        nargs="?",
        const="auto",
        metavar="KEY[,KEY]",
        help="one row per group with n, mean and sample std of each metric; alone (or 'auto') "
        "groups runs whose configs are identical except --seed-key (put it after the DIRs)",
    )
    p.add_argument(
        "--seed-key",
        default=DEFAULT_SEED_KEY,
        help="config key that --group-by auto ignores; runs of two groups with the same value are compared "
        "pair by pair in `vs best`",
    )
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument("--all-keys", action="store_true", help="show every config key, not only the differing ones")
    p.add_argument(
        "--ignore",
        action="append",
        default=list(DEFAULT_IGNORE),
        metavar="PREFIX",
        help="config key prefix never shown as differing (repeatable; 'hydra' always)",
    )
    p.add_argument(
        "--diff",
        nargs=2,
        metavar=("RUN_A", "RUN_B"),
        help="config keys that differ between two run dirs, and metric deltas B - A",
    )
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        help="write a PNG: one curve per run, or with --group-by each group's mean with a 95%% CI",
    )
    p.add_argument(
        "--best",
        metavar="KEY",
        help="print the command line that reruns the best run (with --group-by: "
        "the best group, without its seed) by KEY",
    )
    p.add_argument(
        "--rank-corr",
        metavar="EST[,EST]:REAL[,REAL]",
        help="Spearman's rank correlation of each estimate with each real metric, over the runs' final values "
        "and over every eval record (e.g. eval/sim_tau_greedy,train/avg_streak:eval/tau,bench/humaneval/tau)",
    )
    p.add_argument(
        "--curve",
        metavar="OUT.png",
        help="tau per suite against supervised tokens and CPU-hours, a line per recipe (runs equal up to budget and "
        "seed), prompt lookup as a horizontal line (dflash/analysis/learning_curve.py)",
    )
    p.add_argument(
        "--curve-recipe",
        metavar="KEY[,KEY]",
        help="--curve: the config keys that name a recipe (default: all that vary)",
    )
    p.add_argument("--plot-metric", default="train/loss", help="metric to plot (default: train/loss)")
    p.add_argument("--plot-x", default="step", choices=("step", "tokens", "time_s"), help="x axis of --plot")
    return p


def run_cli(args: argparse.Namespace) -> str:
    """Everything the CLI does, returning the text to print. Raises ValueError for user errors."""
    if args.diff:
        a, b = (load_run(d) for d in args.diff)
        for r, d in ((a, args.diff[0]), (b, args.diff[1])):
            if not (r.path / CONFIG_FILE).exists():
                raise ValueError(f"--diff: {d} is not a run directory (no {CONFIG_FILE})")
        return render(*diff_table(a, b, args.metrics, args.ignore), args.format)
    if not args.dirs:
        raise ValueError("give at least one DIR (or --diff RUN_A RUN_B)")
    runs = find_runs(args.dirs)
    if not runs:
        raise ValueError(f"no run directories (with {CONFIG_FILE}) under {', '.join(args.dirs)}")
    runs = filter_runs(runs, args.filter)
    if not runs:
        raise ValueError(f"no run matches --filter {' '.join(args.filter)}")
    sort = parse_sort(args.sort) if args.sort else []
    check_keys([k for k, _ in sort], runs, "--sort")
    if list(args.metrics) != list(DEFAULT_METRICS):  # the defaults may be missing (e.g. runs without eval)
        check_keys(args.metrics, runs, "--metrics")
    else:  # runs with benchmarks.json: their tau per suite (temperature 0) as columns too
        bench = {k: None for r in runs for k in r.metrics if k.startswith("bench/") and k.count("/") == 2}
        args.metrics = [*DEFAULT_METRICS, *(k for k in bench if k.endswith("/tau"))]
    if args.rank_corr:
        est, sep, real = args.rank_corr.partition(":")
        if not sep or not est or not real:
            raise ValueError(f"--rank-corr {args.rank_corr!r}: expected EST[,EST]:REAL[,REAL]")
        check_keys([*_split(est), *_split(real)], runs, "--rank-corr")
        columns, rows = rank_corr_table(runs, _split(est), _split(real))
        return render(columns, rows, args.format, title=f"Spearman's rho over {len(runs)} runs")
    if args.curve:
        keys = _split(args.curve_recipe) if args.curve_recipe else None
        if keys:
            check_keys(keys, runs, "--curve-recipe")
        log.info("wrote %s", plot_curves(runs, args.curve, keys))
        print(projection_table(projections(runs, keys)))  # how far each recipe's line is from prompt lookup
    if args.plot and not args.group_by:
        path = plot_runs(runs, args.plot_metric, args.plot, args.plot_x, args.ignore)
        log.info("wrote %s", path)
    if args.best and not args.group_by:
        check_keys([args.best], runs, "--best")
        return best_command(runs, None, args.best, args.seed_key)
    if args.group_by:
        by = None if args.group_by == "auto" else _split(args.group_by)
        if by:
            check_keys(by, runs, "--group-by")
        groups = group_runs(runs, by, args.seed_key, args.ignore)
        groups = sort_items(groups, sort, lambda g, k: g.key[k] if k in g.key else group_mean(g, k))
        if args.plot:
            log.info("wrote %s", plot_groups(groups, args.plot_metric, args.plot))
        if args.best:
            check_keys([args.best], runs, "--best")
            return best_command(runs, groups, args.best, args.seed_key)
        columns, rows = group_table(groups, args.metrics, args.seed_key if by is None else None, pair_key=args.seed_key)
        title = f"{len(runs)} runs in {len(groups)} groups"
    else:
        runs = sort_items(runs, sort, lambda r, k: r.get(k))
        keys = None
        if args.all_keys:
            keys = sorted({k for r in runs for k in r.config if not is_ignored(k, args.ignore)})
        columns, rows = compare_table(runs, args.metrics, keys, args.ignore)
        title = f"{len(runs)} runs"
    return render(columns, rows, args.format, title=title)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        text = run_cli(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0
