"""95% intervals of tau by a bootstrap over prompts (conversations for suites), and paired against prompt lookup."""

from __future__ import annotations

import math
import random

import pytest

from dflash.evaluation.benchmark import suite_metrics
from dflash.evaluation.intervals import bootstrap_interval, mean_tau, pooled_tau, tau_intervals


def _prompts(n: int, mean_len: float, seed: int) -> list[list[list[int]]]:
    """n prompts, each one generation of 10 cycles with acceptance lengths around mean_len (1..8)."""
    rng = random.Random(seed)
    return [[[min(8, max(1, round(rng.gauss(mean_len, 1.0)))) for _ in range(10)]] for _ in range(n)]


def test_the_interval_holds_the_estimate_narrows_with_prompts_and_repeats():
    few, many = _prompts(8, 2.0, 0), _prompts(200, 2.0, 0)
    a, b = tau_intervals(few, None), tau_intervals(many, None)
    assert a["tau_ci95_low"] <= pooled_tau(few) <= a["tau_ci95_high"]
    assert b["tau_ci95_high"] - b["tau_ci95_low"] < (a["tau_ci95_high"] - a["tau_ci95_low"]) / 2
    assert tau_intervals(many, None) == b  # seeded
    assert tau_intervals(few[:1], None) == {}  # one prompt: no interval
    assert math.isnan(bootstrap_interval(1, len)[0])


def test_paired_difference_against_prompt_lookup():
    lookup = _prompts(60, 1.5, 1)
    same = tau_intervals(lookup, lookup)
    assert same["tau_minus_lookup"] == same["tau_minus_lookup_ci95_low"] == same["tau_minus_lookup_ci95_high"] == 0
    ahead = tau_intervals([[[x + 1 for x in g] for g in unit] for unit in lookup], lookup)  # one more token a cycle
    assert ahead["tau_minus_lookup"] == pytest.approx(1.0) and ahead["tau_minus_lookup_ci95_low"] > 0.99
    noisy = tau_intervals(_prompts(60, 1.5, 2), lookup)  # the same recipe on other prompts: not separated
    assert noisy["tau_minus_lookup_ci95_low"] < 0 < noisy["tau_minus_lookup_ci95_high"]


def test_bootstrap_percentiles():
    lo, hi = bootstrap_interval(100, lambda idx: sum(idx) / len(idx), resamples=500)
    assert lo < 49.5 < hi and hi - lo < 20  # the mean of 0..99 and its spread (about +-11)


def test_a_suites_interval_resamples_conversations_with_their_turns():
    generations = []
    for conv in range(10):
        for turn in range(2):  # mt-bench: two turns of one conversation go together
            lengths = [3, 3] if conv < 5 else [1, 1]
            generations.append(
                {"conversation": conv, "turn": turn, "tokens": [1, 2, 3], "accept_lengths": lengths,
                 "lookup_accept_lengths": [1, 1], "decode_time_s": 0.0, "target_only_decode_time_s": 0.0,
                 "target_only_decode_tokens": 0, "matches_target_only": None, "eos_id": 0}
            )  # fmt: skip
    m = suite_metrics(generations, block_size=4, temperature=0.0, num_prompts=10)
    assert m["tau"] == mean_tau([[g["accept_lengths"]] for g in generations]) == 2.0
    assert m["tau_ci95_low"] < 2.0 < m["tau_ci95_high"] and m["tau_minus_lookup"] == 1.0
    assert m["tau_minus_lookup_ci95_low"] > 0  # every conversation at or above lookup
