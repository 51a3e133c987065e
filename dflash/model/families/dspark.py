"""DSpark (arXiv 2607.05147): the DFlash backbone plus a low-rank Markov logit bias and a confidence head.

Our implementation, written from the paper's description and the layout of vLLM speculators 0.9.0
(`speculators/models/dspark`), whose parameter names it keeps so that an export loads there
(`families/speculators_layout.py`).

Each drafted position j of a block predicts the token after position p + j (p: the anchor). Besides the backbone's
logits h_j @ W_lm^T it gets a bias that depends on the token before it in the block (the anchor for j = 0, the
draft chosen at j - 1 when decoding, the data's token in training):

    e_j = W1[prev_j]                                (markov_w1: an embedding of rank r over the target's vocabulary)
    vanilla: z_j = e_j
    gated:   z_j = sigmoid(gate_proj([h_j; e_j])) * e_j
    rnn:     g, c, o = joint_proj([s_{j-1}; e_j; h_j]);  s_j = sig(g) s_{j-1} + (1 - sig(g)) tanh(c);  z_j = tanh(o)
    logits_j = h_j @ W_lm^T + z_j @ W2^T            (markov_w2: rank r -> vocabulary; low rank: B = W2 W1)

and a confidence c_j = sigmoid(proj([h_j; e_j])) (or of h_j alone): the probability that draft j is accepted once
the drafts before it were, trained against 1 - TV(draft, target) (`dspark_loss.py`).

`sample_from_anchor` (speculators' name): the anchor's own slot predicts (the token after the anchor), so the forward
runs `block_size - 1` slots [anchor, MASK...] for the `block_size - 1` drafts a cycle verifies; without it the block
is DFlash's `block_size` slots whose anchor slot predicts nothing. Either way the drafted positions are
[N, block_size - 1], the layout of every loss.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.model.drafter import DFlashDraftModel
from dflash.model.muon_split import EMBEDDING, OUTPUT

FAMILY = "dspark"


def dspark_settings(config) -> dict:
    """The family's settings as the drafter's config carries them (`config.dspark_config`)."""
    settings = getattr(config, "dspark_config", None)
    if not settings:
        raise ValueError("a DSpark drafter's config needs dspark_config (markov_rank, markov_head_type, ...)")
    return dict(settings)


class MarkovHead(nn.Module):
    """The low-rank bias W2 z_j; z_j from the previous token's embedding (and the hidden state, the rnn's state)."""

    # W1 is a table over the vocabulary and W2 a projection onto it: optim=muon leaves both to AdamW (muon_split.py)
    PARAMETER_ROLES = {"markov_w1.weight": EMBEDDING, "markov_w2.weight": OUTPUT}

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, head_type: str, out_size: int | None = None):
        super().__init__()  # out_size: W2's, the draft vocabulary's size under model.draft_vocab_size (speculators')
        if rank < 1:
            raise ValueError(f"markov_rank={rank} must be >= 1 for a Markov head")
        if head_type not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov_head_type={head_type!r} must be vanilla, gated or rnn")
        self.rank, self.head_type = rank, head_type
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_size or vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(
        self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position: (prev_emb [.., r], hidden [.., H], state or None) -> (z [.., r], the next state)."""
        if self.head_type == "vanilla":
            return prev_emb, None
        hidden = hidden.to(prev_emb.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb, None
        if state is None:
            state = prev_emb.new_zeros(prev_emb.shape)
        gate, cand, out = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(cand)

    def factors(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced z for whole blocks: prev_emb [N, K, r], hidden [N, K, H] -> [N, K, r] (bias = W2 z)."""
        if self.head_type != "rnn":
            return self.step(prev_emb, hidden, None)[0]
        state, out = None, []
        for j in range(prev_emb.shape[1]):
            z, state = self.step(prev_emb[:, j], hidden[:, j], state)
            out.append(z)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    """One logit per drafted position: its acceptance probability is the sigmoid."""

    PARAMETER_ROLES = {"proj.weight": OUTPUT}  # an output layer: AdamW's under optim=muon

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDraftModel(DFlashDraftModel):
    """The DFlash backbone (its forward unchanged: block hidden states) with the two heads; `head_outputs` applies
    them teacher-forced, `choose_drafts` step by step (decoding's proposer and eval.replay's blocks call it)."""

    def __init__(self, config):
        settings = dspark_settings(config)
        super().__init__(config)
        self.sample_from_anchor = bool(settings["sample_from_anchor"])
        rank = int(settings["markov_rank"])
        self.markov_head = (
            MarkovHead(
                config.vocab_size,
                config.hidden_size,
                rank,
                settings["markov_head_type"],
                getattr(config, "draft_vocab_size", None),
            )  # fmt: skip
            if rank > 0
            else None
        )
        self.confidence_with_markov = bool(settings["confidence_head_with_markov"])
        self.confidence_head = None
        if settings["confidence_head"]:
            if self.confidence_with_markov and self.markov_head is None:
                raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
            self.confidence_head = ConfidenceHead(config.hidden_size + (rank if self.confidence_with_markov else 0))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, nn.Embedding):  # W1: small, so the bias starts near zero (as speculators starts it)
            nn.init.normal_(module.weight, mean=0.0, std=0.01)

    @property
    def draft_slots(self) -> int:
        """Block slots one proposal runs: the anchor's slot predicts under sample_from_anchor."""
        return self.block_size - 1 if self.sample_from_anchor else self.block_size

    @property
    def first_drafted_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1

    def slots_for(self, num_draft: int) -> int:
        """Block slots a proposal of num_draft tokens runs."""
        return num_draft if self.sample_from_anchor else num_draft + 1

    @torch.no_grad()
    def choose_drafts(self, block_hidden: torch.Tensor, lm_head: nn.Module, anchor: int):
        """DSpark's proposal rule, greedy: block_hidden (slots, H) from one backbone forward -> (drafts, their
        confidences or None). Draft j = argmax(base logits_j + W2 z_j), z_j from the draft chosen at j - 1 (the
        anchor for j = 0): the Markov head chooses sequentially inside the block."""
        hidden = block_hidden[self.first_drafted_slot :]
        base = lm_head(hidden.to(lm_head.weight.device, lm_head.weight.dtype)).float()  # (num_draft, V)
        prev, state, drafts, confidences = anchor, None, [], []
        for j in range(hidden.shape[0]):
            h = hidden[j : j + 1]
            prev_emb = self.prev_embeddings(torch.tensor([prev], device=hidden.device))
            logits = base[j]
            if self.markov_head is not None:
                z, state = self.markov_head.step(prev_emb, h, state)
                bias = self.markov_head.markov_w2(z)[0].float().to(logits.device)
                logits = logits + (lm_head.to_target(bias) if hasattr(lm_head, "to_target") else bias)
            conf = self.confidence_logits(h, prev_emb)
            if conf is not None:
                confidences.append(float(torch.sigmoid(conf.float())[0]))
            prev = int(logits.argmax())
            drafts.append(prev)
        return drafts, (confidences if self.confidence_head is not None else None)

    def prev_embeddings(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        return None if self.markov_head is None else self.markov_head.markov_w1(prev_ids.long())

    def confidence_logits(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        feats = hidden if not self.confidence_with_markov else torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        return self.confidence_head(feats)

    def head_outputs(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Teacher-forced heads on drafted positions: hidden [N, K, H], prev_ids [N, K] (the token before each) ->
        (Markov factors z [N, K, r] or None: bias = z @ markov_w2.weight.T; confidence logits [N, K] or None)."""
        prev_emb = self.prev_embeddings(prev_ids)
        z = None if self.markov_head is None else self.markov_head.factors(prev_emb, hidden)
        return z, self.confidence_logits(hidden, prev_emb)


def configure_dspark(config, drafter_cfg) -> None:
    """Write drafter=dspark's settings into the drafter's (Qwen3) config, where the model and its export read them."""
    config.drafter_family = FAMILY
    config.architectures = ["DSparkDraftModel"]
    config.dspark_config = {
        "sample_from_anchor": bool(drafter_cfg.sample_from_anchor),
        "markov_rank": int(drafter_cfg.markov_rank),
        "markov_head_type": str(drafter_cfg.markov_head_type),
        "confidence_head": bool(drafter_cfg.confidence_head),
        "confidence_head_with_markov": bool(drafter_cfg.confidence_head_with_markov),
    }
