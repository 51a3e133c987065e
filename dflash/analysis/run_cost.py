"""What a `make real` run cost (#46), in CPU seconds and wall seconds. Each phase of one `make real` is measured
(this process and its children that ended: resource.getrusage, every thread, user and system time) into
OUT/phases.json; the run directory's cost.json holds the run's whole cost, whenever its parts were made:

    data   making its training file: the regeneration's own account (regen.jsonl.cost.json, kept by
           python -m dflash.regenerate over every resume) plus making an original or mixed file (its manifest)
    store  its feature store: every build of it that make real ran (OUT/store_costs.json; a store that runs share
           counts whole for each of them)
    train  every make real that trained or resumed it (the launch.py process: training and the final eval)

A part nobody measured (answers made before costs were recorded, a store built outside make real) is None, and so
is the total. summary.json gets the totals as `cost/*` keys, so `python -m dflash.compare --metrics
eval/tau,cost/cpu_s` shows them beside the taus."""

from __future__ import annotations

import resource
import time
from pathlib import Path

from dflash.core.jsonio import read_json, write_json
from dflash.core.rundir import SUMMARY_FILE, now_iso

COST_FILE = "cost.json"
STORE_COSTS = "store_costs.json"
PARTS = ("data", "store", "train")


def cpu_seconds() -> float:
    """This process's CPU seconds and those of its children that ended (subprocess.run waits for them)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Meter:
    """Wall and CPU seconds from when it was made."""

    def __init__(self):
        self.wall0, self.cpu0 = time.perf_counter(), cpu_seconds()

    def read(self) -> dict:
        return {"seconds": round(time.perf_counter() - self.wall0, 1), "cpu_s": round(cpu_seconds() - self.cpu0, 1)}


def add_store_build(out: Path, store: Path, phase: dict) -> None:
    """A build of `store` that wrote something: its seconds added to OUT/store_costs.json."""
    ledger = read_json(out / STORE_COSTS, default={}) or {}
    entry = ledger.get(str(store), {"cpu_s": 0.0, "wall_s": 0.0, "builds": 0})
    ledger[str(store)] = {
        "cpu_s": round(entry["cpu_s"] + phase["cpu_s"], 1),
        "wall_s": round(entry["wall_s"] + phase["seconds"], 1),
        "builds": entry["builds"] + 1,
    }
    write_json(out / STORE_COSTS, ledger)


def _sum(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else round(sum(values), 1)


def record_run_cost(run_dir: Path, out: Path, phases: dict, data: dict, store: Path | None, code: dict) -> dict:
    """The run's cost.json (and summary.json's `cost/*` keys, when the run has a summary), this make real's phases
    added to it. `data`: sharegpt_data.data_cost and the file's name; `store`: the store the build opened."""
    before = read_json(run_dir / COST_FILE, default={}) or {}
    train = before.get("train") or {"cpu_s": 0.0, "wall_s": 0.0, "launches": 0}
    phase = phases.get("train")
    if phase and phase["result"] != "reused":  # it ran launch.py for this run: trained, resumed or failed
        train = {"cpu_s": round(train["cpu_s"] + phase["cpu_s"], 1),
                 "wall_s": round(train["wall_s"] + phase["seconds"], 1), "launches": train["launches"] + 1}  # fmt: skip
    built = (read_json(out / STORE_COSTS, default={}) or {}).get(str(store)) if store else None
    parts = {
        "data": {"cpu_s": None, "wall_s": None, **data},
        "store": {"path": str(store) if store else None, **(built or {"cpu_s": None, "wall_s": None})},
        "train": train,
    }
    cost = {
        "cpu_s": {k: parts[k]["cpu_s"] for k in PARTS},
        "wall_s": {k: parts[k]["wall_s"] for k in PARTS},
        "total_cpu_s": _sum(parts[k]["cpu_s"] for k in PARTS),
        "total_wall_s": _sum(parts[k]["wall_s"] for k in PARTS),
        **parts,
        "code": code,
        "invocations": [*before.get("invocations", []), {"at": now_iso(), "phases": phases}],
    }
    write_json(run_dir / COST_FILE, cost)
    summary = read_json(run_dir / SUMMARY_FILE, default=None)
    if isinstance(summary, dict):
        keys = {"cost/cpu_s": cost["total_cpu_s"], "cost/wall_s": cost["total_wall_s"],
                **{f"cost/{k}_cpu_s": cost["cpu_s"][k] for k in PARTS}}  # fmt: skip
        summary.update({k: v for k, v in keys.items() if v is not None})
        write_json(run_dir / SUMMARY_FILE, summary)
    return cost


def cost_line(cost: dict, run_dir: Path) -> str:
    """The run's cost in one line: total CPU seconds and each part's, or which part nobody measured."""
    parts = ", ".join(f"{k} {_shown(cost['cpu_s'][k])}" for k in PARTS)
    total = cost["total_cpu_s"]
    head = f"{total:,.0f} CPU-s" if total is not None else "not fully known"
    wall = f", {cost['total_wall_s']:,.0f} s wall" if cost["total_wall_s"] is not None else ""
    return f"cost of the run: {head} ({parts}{wall}) -> {run_dir / COST_FILE}"


def _shown(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:,.0f}"
