"""TargetModel: any HF causal LM, frozen, as the source of context features, embeddings and the LM head."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from dflash.config import DTYPE_NAMES, ConfigError

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"model.device={name!r} is invalid: torch sees no CUDA device here "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); use auto or cpu"
        )
    return device


def check_target_exists(target: str) -> None:
    """A local-looking path that does not exist is a user error: fail now, not deep inside from_pretrained."""
    looks_local = target.startswith((".", "/", "~")) or Path(target).expanduser().exists() or target.count("/") > 1
    if looks_local and not Path(target).expanduser().is_dir():
        raise FileNotFoundError(f"model.target={target!r}: no such model directory")


def load_target_config(target: str):
    from transformers import AutoConfig

    check_target_exists(target)
    return AutoConfig.from_pretrained(target)


class TargetModel(nn.Module):
    """Frozen target. `features(input_ids)` returns the concatenated outputs of `layer_ids` (id i = output of
    decoder layer i = HF hidden_states[i + 1]) and the last hidden states after the final norm, from which the
    shared LM head gives the target's logits."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        super().__init__()
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.layer_ids = list(layer_ids)
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's layers 0..{self.num_layers - 1}")

    @classmethod
    def load(cls, target: str, layer_ids: list[int], dtype: str = "float32", device: str = "auto") -> TargetModel:
        from transformers import AutoModelForCausalLM

        check_target_exists(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=DTYPES[dtype])
        model.to(resolve_device(device))
        log.info(
            "target %s: %s, %d layers, hidden %d, %.1fM params, features from layers %s",
            target,
            type(model).__name__,
            model.config.num_hidden_layers,
            model.config.hidden_size,
            sum(p.numel() for p in model.parameters()) / 1e6,
            layer_ids,
        )
        return cls(model, layer_ids)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        # the model's own output embedding: for tie_word_embeddings models this *is* embed_tokens' weight
        return self.model.get_output_embeddings()

    # no_grad rather than inference_mode: the drafter's autograd graph saves these features (fc's input) for
    # backward, which inference tensors forbid
    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """input_ids (bsz, S) -> target_hidden (bsz, S, n_feat * H), last_hidden (bsz, S, H) (final-normed)."""
        out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        hs = out.hidden_states  # embeddings + one per layer
        target_hidden = torch.cat([hs[i + 1] for i in self.layer_ids], dim=-1)
        return target_hidden, out.last_hidden_state

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(last_hidden)


class TargetHeads(nn.Module):
    """Frozen copies of the target's input embedding and LM head on the drafter's device, for a drafter that
    trains on another device than the target (parallel.drafter_device): what the trainer reads of the target."""

    def __init__(self, target: TargetModel, device: torch.device):
        super().__init__()
        import copy

        self.embed_tokens = copy.deepcopy(target.embed_tokens).to(device).requires_grad_(False)
        tied = target.lm_head.weight is target.embed_tokens.weight
        self.lm_head = self.embed_tokens if tied else copy.deepcopy(target.lm_head).to(device).requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device
