"""Compare runs by their output directories: the keys that vary, filters, sorting, tables, seed groups, diffs.

Runs are read by `dflash.rundir.find_runs`; this module decides what to show. Library use:

    runs = find_runs(["outputs/multirun"])
    columns, rows = compare_table(runs, ["eval/tau", "train/loss"])
    print(render(columns, rows, "markdown"))   # dflash.tools.compare_cli.render
"""

from __future__ import annotations

import difflib
import json
import math
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dflash.jsonio import is_number, json_safe
from dflash.rundir import Run

DEFAULT_METRICS = ("eval/tau", "train/avg_streak", "train/loss", "perf/ktok_s")


DEFAULT_SEED_KEY = "train.seed"


DEFAULT_IGNORE = ("hydra",)  # config key prefixes that never describe an experiment


# run-level fields addressable by --sort/--filter/--group-by besides config keys and metrics
RUN_FIELDS = ("status", "wall_time_s", "run_dir", "error")


_FILTER_RE = re.compile(r"^\s*(?P<key>[^=!<>]+?)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<value>.*?)\s*$")


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
}


@dataclass
class RunGroup:
    """Runs sharing the values in `key` (e.g. the same config up to the seed)."""

    key: dict[str, Any]
    runs: list[Run]


def canon(v: Any) -> str:
    """Hashable, comparable form of a config value (lists and dicts included)."""
    return json.dumps(v, sort_keys=True, default=str)


def _mentions_run_dir(value: Any, run: Run) -> bool:
    """True for string values naming the run's own directory (output paths differ in every run)."""
    if not isinstance(value, str) or not value:
        return False
    tail = "/".join(run.path.parts[-2:])  # "<time>/<job_num>" or "<date>/<time>": unique per run
    return str(run.path) in value or tail in value


def varying_keys(runs: Sequence[Run], ignore: Sequence[str] = DEFAULT_IGNORE) -> list[str]:
    """Config keys whose value is not the same in every run (runs without a config do not count).

    Keys under an `ignore` prefix and keys whose value names the run's own directory are left out.
    """
    with_cfg = [r for r in runs if r.config]
    if len(with_cfg) < 2:
        return []
    keys = sorted({k for r in with_cfg for k in r.config})
    out = []
    for k in keys:
        if is_ignored(k, ignore):
            continue
        if any(_mentions_run_dir(r.config.get(k), r) for r in with_cfg):
            continue
        if len({canon(r.config.get(k, "<missing>")) for r in with_cfg}) > 1:
            out.append(k)
    return out


def is_ignored(key: str, ignore: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in ignore)


def known_keys(runs: Sequence[Run]) -> set[str]:
    """Every name --sort/--filter/--group-by accept for these runs."""
    keys = set(RUN_FIELDS) | {"path"}
    for r in runs:
        keys.update(r.config)
        keys.update(r.metrics)
    return keys


def check_keys(keys: Iterable[str], runs: Sequence[Run], option: str) -> None:
    """Raise ValueError naming the option and suggesting close names for a key no run has."""
    known = known_keys(runs)
    for k in keys:
        if k not in known:
            close = difflib.get_close_matches(k, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"{option}: no run has a config key or metric named {k!r}{hint}")


def _parse_literal(text: str) -> Any:
    """Right-hand side of a filter: a number, null, true/false, or the text itself."""
    low = text.lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return float(text)
    except ValueError:
        return text.strip("'\"")


