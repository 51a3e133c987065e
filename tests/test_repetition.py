"""The degenerate-output measure (dflash/core/repetition.py) on hand-made token sequences, and its place in the
benchmark's metrics."""

from __future__ import annotations

import math

import pytest

from dflash.core.repetition import MAX_DISTINCT, WINDOW, degenerate_share, distinct_tail, is_degenerate

PROSE = list(range(100, 100 + 40))  # no token repeats
NL2, NL3, ONE, DOT = 5, 6, 7, 8  # "\n\n", "\n\n\n", "1", "."


@pytest.mark.parametrize(
    ("tokens", "distinct"),
    [
        ([7] * WINDOW, 1),  # one token to the end
        (PROSE + [7] * WINDOW, 1),  # prose that falls into a loop: only the tail counts
        (PROSE + [1, 2] * 20, 2),
        (PROSE + [1, 2, 3, 4] * 8, 4),
        (PROSE + list(range(1, 9)) * 4, 8),  # a pattern of 8 tokens: the longest that counts
        # a loose loop: "1.\n\n" with the newlines varying (a strict period test misses it)
        (PROSE + [ONE, DOT, NL2, ONE, DOT, NL3, ONE, DOT, NL2, NL2] * 4, 4),
    ],
)
def test_a_loop_of_a_short_pattern_is_degenerate(tokens, distinct):
    assert distinct_tail(tokens) == distinct
    assert is_degenerate(tokens)


@pytest.mark.parametrize(
    "tokens",
    [
        PROSE,  # no repetition
        [7] * (WINDOW - 1),  # too short to tell: an answer that stopped on its own
        PROSE + list(range(1, 10)) * 4,  # 9 distinct tokens: a longer pattern is not "short"
        [7] * 20 + PROSE[:WINDOW],  # a loop that the output left again
        PROSE[:20] + [7] * (WINDOW - MAX_DISTINCT - 1),  # the loop's start is in the window with 9 prose tokens
    ],
)
def test_prose_short_outputs_and_longer_patterns_are_not(tokens):
    assert not is_degenerate(tokens)


def test_stop_tokens_at_the_end_are_not_part_of_the_tail():
    loop = PROSE + [1, 2] * 16
    assert is_degenerate(loop + [0] * 30, stop_ids=[0])
    assert is_degenerate(PROSE + [0] * 32) and not is_degenerate(PROSE + [0] * 32, stop_ids=[0])
    assert not is_degenerate([1, 2] * 15 + [0, 0], stop_ids=[0])  # 30 tokens of content: too short


def test_window_and_share():
    assert distinct_tail([5] * 8, window=8) == 1 and distinct_tail([5] * 7, window=8) is None
    outputs = [PROSE, PROSE + [3] * WINDOW, [1, 2] * 20, [4] * 3]
    assert degenerate_share(outputs) == 0.5
    assert math.isnan(degenerate_share([]))


def test_the_benchmark_reports_the_share_of_degenerate_generations():
    from dflash.core.rundir import BENCH_COLUMNS
    from dflash.evaluation.benchmark import suite_metrics

    def gen(tokens):
        n = len(tokens)
        return dict(
            tokens=tokens,
            accept_lengths=[2] * (n // 2),
            decode_time_s=1.0,
            target_only_decode_time_s=2.0,
            target_only_decode_tokens=n,
            matches_target_only=True,
            lookup_accept_lengths=None,
            eos_id=0,
        )

    gens = [gen(PROSE), gen(PROSE + [9] * WINDOW + [0]), gen([1, 2, 3] * 12), gen(PROSE[:10] + [0])]
    m = suite_metrics(gens, block_size=4, temperature=0.0, num_prompts=4)
    assert m["degenerate"] == 0.5 and "degenerate" in BENCH_COLUMNS
