"""Drafter families on the DFlash backbone (`drafter=` group, config.DrafterConfig): a small registry.

A family is the drafter's class, how its settings enter the drafter's config, and its training rule: which block
slots the drafter runs and predicts from (`training_blocks`, `drafted_hidden`) and its loss (`loss`). A family's
proposal rule is its drafter's `choose_drafts`, which decoding's proposer (evaluation/decoding.py) and replay's
blocks (evaluation/sim_tau.py, eval.replay) both call; the speculators export layout is
families/speculators_layout.py's.

    dflash   z-lab's drafter (model/drafter.py), its fused loss (model/losses.py)
    dspark   DFlash + a Markov logit bias and a confidence head (families/dspark.py, families/dspark_loss.py)
    dflash2  DFlash + dynamic convolutions on the draft positions and a top-k candidate selector (families/dflash2.py,
             families/dflash2_loss.py)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.core.config import default_decay_gamma
from dflash.model.blocks import TrainingBlocks, build_training_blocks
from dflash.model.draft_vocab import OOV_METRIC, draft_targets, has_draft_vocab, head_weight
from dflash.model.drafter import DFlashDraftModel
from dflash.model.families.dflash2 import DFlash2DraftModel, configure_dflash2
from dflash.model.families.dflash2_loss import selector_loss
from dflash.model.families.dspark import DSparkDraftModel, configure_dspark
from dflash.model.families.dspark_loss import dspark_loss
from dflash.model.losses import LossOutput, dflash_loss, loss_uses_kl
from dflash.model.target import greedy_tokens_at


@dataclass(frozen=True)
class Family:
    name: str
    model_class: type[DFlashDraftModel]
    configure: Callable  # (drafter's Qwen3Config, config.DrafterConfig) -> None


def _configure_dflash(config, drafter_cfg) -> None:
    config.drafter_family = "dflash"


FAMILIES = {
    "dflash": Family("dflash", DFlashDraftModel, _configure_dflash),
    "dspark": Family("dspark", DSparkDraftModel, configure_dspark),
    "dflash2": Family("dflash2", DFlash2DraftModel, configure_dflash2),
}


def family_name(config) -> str:
    """The family a drafter config belongs to (configs written before families existed are DFlash's)."""
    name = getattr(config, "drafter_family", None) or "dflash"
    if name not in FAMILIES:
        raise ValueError(f"drafter_family={name!r} in the drafter's config is unknown: one of {', '.join(FAMILIES)}")
    return name


def drafter_class(config) -> type[DFlashDraftModel]:
    return FAMILIES[family_name(config)].model_class


def configure_family(config, drafter_cfg) -> None:
    """drafter.* into the drafter's config (model/build.py made its backbone part from model.*)."""
    FAMILIES[drafter_cfg.name].configure(config, drafter_cfg)


def check_block_size(drafter: DFlashDraftModel, block_size: int) -> None:
    """Refuse a block size the drafter's family cannot run, naming both sizes. DFlash and DSpark draft blocks of any
    size (the backbone attends over the block, DSpark's heads run draft by draft); DFlash2's convolutions span its
    training block, so another size would run a model that was never trained (`fixed_block_size`)."""
    if block_size < 2:
        raise ValueError(f"block size {block_size} must be >= 2 to evaluate a drafter")
    fixed = getattr(drafter, "fixed_block_size", None)
    if fixed is not None and block_size != fixed:
        raise ValueError(
            f"block size {block_size} cannot run this drafter={family_name(drafter.config)} drafter: it was trained "
            f"at block size {fixed}, and its convolutions span exactly that block; evaluate it at block size {fixed}"
        )


def draft_slots(drafter: DFlashDraftModel) -> int:
    """Block slots the drafter runs per proposal (DFlash: block_size; DSpark sampling from the anchor: one fewer)."""
    return getattr(drafter, "draft_slots", drafter.block_size)


def training_blocks(
    drafter: DFlashDraftModel,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    attention: str = "sdpa",
    *block_args,
) -> TrainingBlocks:
    """The training blocks: the drafter's slots as its input, the block_size - 1 drafted tokens as labels."""
    slots = draft_slots(drafter)
    if slots == block_size:
        return build_training_blocks(
            input_ids, loss_mask, anchors, block_valid, block_size, mask_token_id, attention, *block_args
        )
    # the anchor's slot predicts: block_size - 1 slots in, labels at a + 1 .. a + block_size - 1 (those of a
    # block of block_size slots), teachers at a .. a + block_size - 2
    blocks = build_training_blocks(
        input_ids, loss_mask, anchors, block_valid, slots, mask_token_id, attention, *block_args
    )
    seq_len = input_ids.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, block_size, device=input_ids.device)  # (bsz, N, B-1)
    clamped = pos.clamp(max=seq_len - 1)
    bsz, n = anchors.shape
    blocks.labels = torch.gather(input_ids, 1, clamped.reshape(bsz, -1)).view(bsz, n, block_size - 1)
    supervised = torch.gather(loss_mask.bool(), 1, clamped.reshape(bsz, -1)).view(bsz, n, block_size - 1)
    blocks.label_valid = block_valid[:, :, None] & (pos < seq_len) & supervised
    blocks.teacher_positions = (pos - 1).clamp(max=seq_len - 1)
    return blocks


