"""compare --rank-corr: how well a cheap estimate ranks runs as real tau does (Spearman's rank correlation).

Two views of the same runs: over the runs' final values (summary.json / eval.json / last record), and over
every eval record of metrics.jsonl that holds both names (each periodic eval of each run is a point, so a
few runs give many checkpoints). Spearman's rho is the Pearson correlation of the ranks, ties given their
average rank; it needs 3 points and neither side constant.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from dflash.core.jsonio import is_number
from dflash.core.rundir import Run


def ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rho of paired values; None with fewer than 3 pairs or a constant side."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} x values but {len(ys)} y values")
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(ranks(xs), ranks(ys))


def final_pairs(runs: Sequence[Run], x: str, y: str) -> tuple[list[float], list[float]]:
    """The runs' final values of x and y, for runs that have both."""
    pairs = [(r.get(x), r.get(y)) for r in runs]
    pairs = [(float(a), float(b)) for a, b in pairs if is_number(a) and is_number(b)]
    return [a for a, _ in pairs], [b for _, b in pairs]


def eval_pairs(runs: Sequence[Run], x: str, y: str) -> tuple[list[float], list[float]]:
    """x and y of every metrics.jsonl record (of every run) that holds both, matched by step."""
    xs: list[float] = []
    ys: list[float] = []
    for r in runs:
        sx, vx = r.history(x)
        by_step = dict(zip(*r.history(y)))
        for s, v in zip(sx, vx):
            if s in by_step:
                xs.append(v)
                ys.append(by_step[s])
    return xs, ys


def rank_corr_table(runs: Sequence[Run], estimates: Sequence[str], reals: Sequence[str]):
    """(columns, rows): per estimate and real metric, rho over the runs' final values and over eval records."""
    columns = ["estimate", "real", "runs", "rho (runs)", "evals", "rho (evals)"]
    rows = []
    for est in estimates:
        for real in reals:
            fx, fy = final_pairs(runs, est, real)
            ex, ey = eval_pairs(runs, est, real)
            rows.append([est, real, len(fx), spearman(fx, fy), len(ex), spearman(ex, ey)])
    return columns, rows
