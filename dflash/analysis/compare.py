"""Compare runs by their output directories: the keys that vary, filters, sorting, tables, diffs (seed groups:
`dflash.analysis.seed_groups`).

Runs are read by `dflash.core.rundir.find_runs`; this module decides what to show. Library use:

    runs = find_runs(["outputs/multirun"])
    columns, rows = compare_table(runs, ["eval/tau", "train/loss"])
    print(render(columns, rows, "markdown"))   # dflash.analysis.compare_cli.render
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dflash.core.jsonio import is_number, json_safe
from dflash.core.rundir import Run

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


def as_text(v: Any) -> str:
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
            return _OPS[self.op](as_text(v), as_text(self.value))
        if v is None:
            return False  # a missing value is neither larger nor smaller than anything
        return _OPS[self.op](as_text(v), as_text(self.value))


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
    return (1, 0.0, as_text(v))


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