def drafted_hidden(drafter: DFlashDraftModel, out: torch.Tensor, bsz: int, n: int, block_size: int) -> torch.Tensor:
    """The drafter's output (bsz, N * slots, H) -> its drafted positions [bsz * N, block_size - 1, H]."""
    slots = draft_slots(drafter)
    first = getattr(drafter, "first_drafted_slot", 1)
    return out.view(bsz, n, slots, -1)[:, :, first:].reshape(bsz * n, block_size - 1, -1)


def previous_tokens(
    blocks: TrainingBlocks, input_ids: torch.Tensor, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, B-1]: the token before each drafted one (the anchor, then the labels: `labels` [N, B-1] where given, else
    the text's): what a Markov head or DFlash2's selector conditions on."""
    anchor_tokens = torch.gather(input_ids, 1, blocks.anchors)  # (bsz, N)
    labels = blocks.labels if labels is None else labels.view(blocks.labels.shape)
    prev = torch.cat([anchor_tokens[:, :, None], labels[:, :, :-1]], dim=-1)
    return prev.reshape(-1, prev.shape[-1])


def target_argmax(
    drafter: DFlashDraftModel,
    blocks: TrainingBlocks,
    last_hidden: torch.Tensor,
    stored: torch.Tensor | None,
    lm_head_weight: torch.Tensor,
    loss_cfg,
) -> torch.Tensor | None:
    """[bsz * N, B-1]: the target's argmax at each drafted position, which `target_correct` (train/sim_tau) and
    DFlash2's selector compare with. A feature store's `target_next` (bsz, S) gathered when the item has one; else
    computed here once per distinct position when the loss computes no teacher logits of its own (dflash, dflash2
    without the KL): overlapping blocks read a position up to B-1 times. None where the loss has those logits
    anyway (DSpark's TV, the KL) and takes the argmax from them."""
    vocab = has_draft_vocab(drafter)  # the target's own argmax is needed: the loss's logits cover the draft vocabulary
    if isinstance(drafter, DSparkDraftModel) and not vocab:
        return None
    positions = blocks.teacher_positions
    bsz, n, width = positions.shape
    if stored is not None:
        return torch.gather(stored, 1, positions.reshape(bsz, -1)).view(bsz * n, width)
    if loss_uses_kl(loss_cfg.name, loss_cfg.kl_weight) and loss_cfg.get("labels", "data") == "data" and not vocab:
        return None
    valid = blocks.label_valid
    return greedy_tokens_at(last_hidden, positions, valid, lm_head_weight, loss_cfg.chunk_size).view(bsz * n, width)


def family_loss(
    drafter: DFlashDraftModel,
    draft_hidden: torch.Tensor,
    blocks: TrainingBlocks,
    input_ids: torch.Tensor,
    teacher_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    loss_cfg,
    block_size: int,
    weight_denominator=None,
    target_next: torch.Tensor | None = None,
) -> LossOutput:
    """The family's training loss on the drafted positions (`loss_cfg`: the loss group); `target_next` [N, B-1]:
    the target's argmax there (`target_argmax`), which saves dflash and dflash2 the teacher's logits without KL."""
    n = draft_hidden.shape[0]
    common = dict(
        loss_name=loss_cfg.name,
        block_size=block_size,
        decay_gamma=loss_cfg.decay_gamma,
        kl_temperature=loss_cfg.kl_temperature,
        kl_weight=loss_cfg.kl_weight,
        streak_alpha=loss_cfg.streak_alpha,
        dpace_alpha=loss_cfg.dpace_alpha,
        teacher_hidden=teacher_hidden,
        chunk_size=loss_cfg.chunk_size,
        weight_denominator=weight_denominator,
    )
    labels, valid = blocks.labels.reshape(n, block_size - 1), blocks.label_valid.reshape(n, block_size - 1)
    if loss_cfg.get("labels", "data") == "target":  # the target's argmax as the hard label (validation: not DSpark)
        if target_next is None:
            raise ValueError("loss.labels=target needs the target's argmax (target_argmax) at the drafted positions")
        labels = target_next.reshape(n, block_size - 1)
    if has_draft_vocab(drafter):  # the loss over the draft vocabulary (the head's rows of it), labels mapped
        return _draft_vocab_loss(
            drafter, draft_hidden, blocks, input_ids, labels, valid, teacher_hidden, lm_head_weight, loss_cfg,
            weight_denominator, target_next, common,
        )  # fmt: skip
    if isinstance(drafter, DFlash2DraftModel):  # the unary loss is DFlash's; the selector's k-way CE beside it
        out = dflash_loss(draft_hidden, labels, valid, lm_head_weight, target_next=target_next, **common)
        gamma = default_decay_gamma(block_size) if loss_cfg.decay_gamma is None else loss_cfg.decay_gamma
        sel = selector_loss(
            draft_hidden, previous_tokens(blocks, input_ids, labels), valid, lm_head_weight, teacher_hidden,
            drafter.candidate_selector, block_size, gamma, loss_cfg.chunk_size, weight_denominator, target_next,
        )  # fmt: skip
        weight = 1.0 if loss_cfg.get("selector_weight") is None else loss_cfg.selector_weight
        out.loss = out.loss + weight * sel
        out.extra["train/loss_selector"] = sel.detach()
        return out
    if not isinstance(drafter, DSparkDraftModel):
        return dflash_loss(draft_hidden, labels, valid, lm_head_weight, target_next=target_next, **common)
    z, conf = drafter.head_outputs(draft_hidden, previous_tokens(blocks, input_ids))
    w2 = None if z is None else drafter.markov_head.markov_w2.weight
    weight = 1.0 if loss_cfg.confidence_weight is None else loss_cfg.confidence_weight
    return dspark_loss(
        draft_hidden, labels, valid, lm_head_weight, z, w2, conf, tv_weight=loss_cfg.tv_weight,
        confidence_weight=weight, **common,
    )  # fmt: skip


def _draft_vocab_loss(
    drafter, draft_hidden, blocks, input_ids, labels, valid, teacher_hidden, weight, loss_cfg, weight_denominator,
    target_next, common,
) -> LossOutput:  # fmt: skip
    """DFlash's or DSpark's loss over a draft vocabulary (model/draft_vocab.py): labels in draft ids, one outside it
    replaced by the target's best token inside it (speculators' label); train/accuracy counts no hit there, and
    train/sim_tau none where the target's own argmax is outside (the drafter cannot propose it)."""
    shape, weight = labels.shape, head_weight(drafter, weight)  # the target head's rows of the draft vocabulary
    if target_next is not None:
        target_next = target_next.reshape(shape)
    labels, nxt, outside, share = draft_targets(
        drafter, labels, valid, teacher_hidden, weight, target_next, weight_denominator
    )
    if isinstance(drafter, DSparkDraftModel):
        z, conf = drafter.head_outputs(draft_hidden, previous_tokens(blocks, input_ids))
        w2 = None if z is None else drafter.markov_head.markov_w2.weight
        out = dspark_loss(
            draft_hidden, labels, valid, weight, z, w2, conf, tv_weight=loss_cfg.tv_weight,
            confidence_weight=1.0 if loss_cfg.confidence_weight is None else loss_cfg.confidence_weight, **common,
        )  # fmt: skip
        if out.target_correct is not None and nxt is not None:  # its hit is on the restricted argmax
            out.target_correct = out.target_correct & (nxt >= 0)
    else:
        out = dflash_loss(draft_hidden, labels, valid, weight, target_next=nxt, **common)
    out.correct = out.correct & ~outside
    out.extra[OOV_METRIC] = share
    return out
