"""Targets by architecture, not by name: what a target's checkpoint is and how its language model loads.

Qwen3.5/3.6 ship as vision-language checkpoints (`Qwen3_5ForConditionalGeneration`: a vision tower beside the
language model, text weights under `model.language_model.*`, shapes in `text_config`); Gemma 4 likewise. A drafter
reads only the language model, so the target loads as its text causal LM from the same files and the vision tower
is never built: transformers maps Qwen3.5's folder to `Qwen3_5ForCausalLM` itself (its key mapping drops the
`language_model` prefix, its unexpected-key list the vision tensors); Gemma 4's maps to the whole VLM, so it is
loaded as `Gemma4ForCausalLM` with the prefix mapped here. A load that leaves any language-model weight missing is
refused (transformers would initialise it at random with a log line only).

Attention: sdpa wherever the class runs it (the features do not change with transformers' default), else eager
(GPT-OSS: attention sinks; transformers refuses sdpa for it).
"""

from __future__ import annotations

import importlib.util
import logging

log = logging.getLogger(__name__)

# the text causal LM of a vision-language wrapper whose transformers auto-class is the whole VLM, and the prefix
# of its language model's weights in the checkpoint
_TEXT_PREFIX = r"^model\.language_model\."


def text_config(config):
    """The language model's config: `text_config` of a vision-language checkpoint, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def is_vision_language(config) -> bool:
    return text_config(config) is not config


def causal_lm_class(config):
    """The class that holds the text model alone (`Qwen3_5ForCausalLM` for a `qwen3_5` checkpoint)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = text_config(config)
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
    except KeyError:
        raise ValueError(
            f"model.target's architecture {text.model_type!r} ({type(config).__name__}) has no causal-LM class in "
            "transformers: a DFlash target must be a decoder-only language model"
        ) from None


def attention_implementation(model_class) -> str:
    """sdpa where the class runs it; eager otherwise (GPT-OSS's attention sinks)."""
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def dense_intermediate(config) -> int:
    """The MLP width a drafter takes from its target by default: the target's, or, for a mixture-of-experts target
    that has no dense MLP (Qwen3.5-35B-A3B), 3 x hidden, as z-lab's drafters for MoE targets have
    (model.draft_intermediate_size sets another)."""
    text = text_config(config)
    return getattr(text, "intermediate_size", None) or 3 * text.hidden_size


def layer_kinds(config) -> dict[str, int]:
    """The language model's layers by kind (full_attention, sliding_attention, linear_attention, ...)."""
    text = text_config(config)
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def describe(config) -> dict:
    """What run.json, a store's manifest and an export record of the target's architecture."""
    text = text_config(config)
    out = {
        "model_type": getattr(config, "model_type", None),
        "text_model_type": text.model_type,
        "architectures": list(getattr(config, "architectures", None) or []),
        "layer_types": layer_kinds(config),
        "vision_language": is_vision_language(config),
    }
    for key in ("num_experts", "num_local_experts", "hidden_size_per_layer_input", "sliding_window"):
        if getattr(text, key, None):
            out[key] = getattr(text, key)
    return out


def load_language_model(path: str, config, dtype, **kwargs):
    """The target's language model from its folder (or hub name): `(model, attn_implementation)`."""
    cls = causal_lm_class(config)
    attn = attention_implementation(cls)
    extra = {}
    if is_vision_language(config):
        extra["config"] = text_config(config)
        if cls.__name__.startswith("Gemma"):  # transformers has no key mapping of its own for Gemma 4's text model
            extra["key_mapping"] = {_TEXT_PREFIX: "model."}
    model, info = cls.from_pretrained(
        path, dtype=dtype, attn_implementation=attn, output_loading_info=True, **extra, **kwargs
    )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(
            f"model.target {path}: {len(missing)} weights of its language model ({cls.__name__}) are not in its "
            f"files (e.g. {missing[:3]}): transformers would start them at random. Is it a checkpoint of this "
            "architecture?"
        )
    if any("visual" in n or "vision" in n for n, _ in model.named_parameters()):
        raise ValueError(f"model.target {path}: the vision tower was built; only the language model should load")
    return model, attn


def linear_attention_path(config, device) -> str | None:
    """Which Gated DeltaNet kernels run (None: no linear-attention layers): on a GPU transformers uses
    flash-linear-attention and causal-conv1d when installed (`pip install -e '.[hybrid]'`), else a reference PyTorch
    path it calls much slower."""
    if "linear_attention" not in layer_kinds(config):
        return None
    if getattr(device, "type", str(device)) != "cuda":
        return "reference PyTorch path (CPU: the kernels are CUDA-only)"
    have = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    if all(have.values()):
        return "flash-linear-attention and causal-conv1d kernels"
    lacking = [
        {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}[n] for n, ok in have.items() if not ok
    ]
    return f"reference PyTorch path, much slower: {' and '.join(lacking)} not installed (pip install -e '.[hybrid]')"
