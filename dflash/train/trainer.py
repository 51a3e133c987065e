"""The two stage functions the pipeline runs: the target step (features) and the drafter training step.

Nothing here knows about threads or Hydra: `pipeline.Pipeline` calls `TargetForward` and `DrafterTrainer.step`,
either in sequence (pipeline=sync) or in threads joined by bounded queues (pipeline=async).

Determinism: the anchors and the feature noise of optimizer step t come from generators seeded with
(train.seed, t), and the data order from (train.seed, pass). So a resumed run draws exactly what an
uninterrupted one would have drawn.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.data.batches import Batch
from dflash.model.blocks import build_training_blocks, gather_positions, sample_anchors
from dflash.model.losses import dflash_loss
from dflash.train.block_metrics import BlockMetricsAccumulator
from dflash.train.schedules import add_feature_noise, lr_at, noise_std_at

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """train.max_bad_steps non-finite steps in a row."""


@dataclass
class HiddenItem:
    """What crosses the hs_queue: target features of one batch, on the drafter's device."""

    input_ids: torch.Tensor  # (bsz, S)
    loss_mask: torch.Tensor  # (bsz, S) bool
    target_hidden: torch.Tensor  # (bsz, S, n_feat * H)
    last_hidden: torch.Tensor  # (bsz, S, H), final-normed (teacher logits = lm_head(last_hidden))
    num_tokens: int
    data_pass: int
    index: int


class TargetForward:
    """Batch -> HiddenItem with the frozen target. `fail_at_batch` is a fault-injection hook for tests."""

    def __init__(self, target, device: torch.device, fail_at_batch: int | None = None):
        self.target = target
        self.device = device
        self.fail_at_batch = fail_at_batch
        self.calls = 0

    def __call__(self, batch: Batch) -> HiddenItem:
        self.calls += 1
        if self.fail_at_batch is not None and self.calls >= self.fail_at_batch:
            raise RuntimeError(f"injected target-stage fault at batch {self.calls} (debug.fail_target_at_batch)")
        ids = batch.input_ids.to(self.target.device)
        target_hidden, last_hidden = self.target.features(ids)
        # features are made under no-grad in the target; the drafter only reads them
        return HiddenItem(
            input_ids=batch.input_ids.to(self.device),
            loss_mask=batch.loss_mask.to(self.device),
            target_hidden=target_hidden.to(self.device),
            last_hidden=last_hidden.to(self.device),
            num_tokens=batch.num_tokens,
            data_pass=batch.data_pass,
            index=batch.index,
        )


def training_attention(name: str, device: torch.device) -> str:
    """auto = FlexAttention on CUDA (sparse tiles), SDPA with a dense mask elsewhere (flex has no CPU backward)."""
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name == "flex" and device.type != "cuda":
        raise ValueError("model.attention=flex needs a CUDA device (FlexAttention has no CPU backward); use sdpa")
    return name


