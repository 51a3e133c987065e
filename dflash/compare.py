"""Compare runs by their output directories: `python -m dflash.compare DIR [DIR...]`.

A run is any directory holding `config_resolved.yaml` (see DESIGN.md, "Output directory of a run"). For each
run we read only small text files: the resolved config (flattened to dotted keys), `status.json`, the final
metrics (`summary.json` over `eval.json` over the last value of each key in `metrics.jsonl`), and `run.json`.
W&B files are never read. Missing or half-written files give blank cells, never a crash.

The table shows the config keys that differ between the selected runs (constant keys hidden), the chosen
metrics, status, wall time and run dir. Library entry points, usable without the CLI:

    runs = find_runs(["outputs/multirun"])
    columns, rows = compare_table(runs, ["eval/tau", "train/loss"])
    print(render(columns, rows, "markdown"))
"""

from __future__ import annotations

import argparse
import csv
import difflib
import io
import json
import logging
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import yaml

from dflash.snapshot import json_safe

log = logging.getLogger(__name__)

CONFIG_FILE = "config_resolved.yaml"
DEFAULT_METRICS = ("eval/tau", "train/avg_streak", "train/loss", "perf/ktok_s")
DEFAULT_SEED_KEY = "train.seed"
DEFAULT_IGNORE = ("hydra",)  # config key prefixes that never describe an experiment
FORMATS = ("table", "csv", "json", "markdown")
# run-level fields addressable by --sort/--filter/--group-by besides config keys and metrics
RUN_FIELDS = ("status", "wall_time_s", "run_dir", "error")
# sub-directories of a run that never hold another run; skipped to keep discovery fast
_SKIP_DIRS = {"wandb", "checkpoints", "drafter", "__pycache__"}
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
class Run:
    """What compare knows about one run directory. `config` is flat: {"loss.kl_temperature": 1.0, ...}."""

    path: Path  # absolute
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)  # final value per metric name
    status: str = "unknown"  # running | completed | failed | interrupted | unknown (no status.json)
    error: str | None = None
    wall_time_s: float | None = None
    overrides: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The run dir relative to the current directory when it lies below it, else absolute."""
        try:
            return str(self.path.relative_to(Path.cwd()))
        except ValueError:
            return str(self.path)

    def get(self, key: str) -> Any:
        """Value of a run field, metric or config key (in that order); None when the run lacks it."""
        if key in ("run_dir", "path"):
            return self.name
        if key in ("status", "error", "wall_time_s"):
            return getattr(self, key)
        if key in self.metrics:
            return self.metrics[key]
        return self.config.get(key)

    def history(self, metric: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(xs, ys) of every metrics.jsonl record that has both `x` and `metric` as numbers."""
        xs: list[float] = []
        ys: list[float] = []
        for rec in _iter_jsonl(self.path / "metrics.jsonl"):
            xv, yv = rec.get(x), rec.get(metric)
            if _is_number(xv) and _is_number(yv):
                xs.append(float(xv))
                ys.append(float(yv))
        return xs, ys


@dataclass
class RunGroup:
    """Runs sharing the values in `key` (e.g. the same config up to the seed)."""

    key: dict[str, Any]
    runs: list[Run]


