"""Seed groups: runs identical up to the seed, their means and 95% intervals, and each group against the best
(paired by seed where they share seeds). `python -m dflash.compare DIR --group-by` shows them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash.analysis.compare import DEFAULT_IGNORE, DEFAULT_METRICS, DEFAULT_SEED_KEY, as_text, canon, varying_keys
from dflash.core.jsonio import is_number
from dflash.core.rundir import Run


@dataclass
class RunGroup:
    """Runs sharing the values in `key` (e.g. the same config up to the seed)."""

    key: dict[str, Any]
    runs: list[Run]


def group_runs(
    runs: Sequence[Run],
    by: Sequence[str] | None = None,
    seed_key: str = DEFAULT_SEED_KEY,
    ignore: Sequence[str] = DEFAULT_IGNORE,
) -> list[RunGroup]:
    """Group runs by the values of `by`; with `by=None`, by every varying config key except `seed_key`
    (runs whose configs are identical up to the seed form one group). Groups keep first-seen order."""
    if by is None:
        by = [k for k in varying_keys(runs, ignore) if k != seed_key]
    groups: dict[tuple, RunGroup] = {}
    for r in runs:
        values = {k: r.get(k) for k in by}
        sig = tuple(canon(values[k]) for k in by)
        groups.setdefault(sig, RunGroup(key=values, runs=[])).runs.append(r)
    return list(groups.values())


def _numbers(group: RunGroup, metric: str) -> list[float]:
    vals = (r.get(metric) for r in group.runs)
    return [float(v) for v in vals if is_number(v) and math.isfinite(v)]


def group_mean(group: RunGroup, metric: str) -> float | None:
    vals = _numbers(group, metric)
    return statistics.fmean(vals) if vals else None


def group_std(group: RunGroup, metric: str) -> float | None:
    """Sample standard deviation (n - 1); None below two values."""
    vals = _numbers(group, metric)
    return statistics.stdev(vals) if len(vals) >= 2 else None


# two-sided 95% Student t quantiles by degrees of freedom (1..30); above 30 the normal 1.96 is close enough
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def _ci95(vals: Sequence[float]) -> float:
    """Half-width of the 95% Student t interval of the mean of `vals` (at least two)."""
    t = _T975[len(vals) - 2] if len(vals) - 1 <= len(_T975) else 1.96
    return t * statistics.stdev(vals) / math.sqrt(len(vals))


def group_ci95(group: RunGroup, metric: str) -> float | None:
    """Half-width of the 95% t confidence interval of the group's mean (seeds as samples); None below 2."""
    vals = _numbers(group, metric)
    return _ci95(vals) if len(vals) >= 2 else None


def _values_by_seed(group: RunGroup, metric: str, seed_key: str) -> dict[str, float] | None:
    """{seed: value} over the group's runs with a finite value; None when a seed is missing or repeats."""
    out: dict[str, float] = {}
    for r in group.runs:
        v = r.get(metric)
        if not (is_number(v) and math.isfinite(v)):
            continue
        seed = r.get(seed_key)
        if seed is None or canon(seed) in out:
            return None
        out[canon(seed)] = float(v)
    return out


def paired_difference(
    group: RunGroup, other: RunGroup, metric: str, seed_key: str = DEFAULT_SEED_KEY
) -> tuple[float, float] | None:
    """Mean and 95% t half-width of `group - other` over the seeds both ran; None below two
    shared seeds. Runs of one seed share the drafter's init, data order and anchors (and the eval prompts), so
    what a seed adds to both cancels: far narrower than comparing the two groups' own intervals."""
    a, b = _values_by_seed(group, metric, seed_key), _values_by_seed(other, metric, seed_key)
    if a is None or b is None:
        return None
    diffs = [a[s] - b[s] for s in a if s in b]
    if len(diffs) < 2:
        return None
    return statistics.fmean(diffs), _ci95(diffs)


def lower_is_better(metric: str) -> bool:
    return "loss" in metric or metric.endswith(("_s", "wall_time_s"))


