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

Optuna searches (`hydra/sweeper=dflash_optuna`, or any hydra-optuna-sweeper config with a `storage`): the plugin
(checked in hydra-optuna-sweeper 1.3.0) always loads an existing study (`load_if_exists=True`) but then runs
`n_trials` more trials numbered from job 0 again, so a relaunch would write into the first launch's run dirs, and
its seeded sampler would replay the first launch's random samples. `on_multirun_start` runs before Hydra
instantiates the sweeper and prepares the study (`prepare_optuna_search`): it holds `<sweep_dir>/.optuna.lock`
for the whole search (one search per sweep dir at a time), creates the study and records its definition
(`search_definition`: the search space, the job overrides and the job config they apply to) or, on a relaunch,
refuses a different one; marks the trials a killed search left `RUNNING` as failed (they do not count, a new
trial replaces each); sets `n_trials` to the trials still missing (finished trials: complete, pruned or failed,
count), offsets the sampler's seed by the trials already in the study, and makes job N run in the subdir of
trial N (the `dflash.add` resolver). With any Optuna sweeper, `on_job_end` turns a NaN or infinite return value
into a failed job (`fail_unusable_objective`): the plugin would end the whole search on it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from dflash.analysis.compare import DEFAULT_METRICS, compare_table, varying_keys
from dflash.analysis.compare_cli import render
from dflash.core.jsonio import read_json, write_json
from dflash.core.rundir import CONFIG_FILE, STATUS_FILE, Run, find_runs, flatten
from dflash.core.secrets import redact_url_credentials, scrub_arguments, scrub_text

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.json"
OPTUNA_LOCK = ".optuna.lock"  # held by the process that runs a search in this sweep dir
OPTUNA_SEARCH_ATTR = "dflash_search"  # study user attr: what defines the search (search_definition)
_JOB_NUM = "${hydra.job.num}"

if not OmegaConf.has_resolver("dflash.add"):  # the job subdirs of a continued Optuna search: job num + offset
    OmegaConf.register_new_resolver("dflash.add", lambda a, b: int(a) + int(b))

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
    callback are logged, never raised: a summary must not fail a sweep. The one exception is the preparation
    of an Optuna search (`on_multirun_start`), which stops a launch that would mix up a stored study.
    """

    def __init__(self, metrics: Sequence[str] | None = None, log_table: bool = True) -> None:
        self.metrics = list(metrics) if metrics else list(DEFAULT_METRICS)
        self.log_table = log_table
        self._hydra_status: dict[str, str] = {}  # this process's view; parallel launchers merge via the file
        self._optuna_lock = None  # the open lock file of the Optuna search this process runs

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """An Optuna search with a storage: prepare its (re)launch. Hydra turns a callback's exception into a
        warning, so a refusal exits (SystemExit) before any trial runs: a relaunch that went on unprepared would
        write into the earlier trials' run dirs."""
        if _optuna_sweeper(config) is None:
            return
        try:
            self._optuna_lock = prepare_optuna_search(config)  # held until the process exits
        except OptunaSearchError as e:
            raise SystemExit(f"error: {e}") from None
        except Exception as e:  # noqa: BLE001 - the storage's error may quote its URL: its credentials go
            failed = f"error: preparing the Optuna search failed: {type(e).__name__}: {e}"
            raise SystemExit(scrub_text(failed)) from None

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if not _is_multirun(config):
            return
        if _is_optuna(config):
            fail_unusable_objective(job_return)
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


class OptunaSearchError(RuntimeError):
    """A relaunch that must not run: another search holds the sweep dir, or the search differs."""


def _is_optuna(config: DictConfig) -> bool:
    node = OmegaConf.select(config, "hydra.sweeper", default=None)
    return isinstance(node, DictConfig) and "hydra_optuna_sweeper" in str(node.get("_target_", ""))


def _optuna_sweeper(config: DictConfig) -> DictConfig | None:
    """hydra.sweeper when it is the Optuna sweeper with a storage (a study that outlives the process)."""
    return config.hydra.sweeper if _is_optuna(config) and config.hydra.sweeper.get("storage") else None


def fail_unusable_objective(job_return: Any) -> None:
    """A completed job whose return value is NaN or infinite becomes a failed job. The Optuna sweeper (checked in
    hydra-optuna-sweeper 1.3.0) records a failed job's trial as failed and goes on, but on a NaN it first has
    Optuna refuse the value and then tells the failure with that value, which raises and ends the whole search."""
    from hydra.core.utils import JobStatus

    if getattr(job_return, "status", None) != JobStatus.COMPLETED:
        return
    value = job_return.return_value
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, (int, float)) and not math.isfinite(v) for v in values):
        job_return.status = JobStatus.FAILED
        job_return.return_value = ValueError(f"the job returned {value!r}: not a finite objective")
        log.warning("job %s returned %r: its trial is recorded as failed", job_return.working_dir, value)


def search_definition(config: DictConfig) -> dict[str, Any]:
    """What defines an Optuna search: `overrides`, the sweeper's params and the command line's job overrides
    (ranges and fixed values) as the sweeper reads them, sorted; `config`, the job config they apply to (the
    experiment file's values included), unresolved and flattened; secrets redacted. hydra.* (n_trials, the sweep
    dir) is not part."""
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    task = OmegaConf.select(config, "hydra.overrides.task", default=None) or []
    job = {k: v for k, v in config.items_ex(resolve=False) if k != "hydra"}
    job = OmegaConf.to_container(OmegaConf.create(job), resolve=False, enum_to_str=True)
    overrides = sorted([f"{k}={v}" for k, v in params.items()] + [str(o) for o in task])
    # the study is a file of the sweep: no secret of the command line in it (nor does one define a search)
    return scrub_arguments({"overrides": overrides, "config": flatten(job)}, overrides)