def _as_text(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return canon(v)
    return str(v)


@dataclass
class Filter:
    """One `KEY OP VALUE` condition: numbers compare numerically, anything else as text."""

    key: str
    op: str
    value: Any

    @classmethod
    def parse(cls, expr: str) -> Filter:
        m = _FILTER_RE.match(expr)
        if not m or not m.group("key").strip():
            raise ValueError(f"--filter {expr!r}: expected KEY OP VALUE with OP one of {' '.join(_OPS)}")
        return cls(m.group("key").strip(), m.group("op"), _parse_literal(m.group("value")))

    def __call__(self, run: Run) -> bool:
        v = run.get(self.key)
        if is_number(v) and is_number(self.value):
            return _OPS[self.op](float(v), float(self.value))
        if self.op in ("==", "!="):
            return _OPS[self.op](_as_text(v), _as_text(self.value))
        if v is None:
            return False  # a missing value is neither larger nor smaller than anything
        return _OPS[self.op](_as_text(v), _as_text(self.value))


def filter_runs(runs: Sequence[Run], exprs: Sequence[str]) -> list[Run]:
    """Runs matching every expression (`loss.streak_alpha>0`, `status==completed`)."""
    filters = [Filter.parse(e) for e in exprs]
    check_keys([f.key for f in filters], runs, "--filter")
    return [r for r in runs if all(f(r) for f in filters)]


def parse_sort(spec: str) -> list[tuple[str, bool]]:
    """`eval/tau,+loss.kl_temperature` -> [(key, descending)].

    A plain metric name (it contains "/") sorts descending, a plain config key or run field ascending;
    a leading `+` forces ascending, `-` descending.
    """
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part[0] in "+-":
            out.append((part[1:], part[0] == "-"))
        else:
            out.append((part, "/" in part))
    if not out:
        raise ValueError(f"--sort {spec!r}: no key given")
    return out


def _sort_value(v: Any) -> tuple:
    if is_number(v) and not math.isnan(v):
        return (0, float(v), "")
    return (1, 0.0, _as_text(v))


def sort_items(items: list, spec: Sequence[tuple[str, bool]], get: Callable[[Any, str], Any]) -> list:
    """Stable multi-key sort; missing (None / NaN) values always go last whatever the direction."""
    out = list(items)
    for key, desc in reversed(spec):
        present = [x for x in out if _present(get(x, key))]
        absent = [x for x in out if not _present(get(x, key))]
        # numbers before text in either direction (reversing one mixed list would put text first)
        numbers = [x for x in present if _sort_value(get(x, key))[0] == 0]
        texts = [x for x in present if _sort_value(get(x, key))[0] == 1]
        numbers.sort(key=lambda x: _sort_value(get(x, key)), reverse=desc)
        texts.sort(key=lambda x: _sort_value(get(x, key)), reverse=desc)
        out = numbers + texts + absent
    return out


def _present(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def config_cell(run: Run, key: str) -> Any:
    """A config value for display: a key the run lacks is blank (None), an explicit null reads `null`."""
    if key not in run.config:
        return None
    v = run.config[key]
    return "null" if v is None else v


def compare_table(
    runs: Sequence[Run],
    metrics: Sequence[str] = DEFAULT_METRICS,
    keys: Sequence[str] | None = None,
    ignore: Sequence[str] = DEFAULT_IGNORE,
) -> tuple[list[str], list[list[Any]]]:
    """One row per run: config keys (`keys`, default the varying ones), metrics, status, wall time, run dir.

    Cells hold raw values (None = missing); `render` formats them.
    """
    keys = list(varying_keys(runs, ignore) if keys is None else keys)
    columns = keys + list(metrics) + ["status", "wall_time_s", "run_dir"]
    rows = []
    for r in runs:
        rows.append([config_cell(r, k) for k in keys] + [r.get(m) for m in metrics] + [r.status, r.wall_time_s, r.name])
    return columns, rows


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
) -> tuple[float, float, int] | None:
    """Mean and 95% t half-width of `group - other` over the seeds both ran, and how many; None below two
    shared seeds. Runs of one seed share the drafter's init, data order and anchors (and the eval prompts), so
    what a seed adds to both cancels: far narrower than comparing the two groups' own intervals."""
    a, b = _values_by_seed(group, metric, seed_key), _values_by_seed(other, metric, seed_key)
    if a is None or b is None:
        return None
    diffs = [a[s] - b[s] for s in a if s in b]
    if len(diffs) < 2:
        return None
    return statistics.fmean(diffs), _ci95(diffs), len(diffs)


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
            delta, half, _ = paired
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

    Means and stds are over the runs that have a finite value; the status column shows what the group holds
    (e.g. `completed:2 failed:1`), filter with `status==completed` to average finished runs only.
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
            row.append(",".join(_as_text(s) for s in seeds if s is not None) or None)
        row.append(len(g.runs))
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


def diff_table(
    a: Run, b: Run, metrics: Sequence[str] = DEFAULT_METRICS, ignore: Sequence[str] = DEFAULT_IGNORE
) -> tuple[list[str], list[list[Any]]]:
    """Rows (section, key, A, B, B - A): differing config keys, then metrics (chosen first, then every other
    metric either run has), then status and wall time."""
    columns = ["section", "key", f"A: {a.name}", f"B: {b.name}", "delta (B-A)"]
    rows: list[list[Any]] = []
    for k in varying_keys([a, b], ignore):
        rows.append(["config", k, config_cell(a, k), config_cell(b, k), _delta(a.config.get(k), b.config.get(k))])
    extra = sorted((set(a.metrics) | set(b.metrics)) - set(metrics))
    for m in list(metrics) + extra:
        va, vb = a.metrics.get(m), b.metrics.get(m)
        if m in metrics or va is not None or vb is not None:
            rows.append(["metric", m, va, vb, _delta(va, vb)])
    rows.append(["run", "status", a.status, b.status, None])
    rows.append(["run", "wall_time_s", a.wall_time_s, b.wall_time_s, _delta(a.wall_time_s, b.wall_time_s)])
    return columns, rows


def _delta(a: Any, b: Any) -> float | None:
    return float(b) - float(a) if is_number(a) and is_number(b) else None


def human(v: Any, column: str) -> str:
    """Cell text for the table and markdown formats: 4 significant digits, durations for wall time."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and column.startswith("wall_time_s") and math.isfinite(v):
        return _duration(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return canon(v)
    return str(v)


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def machine_value(v: Any) -> Any:
    """Cell value for csv/json: raw, with NaN/inf as null (strict JSON) and containers as JSON text in CSV."""
    return json_safe(v)
