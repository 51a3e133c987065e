"""train.anchor_budget: how many anchors each row of a batch gets when the batch's total is capped (pure Python:
the sampler in model/blocks.py and the memory plan in model/plan.py share it)."""

from __future__ import annotations


def anchor_counts(eligible: list[int], num_anchors: int, budget: int | None = None) -> list[int]:
    """Anchors per row, from each row's count of eligible positions e_b. Without a budget: min(e_b, num_anchors).

    With train.anchor_budget K, the rule: row b can take c_b = min(e_b, num_anchors); the batch gets
    min(K, sum c_b) anchors; each row with c_b > 0 gets one, and the rest are shared in proportion to c_b - 1,
    rounded down, the leftover going one each to the largest remainders (ties: the lower row first). So the total
    never exceeds K, no row exceeds its c_b, and the counts depend on the rows' loss masks alone (the positions
    are then drawn from the step's seeded generator)."""
    caps = [min(int(e), num_anchors) for e in eligible]
    if budget is None:
        return caps
    counts = [1 if c > 0 else 0 for c in caps]
    rest = min(budget, sum(caps)) - sum(counts)
    if rest < 0:
        raise ValueError(f"anchor budget {budget} is less than the {sum(counts)} rows that have an anchor position")
    spare = [c - n for c, n in zip(caps, counts)]
    total = sum(spare)
    if rest == 0:
        return counts
    shares = [divmod(rest * s, total) for s in spare]  # exact: integer floor and remainder of rest * s / total
    order = sorted(range(len(caps)), key=lambda b: (-shares[b][1], b))
    leftover = rest - sum(q for q, _ in shares)
    for i, b in enumerate(order):
        counts[b] += shares[b][0] + (1 if i < leftover else 0)
    return counts


def planned_width(num_anchors: int, budget: int | None, batch_size: int, seq_len: int, block_size: int) -> int:
    """The anchors per row of a batch of `batch_size` full rows of seq_len supervised tokens (the memory plan's
    batch): the width of the anchor tensor sample_anchors returns for it."""
    if budget is None:
        return num_anchors
    eligible = max(0, seq_len - block_size + 1)
    return max(1, max(anchor_counts([eligible] * batch_size, num_anchors, budget), default=0))
