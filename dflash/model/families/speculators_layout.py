"""vLLM speculators' checkpoint layout (0.9.0) for the families it defines beside DFlash: written by our exports of
them, read back by `python -m dflash.evaluate` (dflash stays in z-lab's layout: model/export.py).

A speculators checkpoint is `config.json` + `model.safetensors`. The config (a pydantic SpeculatorModelConfig that
`SpeculatorModel.from_pretrained` resolves by `speculators_model_type`) holds the drafter's decoder shape as
`transformer_layer_config` (a Qwen3 config), `block_size` (the slots of one forward), `aux_hidden_state_layer_ids`
(HF hidden_states indices: our target layer id + 1, as speculators' own z-lab converter adds), `mask_token_id`,
`draft_vocab_size` (the full vocabulary: no pruned draft vocabulary here), the family's fields, and
`speculators_config` (algorithm, the greedy proposal with its `speculative_tokens`, the verifier). The weights are
the drafter's own under our parameter names, which are speculators' (no embed_tokens / lm_head: speculators
reloads those from the verifier named in the config).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash.model.families.dflash2 import DFlash2DraftModel, dflash2_settings
from dflash.model.families.dspark import DSparkDraftModel, dspark_settings

SPECULATORS_VERSION = "0.9.0"
# our keys in the drafter's Qwen3Config that are not the decoder layer's
_OURS = ("dflash_config", "dspark_config", "dflash2_config", "drafter_family", "block_size", "num_target_layers",
         "auto_map", "architectures", "dflash_target", "transformers_version", "dtype", "torch_dtype")  # fmt: skip


def _layer_config(config) -> dict:
    layer = {k: v for k, v in config.to_dict().items() if k not in _OURS and not k.startswith("_")}
    layer["model_type"] = "qwen3"
    layer["tie_word_embeddings"] = False
    return layer


def _family_fields(drafter) -> dict:
    if isinstance(drafter, DFlash2DraftModel):
        s = dflash2_settings(drafter.config)
        return {
            "sample_from_anchor": False,  # DFlash's block: speculators' DFlash2 default
            "sliding_window_non_causal": True,
            "conv_kernel_size": int(s["conv_kernel_size"]),
            "conv_group_size": int(s["conv_group_size"]),
            "selector_rank": int(s["selector_rank"]),
            "selector_top_k": int(drafter.candidate_selector.top_k),
        }
    s = dspark_settings(drafter.config)
    return {
        "sample_from_anchor": bool(s["sample_from_anchor"]),
        "sliding_window_non_causal": False,
        "markov_rank": int(s["markov_rank"]),
        "markov_head_type": s["markov_head_type"],
        "enable_confidence_head": bool(s["confidence_head"]),
        "confidence_head_with_markov": bool(s["confidence_head_with_markov"]),
    }


def speculators_config(drafter: DSparkDraftModel | DFlash2DraftModel, verifier: str | None) -> dict:
    """The config.json speculators' DSpark / DFlash2 config class reads for this drafter."""
    cfg = drafter.config
    family = "dflash2" if isinstance(drafter, DFlash2DraftModel) else "dspark"
    num_target = getattr(cfg, "num_target_layers", None)
    if num_target is not None and any(i + 1 >= num_target for i in drafter.target_layer_ids):
        raise ValueError(
            f"target_layer_ids={drafter.target_layer_ids} read the target's last layer, which speculators splits off "
            "as the verifier's last hidden state: train with model.target_layer_ids below the last layer"
        )
    return {
        "speculators_model_type": family,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["DFlash2DraftModel" if family == "dflash2" else "DSparkDraftModel"],
        "transformer_layer_config": _layer_config(cfg),
        "draft_vocab_size": int(cfg.vocab_size),
        "block_size": int(getattr(drafter, "draft_slots", drafter.block_size)),
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in drafter.target_layer_ids],
        "mask_token_id": int(drafter.mask_token_id),
        **_family_fields(drafter),
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": family,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(drafter.block_size) - 1,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": verifier},
        },
    }


def write_speculators(drafter, out_dir: Path, verifier: str | None = None, dtype: torch.dtype | None = None) -> None:
    """config.json and model.safetensors into out_dir (an existing, empty directory)."""
    out_dir = Path(out_dir)
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = speculators_config(drafter, verifier)
    config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def is_speculators_dir(path: Path) -> bool:
    config = Path(path) / "config.json"
    return config.exists() and "speculators_model_type" in json.loads(config.read_text())


def load_speculators(path: Path) -> DSparkDraftModel | DFlash2DraftModel:
    """A speculators-layout DSpark or DFlash2 checkpoint as our drafter (the inverse of write_speculators)."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    kind = raw.get("speculators_model_type")
    if kind not in ("dspark", "dflash2"):
        raise ValueError(f"{path}: speculators_model_type={kind!r}; this framework reads dspark and dflash2 ones")
    config = Qwen3Config(**{k: v for k, v in raw["transformer_layer_config"].items() if k != "model_type"})
    draft_tokens = int(raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    config.block_size = draft_tokens + 1
    config.dflash_config = {
        "mask_token_id": int(raw["mask_token_id"]),
        "target_layer_ids": [int(i) - 1 for i in raw["aux_hidden_state_layer_ids"]],
        "block_size": draft_tokens + 1,
    }
    config.drafter_family = kind
    config.architectures = ["DFlash2DraftModel" if kind == "dflash2" else "DSparkDraftModel"]
    config.dflash2_config = {
        "conv_kernel_size": int(raw.get("conv_kernel_size", 2)),
        "conv_group_size": int(raw.get("conv_group_size", 16)),
        "selector_rank": int(raw.get("selector_rank", 256)),
        "selector_top_k": int(raw.get("selector_top_k", 16)),
    }
    config.dspark_config = {
        "sample_from_anchor": bool(raw.get("sample_from_anchor", True)),
        "markov_rank": int(raw.get("markov_rank", 256)),
        "markov_head_type": raw.get("markov_head_type", "vanilla"),
        "confidence_head": bool(raw.get("enable_confidence_head", True)),
        "confidence_head_with_markov": bool(raw.get("confidence_head_with_markov", True)),
    }
    target = raw["speculators_config"].get("verifier", {}).get("name_or_path")
    if target is not None:
        config.dflash_target = target
    if kind == "dflash2":
        del config.dspark_config
    else:
        del config.dflash2_config
    drafter = (DFlash2DraftModel if kind == "dflash2" else DSparkDraftModel)(config)
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match its config (missing {missing[:5]}, extra {unexpected[:5]})")
    return drafter.to(next(iter(state.values())).dtype)
