"""Regenerate the ablation tables of docs/results.md from the run directories of `experiment=ablation_loss`.

    python scripts/ablation_table.py [SWEEP_DIR] [--readme docs/results.md]

It runs `python -m dflash.compare SWEEP_DIR --group-by --format markdown --metrics M --sort M` for each real
metric M (mean, std and 95% interval over the seeds of each configuration, and the paired difference against
the best group with its interval: held-out prompts, then each benchmark suite) and
`python -m dflash.compare SWEEP_DIR --rank-corr ...` (Spearman's rho of the teacher-forced estimates with real
tau over the runs and over every eval record), and puts both, with the commands, the machine and the date,
between docs/results.md's `<!-- ablation_loss:begin -->` and `:end -->` markers. No number is copied by hand.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- ablation_loss:begin -->", "<!-- ablation_loss:end -->"
# one table each, with its paired differences against the best (train/loss is not comparable across losses)
METRICS = "eval/tau,bench/humaneval/tau,bench/sharegpt/tau"
ESTIMATES = "train/avg_streak,train/sim_tau,eval/sim_tau,eval/avg_streak_data,eval/sim_tau_greedy,eval/sim_tau_replay"


def table(sweep: Path, metrics: list[str], rank_corr: str | None) -> str:
    tables = []
    for m in metrics:
        cmd = [sys.executable, "-m", "dflash.compare", str(sweep), "--group-by", "--format", "markdown"]
        tables.append(_run(cmd + ["--metrics", m, "--sort", m]))
    text = "\n\n".join(tables)
    if rank_corr:
        cmd = [sys.executable, "-m", "dflash.compare", str(sweep), "--rank-corr", rank_corr, "--format", "markdown"]
        text += "\n\n" + _run(cmd)
    return text


def known_names(sweep: Path, names: str) -> list[str]:
    """The names (comma-separated) that some run under `sweep` has."""
    sys.path.insert(0, str(REPO))
    from dflash.analysis.compare import known_keys
    from dflash.core.rundir import find_runs

    known = known_keys(find_runs([sweep]))
    return [k for k in names.split(",") if k in known]


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr.strip()}")
    return out.stdout.strip()


def block(sweep: Path, text: str, metrics: list[str], rank_corr: str | None) -> str:
    sys.path.insert(0, str(REPO))
    from dflash.core.machine import cpu_model

    shown = sweep.relative_to(REPO) if sweep.is_relative_to(REPO) else sweep
    when = datetime.date.today().isoformat()
    return (
        f"{BEGIN}\n`make ablation` ({when}, {cpu_model()}, {os.cpu_count()} cores; "
        f"`python -m dflash.compare {shown} --group-by --format markdown --metrics M --sort M` for M in "
        f"{', '.join(metrics)}"
        + (f", then `python -m dflash.compare {shown} --rank-corr {rank_corr} --format markdown`" if rank_corr else "")
        + "):\n\n"
        f"{text}\n{END}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", nargs="?", type=Path, default=REPO / "outputs" / "ablation_loss")
    p.add_argument("--readme", type=Path, default=REPO / "docs" / "results.md")
    p.add_argument("--metrics", default=METRICS, help=f"compare's --metrics (default {METRICS})")
    p.add_argument("--estimates", default=ESTIMATES, help=f"--rank-corr's estimates (default {ESTIMATES})")

    args = p.parse_args()
    if not any(args.sweep.rglob("sweep.json")):
        raise SystemExit(f"{args.sweep}: no sweep.json (run `make ablation` or pass the sweep directory)")
    readme = args.readme.read_text()
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"{args.readme}: no {BEGIN} ... {END} markers")
    metrics = known_names(args.sweep, args.metrics)
    if not metrics:
        raise SystemExit(f"{args.sweep}: no run has any of {args.metrics}")
    estimates = known_names(args.sweep, args.estimates)
    spec = f"{','.join(estimates)}:{','.join(metrics)}" if estimates else None
    new = re.sub(
        re.escape(BEGIN) + ".*?" + re.escape(END),
        lambda _: block(args.sweep.resolve(), table(args.sweep, metrics, spec), metrics, spec),
        readme,
        flags=re.S,
    )
    args.readme.write_text(new)
    print(f"{args.readme}: ablation table regenerated from {args.sweep}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
