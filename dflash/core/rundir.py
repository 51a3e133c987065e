"""The run directory: its layout, and every writer and reader of its files (docs/architecture.md, "Run directory").

    <run_dir>/
      config_resolved.yaml  the composed config, interpolations resolved, secrets redacted
      run.json              how the run was started (argv, overrides, git, packages, host, device) + resumes
      status.json           running | completed | failed | interrupted (with the error)
      metrics.jsonl         one JSON object per monitor tick and per eval (the source of truth)
      eval.json             the final eval: metrics, per-prompt details and the prompts' token ids
      summary.json          final metrics (what compare reads first)
      checkpoints/step_N/   resumable state (dflash.train.checkpoint)
      drafter/              the exported drafter (dflash.model.export)
      wandb/                W&B's own files

Writers go through `RunDir` (whose `read_*` methods serve the run and `evaluate`); `load_run` / `find_runs` are
the readers of `compare` and `sweep`.
Every reader is lenient (`dflash.core.jsonio.read_json`): a file cut short by a killed process reads as missing.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from dflash.core.jsonio import (
    is_number,
    iter_jsonl,
    json_safe,
    read_json,
    write_json,
    write_text_atomic,
)
from dflash.core.machine import device_info
from dflash.core.secrets import redact, scrub_json, scrub_text

CONFIG_FILE = "config_resolved.yaml"
RUN_INFO_FILE = "run.json"
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
SUMMARY_FILE = "summary.json"
BENCH_FILE = "benchmarks.json"  # python -m dflash.benchmark: per suite and temperature
CHECKPOINTS_DIR = "checkpoints"
DRAFTER_DIR = "drafter"
TARGET_RANK_FILE = "target_rank{rank}.json"  # parallel.target_ranks: each target process's link totals
STATUSES = ("running", "completed", "failed", "interrupted")
END_STATUSES = STATUSES[1:]
log = logging.getLogger(__name__)
# sub-directories of a run that never hold another run; skipped to keep discovery fast
_SKIP_DIRS = {"wandb", CHECKPOINTS_DIR, DRAFTER_DIR, "__pycache__"}


PACKAGES = ("torch", "transformers", "hydra-core", "omegaconf", "wandb", "safetensors", "tokenizers", "dflash")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def git_info(cwd: Path) -> dict:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


class RunDir:
    """The writers of one run directory. Paths are attributes, so no other module spells a file name."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.config_file = self.path / CONFIG_FILE
        self.run_info_file = self.path / RUN_INFO_FILE
        self.status_file = self.path / STATUS_FILE
        self.metrics_file = self.path / METRICS_FILE
        self.eval_file = self.path / EVAL_FILE
        self.summary_file = self.path / SUMMARY_FILE
        self.checkpoints = self.path / CHECKPOINTS_DIR
        self.drafter = self.path / DRAFTER_DIR

    def write_config(self, cfg: DictConfig) -> None:
        resolved = redact(OmegaConf.to_container(cfg, resolve=True))
        write_text_atomic(self.config_file, scrub_text(OmegaConf.to_yaml(OmegaConf.create(resolved))))

    def write_run_info(self, overrides: list[str], choices: dict, extra: dict | None = None) -> dict:
        info = {
            "argv": redact(list(sys.argv)),
            "overrides": redact(list(overrides)),
            "choices": dict(choices),
            "cwd": os.getcwd(),
            "git": git_info(Path(__file__).resolve().parents[2]),
            "packages": package_versions(),
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "device": device_info(),
            "start_time": now_iso(),
            **(extra or {}),
        }
        info = scrub_json(info)
        write_json(self.run_info_file, info)
        return info

    def append_resume(self, overrides: list[str]) -> None:
        """run.json keeps how the run was started; each resume is appended to its `resumes` list."""
        info = read_json(self.run_info_file, default=None)
        if not isinstance(info, dict):  # unreadable: keep it for a person to look at, start a new record
            if self.run_info_file.exists():
                aside = self.run_info_file.with_name(f"run.json.unreadable-{int(time.time())}")
                self.run_info_file.rename(aside)
                log.warning("run.json could not be read; kept as %s, a new one records this resume", aside.name)
            info = {}
        entry = {"time": now_iso(), "argv": redact(list(sys.argv)), "overrides": redact(list(overrides))}
        info.setdefault("resumes", []).append(scrub_json(entry))
        write_json(self.run_info_file, info)

    def add_run_info(self, key: str, value: Any, resumed: bool = False) -> None:
        """Add a field to run.json (or to its latest resume entry)."""
        info = read_json(self.run_info_file, default={})
        target = info["resumes"][-1] if resumed and info.get("resumes") else info
        target[key] = value
        write_json(self.run_info_file, info)

    def read_run_info(self) -> dict:
        info = read_json(self.run_info_file, default={})
        return info if isinstance(info, dict) else {}

    def write_summary(self, summary: dict) -> None:
        write_json(self.summary_file, summary)

    def write_eval(self, result: dict[str, Any], **extra: Any) -> Path:
        """eval.json: {"metrics": flat eval/* metrics, "details": ..., "prompts": token ids, **extra}."""
        return write_eval_json(self.eval_file, result, **extra)

    def read_eval(self) -> dict[str, Any] | None:
        return read_eval_json(self.eval_file)

    def write_target_rank(self, rank: int, stats: dict) -> None:
        write_json(self.path / TARGET_RANK_FILE.format(rank=rank), stats)

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines past a resumed checkpoint's step, so the resumed run appends without duplicates."""
        if not self.metrics_file.exists():
            return
        keep = []
        for line in self.metrics_file.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the crash
            if isinstance(record, dict) and record.get("step", 0) <= step:
                keep.append(line)
        write_text_atomic(self.metrics_file, "".join(line + "\n" for line in keep))


