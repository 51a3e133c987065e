"""The drafter export in z-lab's layout, and checked loading (the drafter config is built in model/build.py).

An exported drafter directory holds `config.json` (Qwen3 fields + `architectures: ["DFlashDraftModel"]`,
`auto_map`, top-level `block_size`, `num_target_layers`, `rope_theta`, `dflash_config`; `layer_types`,
`sliding_window` and the block's causality as z-lab's loader reads them: `causality_fields`), `model.safetensors`
(unprefixed keys, no embed_tokens / lm_head) and `dflash.py` (a copy of dflash/model/drafter.py), so z-lab's
`AutoModel.from_pretrained(dir, trust_remote_code=True)`, SGLang and vLLM load it.

    python -m dflash.export CHECKPOINT_OR_RUN_DIR OUT_DIR
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from dflash.core.disk import remove_partial
from dflash.model.drafter import DFlashDraftModel
from dflash.model.families import family_name
from dflash.model.families.speculators_layout import is_speculators_dir, load_speculators, write_speculators

log = logging.getLogger(__name__)

DRAFTER_SOURCE = Path(__file__).with_name("drafter.py")


LAYOUTS = ("auto", "zlab", "speculators")


def export_layout(drafter: DFlashDraftModel, layout: str = "auto") -> str:
    """The layout an export writes: `auto` is z-lab's for a DFlash with the target's vocabulary, speculators' for
    the other families and for a draft vocabulary (model.draft_vocab_size: z-lab's layout has no head of its own,
    it uses the target's, so it refuses one, in one line)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: one of {', '.join(LAYOUTS)}")
    family, vocab = family_name(drafter.config), getattr(drafter.config, "draft_vocab_size", None)
    if layout == "zlab" and vocab is not None:
        raise ValueError(
            f"z-lab's layout uses the target's LM head and cannot hold a draft vocabulary (model.draft_vocab_size="
            f"{vocab}): export it in speculators' layout (--layout speculators)"
        )
    if layout == "zlab" and family != "dflash":
        raise ValueError(f"z-lab's layout holds DFlash only: export drafter={family} in speculators' layout")
    if layout == "auto":
        return "zlab" if family == "dflash" and vocab is None else "speculators"
    return layout


def export_drafter(
    drafter: DFlashDraftModel,
    out_dir: Path,
    dtype: torch.dtype | None = None,
    target: str | None = None,
    rendering: dict | None = None,
    layout: str = "auto",
) -> Path:
    """Write the drafter to out_dir (replaced atomically) in `export_layout`'s layout: z-lab's, or speculators'
    (model/families/speculators_layout.py) for DSpark, DFlash2 and a draft vocabulary."""
    layout = export_layout(drafter, layout)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = drafter
    if dtype is not None and dtype != next(drafter.parameters()).dtype:
        import copy

        model = copy.deepcopy(drafter).to(dtype)
    try:
        if layout == "zlab":
            _write(model, drafter, tmp, target, rendering)
        else:
            tmp.mkdir(parents=True)
            write_speculators(drafter, tmp, verifier=target, dtype=dtype)
    except BaseException:
        remove_partial(tmp)  # a full disk leaves no half export behind
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def _write(model, drafter: DFlashDraftModel, tmp: Path, target: str | None, rendering: dict | None = None) -> None:
    """The export's files into `tmp`: weights, the self-contained dflash.py, a config z-lab, SGLang and vLLM read."""
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.copyfile(DRAFTER_SOURCE, tmp / "dflash.py")
    cfg_path = tmp / "config.json"
    config = json.loads(cfg_path.read_text())
    rope = config.get("rope_parameters") or {}
    config["rope_theta"] = rope.get("rope_theta", config.get("rope_theta", 10000.0))  # z-lab MLX loader reads it
    config["rope_scaling"] = None
    # transformers drops these on save for a class it did not load remotely: write them explicitly
    config["architectures"] = ["DFlashDraftModel"]
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    for key in ("block_size", "num_target_layers", "dflash_config"):
        config[key] = getattr(drafter.config, key)
    config.update(causality_fields(drafter.config))
    if config.get("is_causal") is None:
        config.pop("is_causal", None)
    if target is not None:
        config["dflash_target"] = target  # ours: lets `python -m dflash.evaluate DRAFTER_DIR` find the target
        if (arch := target_architecture(target)) is not None:
            config["dflash_target_architecture"] = arch  # ours: which kind of target it drafts for (layer kinds)
    if rendering is not None:  # ours: the chat rendering it was trained on (dflash/model/rendering.py)
        config["dflash_chat_template_kwargs"] = dict(rendering)
    cfg_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def causality_fields(config) -> dict:
    """The block's causality as z-lab's loader (>= 07ebd93) and vLLM read it. Every layer the same: `is_causal`,
    and `dflash_config.causal` for vLLM before its top-level key (PR 52816); sliding layers causal and full ones
    bidirectional (z-lab's Qwen3.6 layout): neither key, each layer's default. Only z-lab's older code (44947fb)
    runs every block bidirectionally whatever the config says."""
    is_causal = getattr(config, "is_causal", None)
    types = list(getattr(config, "layer_types", None) or [])
    if getattr(config, "window_origin", "query") == "anchor":
        log.warning(
            "a drafter trained with model.window_origin=anchor in z-lab's layout: z-lab and vLLM count the window "
            "from each query slot, so they show up to block_size fewer context positions at the window's edge"
        )
    dflash_config = {k: v for k, v in dict(getattr(config, "dflash_config", None) or {}).items() if k != "causal"}
    if is_causal is None and "sliding_attention" in types:
        return {"is_causal": None, "dflash_config": dflash_config}
    return {"is_causal": bool(is_causal), "dflash_config": {**dflash_config, "causal": bool(is_causal)}}


def target_architecture(target: str) -> dict | None:
    """The target's architecture as an export records it (model type, layer kinds); None when its config is not
    here (a hub name not in the local cache: nothing is downloaded for an export)."""
    from transformers import AutoConfig

    from dflash.model.architectures import describe

    try:
        return describe(AutoConfig.from_pretrained(target, local_files_only=True))
    except (OSError, ValueError):
        return None


def check_drafter_against(
    drafter_config, *, target_config=None, mask_token_id: int | None = None, target_layer_ids: list[int] | None = None
) -> None:
    """Refuse a drafter whose mask id or target layers do not match the run or target (clear error, not silent)."""
    dc = getattr(drafter_config, "dflash_config", None) or {}
    if mask_token_id is not None and dc.get("mask_token_id") != mask_token_id:
        raise ValueError(
            f"drafter dflash_config.mask_token_id={dc.get('mask_token_id')} but the target's tokenizer mask id is "
            f"{mask_token_id}: the drafter was trained with a different mask token"
        )
    if target_layer_ids is not None and list(dc.get("target_layer_ids", [])) != list(target_layer_ids):
        raise ValueError(
            f"drafter dflash_config.target_layer_ids={dc.get('target_layer_ids')} but {list(target_layer_ids)} "
            "were expected: the drafter reads different target layers"
        )
    if target_config is not None:
        if drafter_config.hidden_size != target_config.hidden_size:
            raise ValueError(
                f"drafter hidden_size {drafter_config.hidden_size} != target hidden_size {target_config.hidden_size}"
            )
        n = target_config.num_hidden_layers
        bad = [i for i in dc.get("target_layer_ids", []) if not 0 <= i < n]
        if bad:
            raise ValueError(f"drafter dflash_config.target_layer_ids {bad} are outside the target's {n} layers")
        mid = dc.get("mask_token_id")
        if mid is not None and not 0 <= mid < target_config.vocab_size:
            raise ValueError(
                f"drafter mask_token_id {mid} is outside the target's vocabulary ({target_config.vocab_size})"
            )


def load_drafter(path: str | Path, **expect) -> DFlashDraftModel:
    """Load an exported drafter directory with our class, after checking it against `expect` (see
    check_drafter_against)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: not a drafter directory (no config.json)")
    if is_speculators_dir(path):
        drafter = load_speculators(path)
        check_drafter_against(drafter.config, **expect)
        return drafter
    config = AutoConfig.from_pretrained(path)
    check_drafter_against(config, **expect)
    return DFlashDraftModel.from_pretrained(path)
