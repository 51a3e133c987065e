"""tau of runs from a feature store against the online runs of the same seeds (docs/training.md#feature-store).

    python scripts/store_dtype_table.py [RUNS_DIR] [metric ...]   (default outputs/store_dtype eval/tau)

Reads every run under RUNS_DIR, groups them by (features.name, features.dtype), prints each run's metric and,
for each store dtype, the difference store - online paired by train.seed with its 95% t interval (seed_groups'
paired_difference: the seeds share the drafter's init, data order, anchors and eval prompts).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash.analysis.seed_groups import group_ci95, group_mean, group_runs, paired_difference  # noqa: E402
from dflash.core.rundir import find_runs  # noqa: E402

SEED = "train.seed"


def main() -> int:
    runs = find_runs([sys.argv[1] if len(sys.argv) > 1 else REPO / "outputs" / "store_dtype"])
    for metric in sys.argv[2:] or ["eval/tau"]:
        table([r for r in runs if r.get(metric) is not None], metric)
    return 0


def table(runs: list, metric: str) -> None:
    groups = {
        (g.key["features.name"], g.key["features.dtype"] if g.key["features.name"] == "store" else "float32"): g
        for g in group_runs(runs, by=["features.name", "features.dtype"])
    }
    print(
        f"\n{metric}\n\n| features | dtype | "
        + " | ".join(f"seed {s}" for s in (0, 1, 2))
        + " | mean ± 95% | store - online |"
    )
    print("|---|---|---|---|---|---|---|")
    online = groups.get(("online", "float32"))
    for (name, dtype), g in sorted(groups.items(), key=lambda kv: kv[0] != ("online", "float32")):
        by_seed = {int(r.get(SEED)): r.get(metric) for r in g.runs}
        cells = [f"{by_seed[s]:.4f}" if s in by_seed else "" for s in (0, 1, 2)]
        ci = group_ci95(g, metric)
        mean = f"{group_mean(g, metric):.4f}" + (f" ± {ci:.4f}" if ci is not None else "")
        pair = paired_difference(g, online, metric, SEED) if online is not None and g is not online else None
        diff = f"{pair[0]:+.4f} ± {pair[1]:.4f}" if pair else ""
        print(f"| {name} | {dtype} | " + " | ".join(cells) + f" | {mean} | {diff} |")


if __name__ == "__main__":
    raise SystemExit(main())
