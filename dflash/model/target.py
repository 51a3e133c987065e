"""TargetModel: any HF causal LM, frozen, as the source of context features, embeddings and the LM head."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from dflash.core.config import DTYPE_NAMES
from dflash.core.distributed import resolve_device
from dflash.model.architectures import describe, linear_attention_path, load_language_model, text_config

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
# the target's attention kernels (transformers' attn_implementation; its default for Qwen3 too), named so that
# its features do not change with transformers' choice; a feature store's manifest records the one that ran
# (eager for an architecture that has no sdpa path: dflash/model/architectures.py)
TARGET_ATTENTION = "sdpa"


def check_target_exists(target: str) -> None:
    """A local-looking path that does not exist is a user error: fail now, not deep inside from_pretrained."""
    looks_local = target.startswith((".", "/", "~")) or Path(target).expanduser().exists() or target.count("/") > 1
    if looks_local and not Path(target).expanduser().is_dir():
        raise FileNotFoundError(f"model.target={target!r}: no such model directory")


def load_target_config(target: str, *, whole: bool = False):
    """The target's language-model config (a vision-language checkpoint's `text_config`); `whole`: the
    checkpoint's own config."""
    from transformers import AutoConfig

    check_target_exists(target)
    config = AutoConfig.from_pretrained(target)
    return config if whole else text_config(config)


def load_causal_lm(target: str, dtype: torch.dtype) -> nn.Module:
    """The target's language model as an HF causal LM (a vision-language checkpoint's text model alone, eager
    attention where sdpa does not run): for evaluation, benchmarks and regeneration."""
    check_target_exists(target)
    return load_language_model(target, load_target_config(target, whole=True), dtype)[0]


def target_attention(target: str) -> str:
    """The attention implementation the target loads with (from its config alone: nothing is loaded)."""
    from dflash.model.architectures import attention_implementation, causal_lm_class

    try:
        return attention_implementation(causal_lm_class(load_target_config(target, whole=True)))
    except (OSError, ValueError):
        return TARGET_ATTENTION


class TargetModel(nn.Module):
    """Frozen target. `features(input_ids)` returns the concatenated outputs of `layer_ids` (id i = output of
    decoder layer i = HF hidden_states[i + 1]) and the last hidden states after the final norm, from which the
    shared LM head gives the target's logits."""

    def __init__(self, model: nn.Module, layer_ids: list[int], attn_implementation: str = TARGET_ATTENTION):
        super().__init__()
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.layer_ids = list(layer_ids)
        self.attn_implementation = attn_implementation
        cfg = text_config(model.config)
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's layers 0..{self.num_layers - 1}")

    @classmethod
    def load(cls, target: str, layer_ids: list[int], dtype: str = "float32", device: str = "auto") -> TargetModel:
        check_target_exists(target)
        whole = load_target_config(target, whole=True)
        model, attn = load_language_model(target, whole, DTYPES[dtype])
        model.to(resolve_device(device))
        arch = describe(whole)
        log.info(
            "target %s: %s (%s), %d layers (%s), hidden %d, %.1fM params, %s attention, features from layers %s",
            target,
            type(model).__name__,
            "the language model of a vision-language checkpoint" if arch["vision_language"] else arch["model_type"],
            model.config.num_hidden_layers,
            ", ".join(f"{n} {kind}" for kind, n in arch["layer_types"].items()),
            model.config.hidden_size,
            sum(p.numel() for p in model.parameters()) / 1e6,
            attn,
            layer_ids,
        )
        if (path := linear_attention_path(whole, resolve_device(device))) is not None:
            log.info("target %s: linear-attention layers run the %s", target, path)
        return cls(model, layer_ids, attn)

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


# the logits of one chunk of greedy_tokens: at most this many bytes (256 MiB) unless a chunk size is given
_GREEDY_CHUNK_BYTES = 2**28


