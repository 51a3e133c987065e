"""Degenerate output: text that has fallen into a loop of a short pattern ("the the the", "1.\n\n1.\n\n1.").

An output is degenerate when it has at least `window` tokens (trailing stop tokens removed) and its last
`window` tokens hold at most `max_distinct` distinct tokens. A strict loop of a pattern of p tokens has p
distinct ones; a looser loop ("# Sal.\n\n# Saa.\n\n\n# Sal.": a few tokens, their order and the newlines
varying) is caught too, which a strict periodicity test misses: byte-level BPE tokenises the same loop
differently as it drifts. Prose, code and lists use far more: 32 tokens of ShareGPT's own answers held 16 to
32 distinct tokens (docs/data.md). A short output that stopped on its own is never degenerate.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

WINDOW = 32  # tokens at the end of an output that are looked at
MAX_DISTINCT = 8  # at most this many distinct tokens in the window: a loop of a short pattern


def distinct_tail(tokens: Sequence[int], window: int = WINDOW, stop_ids: Iterable[int] = ()) -> int | None:
    """How many distinct tokens the last `window` tokens (trailing stop tokens removed) hold; None when the
    output is shorter than `window`."""
    stop = set(stop_ids)
    end = len(tokens)
    while end and tokens[end - 1] in stop:
        end -= 1
    if window < 1 or end < window:
        return None
    return len(set(tokens[end - window : end]))


def is_degenerate(
    tokens: Sequence[int], stop_ids: Iterable[int] = (), window: int = WINDOW, max_distinct: int = MAX_DISTINCT
) -> bool:
    n = distinct_tail(tokens, window, stop_ids)
    return n is not None and n <= max_distinct


def degenerate_share(outputs: Sequence[Sequence[int]], stop_ids: Iterable[int] = (), window: int = WINDOW) -> float:
    """The share of outputs that are degenerate (nan for no outputs)."""
    stop = tuple(stop_ids)
    if not outputs:
        return float("nan")
    return sum(is_degenerate(o, stop, window) for o in outputs) / len(outputs)