def search_changes(recorded: dict[str, Any], definition: dict[str, Any]) -> list[str]:
    """How `definition` differs from the one a study recorded: overrides only one has, config keys both have
    with other values (keys a newer code version added or removed are not a different search)."""
    old, new = set(recorded.get("overrides", [])), set(definition["overrides"])
    changes = [f"-{o}" for o in sorted(old - new)] + [f"+{o}" for o in sorted(new - old)]
    before, after = recorded.get("config", {}), definition["config"]
    changes += [
        f"{k}: {before[k]!r} -> {after[k]!r}" for k in sorted(before.keys() & after.keys()) if before[k] != after[k]
    ]
    return changes


def _lock_search(sweep_dir: Path):
    """An exclusive lock on the sweep dir's search, released when the process ends however it ends."""
    f = open(sweep_dir / OPTUNA_LOCK, "a+")  # noqa: SIM115 - kept open for the whole search
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise OptunaSearchError(
            f"another Optuna search is running in {sweep_dir} ({holder or 'pid unknown'}); "
            "one process per sweep dir (its trials are numbered by the study)"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f


def prepare_optuna_search(config: DictConfig):
    """Create or continue the study of `hydra.sweeper` before the sweeper runs (see the module docstring) and
    adjust `config` (n_trials, sampler seed, job subdir); returns the held lock file (released on a refusal)."""
    logging.getLogger("alembic").setLevel(logging.WARNING)  # optuna's storage imports it: a line per plugin
    import optuna
    import sqlalchemy

    if int(optuna.__version__.split(".")[0]) < 3 and int(sqlalchemy.__version__.split(".")[0]) >= 2:
        raise OptunaSearchError(  # optuna 2.x's RDB storage fails on an assertion with SQLAlchemy 2
            f"optuna {optuna.__version__} (what hydra-optuna-sweeper 1.x needs) cannot use an RDB storage with "
            f"SQLAlchemy {sqlalchemy.__version__}: pip install 'sqlalchemy<2'"
        )
    node = _optuna_sweeper(config)
    assert node is not None
    sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir"))).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)  # sqlite creates the file, not its directory
    lock = _lock_search(sweep_dir)
    try:
        _continue_study(config, node, sweep_dir)
    except BaseException:
        lock.close()
        raise
    return lock


def _continue_study(config: DictConfig, node: DictConfig, sweep_dir: Path) -> None:
    import optuna
    from optuna.trial import TrialState

    name = node.get("study_name")
    if not name:
        log.warning("hydra.sweeper.study_name is not set: Optuna names the study at random, a relaunch starts anew")
        return
    direction = node.get("direction")
    directions = list(direction) if OmegaConf.is_list(direction) else [direction]
    study = optuna.create_study(
        storage=str(node.storage),
        study_name=str(name),
        directions=[str(getattr(d, "name", d)) for d in directions],
        load_if_exists=True,
    )
    definition = search_definition(config)
    storage = redact_url_credentials(str(node.storage))  # said in messages: postgresql://user:pw@... never the pw
    recorded = study.user_attrs.get(OPTUNA_SEARCH_ATTR)
    if not isinstance(recorded, dict):  # a new study (or one another tool created): this is its search
        study.set_user_attr(OPTUNA_SEARCH_ATTR, definition)
    elif changes := search_changes(recorded, definition):
        raise OptunaSearchError(
            f"study {name!r} in {storage} was run as another search ({'; '.join(changes)}). Relaunch it "
            "as it was run to continue it, or give the new search its own hydra.sweep.dir"
        )
    trials = study.get_trials(deepcopy=False)
    if not trials and (runs := sorted(int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit())):
        raise OptunaSearchError(
            f"{sweep_dir} holds job dirs ({', '.join(map(str, runs[:5]))}{', ...' if len(runs) > 5 else ''}) that "
            f"are no trial of study {name!r}: its trials would write into them; give the search its own "
            "hydra.sweep.dir"
        )
    finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL) for t in trials)
    stale = [t.number for t in trials if t.state == TrialState.RUNNING]
    for number in stale:  # a killed search's trial: the lock says no other process runs it
        study.tell(number, state=TrialState.FAIL)
    offset = len(trials)
    n_trials = int(node.n_trials)
    remaining = max(0, n_trials - finished)
    seed = OmegaConf.select(config, "hydra.sweeper.sampler.seed", default=None)
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.sweeper.n_trials = remaining
        if offset and isinstance(seed, int):
            config.hydra.sweeper.sampler.seed = seed + offset  # seed s again would replay trials 0.. of seed s
        subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
        if offset and isinstance(subdir, str) and _JOB_NUM in subdir:
            # oc.select: the multirun's own config (no job num) still resolves; each job's config gets num + offset
            shifted = subdir.replace(_JOB_NUM, "${dflash.add:${oc.select:hydra.job.num,0}," + f"{offset}}}")
            config.hydra.overrides.hydra.append(f"hydra.sweep.subdir='{shifted}'")  # the jobs' configs read it
    if offset:
        log.info(
            "Optuna study %r (%s): %d trials there, %d finished%s; running %d more for n_trials=%d, "
            "numbered from %d (run dirs too)%s",
            name,
            storage,
            len(trials),
            finished,
            f", {len(stale)} left running by a killed search marked failed ({stale})" if stale else "",
            remaining,
            n_trials,
            offset,
            f", sampler seed {seed}+{offset}" if isinstance(seed, int) else "",
        )