def greedy_tokens(hidden: torch.Tensor, lm_head_weight: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """The target's greedy next token after each position: argmax of hidden @ W.T, computed as the fused loss
    computes its teacher's logits (in W's dtype, no bias). hidden [..., H] -> int32 [...], `chunk_size` positions at
    a time (None: as many as keep a chunk's logits within 256 MiB)."""
    weight = lm_head_weight.detach()
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    chunk = chunk_size or max(1, _GREEDY_CHUNK_BYTES // (weight.shape[0] * weight.element_size()))
    out = torch.empty(flat.shape[0], dtype=torch.int32, device=flat.device)
    for start in range(0, flat.shape[0], chunk):
        out[start : start + chunk] = (flat[start : start + chunk].to(weight.dtype) @ weight.T).argmax(-1)
    return out.view(hidden.shape[:-1])


def greedy_tokens_at(
    hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, lm_head_weight: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """greedy_tokens of hidden (bsz, S, H) at `positions` (bsz, N, K) where `valid` (bsz, N, K), 0 elsewhere: each
    distinct position once, though overlapping blocks read a position up to K times."""
    bsz, seq_len, width = hidden.shape
    flat = positions + seq_len * torch.arange(bsz, device=positions.device).view(-1, 1, 1)
    distinct, inverse = torch.unique(flat[valid], return_inverse=True)
    tokens = greedy_tokens(hidden.reshape(-1, width).index_select(0, distinct), lm_head_weight, chunk_size)
    out = torch.zeros(positions.shape, dtype=torch.int32, device=positions.device)
    out[valid] = tokens[inverse]
    return out


class TargetHeads(nn.Module):
    """What the trainer reads of the target, frozen: its input embedding and LM head (one module when tied).
    `TargetHeads(target, device)` copies them from a loaded target onto the drafter's device
    (parallel.drafter_device); `TargetHeads.load(path, ...)` reads only those tensors from the target's files,
    for a drafter rank of parallel.target_ranks that must not hold the whole target."""

    def __init__(self, target: TargetModel | None, device: torch.device, *, embed=None, lm_head=None):
        super().__init__()
        import copy

        if target is not None:
            tied = target.lm_head.weight is target.embed_tokens.weight
            embed = copy.deepcopy(target.embed_tokens)
            lm_head = None if tied else copy.deepcopy(target.lm_head)
        self.embed_tokens = embed.to(device).requires_grad_(False)
        self.lm_head = self.embed_tokens if lm_head is None else lm_head.to(device).requires_grad_(False)

    @classmethod
    def load(cls, target: str, dtype: str, device: torch.device) -> TargetHeads:
        """The embedding and LM head alone, read from the target's safetensors files: the model is laid out on
        the meta device (no memory) to learn their tensor names. Falls back to loading the whole target, with a
        warning, when the files are not laid out as its class names them or its embedding does more than a lookup
        (Gemma's scales by sqrt(hidden), a factor its files do not hold)."""
        from transformers import AutoModelForCausalLM

        config = load_target_config(target)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        module_names = {id(m): n for n, m in skeleton.named_modules()}
        embed_key = module_names[id(skeleton.get_input_embeddings())] + ".weight"
        head = skeleton.get_output_embeddings()
        tied = head is None or head.weight is skeleton.get_input_embeddings().weight
        head_key = None if tied else module_names[id(head)] + ".weight"
        keys = [k for k in (embed_key, head_key) if k]
        tensors = None
        if type(skeleton.get_input_embeddings()) is nn.Embedding:
            tensors = _read_tensors(target, keys)
            if tensors is None:  # a vision-language checkpoint keeps its language model under model.language_model
                inside = {k: k.replace("model.", "model.language_model.", 1) for k in keys}
                found = _read_tensors(target, list(inside.values()))
                tensors = None if found is None else {k: found[v] for k, v in inside.items()}
        if tensors is None:
            log.warning("target %s: embedding/LM head not read alone from its files; loading the whole target", target)
            return cls(TargetModel.load(target, [], dtype, str(device)), device)
        torch_dtype = DTYPES[dtype]
        embed = nn.Embedding.from_pretrained(tensors[embed_key].to(torch_dtype), freeze=True)
        lm_head = None
        if head_key:
            weight = tensors[head_key].to(torch_dtype)
            lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            lm_head.weight = nn.Parameter(weight, requires_grad=False)
        log.info("target %s: embedding and LM head only (%s): not the whole model", target, "tied" * tied or "untied")
        return cls(None, device, embed=embed, lm_head=lm_head)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device


def _read_tensors(target: str, keys: list[str]) -> dict[str, torch.Tensor] | None:
    """The named tensors from the target's safetensors files (one file or a sharded index); None if absent."""
    import json

    from safetensors import safe_open
    from transformers.utils import cached_file

    index = cached_file(target, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        if not all(k in weight_map for k in keys):
            return None
        files = {k: cached_file(target, weight_map[k]) for k in keys}
    else:
        single = cached_file(target, "model.safetensors", _raise_exceptions_for_missing_entries=False)
        if not single:
            return None
        files = dict.fromkeys(keys, single)
    out = {}
    for key, file in files.items():
        with safe_open(file, framework="pt") as f:
            if key not in f.keys():
                return None
            out[key] = f.get_tensor(key)
    return out
