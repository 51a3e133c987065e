"""95% intervals for tau, by a percentile bootstrap over prompts (or conversations, whose turns stay together).

A decision between two recipes or against prompt lookup needs to know how far a suite's tau moves with its sample
of prompts. The unit resampled is the prompt: its cycles are not independent (a prompt that repeats itself is
accepted all along), so resampling cycles would give intervals that are too narrow. Paired: the drafter's tau minus
prompt lookup's on the same resampled prompts, so "ahead of prompt lookup" is a statement with its own interval.
The resampling is seeded (the same inputs give the same interval).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

LEVEL = 0.95
RESAMPLES = 2000

Lengths = Sequence[Sequence[int]]  # acceptance lengths per generation


def pooled_tau(groups: Sequence[Lengths]) -> float:
    """Accepted tokens per verify cycle, pooled over every cycle of the groups (eval/tau's statistic)."""
    return _ratio([_pooled_parts(group) for group in groups])


def mean_tau(groups: Sequence[Lengths]) -> float:
    """z-lab's benchmark tau: the mean over generations of each generation's mean acceptance length."""
    return _ratio([_mean_parts(group) for group in groups])


def _pooled_parts(group: Lengths) -> tuple[float, float]:
    return float(sum(sum(lengths) for lengths in group)), float(sum(len(lengths) for lengths in group))


def _mean_parts(group: Lengths) -> tuple[float, float]:
    means = [sum(lengths) / len(lengths) for lengths in group if lengths]
    return float(sum(means)), float(len(means))


def _ratio(parts: Sequence[tuple[float, float]]) -> float:
    den = sum(d for _, d in parts)
    return sum(n for n, _ in parts) / den if den else math.nan


def bootstrap_interval(
    n: int, statistic: Callable[[list[int]], float], *, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """The percentile interval (LEVEL) of statistic(indices) over `resamples` draws of n indices with replacement;
    (nan, nan) below two units."""
    if n < 2:
        return math.nan, math.nan
    rng = random.Random(seed)
    values = sorted(v for v in (statistic(rng.choices(range(n), k=n)) for _ in range(resamples)) if not math.isnan(v))
    if not values:
        return math.nan, math.nan
    lo = values[int((1 - LEVEL) / 2 * (len(values) - 1))]
    hi = values[int((1 + LEVEL) / 2 * (len(values) - 1))]
    return lo, hi


def tau_intervals(
    drafter: Sequence[Lengths], lookup: Sequence[Lengths] | None, tau: Callable = pooled_tau, prefix: str = ""
) -> dict[str, float]:
    """`<prefix>tau_ci95_low/high`, and with prompt lookup's lengths for the same units: `<prefix>tau_minus_lookup`
    and its `_ci95_low/high` (paired). Each unit (prompt or conversation) holds its generations' lengths; `tau` is
    pooled_tau or mean_tau (both ratios of per-unit sums, so a resample costs one pass over the units)."""
    parts_of = _mean_parts if tau is mean_tau else _pooled_parts
    ours = [parts_of(unit) for unit in drafter]
    out: dict[str, float] = {}
    n = len(ours)
    if n >= 2:  # one unit has no spread to resample: no interval keys (a NaN would never equal itself)
        out[f"{prefix}tau_ci95_low"], out[f"{prefix}tau_ci95_high"] = bootstrap_interval(
            n, lambda idx: _ratio([ours[i] for i in idx])
        )
    if lookup is not None and len(lookup) == n:
        theirs = [parts_of(unit) for unit in lookup]

        def diff(idx: list[int]) -> float:
            return _ratio([ours[i] for i in idx]) - _ratio([theirs[i] for i in idx])

        out[f"{prefix}tau_minus_lookup"] = diff(list(range(n)))
        if n >= 2:
            low, high = bootstrap_interval(n, diff)
            out[f"{prefix}tau_minus_lookup_ci95_low"], out[f"{prefix}tau_minus_lookup_ci95_high"] = low, high
    return out