def write_eval_json(path: str | Path, result: dict[str, Any], **extra: Any) -> Path:
    """An eval.json (a run's, or `python -m dflash.evaluate --out`): {"metrics", "details", **extra}."""
    metrics = {k: v for k, v in result.items() if k != "details"}
    payload = {"metrics": metrics, "details": result.get("details", {}), **extra}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, payload)
    return path


def read_eval_json(path: str | Path) -> dict[str, Any] | None:
    """An eval.json as `write_eval_json` wrote it, or None when it is missing or unreadable."""
    data = read_json(path)
    return data if isinstance(data, dict) and isinstance(data.get("metrics"), dict) else None


class StatusFile:
    """status.json: `running` at start, then exactly one of completed / failed / interrupted. The `running` file
    is written RESERVE_BYTES long (JSON, then spaces), so that the end can be recorded on a full disk: when the
    usual atomic write fails, the end is written over it in place, in blocks the file already has."""

    RESERVE_BYTES = 16 << 10

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / STATUS_FILE
        self.t0 = time.time()
        self.start_time = now_iso()

    def running(self, **extra: Any) -> None:
        record = {
            "status": "running",
            "start_time": self.start_time,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            **extra,
        }
        text = json.dumps(json_safe(record), indent=2) + "\n"
        write_text_atomic(self.path, text + " " * max(0, self.RESERVE_BYTES - len(text.encode())))

    def finish(self, status: str, error: str | None = None, **extra: Any) -> None:
        extra = {k: scrub_text(v) if isinstance(v, str) else v for k, v in extra.items()}  # e.g. the traceback
        record = {
            "status": status,
            "error": scrub_text(error) if error else None,
            "start_time": self.start_time,
            "end_time": now_iso(),
            "wall_time_s": round(time.time() - self.t0, 3),
            **extra,
        }
        try:
            write_json(self.path, record)
        except OSError as e:  # a full disk (or quota): the atomic write needs new blocks; the reserve does not
            self._write_in_place(record, e)

    def _write_in_place(self, record: dict, cause: OSError) -> None:
        with open(self.path, "r+b") as f:
            room = f.seek(0, os.SEEK_END)
            record = {**record, "status_written_in_place": f"{type(cause).__name__}: {cause}"}
            data = json.dumps(json_safe(record)).encode()
            if len(data) > room:  # the traceback goes first, then the error is cut to fit
                record.pop("traceback", None)
                data = json.dumps(json_safe(record)).encode()
            if len(data) > room:  # then the error's middle: its head says what failed, its tail how it ended
                rest = len(json.dumps(json_safe({**record, "error": ""})).encode())
                record["error"] = cut_middle(str(record.get("error") or ""), room - rest)
                data = json.dumps(json_safe(record)).encode()[:room]
            f.seek(0)
            f.write(data + b" " * (room - len(data)))
            f.flush()
            os.fsync(f.fileno())


