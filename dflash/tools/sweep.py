"""`SweepSummaryCallback`: a Hydra callback that leaves `<sweep_dir>/sweep.json` after a multirun.

Registered in `conf/config.yaml` under `hydra.callbacks.sweep_summary`. Why both hooks write the file
(checked in hydra-core 1.3.8): `run_job` (hydra/core/utils.py) catches a job's exception into its
`JobReturn` and still calls `on_job_end`, but the basic sweeper (hydra/_internal/core_plugins/basic_sweeper.py)
reads `return_value` of every job after the batch, which re-raises the first failure, so `Hydra.multirun`
(hydra/_internal/hydra.py) never reaches `on_multirun_end`. A summary written only there would be missing
exactly when a sweep has failures. So every `on_job_end` rewrites the summary of all job dirs so far, and
`on_multirun_end` (reached when every job succeeded) writes it a last time and logs the compare table.

sweep.json:

    {"sweep_dir": abs path, "updated": ISO time, "finished": bool (true once on_multirun_end ran),
     "varying_keys": [...], "metrics": [...],
     "jobs": [{"job_num", "run_dir" (relative to sweep_dir), "status", "hydra_status", "error",
               "wall_time_s", "overrides", "config": {varying key: value}, "metrics": {name: value}}]}

`status` comes from the job's status.json ("unknown" without one; then Hydra's verdict when known).
`hydra_status` is Hydra's COMPLETED/FAILED for jobs whose end this callback saw. A job whose status.json
still says `running` after Hydra ended it (killed, or crashed before writing its status) keeps
`status: running` and gets `"status_stale": true`, with a warning in the log.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dflash.jsonio import read_json, write_json
from dflash.rundir import CONFIG_FILE, STATUS_FILE, Run, find_runs
from dflash.tools.compare import DEFAULT_METRICS, compare_table, varying_keys
from dflash.tools.compare_cli import render

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.json"
# a job dir is any direct child of the sweep dir that Hydra or the run wrote into
_JOB_MARKERS = (CONFIG_FILE, ".hydra", STATUS_FILE)


def _is_multirun(config: DictConfig) -> bool:
    """True inside a multirun. Hydra sets hydra.mode (RunMode enum) in both modes; a bare test config without
    it counts as a multirun when it names a sweep dir."""
    mode = OmegaConf.select(config, "hydra.mode", default=None)
    if mode is not None:
        return str(getattr(mode, "name", mode)).upper().endswith("MULTIRUN")
    return OmegaConf.select(config, "hydra.sweep.dir", default=None) is not None


def _job_num(run: Run, sweep_dir: Path) -> int | None:
    """The job number: the sweep subdir name when numeric (the default `${hydra.job.num}`), else Hydra's own
    record in .hydra/hydra.yaml."""
    if run.path.parent == sweep_dir and run.path.name.isdigit():
        return int(run.path.name)
    try:
        import yaml

        hydra_yaml = yaml.safe_load((run.path / ".hydra" / "hydra.yaml").read_text())
        num = hydra_yaml["hydra"]["job"]["num"]
        return int(num)
    except Exception:  # noqa: BLE001 - a missing or odd hydra.yaml only costs the job number
        return None


def _read_previous(path: Path) -> dict[str, str]:
    """hydra_status per run_dir from an earlier sweep.json (another process may have written it)."""
    data = read_json(path, default={})
    try:
        return {j["run_dir"]: j["hydra_status"] for j in data.get("jobs", []) if j.get("hydra_status")}
    except (KeyError, TypeError, AttributeError):
        return {}


def sweep_runs(sweep_dir: str | os.PathLike) -> list[Run]:
    """The job dirs below `sweep_dir`, including jobs that failed before writing config_resolved.yaml."""
    root = Path(sweep_dir).resolve()
    if not root.is_dir():
        return []
    return [r for r in find_runs([root], markers=_JOB_MARKERS) if r.path != root]


def summarize_sweep(
    sweep_dir: str | os.PathLike,
    metrics: Sequence[str] = DEFAULT_METRICS,
    hydra_status: dict[str, str] | None = None,
    finished: bool = False,
) -> dict[str, Any]:
    """Build (and write) `<sweep_dir>/sweep.json` from the job dirs found under `sweep_dir`.

    hydra_status: {run dir relative to sweep_dir: "COMPLETED" | "FAILED"} for jobs Hydra has ended; merged
    over the statuses an earlier sweep.json recorded.
    """
    root = Path(sweep_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    # Parallel launchers (joblib) end jobs in several processes at once: the whole read-scan-write happens
    # under one lock, so a slower writer cannot replace a newer view with an older one.
    with _sweep_lock(root):
        return _summarize_locked(root, metrics, hydra_status, finished)


@contextlib.contextmanager
def _sweep_lock(root: Path):
    with open(root / ".sweep.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _summarize_locked(
    root: Path, metrics: Sequence[str], hydra_status: dict[str, str] | None, finished: bool
) -> dict[str, Any]:
    out_path = root / SWEEP_FILE
    known = {**_read_previous(out_path), **(hydra_status or {})}
    runs = sweep_runs(root)
    keys = varying_keys(runs)
    jobs = []
    for r in runs:
        rel = os.path.relpath(r.path, root)
        hs = known.get(rel)
        job: dict[str, Any] = {
            "job_num": _job_num(r, root),
            "run_dir": rel,
            "status": r.status,
            "hydra_status": hs,
            "error": r.error,
            "wall_time_s": r.wall_time_s,
            "overrides": r.overrides,
            "config": {k: r.config.get(k) for k in keys},
            "metrics": {m: r.metrics.get(m) for m in metrics},
        }
        if r.status == "unknown" and hs:
            job["status"] = hs.lower()  # no status.json (failed before the config was written): Hydra's verdict
        if r.status == "running" and (hs or finished):
            job["status_stale"] = True
        jobs.append(job)
    jobs.sort(key=lambda j: (j["job_num"] is None, j["job_num"] or 0, j["run_dir"]))
    summary = {
        "sweep_dir": str(root),
        "updated": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "finished": finished,
        "varying_keys": keys,
        "metrics": list(metrics),
        "jobs": jobs,
    }
    write_json(out_path, summary)
    return summary


class SweepSummaryCallback(Callback):
    """Writes `<sweep_dir>/sweep.json` after every job and at the end of a multirun; logs the compare table.

    Single runs (`on_run_end`, and `on_job_end` outside a multirun) are left alone. Errors inside the
    callback are logged, never raised: a summary must not fail a sweep.
    """

    def __init__(self, metrics: Sequence[str] | None = None, log_table: bool = True) -> None:
        self.metrics = list(metrics) if metrics else list(DEFAULT_METRICS)
        self.log_table = log_table
        self._hydra_status: dict[str, str] = {}  # this process's view; parallel launchers merge via the file

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if not _is_multirun(config):
            return
        try:
            sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir"))).resolve()
            job_dir = OmegaConf.select(config, "hydra.runtime.output_dir", default=None)
            status = getattr(job_return, "status", None)
            if job_dir is not None and status is not None:
                rel = os.path.relpath(Path(str(job_dir)).resolve(), sweep_dir)
                self._hydra_status[rel] = str(getattr(status, "name", status)).upper()
            summarize_sweep(sweep_dir, self.metrics, self._hydra_status)
        except Exception as e:  # noqa: BLE001
            log.warning("sweep summary after a job failed: %s: %s", type(e).__name__, e)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir"))).resolve()
            summary = summarize_sweep(sweep_dir, self.metrics, self._hydra_status, finished=True)
            for job in summary["jobs"]:
                if job.get("status_stale"):
                    log.warning(
                        "job %s (%s): status.json still says running after the job ended (killed?)",
                        job["job_num"],
                        job["run_dir"],
                    )
            if self.log_table:
                runs = sweep_runs(sweep_dir)
                if runs:
                    table = render(*compare_table(runs, self.metrics), "table", title=f"sweep {sweep_dir}")
                    log.info("sweep summary (%s):\n%s", sweep_dir / SWEEP_FILE, table)
        except Exception as e:  # noqa: BLE001
            log.warning("sweep summary at the end of the multirun failed: %s: %s", type(e).__name__, e)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        """A single run has nothing to aggregate; `python -m dflash.compare` reads its dir directly."""
        return None
