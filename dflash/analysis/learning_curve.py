"""`python -m dflash.compare DIR ... --curve OUT.png`: how much tau a unit of compute buys.

One panel per set of prompts (held-out eval and each benchmark suite at temperature 0), two rows: tau against the
supervised tokens a drafter saw (`train/supervised_tokens`: the loss mask's tokens, on chat data the assistant turns
only), and against the CPU-hours its run cost. Where a run predates that count, the axis is every token of every
batch (`tokens`) for all runs, and says so. A recipe is a line: runs equal
up to their budget (train.max_steps, train.max_tokens, train.max_minutes) and seed form one recipe; runs of a recipe
at one budget are averaged over seeds (error bars: their range). Prompt lookup on the same prompts is a horizontal
line per panel (the mean over the runs that measured it), so a recipe's curve crossing it is the budget at which
its drafter starts to pay.

The cost of a run: `cost/cpu_s` (make real's whole cost: regeneration, store and training; dflash/analysis/run_cost.py)
where recorded, else the training stages' CPU seconds (`perf/source_cpu_s` + `perf/target_cpu_s` +
`perf/drafter_cpu_s`: no eval); the legend marks recipes measured the second way, which leaves out what their data
and store cost.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dflash.analysis.compare import DEFAULT_SEED_KEY, canon, varying_keys
from dflash.core.jsonio import is_number
from dflash.core.rundir import Run

BUDGET_KEYS = ("train.max_steps", "train.max_tokens", "train.max_minutes")
SUPERVISED = "train/supervised_tokens"
HELD_OUT = "held-out"


@dataclass
class Point:
    tokens: list[float] = field(default_factory=list)
    cpu_hours: list[float] = field(default_factory=list)
    tau: dict[str, list[float]] = field(default_factory=dict)  # per panel, one value per seed
    partial_cost: bool = False  # a run's cost left out its data and store


def panel_taus(run: Run) -> dict[str, tuple[float, float | None]]:
    """(tau, prompt lookup's tau) per panel: the held-out eval and each suite at temperature 0."""
    m = run.metrics
    out = {}
    if is_number(m.get("eval/tau")):
        out[HELD_OUT] = (float(m["eval/tau"]), m.get("eval/tau_baseline"))
    for key, value in m.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "bench" and parts[2] == "tau" and is_number(value):
            out[parts[1]] = (float(value), m.get(f"bench/{parts[1]}/tau_lookup"))
    return out


TRAINING_CPU = ("perf/source_cpu_s", "perf/target_cpu_s", "perf/drafter_cpu_s")  # the stages' threads, no eval


def run_cost_hours(run: Run) -> tuple[float | None, bool]:
    """(CPU-hours, whether only the training's own CPU time was known: its stages, without data, store or eval)."""
    m = run.metrics
    if is_number(m.get("cost/cpu_s")):
        return float(m["cost/cpu_s"]) / 3600, False
    if all(is_number(m.get(k)) for k in TRAINING_CPU):
        return sum(float(m[k]) for k in TRAINING_CPU) / 3600, True
    return None, True


def token_axis(runs: Sequence[Run]) -> tuple[str, str]:
    """(the metric the token axis reads, its label): supervised tokens where every run with a tau counted them, else
    every token of every batch, labelled so (runs before train/supervised_tokens; on chat data ~4x the supervised)."""
    measured = [r for r in runs if panel_taus(r)]
    if measured and all(is_number(r.metrics.get(SUPERVISED)) for r in measured):
        return SUPERVISED, "supervised tokens seen"
    return "tokens", "tokens seen (all, not only supervised)"


def recipe_label(run: Run, keys: Sequence[str]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={run.get(k)}" for k in keys) or "runs"


def curve_points(runs: Sequence[Run], recipe_keys: Sequence[str] | None = None) -> dict[str, dict[tuple, Point]]:
    """recipe label -> budget -> Point. Recipe keys default to every config key that varies over the runs, but
    the budget keys, the seeds and the run's own paths."""
    if recipe_keys is None:
        ignore = ("hydra", "paths", "logging", "features.path", "eval.replay_dir", *BUDGET_KEYS)
        recipe_keys = [k for k in varying_keys(runs, ignore) if k not in (DEFAULT_SEED_KEY, "train.data_seed")]
    curves: dict[str, dict[tuple, Point]] = {}
    token_key = token_axis(runs)[0]
    for run in runs:
        taus = panel_taus(run)
        if not taus:
            continue
        budget = tuple(canon(run.get(k)) for k in BUDGET_KEYS)
        point = curves.setdefault(recipe_label(run, recipe_keys), {}).setdefault(budget, Point())
        hours, partial = run_cost_hours(run)
        if is_number(run.metrics.get(token_key)):
            point.tokens.append(float(run.metrics[token_key]))
        if hours is not None:
            point.cpu_hours.append(hours)
        point.partial_cost |= partial
        for panel, (tau, _) in taus.items():
            point.tau.setdefault(panel, []).append(tau)
    return curves


def lookup_levels(runs: Sequence[Run]) -> dict[str, float]:
    """Prompt lookup's tau per panel, the mean over the runs that measured it (the same prompts give the same)."""
    seen: dict[str, list[float]] = {}
    for run in runs:
        for panel, (_, lookup) in panel_taus(run).items():
            if is_number(lookup):
                seen.setdefault(panel, []).append(float(lookup))
    return {p: statistics.fmean(v) for p, v in seen.items()}


def projections(runs: Sequence[Run], recipe_keys: Sequence[str] | None = None) -> list[dict]:
    """Per recipe and panel with two or more budgets: the least-squares line tau = a + b * log2(CPU-hours) through
    the budgets' means, its gain per doubling of compute, and the CPU-hours at which it reaches prompt lookup (None
    when it does not rise). An extrapolation of a few points: it says how far, not when."""
    curves, lookups = curve_points(runs, recipe_keys), lookup_levels(runs)
    rows = []
    for label, points in curves.items():
        panels = {p for pt in points.values() for p in pt.tau}
        for panel in sorted(panels, key=lambda p: p != HELD_OUT):
            xy = [
                (math.log2(statistics.fmean(pt.cpu_hours)), statistics.fmean(pt.tau[panel]))
                for pt in points.values()
                if pt.cpu_hours and panel in pt.tau
            ]
            if len({x for x, _ in xy}) < 2:
                continue
            mx, my = statistics.fmean(x for x, _ in xy), statistics.fmean(y for _, y in xy)
            slope = sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)
            lookup = lookups.get(panel)
            reach = None
            if lookup is not None and slope > 0:
                reach = 2 ** (mx + (lookup - my) / slope)
            rows.append(
                {"recipe": label, "panel": panel, "budgets": len(xy), "tau_per_doubling": slope,
                 "lookup": lookup, "cpu_hours_to_lookup": reach, "cpu_hours_now": 2 ** max(x for x, _ in xy)}
            )  # fmt: skip
    return rows


def projection_table(rows: list[dict]) -> str:
    lines = [
        "recipe | prompts | budgets | tau per doubling of CPU | prompt lookup | CPU-hours now | CPU-hours to lookup"
    ]
    for r in rows:
        reach = "-" if r["cpu_hours_to_lookup"] is None else f"{r['cpu_hours_to_lookup']:.3g}"
        lookup = "-" if r["lookup"] is None else f"{r['lookup']:.3f}"
        lines.append(
            f"{r['recipe']} | {r['panel']} | {r['budgets']} | {r['tau_per_doubling']:+.3f} | {lookup} | "
            f"{r['cpu_hours_now']:.3g} | {reach}"
        )
    return "\n".join(lines)


def plot_curves(runs: Sequence[Run], out: str | Path, recipe_keys: Sequence[str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves, lookups, token_label = curve_points(runs, recipe_keys), lookup_levels(runs), token_axis(runs)[1]
    panels = sorted({p for pts in curves.values() for pt in pts.values() for p in pt.tau}, key=lambda p: p != HELD_OUT)
    if not panels:
        raise ValueError("--curve: no run has eval/tau or bench/<suite>/tau to draw")
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7.5), squeeze=False)
    for col, panel in enumerate(panels):
        for row, (x_name, x_label) in enumerate((("tokens", token_label), ("cpu_hours", "CPU-hours"))):
            ax = axes[row][col]
            for label, points in curves.items():
                xs, ys, lo, hi = [], [], [], []
                for pt in points.values():
                    values, x = pt.tau.get(panel), getattr(pt, x_name)
                    if not values or not x:
                        continue
                    xs.append(statistics.fmean(x))
                    ys.append(statistics.fmean(values))
                    lo.append(ys[-1] - min(values))
                    hi.append(max(values) - ys[-1])
                if not xs:
                    continue
                order = sorted(range(len(xs)), key=xs.__getitem__)
                partial = any(p.partial_cost for p in points.values())  # its CPU-hours leave out data and store
                spread = [[lo[i] for i in order], [hi[i] for i in order]]
                ax.errorbar(
                    [xs[i] for i in order], [ys[i] for i in order], yerr=spread,
                    marker="o", capsize=3, label=label + (" (training CPU only)" if partial else ""),
                )  # fmt: skip
            if panel in lookups:
                ax.axhline(lookups[panel], color="grey", linestyle="--", label="prompt lookup")
            ax.set_xscale("log")
            ax.set_xlabel(x_label)
            ax.set_ylabel("tau")
            ax.set_title(panel)
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:  # every recipe once, whichever panel has it
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(3, max(1, len(labels))), fontsize=8)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * math.ceil(len(labels) / 3), 1, 1))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