def cut_middle(text: str, room: int) -> str:
    """`text` in at most `room` bytes as a JSON string's content: its head and tail kept, the middle cut (marked
    with how much), or "" when not even the mark fits."""
    keep = len(text)
    while True:
        cut = text if keep >= len(text) else f"{text[: keep // 2]} [... {len(text) - keep} characters cut ...] "
        cut += text[len(text) - (keep - keep // 2) :] if keep < len(text) else ""
        over = len(json.dumps(cut).encode()) - 2 - room
        if over <= 0:
            return cut
        if keep <= 0:
            return ""
        keep = max(0, min(keep, len(text)) - over)


def process_died(status: dict) -> bool:
    """A `running` status whose process is gone (judged only on the host that wrote it)."""
    pid, host = status.get("pid"), status.get("host")
    if status.get("status") != "running" or not isinstance(pid, int) or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


# ----------------------------------------------------------------------------- readers (compare, sweep)


@dataclass
class Run:
    """What compare knows about one run directory. `config` is flat: {"loss.kl_temperature": 1.0, ...}."""

    path: Path  # absolute
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)  # final value per metric name
    # running | completed | failed | interrupted | died (running, but its process is gone) | unknown (none)
    status: str = "unknown"
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
        for rec in iter_jsonl(self.path / METRICS_FILE):
            xv, yv = rec.get(x), rec.get(metric)
            if is_number(xv) and is_number(yv):
                xs.append(float(xv))
                ys.append(float(yv))
        return xs, ys


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": leaf}; lists and scalars are leaves; an empty dict is a leaf too."""
    if not isinstance(tree, dict) or (not tree and prefix):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _final_metrics(path: Path) -> dict[str, Any]:
    """Last value of every key in metrics.jsonl, overlaid by eval.json's eval/* keys, then summary.json."""
    metrics: dict[str, Any] = {}
    for rec in iter_jsonl(path / METRICS_FILE):
        metrics.update(rec)
    ev = read_json(path / EVAL_FILE)
    if isinstance(ev, dict):
        ev = ev.get("metrics", ev) if isinstance(ev.get("metrics"), dict) else ev
        metrics.update({k: v for k, v in ev.items() if k.startswith("eval/") and not isinstance(v, (dict, list))})
        if "eval/tau" not in ev and is_number(ev.get("tau")):
            metrics["eval/tau"] = ev["tau"]
    summary = read_json(path / SUMMARY_FILE)
    if isinstance(summary, dict):
        metrics.update(summary)
    bench = read_json(path / BENCH_FILE)
    if isinstance(bench, dict):
        metrics.update(bench_metrics(bench))
    return metrics


# tau's 95% interval and the paired difference from prompt lookup: dflash/evaluation/intervals.py
BENCH_COLUMNS = (
    "tau", "tau_pooled", "speedup", "tau_lookup", "lossless", "num_prompts", "degenerate", "tau_ci95_low",
    "tau_ci95_high", "tau_minus_lookup", "tau_minus_lookup_ci95_low", "tau_minus_lookup_ci95_high",
)  # fmt: skip


def bench_column_name(suite: str) -> str:
    """A suite's name in metric names: `jsonl:PATH` becomes `jsonl:<file stem>` (a path's slashes would split
    the name into W&B sections and compare's columns)."""
    return f"jsonl:{Path(suite.removeprefix('jsonl:')).stem}" if suite.startswith("jsonl:") else suite


def bench_metrics(data: dict) -> dict[str, float]:
    """benchmarks.json as compare columns: `bench/<suite>/<metric>` at temperature 0 (the published number),
    `bench/<suite>/T<t>/<metric>` at other temperatures."""
    out: dict[str, float] = {}
    for r in (data.get("results") or {}).values():
        s, t = bench_column_name(r["settings"]["suite"]), float(r["settings"]["temperature"])
        prefix = f"bench/{s}" if t == 0 else f"bench/{s}/T{t:g}"
        out.update({f"{prefix}/{k}": r["metrics"][k] for k in BENCH_COLUMNS if k in r["metrics"]})
    return out


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
    status = read_json(p / STATUS_FILE)
    if isinstance(status, dict):
        run.status = "died" if process_died(status) else str(status.get("status") or "unknown")
        run.error = status.get("error")
        if is_number(status.get("wall_time_s")):
            run.wall_time_s = float(status["wall_time_s"])
    if run.wall_time_s is None and is_number(run.metrics.get("time_s")):
        run.wall_time_s = float(run.metrics["time_s"])  # still running or killed: time of the last record
    meta = read_json(p / RUN_INFO_FILE)
    if isinstance(meta, dict) and isinstance(meta.get("overrides"), list):
        run.overrides = [str(o) for o in meta["overrides"]]
    if isinstance(meta, dict) and (ran := precision_ran(meta)):  # compare and curves group by what ran
        run.config["train.precision"] = ran
    return run


def precision_ran(info: dict) -> str | None:
    """train.precision as it ran by run.json's `precision` records (the start's, each resume's): `fp32 (bf16-mixed
    requested)` where it fell back, ` then ` where a resume changed it; None for runs recorded before them."""
    names: list[str] = []
    for part in [info, *(r for r in info.get("resumes") or [] if isinstance(r, dict))]:
        if isinstance(rec := part.get("precision"), dict) and (ran := rec.get("ran")):
            name = ran if rec.get("requested") in (None, ran) else f"{ran} ({rec['requested']} requested)"
            names += [] if names and names[-1] == name else [name]
    return " then ".join(names) or None


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
