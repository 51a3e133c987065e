"""The two stage functions the pipeline runs: the target step (features) and the drafter training step.

Nothing here knows about threads or Hydra: `pipeline.Pipeline` calls `TargetForward` and `DrafterTrainer.train_on`,
either in sequence (pipeline=sync) or in threads joined by bounded queues (pipeline=async).

Determinism: the anchors and the feature noise of optimizer step t come from generators seeded with (train.seed, t),
and the data order from (train.seed, pass): a resumed run draws exactly what an uninterrupted one would have drawn.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from dflash.core.distributed import World
from dflash.core.machine import peak_rss_mb
from dflash.data.batches import Batch
from dflash.model.blocks import gather_positions, sample_anchors
from dflash.model.families import drafted_hidden, family_loss, target_argmax, training_blocks
from dflash.model.window import draft_window
from dflash.train.block_metrics import BlockMetricsAccumulator
from dflash.train.optimizers import DrafterOptimizer
from dflash.train.precision import autocast, autocast_dtype, head_for_loss
from dflash.train.schedules import add_feature_noise, lr_at, noise_std_at
from dflash.train.time_budget import TimeBudget, stop_reason

log = logging.getLogger(__name__)

# the per-step values summary_metrics averages, in the order `recent` stores them (block counts follow)
_SUMMED = ("train/loss", "train/loss_ce", "train/loss_kl", "train/grad_norm")

# per-rank monitor values that rank 0 shows as `<key>_min` / `<key>_max` under data parallelism
PERF_SPREAD_KEYS = (
    "perf/target_queue_depth",
    "perf/hs_queue_depth",
    "perf/target_busy",
    "perf/drafter_busy",
    "perf/peak_rss_mb",
    "perf/target_mb",
)


class TrainingDiverged(RuntimeError):
    """train.max_bad_steps non-finite steps in a row."""


@dataclass
class HiddenItem:
    """What crosses the hs_queue: target features of one batch, on the drafter's device."""

    input_ids: torch.Tensor  # (bsz, S)
    loss_mask: torch.Tensor  # (bsz, S) bool
    target_hidden: torch.Tensor  # (bsz, S, n_feat * H)
    last_hidden: torch.Tensor  # (bsz, S, H), final-normed (teacher logits = lm_head(last_hidden))
    num_tokens: int  # tokens of these rows
    data_pass: int
    index: int
    global_loss_mask: torch.Tensor | None = None  # (global bsz, S) under data parallelism (anchors are drawn on it)
    row_start: int = 0  # these rows' first row in the global batch
    global_tokens: int | None = None  # tokens of the global batch (the step's token count on every rank)
    target_next: torch.Tensor | None = None  # (bsz, S) int32: argmax of lm_head(last_hidden), a store's (else None)