def step_generator(seed: int, step: int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one (step, stream), on `device`: torch draws CUDA random numbers only from a CUDA
    generator, and drawing GPU-sized noise on the CPU and copying it over would cost a step's worth of time."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + step) * 8 + stream)


def total_steps(train_cfg) -> int:
    """Optimizer steps of a run: `train.max_steps`, capped by `train.max_tokens` when set."""
    steps = train_cfg.max_steps
    if train_cfg.max_tokens:
        per_step = train_cfg.batch_size * train_cfg.seq_len
        steps = min(steps, -(-train_cfg.max_tokens // per_step))
    return int(steps)


class DrafterTrainer:
    """One optimizer step per HiddenItem; keeps step/token counters, metrics and the data position."""

    def __init__(
        self,
        cfg,
        target,
        drafter,
        mask_token_id: int,
        total_steps: int,
        after_step: Callable[[DrafterTrainer], None] | None = None,
    ):
        self.cfg = cfg
        self.target = target
        self.drafter = drafter
        self.mask_token_id = mask_token_id
        self.block_size = cfg.model.block_size
        self.total_steps = total_steps
        self.max_tokens = cfg.train.max_tokens
        self.after_step = after_step
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            [p for p in drafter.parameters() if p.requires_grad],
            lr=cfg.schedule.lr,
            betas=tuple(t.betas),
            weight_decay=t.weight_decay,
        )
        self.lm_head_weight = target.lm_head.weight  # frozen, shared with the target
        self.attention = training_attention(cfg.model.attention, next(drafter.parameters()).device)
        self.step = 0  # optimizer steps taken (skipped steps included)
        self.tokens = 0
        self.skipped_steps = 0
        self.bad_in_row = 0
        self.next_data = (0, 0)  # (pass, index) of the next batch to train on
        self._lock = threading.Lock()
        self._reset_window()
        self.last_metrics: dict[str, float] = {}

    # --- metrics -------------------------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._acc = BlockMetricsAccumulator()
        self._sums = {"train/loss": 0.0, "train/loss_ce": 0.0, "train/loss_kl": 0.0, "train/grad_norm": 0.0}
        self._n = 0

    def metrics(self) -> dict[str, float]:
        """Training metrics averaged over the steps since the last call (thread-safe), plus counters."""
        with self._lock:
            out = {"step": self.step, "tokens": self.tokens}
            if self._n:
                out.update({k: v / self._n for k, v in self._sums.items()})
                out.update(self._acc.compute())
                self._reset_window()
                self.last_metrics = {k: v for k, v in out.items() if k.startswith("train/")}
            else:
                out.update(self.last_metrics)
            last = max(self.step - 1, 0)  # the step these averages end with, not the one about to run
            out["train/lr"] = self.lr_for(last)
            out["train/noise_std"] = self.noise_for(last)
            out["train/skipped_steps"] = self.skipped_steps
        return out

    def lr_for(self, step: int) -> float:
        return lr_at(min(step, self.total_steps - 1), self.total_steps, self.cfg.schedule)

    def noise_for(self, step: int) -> float:
        return noise_std_at(min(step, self.total_steps - 1), self.total_steps, self.cfg.schedule)

    def done(self) -> bool:
        return self.step >= self.total_steps or (self.max_tokens is not None and self.tokens >= self.max_tokens)

    # --- the step -------------------------------------------------------------------------------------
    def compute_loss(self, item: HiddenItem, step: int, noise_std: float):
        """Forward of all blocks of a batch in one pass; returns the loss output of dflash.model.losses."""
        cfg, B = self.cfg, self.block_size
        anchors, valid = sample_anchors(
            item.loss_mask, cfg.train.num_anchors, B, step_generator(cfg.train.seed, step, 0)
        )
        blocks = build_training_blocks(
            item.input_ids, item.loss_mask, anchors, valid, B, self.mask_token_id, self.attention
        )
        with torch.no_grad():
            noise_embedding = self.target.embed_tokens(blocks.input_ids).to(self.drafter.dtype)
        target_hidden = item.target_hidden.to(self.drafter.dtype)
        target_hidden = add_feature_noise(
            target_hidden, noise_std, generator=step_generator(cfg.train.seed, step, 1, target_hidden.device)
        )
        out = self.drafter(noise_embedding, target_hidden, blocks.position_ids, attention_mask=blocks.attention_mask)
        bsz, n = anchors.shape
        draft_hidden = out.view(bsz, n, B, -1)[:, :, 1:].reshape(bsz * n, B - 1, -1)  # slots 1..B-1
        teacher_hidden = None
        if cfg.loss.name != "ce_decay":
            teacher_hidden = gather_positions(item.last_hidden, blocks.teacher_positions).reshape(bsz * n, B - 1, -1)
        lo = cfg.loss
        return dflash_loss(
            draft_hidden,
            blocks.labels.reshape(bsz * n, B - 1),
            blocks.label_valid.reshape(bsz * n, B - 1),
            self.lm_head_weight,
            loss_name=lo.name,
            block_size=B,
            decay_gamma=lo.decay_gamma,
            kl_temperature=lo.kl_temperature,
            kl_weight=lo.kl_weight,
            streak_alpha=lo.streak_alpha,
            teacher_hidden=teacher_hidden,
            chunk_size=lo.chunk_size,
        )

    def train_on(self, item: HiddenItem) -> bool:
        """Train on one item; returns False once training is done (the pipeline then stops)."""
        if self.done():
            return False
        cfg = self.cfg
        if cfg.debug.fail_at_step is not None and self.step + 1 >= cfg.debug.fail_at_step:
            raise RuntimeError(f"injected drafter-stage fault at step {self.step + 1} (debug.fail_at_step)")
        step = self.step
        lr, noise_std = self.lr_for(step), self.noise_for(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.drafter.train()
        out = self.compute_loss(item, step, noise_std)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.train.grad_clip).item()
        finite = math.isfinite(out.loss.item()) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.bad_in_row = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.bad_in_row += 1
            log.warning("step %d: non-finite loss or gradient, step skipped (%d in a row)", step + 1, self.bad_in_row)
        with self._lock:
            self.step += 1
            self.tokens += item.num_tokens
            self.next_data = (item.data_pass, item.index + 1)
            if finite:
                self._sums["train/loss"] += out.loss.item()
                self._sums["train/loss_ce"] += float(out.loss_ce)
                self._sums["train/loss_kl"] += float(out.loss_kl)
                self._sums["train/grad_norm"] += grad_norm
                self._acc.update(out.correct, out.valid)
                self._n += 1
        if self.bad_in_row >= cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"{self.bad_in_row} non-finite steps in a row (train.max_bad_steps={cfg.train.max_bad_steps}); "
                "the last good state was checkpointed"
            )
        if self.after_step is not None:
            self.after_step(self)
        if cfg.debug.crash_at_step is not None and self.step >= cfg.debug.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: no cleanup, exactly like kill -9
        return not self.done()

    # --- state for checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "tokens": self.tokens,
            "skipped_steps": self.skipped_steps,
            "bad_in_row": self.bad_in_row,
            "next_data": list(self.next_data),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        # load_state_dict also restores the saved hyperparameters; the resumed config's own win (lr is set
        # every step anyway), so `resume=RUN train.weight_decay=...` does what it says.
        for group in self.optimizer.param_groups:
            group["betas"] = tuple(self.cfg.train.betas)
            group["weight_decay"] = self.cfg.train.weight_decay
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.bad_in_row = int(state.get("bad_in_row", 0))
        self.next_data = tuple(state["next_data"])