# ---------------------------------------------------------------------------------------------------------
# loading


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": leaf}; lists and scalars are leaves; an empty dict is a leaf too."""
    if not isinstance(tree, dict) or (not tree and prefix):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _read_json(path: Path) -> Any:
    """Parsed JSON, or None when the file is missing or not valid JSON (a run killed mid-write)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return None


def _iter_jsonl(path: Path) -> Iterable[dict]:
    """Records of a JSONL file; a truncated or corrupt line (killed writer) is skipped."""
    try:
        f = path.open()
    except FileNotFoundError:
        return
    with f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                log.debug("%s:%d: skipping unparsable line", path, lineno)
                continue
            if isinstance(rec, dict):
                yield rec


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _final_metrics(path: Path) -> dict[str, Any]:
    """Last value of every key in metrics.jsonl, overlaid by eval.json's eval/* keys, then summary.json."""
    metrics: dict[str, Any] = {}
    for rec in _iter_jsonl(path / "metrics.jsonl"):
        metrics.update(rec)
    ev = _read_json(path / "eval.json")
    if isinstance(ev, dict):
        ev = ev.get("metrics", ev) if isinstance(ev.get("metrics"), dict) else ev
        metrics.update({k: v for k, v in ev.items() if k.startswith("eval/") and not isinstance(v, (dict, list))})
        if "eval/tau" not in ev and _is_number(ev.get("tau")):
            metrics["eval/tau"] = ev["tau"]
    summary = _read_json(path / "summary.json")
    if isinstance(summary, dict):
        metrics.update(summary)
    return metrics


def load_run(path: str | os.PathLike) -> Run:
    """Read one run directory. Raises ValueError when `path` is not a directory."""
    p = Path(path).resolve()
    if not p.is_dir():
        raise ValueError(f"run directory {path!s} does not exist")
    run = Run(path=p)
    try:
        cfg = yaml.safe_load((p / CONFIG_FILE).read_text())
        run.config = flatten(cfg) if isinstance(cfg, dict) else {}
    except FileNotFoundError:
        pass
    except (OSError, yaml.YAMLError) as e:
        log.warning("ignoring unreadable %s: %s", p / CONFIG_FILE, e)
    run.metrics = _final_metrics(p)
    status = _read_json(p / "status.json")
    if isinstance(status, dict):
        run.status = str(status.get("status") or "unknown")
        run.error = status.get("error")
        if _is_number(status.get("wall_time_s")):
            run.wall_time_s = float(status["wall_time_s"])
    if run.wall_time_s is None and _is_number(run.metrics.get("time_s")):
        run.wall_time_s = float(run.metrics["time_s"])  # still running or killed: time of the last record
    meta = _read_json(p / "run.json")
    if isinstance(meta, dict) and isinstance(meta.get("overrides"), list):
        run.overrides = [str(o) for o in meta["overrides"]]
    return run


def find_runs(dirs: Sequence[str | os.PathLike], markers: Sequence[str] = (CONFIG_FILE,)) -> list[Run]:
    """Every run directory at or below `dirs` (a directory holding one of `markers`), sorted by path.

    The walk does not descend into a run once found, nor into hidden, W&B or checkpoint directories.
    """
    found: dict[Path, None] = {}
    for d in dirs:
        root = Path(d)
        if not root.is_dir():
            raise ValueError(f"{d!s} is not a directory")
        for here, dirnames, filenames in os.walk(root):
            names = set(filenames) | set(dirnames)
            if any(m in names for m in markers):
                found[Path(here).resolve()] = None
                dirnames[:] = []
                continue
            dirnames[:] = sorted(n for n in dirnames if not n.startswith(".") and n not in _SKIP_DIRS)
    return [load_run(p) for p in sorted(found, key=_path_sort_key)]


