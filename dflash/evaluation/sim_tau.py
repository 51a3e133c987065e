"""Teacher-forced estimates of tau at eval time, to check what `train/sim_tau` measures against real tau.

For a token sequence, every anchor a from `first_anchor` on whose block fits gets the training block
[token a, MASK x (B-1)] with the target's features of positions < a as context (the training attention
mask); the accepted length of the block is 1 + the leading positions k whose draft argmax equals the
target's argmax at a + k - 1, which is what greedy verification accepts (SpecForge's
`simulated_acc_len` and ModelOpt's acceptance validation count the same per block). Two sequences per
eval prompt:

- eval/sim_tau:        the prompt's own text (held-out data), anchors from B on: the training distribution.
- eval/sim_tau_greedy: the prompt and the target's own continuation of it (the target-only generation of
                       the same eval), anchors from the prompt's end on: the text real tau is measured on.
- eval/sim_tau_replay: the same blocks, only at the anchors greedy decoding visits (each next anchor is the
                       last one plus its accepted length). At temperature 0 this is real tau, from parallel
                       forward passes: the target's continuation does not depend on the drafter, so it can be
                       generated once and every later drafter scored without sequential decoding.

eval/avg_streak_data counts the data's token instead of the target's argmax on the prompt text, as
`train/avg_streak` does. sim_tau and sim_tau_greedy average uniformly over anchors, whereas real decoding
visits the anchors its own accepted lengths lead to: long accepted runs cover many anchors but one cycle,
so the uniform mean overestimates tau where acceptance varies along the text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dflash.evaluation.decoding import hf_model, module_device, module_dtype
from dflash.model.blocks import build_training_blocks, gather_positions
from dflash.model.draft_vocab import decoding_head
from dflash.model.drafter import DFlashDraftModel
from dflash.model.window import draft_window

ANCHOR_CHUNK = 64  # blocks per drafter forward: bounds the dense mask (chunk * B x (S + chunk * B))


def _leading(hits: torch.Tensor) -> torch.Tensor:
    return torch.cumprod(hits.long(), dim=-1).sum(dim=-1) + 1


@torch.no_grad()
def target_pass(target_model: nn.Module, seq: Sequence[int], layer_ids: Sequence[int]):
    """One forward of the target over `seq`: its greedy token after each position (1, S) and the features of
    `layer_ids` at every position (1, S, n_feat * H), as the drafter reads them."""
    model = hf_model(target_model)
    out = model(input_ids=torch.tensor([list(seq)], device=module_device(model)), output_hidden_states=True)
    return out.logits.argmax(dim=-1), torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def drafted_lengths(
    drafter: DFlashDraftModel,
    embed: nn.Module,
    head: nn.Module,
    seq: Sequence[int],
    target_next: torch.Tensor,
    feats: torch.Tensor,
    first_anchor: int,
    last_anchor: int,
    block_size: int,
    confidences: list | None = None,
) -> tuple[list[int], list[int], list[list[int]]]:
    """Per anchor a in [first_anchor, last_anchor] (blocks must fit in seq): (1 + leading draft == target_next,
    1 + leading draft == seq's token, the drafts), each block drafted from the features of the positions before its
    anchor (the training attention mask, with the drafter's sliding window if it has one). The drafts are the argmax
    per slot, or a family's own proposal rule (`choose_drafts`, the one decoding's proposer calls) on the slots its
    proposal runs; `confidences`, when given, receives per anchor what that rule returns beside the drafts (a
    confidence head's predictions, else None)."""
    device, dtype = module_device(drafter), module_dtype(drafter)
    head = decoding_head(drafter, head)  # a draft vocabulary's head gives target ids (model/draft_vocab.py)
    window = draft_window(drafter.config)
    choose = getattr(drafter, "choose_drafts", None)  # a family's proposal rule (model/families/)
    slots = block_size if choose is None else drafter.slots_for(block_size - 1)
    ids = torch.tensor([list(seq)], device=device)
    target_next, feats = target_next.to(device), feats.to(device, dtype)
    sim, data, drafts = [], [], []
    for start in range(max(first_anchor, 0), last_anchor + 1, ANCHOR_CHUNK):
        anchors = torch.arange(start, min(start + ANCHOR_CHUNK, last_anchor + 1), device=device).unsqueeze(0)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        blocks = build_training_blocks(
            ids,
            torch.ones_like(ids, dtype=torch.bool),
            anchors,
            valid,
            slots,
            drafter.mask_token_id,
            window=window,
        )
        noise = embed(blocks.input_ids.to(embed.weight.device)).to(device, dtype)
        hidden = drafter(noise, feats, blocks.position_ids, attention_mask=blocks.attention_mask)
        n = anchors.shape[1]
        if choose is None:
            draft = hidden.view(1, n, block_size, -1)[:, :, 1:]
            pred = head(draft.to(head.weight.device, head.weight.dtype)).argmax(dim=-1).to(device)  # (1, N, B-1)
        else:
            chosen = [choose(h, head, int(seq[a])) for h, a in zip(hidden.view(n, slots, -1), anchors[0].tolist())]
            pred = torch.tensor([[c[0] for c in chosen]], device=device)
            if confidences is not None:
                confidences += [c[1] for c in chosen]
        # draft k (k = 1..B-1) is checked against the target's argmax at a + k - 1 and the data's token at a + k
        checked = anchors.unsqueeze(-1) + torch.arange(block_size - 1, device=device)  # (1, N, B-1)
        want = gather_positions(target_next.unsqueeze(-1), checked).squeeze(-1)
        sim += _leading(pred == want)[0].tolist()
        data += _leading(pred == ids[0][checked + 1])[0].tolist()
        drafts += pred[0].tolist()
    return sim, data, drafts


@torch.no_grad()
def block_accept_lengths(
    target_model: nn.Module, drafter: DFlashDraftModel, seq: Sequence[int], first_anchor: int, block_size: int
) -> tuple[list[int], list[int]]:
    """Per anchor a in [first_anchor, len(seq) - block_size]: (1 + leading draft argmax == target argmax,
    1 + leading draft argmax == seq's token). Empty lists when no block fits."""
    last = len(seq) - block_size
    if last < max(first_anchor, 0):
        return [], []
    model = hf_model(target_model)
    target_next, feats = target_pass(model, seq, drafter.target_layer_ids)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    return drafted_lengths(drafter, embed, head, seq, target_next, feats, first_anchor, last, block_size)[:2]


def replay(lengths: Sequence[int]) -> list[int]:
    """The accepted lengths at the anchors greedy decoding visits, from the first anchor's on."""
    out, anchor = [], 0
    while anchor < len(lengths):
        out.append(lengths[anchor])
        anchor += lengths[anchor]
    return out


def sim_tau_metrics(
    target_model: nn.Module,
    drafter: DFlashDraftModel,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]] | None,
    block_size: int,
) -> dict[str, float]:
    """eval/sim_tau and eval/avg_streak_data on the prompts' text; eval/sim_tau_greedy and eval/sim_tau_replay on
    each prompt followed by its continuation (the target's own output), when given. Keys without a block that
    fits are left out."""
    sim_text, data_text, sim_greedy, replayed = [], [], [], []
    for i, prompt in enumerate(prompts):
        s, d = block_accept_lengths(target_model, drafter, prompt, block_size, block_size)
        sim_text += s
        data_text += d
        if continuations is not None:
            seq = list(prompt) + list(continuations[i])
            lengths = block_accept_lengths(target_model, drafter, seq, len(prompt), block_size)[0]
            sim_greedy += lengths
            replayed += replay(lengths)
    out = {}
    for key, values in (
        ("eval/sim_tau", sim_text),
        ("eval/avg_streak_data", data_text),
        ("eval/sim_tau_greedy", sim_greedy),
        ("eval/sim_tau_replay", replayed),
    ):
        if values:
            out[key] = sum(values) / len(values)
    return out
