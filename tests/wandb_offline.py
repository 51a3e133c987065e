"""Read an offline W&B run back from its `.wandb` transaction log, without network or an account.

Offline runs keep no config.yaml or wandb-summary.json on disk; the only record is the binary
`run-<id>.wandb` log. wandb 0.31 reads it with `wandb leet inspect` (implemented in the bundled wandb-core
binary): `--summary --json` prints state, latest values and config as one object, `--json` prints every
record as a line. Tests use this to check that what W&B received matches metrics.jsonl.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# How wandb-core writes non-finite floats inside JSON values.
_NON_FINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def find_wandb_file(path: Path | str) -> Path:
    """The `run-*.wandb` file for `path`: the file itself, or the newest one anywhere under a directory.

    `path` may be a run directory of ours (`<run_dir>/wandb/offline-run-*/run-*.wandb` below it), a wandb
    directory, an `offline-run-*` directory or the file. Raises FileNotFoundError naming the path.
    """
    p = Path(path)
    if p.is_file():
        return p
    found = sorted(p.glob("**/run-*.wandb"), key=lambda f: f.stat().st_mtime) if p.is_dir() else []
    if not found:
        raise FileNotFoundError(f"no W&B transaction log (run-*.wandb) under {p}")
    return found[-1]


def _inspect(wandb_file: Path, *flags: str, timeout_s: float) -> str:
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", *flags, str(wandb_file)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[1:])}` failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout


def _number(v: Any) -> Any:
    return _NON_FINITE.get(v, v) if isinstance(v, str) else v


def read_offline_run(path: Path | str, timeout_s: float = 60.0) -> dict:
    """What an offline W&B run recorded, as plain Python.

    Returns a dict with:
      state         "finished" | "failed" | "running" ... as wandb-core reports it
      exit_code     the code passed to run.finish (None if the run never finished)
      run_id, name, group, project
      config        the nested config dict given to wandb.init
      summary       final summary values (non-finite floats restored from "NaN"/"Infinity")
      history       list of history rows (user keys only, W&B's own `_step`/`_runtime`/`_timestamp` removed)
      history_keys  sorted union of the keys in `history`
      file          the .wandb file read
    """
    wandb_file = find_wandb_file(path)
    head = json.loads(_inspect(wandb_file, "--summary", "--json", timeout_s=timeout_s))
    history: list[dict] = []
    group = None
    for line in _inspect(wandb_file, "--json", timeout_s=timeout_s).splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("type") == "history":
            item = rec["history"].get("item", {})
            history.append({k: _number(v) for k, v in item.items() if not k.startswith("_")})
        elif rec.get("type") == "run":
            group = rec["run"].get("run_group", group)
    return {
        "state": head.get("state"),
        "exit_code": head.get("exit_code"),
        "run_id": head.get("run_id"),
        "name": head.get("name"),
        "group": group,
        "project": head.get("project"),
        "config": head.get("config", {}),
        "summary": {k: _number(v) for k, v in head.get("summary", {}).items()},
        "history": history,
        "history_keys": sorted({k for row in history for k in row}),
        "file": str(wandb_file),
    }