def _path_sort_key(p: Path) -> tuple:
    """Sort sweep job dirs 0, 1, 2, ..., 10 numerically, everything else by name."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in p.parts)


# ---------------------------------------------------------------------------------------------------------
# keys, filters, sorting


def _canon(v: Any) -> str:
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
        if _ignored(k, ignore):
            continue
        if any(_mentions_run_dir(r.config.get(k), r) for r in with_cfg):
            continue
        if len({_canon(r.config.get(k, "<missing>")) for r in with_cfg}) > 1:
            out.append(k)
    return out


def _ignored(key: str, ignore: Sequence[str]) -> bool:
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
        return _canon(v)
    return str(v)


@dataclass
class Filter:
    """One `KEY OP VALUE` condition: numbers compare numerically, anything else as text."""

    key: str
    op: str
    value: Any

    @classmethod
    def parse(cls, expr: str) -> "Filter":
        m = _FILTER_RE.match(expr)
        if not m or not m.group("key").strip():
            raise ValueError(f"--filter {expr!r}: expected KEY OP VALUE with OP one of {' '.join(_OPS)}")
        return cls(m.group("key").strip(), m.group("op"), _parse_literal(m.group("value")))

    def __call__(self, run: Run) -> bool:
        v = run.get(self.key)
        if _is_number(v) and _is_number(self.value):
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
    if _is_number(v) and not math.isnan(v):
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


# ---------------------------------------------------------------------------------------------------------
# tables


def _config_cell(run: Run, key: str) -> Any:
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
        rows.append(
            [_config_cell(r, k) for k in keys]
            + [r.get(m) for m in metrics]
            + [r.status, r.wall_time_s, r.name]
        )
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
        sig = tuple(_canon(values[k]) for k in by)
        groups.setdefault(sig, RunGroup(key=values, runs=[])).runs.append(r)
    return list(groups.values())


def _numbers(group: RunGroup, metric: str) -> list[float]:
    vals = (r.get(metric) for r in group.runs)
    return [float(v) for v in vals if _is_number(v) and math.isfinite(v)]


def group_mean(group: RunGroup, metric: str) -> float | None:
    vals = _numbers(group, metric)
    return statistics.fmean(vals) if vals else None


def group_std(group: RunGroup, metric: str) -> float | None:
    """Sample standard deviation (n - 1); None below two values."""
    vals = _numbers(group, metric)
    return statistics.stdev(vals) if len(vals) >= 2 else None


def group_table(
    groups: Sequence[RunGroup],
    metrics: Sequence[str] = DEFAULT_METRICS,
    seed_key: str | None = DEFAULT_SEED_KEY,
) -> tuple[list[str], list[list[Any]]]:
    """One row per group: group keys, the seeds it holds, n, `<metric> mean` / `<metric> std`, statuses.

    Means and stds are over the runs that have a finite value; the status column shows what the group holds
    (e.g. `completed:2 failed:1`), filter with `status==completed` to average finished runs only.
    """
    keys = list(groups[0].key) if groups else []
    show_seed = seed_key is not None and seed_key not in keys
    columns = keys + ([seed_key] if show_seed else []) + ["n"]
    for m in metrics:
        columns += [f"{m} mean", f"{m} std"]
    columns += ["status", "wall_time_s mean"]
    rows = []
    for g in groups:
        row: list[Any] = [("null" if g.key[k] is None else g.key[k]) for k in keys]
        if show_seed:
            seeds = [r.config.get(seed_key) for r in g.runs]
            row.append(",".join(_as_text(s) for s in seeds if s is not None) or None)
        row.append(len(g.runs))
        for m in metrics:
            row += [group_mean(g, m), group_std(g, m)]
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
        rows.append(["config", k, _config_cell(a, k), _config_cell(b, k), _delta(a.config.get(k), b.config.get(k))])
    extra = sorted((set(a.metrics) | set(b.metrics)) - set(metrics))
    for m in list(metrics) + extra:
        va, vb = a.metrics.get(m), b.metrics.get(m)
        if m in metrics or va is not None or vb is not None:
            rows.append(["metric", m, va, vb, _delta(va, vb)])
    rows.append(["run", "status", a.status, b.status, None])
    rows.append(["run", "wall_time_s", a.wall_time_s, b.wall_time_s, _delta(a.wall_time_s, b.wall_time_s)])
    return columns, rows


def _delta(a: Any, b: Any) -> float | None:
    return float(b) - float(a) if _is_number(a) and _is_number(b) else None


# ---------------------------------------------------------------------------------------------------------
# rendering


def _human(v: Any, column: str) -> str:
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
        return _canon(v)
    return str(v)


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def _machine(v: Any) -> Any:
    """Cell value for csv/json: raw, with NaN/inf as null (strict JSON) and containers as JSON text in CSV."""
    return json_safe(v)


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "table", title: str | None = None) -> str:
    """Text of a table in `fmt` (table | csv | json | markdown). Missing values are blank / null."""
    if fmt == "json":
        recs = [{c: _machine(v) for c, v in zip(columns, row)} for row in rows]
        return json.dumps(recs, indent=2, default=str)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        for row in rows:
            w.writerow(["" if (x := _machine(v)) is None else (_canon(x) if isinstance(x, (list, dict)) else x)
                        for v in row])
        return buf.getvalue()
    if fmt == "markdown":
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines = ["| " + " | ".join(esc(c) for c in columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(esc(_human(v, c)) for c, v in zip(columns, row)) + " |" for row in rows]
        return "\n".join(lines) + "\n"
    if fmt == "table":
        return _rich_table(columns, rows, title)
    raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")


def _rich_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for i, c in enumerate(columns):
        numeric = any(_is_number(row[i]) for row in rows)
        table.add_column(c, justify="right" if numeric else "left", overflow="fold")
    for row in rows:
        style = {"failed": "red", "running": "yellow", "interrupted": "magenta"}.get(
            str(row[columns.index("status")]) if "status" in columns else "", None
        )
        table.add_row(*(_human(v, c) for c, v in zip(columns, row)), style=style)
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


# ---------------------------------------------------------------------------------------------------------
# plotting


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
        label = ", ".join(f"{k}={_human(_config_cell(r, k), k)}" for k in keys) or r.name
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
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------------------
# CLI


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
    p.add_argument("--metrics", type=_split, default=list(DEFAULT_METRICS),
                   help=f"comma-separated metric names (default: {','.join(DEFAULT_METRICS)})")
    p.add_argument("--sort", metavar="KEY[,KEY]",
                   help="sort rows; a metric (name with '/') sorts descending, other keys ascending; "
                        "prefix + for ascending, - for descending (write --sort=-KEY: a bare -KEY reads as an "
                        "option)")
    p.add_argument("--filter", action="append", default=[], metavar="EXPR",
                   help="keep runs where KEY OP VALUE holds, OP in == != > >= < <= (numbers compare "
                        "numerically); repeat to AND (e.g. 'loss.streak_alpha>0' 'status==completed')")
    p.add_argument("--group-by", nargs="?", const="auto", metavar="KEY[,KEY]",
                   help="one row per group with n, mean and sample std of each metric; alone (or 'auto') "
                        "groups runs whose configs are identical except --seed-key (put it after the DIRs)")
    p.add_argument("--seed-key", default=DEFAULT_SEED_KEY, help="config key that --group-by auto ignores")
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument("--all-keys", action="store_true", help="show every config key, not only the differing ones")
    p.add_argument("--ignore", action="append", default=list(DEFAULT_IGNORE), metavar="PREFIX",
                   help="config key prefix never shown as differing (repeatable; 'hydra' always)")
    p.add_argument("--diff", nargs=2, metavar=("RUN_A", "RUN_B"),
                   help="config keys that differ between two run dirs, and metric deltas B - A")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG with one curve per run")
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
    if args.plot:
        path = plot_runs(runs, args.plot_metric, args.plot, args.plot_x, args.ignore)
        log.info("wrote %s", path)
    if args.group_by:
        by = None if args.group_by == "auto" else _split(args.group_by)
        if by:
            check_keys(by, runs, "--group-by")
        groups = group_runs(runs, by, args.seed_key, args.ignore)
        groups = sort_items(groups, sort, lambda g, k: g.key[k] if k in g.key else group_mean(g, k))
        columns, rows = group_table(groups, args.metrics, args.seed_key if by is None else None)
        title = f"{len(runs)} runs in {len(groups)} groups"
    else:
        runs = sort_items(runs, sort, lambda r, k: r.get(k))
        keys = None
        if args.all_keys:
            keys = sorted({k for r in runs for k in r.config if not _ignored(k, args.ignore)})
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


if __name__ == "__main__":
    sys.exit(main())