class TargetForward:
    """Batch -> HiddenItem with the frozen target, on the drafter's `device`. With several replicas (one per
    device, parallel.target_devices) each pipeline target worker thread keeps one. `fail_at_batch` is a
    fault-injection hook for tests."""

    def __init__(self, target, device: torch.device, fail_at_batch: int | None = None):
        self.replicas = list(target) if isinstance(target, (list, tuple)) else [target]
        self.target = self.replicas[0]
        self.device = device
        self.fail_at_batch = fail_at_batch
        self.calls = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._assigned = 0

    def _replica(self):
        replica = getattr(self._local, "replica", None)
        if replica is None:
            with self._lock:  # each worker thread keeps the next replica
                replica = self._local.replica = self.replicas[self._assigned % len(self.replicas)]
                self._assigned += 1
        return replica

    def __call__(self, batch: Batch) -> HiddenItem:
        with self._lock:
            self.calls += 1
            calls = self.calls
        if self.fail_at_batch is not None and calls >= self.fail_at_batch:
            raise RuntimeError(f"injected target-stage fault at batch {calls} (debug.fail_target_at_batch)")
        target = self._replica()
        target_hidden, last_hidden = target.features(batch.input_ids.to(target.device))
        # features are made under no-grad in the target; the drafter only reads them. Another device: copies
        # queued without blocking, then this (target worker) thread waits for them, not the drafter
        moved = [t.to(self.device, non_blocking=True) for t in (target_hidden, last_hidden)]
        if target.device.type == "cuda" and target.device != self.device:
            torch.cuda.current_stream(target.device).synchronize()
        return HiddenItem(
            input_ids=batch.input_ids.to(self.device),
            loss_mask=batch.loss_mask.to(self.device),
            target_hidden=moved[0],
            last_hidden=moved[1],
            num_tokens=batch.num_tokens,
            data_pass=batch.data_pass,
            index=batch.index,
            global_loss_mask=None if batch.global_loss_mask is None else batch.global_loss_mask.to(self.device),
            row_start=batch.row_start,
            global_tokens=batch.global_tokens,
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


def add_row_noise(features: torch.Tensor, std: float, seed: int, step: int, row_start: int) -> torch.Tensor:
    """Feature noise drawn per global row (data parallelism): a row gets the same noise on whichever rank."""
    if std == 0:
        return features
    rows = []
    for i in range(features.shape[0]):
        g = torch.Generator(device=features.device)
        g.manual_seed(((seed * 1_000_003 + step) * 65_537 + row_start + i) * 8 + 2)  # stream 2: row noise
        rows.append(add_feature_noise(features[i : i + 1], std, generator=g))
    return torch.cat(rows)


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
        world: World | None = None,
        model: torch.nn.Module | None = None,
        stop_requested: Callable[[], bool] | None = None,
    ):
        self.cfg = cfg
        self.target = target
        self.drafter = drafter  # the drafter module (FSDP2 shards it in place)
        self.world = world or World()
        self.model = model if model is not None else drafter  # what forward/backward run through (DDP wrapper)
        self.mask_token_id = mask_token_id
        self.block_size = cfg.model.block_size
        self.total_steps = total_steps
        self.max_tokens = cfg.train.max_tokens
        self.budget = TimeBudget(cfg.train.get("max_minutes"))  # max_minutes: any rank stops all; mean clock
        self.after_step = after_step
        self.optimizer = DrafterOptimizer(self.model, cfg.optim, cfg.schedule.lr)  # the optim group's
        self.lm_head_weight = target.lm_head.weight  # frozen, shared with the target
        self.device = next(drafter.parameters()).device
        # train.precision: bf16-mixed runs the forward and loss under bfloat16 autocast (dflash/train/precision.py)
        self.autocast_dtype = autocast_dtype(cfg.train.get("precision", "fp32"), self.device)
        self.loss_head_weight = head_for_loss(self.lm_head_weight, self.autocast_dtype)
        self._target_mb = sum(p.numel() * p.element_size() for p in target.parameters()) / 2**20
        self.build_blocks = partial(training_blocks, drafter)  # the drafter family's slots and labels
        self.attention = training_attention(cfg.model.attention, next(drafter.parameters()).device)
        self.window = draft_window(drafter.config)  # model.sliding_window, as the drafter's config records it
        self.step = 0  # optimizer steps taken (skipped steps included)
        self.tokens = 0
        self.supervised_tokens = 0  # tokens the loss mask supervises (train/supervised_tokens), global batches
        self.skipped_steps = 0
        self.bad_in_row = 0
        self.next_data = (0, 0)  # (pass, index) of the next batch to train on
        self._lock = threading.Lock()
        self._reset_window()
        # data parallelism: each step all ranks agree on stopping (a signal to any of them: `stop_requested`),
        # and exchange their latest local monitor sample (`set_local_sample`) so rank 0 can show the spread
        self.stop_requested = stop_requested or (lambda: False)
        self.stopped_on_request = False
        self.local_perf: dict[str, float] = {}
        # the last steps' values, for summary metrics that do not depend on timing (checkpointed with counters)
        self.recent: collections.deque = collections.deque(maxlen=cfg.logging.summary_window_steps)
        self.perf_spread: dict[str, float] = {}

    # --- metrics -------------------------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._acc = BlockMetricsAccumulator()
        self._sums = {"train/loss": 0.0, "train/loss_ce": 0.0, "train/loss_kl": 0.0, "train/grad_norm": 0.0}
        self._n = 0  # finite steps in the window
        self._window_steps = 0  # steps in the window, skipped ones included
        self._tokens_and_slots = [0, 0]  # real tokens and batch slots (padding included) since the last window

    def metrics(self) -> dict[str, float]:
        """Training metrics averaged over the steps since the last call (thread-safe), plus counters. A window
        without a step has no train/*: a record repeats no step's values (a mean over records counts each once)."""
        with self._lock:
            out = {"step": self.step, "tokens": self.tokens}
            if not self._window_steps:  # train/supervised_tokens too is written with a step only
                return out
            out["train/supervised_tokens"] = self.supervised_tokens
            if self._n:
                out.update({k: v / self._n for k, v in self._sums.items()})
                out.update(self._acc.compute())
                tokens, slots = self._tokens_and_slots
                if slots:  # what batching costs: the share of the target's and drafter's work spent on padding
                    out["perf/pad_fraction"] = 1.0 - tokens / slots
            self._reset_window()
            last = max(self.step - 1, 0)  # the step these averages end with, not the one about to run
            out["train/lr"] = self.lr_for(last)
            out["train/noise_std"] = self.noise_for(last)
            out["train/skipped_steps"] = self.skipped_steps
        return out

    def summary_metrics(self) -> dict[str, float]:
        """train/* as the mean over the last `logging.summary_window_steps` finite steps (block metrics pooled
        over them), and the window used: what summary.json reports, independent of monitor timing."""
        with self._lock:
            rows = list(self.recent)
        if not rows:
            return {}
        n = len(rows)
        out = {k: sum(r[i] for r in rows) / n for i, k in enumerate(_SUMMED)}
        acc = BlockMetricsAccumulator()
        acc.add_counts(torch.tensor([sum(col) for col in list(zip(*rows))[len(_SUMMED) :]], dtype=torch.float64))
        out.update(acc.compute())
        out["train/summary_window_steps"] = n
        return out

    def lr_for(self, step: int) -> float:
        return lr_at(self.budget.schedule_step(step, self.total_steps), self.total_steps, self.cfg.schedule)

    def noise_for(self, step: int) -> float:
        return noise_std_at(self.budget.schedule_step(step, self.total_steps), self.total_steps, self.cfg.schedule)

    def done(self) -> bool:
        return stop_reason(self) is not None

    # --- the step -------------------------------------------------------------------------------------
    def compute_loss(self, item: HiddenItem, step: int, noise_std: float):
        """Forward of all blocks of a batch in one pass; returns the loss output of dflash.model.losses."""
        cfg, B = self.cfg, self.block_size
        # anchors are drawn for the whole global batch (one process draws the same), then this rank's rows taken
        whole = item.loss_mask if item.global_loss_mask is None else item.global_loss_mask
        anchors, valid = sample_anchors(
            whole, cfg.train.num_anchors, B, step_generator(cfg.train.seed, step, 0), cfg.train.get("anchor_budget")
        )
        rows = slice(item.row_start, item.row_start + item.input_ids.shape[0])
        anchors, valid = anchors[rows], valid[rows]
        blocks = self.build_blocks(
            item.input_ids, item.loss_mask, anchors, valid, B, self.mask_token_id, self.attention, self.window
        )
        with torch.no_grad():
            noise_embedding = self.target.embed_tokens(blocks.input_ids).to(self.drafter.dtype)
        target_hidden = item.target_hidden.to(self.drafter.dtype)
        if self.world.distributed:
            target_hidden = add_row_noise(target_hidden, noise_std, cfg.train.seed, step, item.row_start)
        else:
            generator = step_generator(cfg.train.seed, step, 1, target_hidden.device)
            target_hidden = add_feature_noise(target_hidden, noise_std, generator=generator)
        bsz, n = anchors.shape
        # every loss gets the target's last hidden states (the KL losses' soft labels) and its argmax for sim_tau: a
        # store's, or computed here in float32 outside autocast; a KL loss under labels=data and DSpark (None here)
        # take it from their teacher logits, through the loss's head: the bfloat16 copy under bf16-mixed
        teacher_hidden = gather_positions(item.last_hidden, blocks.teacher_positions).reshape(bsz * n, B - 1, -1)
        stored = item.target_next
        target_next = target_argmax(self.drafter, blocks, item.last_hidden, stored, self.lm_head_weight, cfg.loss)
        with autocast(self.device, self.autocast_dtype):
            out = self.model(noise_embedding, target_hidden, blocks.position_ids, attention_mask=blocks.attention_mask)
            draft_hidden = drafted_hidden(self.drafter, out, bsz, n, B)  # [bsz * N, B-1, H] (DFlash: slots 1..B-1)
            return family_loss(  # the drafter family's loss (DFlash: model/losses.py's fused dflash_loss)
                self.drafter,
                draft_hidden,
                blocks,
                item.input_ids,
                teacher_hidden,
                self.loss_head_weight,
                cfg.loss,
                B,
                # data parallelism: every rank divides by the global weight sum (SpecForge PR #731's fix)
                weight_denominator=self._global_weight_sum if self.world.distributed else None,
                target_next=target_next,
            )

    def _global_weight_sum(self, local: torch.Tensor) -> torch.Tensor:
        return self.world.all_reduce(local.reshape(1)).reshape(())

    def train_on(self, item: HiddenItem) -> bool:
        """Train on one item; returns False once training is done or stopped (the pipeline then stops).
        Under data parallelism every rank runs the same collectives in the same order each step."""
        if self.done():
            return False
        self.budget.start()
        cfg, world = self.cfg, self.world
        step = self.step
        lr, noise_std = self.lr_for(step), self.noise_for(step)
        self.optimizer.set_lr(lr)
        self.model.train()
        out = self.compute_loss(item, step, noise_std)
        self.optimizer.zero_grad(set_to_none=True)
        # DDP and FSDP average gradients over ranks; the loss is already divided by the global weight sum
        (out.loss * world.size if world.distributed else out.loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        stats = self._reduce_step(out)
        finite = math.isfinite(stats["loss"]) and math.isfinite(grad_norm)  # the same verdict on every rank
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
            self._window_steps += 1
            step_tokens = item.global_tokens if item.global_tokens is not None else item.num_tokens
            self.tokens += step_tokens
            whole = item.loss_mask if item.global_loss_mask is None else item.global_loss_mask
            self.supervised_tokens += int(whole.sum())
            self._tokens_and_slots[0] += step_tokens
            self._tokens_and_slots[1] += whole.numel()
            self.next_data = (item.data_pass, item.index + 1)
            if finite:
                own = {f"train/{k}": stats[k] for k in ("loss", "loss_ce", "loss_kl")}  # + a family's (DSpark: TV)
                for key, value in {**own, "train/grad_norm": grad_norm, **stats["extra"]}.items():
                    self._sums[key] = self._sums.get(key, 0.0) + value
                self._acc.add_counts(stats["counts"])
                self._n += 1
                self.recent.append(
                    [stats["loss"], stats["loss_ce"], stats["loss_kl"], grad_norm, *stats["counts"].tolist()]
                )
        if self.bad_in_row >= cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"{self.bad_in_row} non-finite steps in a row (train.max_bad_steps={cfg.train.max_bad_steps}); "
                "the last good state was checkpointed"
            )
        if self.after_step is not None:
            self.after_step(self)
        self.budget.agree(stats["time_up"], self.step, stats["elapsed_s"])
        if stats["stop"]:
            self.stopped_on_request = True
            log.warning("stopping after step %d: a stop was requested", self.step)
            return False
        return not self.done()

    def _reduce_step(self, out) -> dict:
        """This step's loss terms, block counts and stop request, summed over ranks in one collective (the
        loss terms are already divided by the global weight sum); with several ranks, also the min/max of
        their latest monitor samples."""
        extra = sorted(out.extra)  # the same names on every rank (one family)
        local = torch.cat(
            [
                torch.stack([out.loss.detach().float(), out.loss_ce.float(), out.loss_kl.float()]).cpu().double(),
                torch.tensor([float(self.world.distributed and self.stop_requested())], dtype=torch.float64),
                torch.tensor([float(self.budget.time_up()), self.budget.elapsed_s() / self.world.size]).double(),
                torch.tensor([float(out.extra[k]) for k in extra], dtype=torch.float64),
                BlockMetricsAccumulator.counts(out.correct, out.valid, out.target_correct).cpu().double(),
            ]
        )
        total = self.world.all_reduce(local)
        if self.world.distributed and self.world.size > 1:
            self._exchange_perf()
        return {
            "loss": total[0].item(),
            "loss_ce": total[1].item(),
            "loss_kl": total[2].item(),
            "stop": bool(total[3].item() > 0),
            "time_up": bool(total[4].item() > 0),
            "elapsed_s": total[5].item(),
            "extra": {k: total[6 + i].item() for i, k in enumerate(extra)},
            "counts": total[6 + len(extra) :],
        }

    def set_local_sample(self, sample: dict[str, float]) -> None:
        """The monitor thread's latest sample of this rank, exchanged with the others at the next step."""
        self.local_perf = sample

    def memory_sample(self) -> dict[str, float]:
        """perf/peak_rss_mb (host) and perf/target_mb: the target's tensors this rank holds (the whole target, or
        its embedding and LM head on a drafter rank of parallel.target_ranks), the GPU memory it costs there."""
        return {"perf/peak_rss_mb": peak_rss_mb(), "perf/target_mb": self._target_mb}

    def _exchange_perf(self) -> None:
        names = sorted(PERF_SPREAD_KEYS)
        local = {**self.local_perf, **self.memory_sample()}  # fresh each step: the monitor may be slow
        values = torch.tensor([float(local.get(k, 0.0)) for k in names], dtype=torch.float64)
        both = self.world.all_reduce(torch.cat([values, -values]), op="max")
        self.perf_spread = {
            **{f"{k}_max": both[i].item() for i, k in enumerate(names)},
            **{f"{k}_min": -both[len(names) + i].item() for i, k in enumerate(names)},
        }

    # --- state for checkpoints -----------------------------------------------------------------------
    def counters(self) -> dict:
        """Step and token counters and the data position (global batches): the same on every rank."""
        return {
            "step": self.step,
            "tokens": self.tokens,
            "supervised_tokens": self.supervised_tokens,
            "skipped_steps": self.skipped_steps,
            "bad_in_row": self.bad_in_row,
            "next_data": list(self.next_data),
            "recent": [list(map(float, r)) for r in self.recent],
            "recent_layout": 2,  # 2: block counts end with the sim_tau counts
            "trained_s": round(self.budget.agreed_s, 3),
        }

    def load_counters(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens, self.supervised_tokens = int(state["tokens"]), int(state.get("supervised_tokens", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.bad_in_row = int(state.get("bad_in_row", 0))
        self.next_data = tuple(state["next_data"])
        self.budget.load(state.get("trained_s", 0.0))
        self.recent.clear()
        if state.get("recent_layout") == 2:  # an older checkpoint's rows lack the sim_tau counts: start afresh
            self.recent.extend(state.get("recent", []))

    def state_dict(self) -> dict:  # the counters beside the optimizer's state
        return {"optimizer": self.optimizer.state_dict(), **self.counters()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])  # the resumed config's hyperparameters applied
        self.load_counters(state)
