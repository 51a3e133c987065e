"""Degenerate output: text that has fallen into a loop of a short pattern ("the the the", "}\n}\n}\n").

An output is degenerate when it has at least `window` tokens (trailing stop tokens removed) and its last
`window` tokens repeat with a period of at most `max_period` tokens: token i equals token i - p for every i of
that tail, for one p in 1..max_period. A short output that stopped on its own is never degenerate; a loop of a
longer pattern (a repeated sentence) is not counted either: the measure names the tiny models' usual failure,
a short cycle to the end of the budget, and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

WINDOW = 32  # tokens at the end of an output that must repeat
MAX_PERIOD = 4  # the longest pattern, in tokens, that counts as "short"


def repeat_period(
    tokens: Sequence[int], window: int = WINDOW, max_period: int = MAX_PERIOD, stop_ids: Iterable[int] = ()
) -> int | None:
    """The shortest period p <= max_period with which the last `window` tokens repeat, or None."""
    stop = set(stop_ids)
    end = len(tokens)
    while end and tokens[end - 1] in stop:
        end -= 1
    if window < 1 or end < window:
        return None
    tail = list(tokens[end - window : end])
    for p in range(1, max_period + 1):
        if p < window and all(tail[i] == tail[i - p] for i in range(p, window)):
            return p
    return None


def is_degenerate(tokens: Sequence[int], stop_ids: Iterable[int] = (), window: int = WINDOW) -> bool:
    return repeat_period(tokens, window, MAX_PERIOD, stop_ids) is not None


def degenerate_share(outputs: Sequence[Sequence[int]], stop_ids: Iterable[int] = (), window: int = WINDOW) -> float:
    """The share of outputs that are degenerate (nan for no outputs)."""
    stop = tuple(stop_ids)
    if not outputs:
        return float("nan")
    return sum(is_degenerate(o, stop, window) for o in outputs) / len(outputs)
