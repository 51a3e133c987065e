"""vLLM speculators' checkpoint layout (0.9.0), both ways: our exports of DSpark and DFlash2 write it (DFlash's export
stays in z-lab's layout: model/export.py, but `write_speculators` writes DFlash too), and `python -m dflash.evaluate`
reads a DFlash, DSpark or DFlash2 checkpoint in it (one trained by speculators itself: `python -m dflash.bench peer`).

A speculators checkpoint is `config.json` + `model.safetensors`. The config (a pydantic SpeculatorModelConfig that
`SpeculatorModel.from_pretrained` resolves by `speculators_model_type`) holds the drafter's decoder shape as
`transformer_layer_config` (a Qwen3 config), `block_size` (the slots of one forward), `aux_hidden_state_layer_ids`
(HF hidden_states indices: our target layer id + 1, as speculators' own z-lab converter adds), `mask_token_id`,
`draft_vocab_size` (the full vocabulary, or model.draft_vocab_size's N: then the weights hold speculators' `t2d`
(bool [V]), `d2t` (long [N]) and the frozen `lm_head.weight` [N, H], as its DraftVocabMixin saves and loads them),
the family's fields, and
`speculators_config` (algorithm, the greedy proposal with its `speculative_tokens`, the verifier). The weights are
the drafter's own under our parameter names, which are speculators' (no embed_tokens / lm_head: speculators
reloads those from the verifier named in the config).

Sliding layers (`transformer_layer_config.layer_types`, `sliding_window`) run speculators' rule: the window counted
from each block's anchor (our model.window_origin=anchor), the block causal in sliding layers unless
`sliding_window_non_causal` (our model.sliding_block), full layers bidirectional; a checkpoint read here keeps that
rule (window_origin anchor, is_causal absent or false), one written from a query-origin drafter says what differs.
What our drafters cannot be is refused on read: a DFlash sampling from its anchor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash.model.drafter import DFlashDraftModel
from dflash.model.families.dflash2 import DFlash2DraftModel, dflash2_settings
from dflash.model.families.dspark import DSparkDraftModel, dspark_settings
from dflash.model.older_readers import with_legacy_rope

log = logging.getLogger(__name__)

SPECULATORS_VERSION = "0.9.0"
# speculators_model_type -> our class (speculators' class of the same name)
CLASSES = {"dflash": DFlashDraftModel, "dspark": DSparkDraftModel, "dflash2": DFlash2DraftModel}
# our keys in the drafter's Qwen3Config that are not the decoder layer's
_OURS = ("dflash_config", "dspark_config", "dflash2_config", "drafter_family", "block_size", "num_target_layers",
         "auto_map", "architectures", "dflash_target", "transformers_version", "dtype", "torch_dtype",
         "is_causal", "window_origin", "draft_vocab_size")  # fmt: skip


def _layer_config(config) -> dict:
    layer = {k: v for k, v in config.to_dict().items() if k not in _OURS and not k.startswith("_")}
    layer["model_type"] = "qwen3"
    layer["tie_word_embeddings"] = False
    return with_legacy_rope(layer)  # a reader that builds its Qwen3Config under transformers < 5 reads rope_theta


def family_of(drafter) -> str:
    """speculators_model_type of our drafter: its family's name, which is speculators' for the same model."""
    return next(kind for kind, cls in reversed(CLASSES.items()) if isinstance(drafter, cls))


def _sliding(layer_types) -> bool:
    return any(t == "sliding_attention" for t in layer_types or [])


def _sliding_non_causal(config) -> bool:
    """speculators' one flag for every sliding layer's block (its full layers are always bidirectional)."""
    is_causal = getattr(config, "is_causal", None)
    if is_causal and any(t != "sliding_attention" for t in config.layer_types or []):
        log.warning("is_causal=true: speculators runs the full-attention layers' block bidirectionally")
    return _sliding(config.layer_types) and is_causal is False


def _family_fields(drafter, family: str) -> dict:
    if family == "dflash":
        return {"sample_from_anchor": False, "sliding_window_non_causal": _sliding_non_causal(drafter.config)}
    if family == "dflash2":
        s = dflash2_settings(drafter.config)
        return {
            "sample_from_anchor": False,  # DFlash's block: speculators' DFlash2 default
            "sliding_window_non_causal": _sliding_non_causal(drafter.config)
            or not _sliding(drafter.config.layer_types),
            "conv_kernel_size": int(s["conv_kernel_size"]),
            "conv_group_size": int(s["conv_group_size"]),
            "selector_rank": int(s["selector_rank"]),
            "selector_top_k": int(drafter.candidate_selector.top_k),
        }
    s = dspark_settings(drafter.config)
    return {
        "sample_from_anchor": bool(s["sample_from_anchor"]),
        "sliding_window_non_causal": _sliding_non_causal(drafter.config),
        "markov_rank": int(s["markov_rank"]),
        "markov_head_type": s["markov_head_type"],
        "enable_confidence_head": bool(s["confidence_head"]),
        "confidence_head_with_markov": bool(s["confidence_head_with_markov"]),
    }


def verifier_config(verifier: str | None):
    """The verifier's transformers config from its local files (a directory, or a hub name already in the local
    cache: nothing is downloaded), or None."""
    if verifier is None:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(verifier), local_files_only=True)
    except (OSError, ValueError):
        return None


def speculators_config(drafter: DFlashDraftModel, verifier: str | None) -> dict:
    """The config.json speculators' DFlash / DSpark / DFlash2 config class reads for this drafter; the verifier's
    architectures come from its own config (SmolLM2: LlamaForCausalLM), [] when its files are not here."""
    cfg = drafter.config
    family = family_of(drafter)
    num_target = getattr(cfg, "num_target_layers", None)
    if num_target is not None and any(i + 1 >= num_target for i in drafter.target_layer_ids):
        raise ValueError(
            f"target_layer_ids={drafter.target_layer_ids} read the target's last layer, which speculators splits off "
            "as the verifier's last hidden state: train with model.target_layer_ids below the last layer"
        )
    if family == "dflash" and _sliding(cfg.layer_types) and getattr(cfg, "window_origin", "query") != "anchor":
        log.warning(_WINDOW_RULE)
    found = verifier_config(verifier)
    return {
        "speculators_model_type": family,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [CLASSES[family].__name__],
        "transformer_layer_config": _layer_config(cfg),
        "draft_vocab_size": int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size),
        "block_size": int(getattr(drafter, "draft_slots", drafter.block_size)),
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in drafter.target_layer_ids],
        "mask_token_id": int(drafter.mask_token_id),
        **_family_fields(drafter, family),
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
            "verifier": {"architectures": list(getattr(found, "architectures", None) or []), "name_or_path": verifier},
        },
    }


_WINDOW_RULE = (
    "a DFlash with sliding layers in speculators' layout: speculators counts the window from each block's anchor, "
    "this drafter from each query slot, so the two see up to block_size context positions apart at the window's edge "
    "(train with model.window_origin=anchor for speculators' rule)"
)


def write_speculators(drafter, out_dir: Path, verifier: str | None = None, dtype: torch.dtype | None = None) -> None:
    """config.json and model.safetensors into out_dir (an existing, empty directory)."""
    out_dir = Path(out_dir)
    state = {  # the maps (bool, long) keep their dtypes
        k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous().cpu()
        for k, v in drafter.state_dict().items()
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = speculators_config(drafter, verifier)
    config["dtype"] = str(next(v for v in state.values() if v.is_floating_point()).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def is_speculators_dir(path: Path) -> bool:
    config = Path(path) / "config.json"
    return config.exists() and "speculators_model_type" in json.loads(config.read_text())


def _refuse_what_ours_cannot_be(path: Path, kind: str, raw: dict, config) -> None:
    """A DFlash sampling from its anchor (our DFlash's anchor slot drafts nothing), DFlash2 with a draft vocabulary
    (speculators' refuses one too)."""
    if kind == "dflash2" and int(raw.get("draft_vocab_size") or config.vocab_size) != int(config.vocab_size):
        raise ValueError(f"{path}: a DFlash2 with a draft vocabulary; DFlash2 needs the full vocabulary")
    if kind != "dflash":
        return
    if raw.get("sample_from_anchor"):
        raise ValueError(f"{path}: a DFlash with sample_from_anchor=true; our DFlash's anchor slot drafts nothing")


def load_speculators(path: Path) -> DFlashDraftModel:
    """A speculators-layout DFlash, DSpark or DFlash2 checkpoint as our drafter (the inverse of write_speculators;
    also what speculators' own Trainer saves)."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    kind = raw.get("speculators_model_type")
    if kind not in CLASSES:
        raise ValueError(f"{path}: speculators_model_type={kind!r}; this framework reads {', '.join(CLASSES)} ones")
    config = Qwen3Config(**{k: v for k, v in raw["transformer_layer_config"].items() if k != "model_type"})
    _refuse_what_ours_cannot_be(path, kind, raw, config)
    if _sliding(config.layer_types):  # speculators' rule: the window from the anchor; the flag for every sliding block
        config.window_origin = "anchor"
        if raw.get("sliding_window_non_causal"):
            config.is_causal = False
    else:
        config.is_causal = False
    spec = raw.get("speculators_config") or {}
    if kind == "dflash":  # block_size slots, the anchor's drafting nothing
        block = int(raw["block_size"])
    else:
        block = int(spec["proposal_methods"][0]["speculative_tokens"]) + 1
    config.block_size = block
    config.dflash_config = {
        "mask_token_id": int(raw["mask_token_id"]),
        "target_layer_ids": [int(i) - 1 for i in raw["aux_hidden_state_layer_ids"]],
        "block_size": block,
    }
    config.drafter_family = kind
    config.architectures = [CLASSES[kind].__name__]
    if int(raw.get("draft_vocab_size") or config.vocab_size) != int(config.vocab_size):  # t2d, d2t, lm_head in weights
        config.draft_vocab_size = int(raw["draft_vocab_size"])
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
    target = (spec.get("verifier") or {}).get("name_or_path")
    if target is not None:
        config.dflash_target = target
        found = verifier_config(target)
        if found is not None:  # what z-lab's layout records (an export of this drafter there)
            config.num_target_layers = int(found.num_hidden_layers)
    if kind != "dspark":
        del config.dspark_config
    if kind != "dflash2":
        del config.dflash2_config
    drafter = CLASSES[kind](config)
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match its config (missing {missing[:5]}, extra {unexpected[:5]})")
    return drafter.to(next(v for v in state.values() if v.is_floating_point()).dtype)
