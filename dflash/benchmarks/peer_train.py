"""A peer's recipe on our feature store: vLLM speculators 0.9.0's DFlashDraftModel trained by its own forward and
loss with the settings its train CLI (`speculators train --speculator-type dflash`) resolves, read from its own
config schema (`TrainConfig`), not copied: Muon on the hidden matrices + AdamW (its lr 1e-3 for both, weight decay
0.1 / 0.01, torch's betas), a linear schedule (warmup 1% of the steps, then linear to 0), gradient clipping at 1.0,
the `ce` loss on the teacher's argmax with per-position D-PACE weights (alpha 0.5), anchors drawn by its own
`select_anchors` from the global torch RNG, its weight init (torch.manual_seed(seed), then its `post_init`).

Held equal to our run, so only the recipe differs: the store's rows in the run's order (a store item is one step),
the steps, the seed, the drafter's shape (layers, block size, target layers, mask token) and the anchor budget (our
run's train.batch_size x train.num_anchors per step; speculators draws them over its one packed row). Two
adaptations feed it our items: the store's `last_hidden` is already final-normed, so its `verifier_norm` is the
identity (its teacher logits are then lm_head(last_hidden), whose argmax is the store's target_next), and the rows
are packed into its one [1, T] row, each followed by block_size dead positions (document -1, no loss) so that no
block reaches the next row. Left as ours on purpose: every layer full attention with a non-causal block (its CLI's
default is sliding layers, window 2048, with a causal block, which our drafter cannot run: the window never binds
at our sequence lengths, the causal block would change the model), float32 (its Trainer autocasts to bfloat16),
and eager attention and the eager loss (its flex attention and Triton losses need a GPU).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DOCUMENT_GAP = -1  # speculators' document id of padding


def cli_defaults(lr: float | None = None):
    """Its train CLI's resolved settings for --speculator-type dflash (`lr`: --lr, which Muon's lr follows)."""
    from speculators.train.config.schema import OptimizerArgs, TrainConfig

    return TrainConfig(speculator_type="dflash", **({} if lr is None else {"optimizer": OptimizerArgs(lr=lr)}))


def build_peer(ours_config, embed: torch.Tensor, lm_head: torch.Tensor, seed: int, verifier: str | None = None):
    """Speculators' DFlashDraftModel of our drafter's shape, initialised as its CLI does from `seed`, with the
    target's frozen embedding and LM head (its teacher head too). The global torch RNG is left seeded: its anchor
    draws continue from it, as in its Trainer."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    from dflash.model.families.speculators_layout import _layer_config, verifier_config

    layer = Qwen3Config(**{k: v for k, v in _layer_config(ours_config).items() if k != "model_type"})
    layer._attn_implementation = "eager"  # a float mask; speculators' default flex attention needs CUDA to train
    dc = ours_config.dflash_config
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=int(ours_config.vocab_size),
        block_size=int(ours_config.block_size),
        aux_hidden_state_layer_ids=[int(i) + 1 for i in dc["target_layer_ids"]],
        mask_token_id=int(dc["mask_token_id"]),
    )
    torch.manual_seed(seed)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for param, weight in ((model.embed_tokens.weight, embed), (model.lm_head.weight, lm_head),
                              (model.verifier_lm_head.weight, lm_head)):  # fmt: skip
            param.copy_(weight)
    model.verifier_norm = torch.nn.Identity()  # the store's last_hidden is after the target's final norm
    architectures = list(getattr(verifier_config(verifier), "architectures", None) or [])
    config.speculators_config = SpeculatorsConfig(  # what its checkpoints record; set after init, which would load it
        algorithm="dflash",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=int(ours_config.block_size) - 1)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=verifier, architectures=architectures),
    )
    return model


def pack(item, block_size: int) -> dict[str, torch.Tensor]:
    """A store item's rows as speculators' one packed row: each row one document (positions from 0), followed by
    `block_size` dead positions."""
    bsz, seq = item.input_ids.shape
    gap = lambda x: torch.zeros((block_size, *x.shape[1:]), dtype=x.dtype, device=x.device)  # noqa: E731
    cat = lambda rows: torch.cat([torch.cat([r, gap(r)]) for r in rows])[None]  # noqa: E731
    docs = [torch.cat([torch.full((seq,), b), torch.full((block_size,), DOCUMENT_GAP)]) for b in range(bsz)]
    return {
        "hidden_states": cat(item.target_hidden.float()),
        "input_ids": cat(item.input_ids),
        "loss_mask": cat(item.loss_mask.long()),
        "verifier_last_hidden_states": cat(item.last_hidden.float()),
        "document_ids": torch.cat(docs)[None].to(item.input_ids.device),
        "position_ids": torch.arange(seq + block_size, device=item.input_ids.device).repeat(bsz)[None],
    }


def train_peer(model, items, steps: int, anchors_per_step: int, settings, log_path: Path) -> list[dict]:
    """`steps` optimizer steps of its Trainer's loop (forward, zero_grad, backward, clip 1.0, step, schedule), one
    store item each; one line per step in `log_path` (loss, lr, its teacher-forced full acceptance and EAL)."""
    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    opt, sch = settings.optimizer, settings.scheduler
    if sch.scheduler_type != "linear" or sch.scheduler_warmup_steps or sch.scheduler_warmup_ratio:
        raise ValueError(f"speculators' CLI default schedule changed ({sch}); this bench reproduces the linear one")
    call = type(model).get_trainer_kwargs(  # its CLI's train_call_kwargs
        **{**settings.flatten(), "loss_implementation": "eager", "max_anchors": anchors_per_step}
    )[0]
    optimizers = build_optimizers(model, opt)
    schedules = [get_linear_schedule_with_warmup(o, steps // 100, steps) for o in optimizers]  # its default warmup
    model.train()
    records = []
    with open(log_path, "w") as f:
        for step, item in zip(range(steps), items):
            t0 = time.perf_counter()
            _, loss, metrics = model(**pack(item, model.block_size), **call)
            for o in optimizers:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lr = optimizers[0].param_groups[0]["lr"]
            for o in optimizers:
                o.step()
            for s in schedules:
                s.step()
            rate = {k: float(metrics[f"{k}_sum"] / metrics[f"{k}_total"].clamp(min=1)) for k in ("full_acc", "eal")}
            record = {"step": step + 1, "loss": float(loss.detach()), "lr": lr, **rate, "s": time.perf_counter() - t0}
            f.write(json.dumps(record) + "\n")
            f.flush()
            records.append(record)
            if (step + 1) % 10 == 0 or step + 1 == steps:
                log.info(
                    "peer step %d/%d: loss %.4f, lr %.2e (%.1fs)", step + 1, steps, record["loss"], lr, record["s"]
                )
    if len(records) < steps:
        raise ValueError(f"the feature store ran out after {len(records)} of {steps} steps")
    return records