@dataclass
class VersusBest:
    """A group against the best group: `mark` is `best`, `within noise`, `worse` or `n<2`; `delta` its mean
    minus the best's (paired by seed where they share two or more seeds), `ci95` the paired interval's
    half-width (None when not paired)."""

    mark: str = ""
    delta: float | None = None
    ci95: float | None = None


def versus_best(groups: Sequence[RunGroup], metric: str, seed_key: str | None = DEFAULT_SEED_KEY) -> list[VersusBest]:
    """Each group against the best by `metric`'s mean. Groups that share two or more seeds with the best are
    compared pair by pair: `within noise` when the 95% interval of the per-seed differences holds 0. Other
    groups: `within noise` when their own 95% intervals overlap (`n<2` when a group has one run)."""
    means = [group_mean(g, metric) for g in groups]
    known = [i for i, m in enumerate(means) if m is not None]
    if not known:
        return [VersusBest() for _ in groups]
    pick = min if lower_is_better(metric) else max
    best = pick(known, key=lambda i: means[i])
    b_lo, b_hi = _interval(groups[best], metric)
    out = []
    for i, g in enumerate(groups):
        paired = paired_difference(g, groups[best], metric, seed_key) if seed_key and i != best else None
        if i == best:
            out.append(VersusBest("best", 0.0))
        elif means[i] is None:
            out.append(VersusBest())
        elif paired is not None:
            delta, half = paired
            out.append(VersusBest("within noise" if abs(delta) <= half else "worse", delta, half))
        elif group_ci95(g, metric) is None or group_ci95(groups[best], metric) is None:
            out.append(VersusBest("n<2", means[i] - means[best]))
        else:
            lo, hi = _interval(g, metric)
            out.append(VersusBest("within noise" if lo <= b_hi and b_lo <= hi else "worse", means[i] - means[best]))
    return out


def _interval(group: RunGroup, metric: str) -> tuple[float, float]:
    mean, half = group_mean(group, metric), group_ci95(group, metric) or 0.0
    return mean - half, mean + half


def group_table(
    groups: Sequence[RunGroup],
    metrics: Sequence[str] = DEFAULT_METRICS,
    seed_key: str | None = DEFAULT_SEED_KEY,
    pair_key: str | None = DEFAULT_SEED_KEY,
) -> tuple[list[str], list[list[Any]]]:
    """One row per group: group keys, the seeds it holds, n, `<metric> mean` / `std` / `ci95` (half-width of
    the 95% t interval over the group's runs), for the first metric `vs best`, `Δ best` and `Δ ci95`
    (`versus_best`, paired by `pair_key`), statuses.

    Means and stds are over the runs that have a finite value, and n counts those of the first metric (what its
    mean and interval are over: a failed run without a value is not in n); the status column shows what the
    group holds (e.g. `completed:2 failed:1`), filter with `status==completed` to average finished runs only.
    """
    keys = list(groups[0].key) if groups else []
    show_seed = seed_key is not None and seed_key not in keys
    columns = keys + ([seed_key] if show_seed else []) + ["n"]
    for m in metrics:
        columns += [f"{m} mean", f"{m} std", f"{m} ci95"]
    columns += [f"{metrics[0]} vs best", f"{metrics[0]} Δ best", f"{metrics[0]} Δ ci95"] if metrics else []
    columns += ["status", "wall_time_s mean"]
    versus = versus_best(groups, metrics[0], pair_key) if metrics else []
    rows = []
    for gi, g in enumerate(groups):
        row: list[Any] = [("null" if g.key[k] is None else g.key[k]) for k in keys]
        if show_seed:
            seeds = [r.config.get(seed_key) for r in g.runs]
            row.append(",".join(as_text(s) for s in seeds if s is not None) or None)
        row.append(len(_numbers(g, metrics[0])) if metrics else len(g.runs))
        for m in metrics:
            row += [group_mean(g, m), group_std(g, m), group_ci95(g, m)]
        if metrics:
            row += [versus[gi].mark, versus[gi].delta, versus[gi].ci95]
        counts: dict[str, int] = {}
        for r in g.runs:
            counts[r.status] = counts.get(r.status, 0) + 1
        row.append(" ".join(f"{s}:{n}" for s, n in counts.items()))
        row.append(group_mean(g, "wall_time_s"))
        rows.append(row)
    return columns, rows
