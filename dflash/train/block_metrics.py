"""Teacher-forced block metrics of the drafter stage: accuracy, per-position acceptance, avg streak
(1 + leading positions per block whose draft argmax is the data's token) and sim_tau (1 + leading positions
whose draft argmax is the target's argmax: what greedy verification accepts, the simulated acceptance length
of SpecForge's `simulated_acc_len` counted per block rather than from per-position accuracies).
"""

from __future__ import annotations

import threading

import torch


class BlockMetricsAccumulator:
    """Sums block metrics over several steps; `compute()` gives the `train/...` dict for a monitor tick.

    Counts stay on the tensors' device between updates (no host sync per step); `compute()` copies them
    once. update() and compute() may be called from different threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._valid_per_pos: torch.Tensor | None = None  # (B-1,) int64
            self._correct_per_pos: torch.Tensor | None = None  # (B-1,) int64
            self._streak_sum: torch.Tensor | None = None
            self._num_blocks: torch.Tensor | None = None
            self._sim: torch.Tensor | None = None  # (2,) int64: sim streak sum, blocks with target argmaxes

    @staticmethod
    def counts(correct: torch.Tensor, valid: torch.Tensor, target_correct: torch.Tensor | None = None) -> torch.Tensor:
        """One batch's counts as a flat vector [valid per position (B-1), correct per position (B-1), streak
        sum, blocks, sim streak sum, sim blocks]: additive, so data-parallel ranks sum them before `add_counts`.
        target_correct (draft argmax == target argmax) None: the sim counts are 0 (no train/sim_tau)."""
        if correct.shape != valid.shape or correct.dim() != 2:
            raise ValueError(f"correct {tuple(correct.shape)} and valid {tuple(valid.shape)} must both be [N, B-1]")
        valid = valid.detach().bool()
        has_valid = valid.any(dim=1)
        hit = correct.detach().bool() & valid
        sim = torch.zeros(2, dtype=torch.long, device=valid.device)
        if target_correct is not None:
            sim = torch.stack([streak_sum(target_correct.detach().bool() & valid, has_valid), has_valid.sum()])
        return torch.cat([valid.sum(0), hit.sum(0), streak_sum(hit, has_valid).view(1), has_valid.sum().view(1), sim])

    def update(self, correct: torch.Tensor, valid: torch.Tensor, target_correct: torch.Tensor | None = None) -> None:
        """correct, valid (, target_correct): Bool [N, B-1]. Invalid positions end a block's streak."""
        self.add_counts(self.counts(correct, valid, target_correct))

    def add_counts(self, counts: torch.Tensor) -> None:
        """Add a `counts` vector (possibly summed over ranks)."""
        width = (counts.numel() - 4) // 2
        valid_per_pos, hit_per_pos = counts[:width].long(), counts[width : 2 * width].long()
        streak_sum, num_blocks = counts[2 * width].long(), counts[2 * width + 1].long()
        sim = counts[2 * width + 2 :].long()
        with self._lock:
            if self._valid_per_pos is not None and self._valid_per_pos.shape[0] != width:
                raise ValueError(
                    f"block width changed from {self._valid_per_pos.shape[0]} to {width} positions; reset() first"
                )
            if self._valid_per_pos is None:
                self._valid_per_pos, self._correct_per_pos = valid_per_pos, hit_per_pos
                self._streak_sum, self._num_blocks, self._sim = streak_sum, num_blocks, sim
            else:
                self._valid_per_pos = self._valid_per_pos + valid_per_pos
                self._correct_per_pos = self._correct_per_pos + hit_per_pos
                self._streak_sum = self._streak_sum + streak_sum
                self._num_blocks = self._num_blocks + num_blocks
                self._sim = self._sim + sim

    def compute(self) -> dict[str, float]:
        """`train/accuracy`, `train/avg_streak`, `train/sim_tau`, `train/accuracy_<k>` (k = 1..B-1); keys with no data
        are omitted."""
        with self._lock:
            if self._valid_per_pos is None:
                return {}
            v = self._valid_per_pos.cpu().tolist()
            c = self._correct_per_pos.cpu().tolist()
            streak_sum = int(self._streak_sum.item())
            num_blocks = int(self._num_blocks.item())
            sim_sum, sim_blocks = self._sim.cpu().tolist()
        out: dict[str, float] = {}
        if sum(v) > 0:
            out["train/accuracy"] = sum(c) / sum(v)
        if num_blocks > 0:
            out["train/avg_streak"] = streak_sum / num_blocks
        if sim_blocks > 0:
            out["train/sim_tau"] = sim_sum / sim_blocks
        for k, (vk, ck) in enumerate(zip(v, c), start=1):
            if vk > 0:
                out[f"train/accuracy_{k}"] = ck / vk
        return out


def streak_sum(hit: torch.Tensor, has_valid: torch.Tensor) -> torch.Tensor:
    """Sum over blocks with a valid position of 1 + the leading run of hits (cumprod stays 1 until a miss)."""
    return ((torch.cumprod(hit.long(), dim=1).sum(dim=1) + 1) * has_valid).sum()


def block_metrics(
    correct: torch.Tensor, valid: torch.Tensor, target_correct: torch.Tensor | None = None
) -> dict[str, float]:
    """Teacher-forced metrics of one batch; see `BlockMetricsAccumulator`.

    train/accuracy:   top-1 accuracy over valid positions.
    train/avg_streak: over blocks with a valid position, 1 + number of leading correct valid positions
                      (the teacher-forced proxy of the acceptance length tau; the anchor counts as 1).
    train/sim_tau:    as avg_streak, counting positions where the draft's argmax is the target's argmax (greedy
                      verification), given target_correct.
    train/accuracy_k: accuracy at block position k over blocks where k is valid (not conditional on the
                      earlier positions; eval/acc_pos_k is the share of cycles accepting at least k drafts).
    """
    acc = BlockMetricsAccumulator()
    acc.update(correct, valid, target_correct)
    return acc.compute()
