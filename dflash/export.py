"""Drafter config, export in z-lab's layout, and checked loading.

An exported drafter directory holds `config.json` (Qwen3 fields + `architectures: ["DFlashDraftModel"]`,
`auto_map`, top-level `block_size`, `num_target_layers`, `rope_theta`, `dflash_config`), `model.safetensors`
(unprefixed keys, no embed_tokens / lm_head) and `dflash.py` (a copy of dflash/drafter.py), so z-lab's
`AutoModel.from_pretrained(dir, trust_remote_code=True)`, SGLang and vLLM load it.

    python -m dflash.export CHECKPOINT_OR_RUN_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import torch

from dflash.config import ConfigError
from dflash.drafter import DFlashDraftModel

log = logging.getLogger(__name__)

DRAFTER_SOURCE = Path(__file__).with_name("drafter.py")


def build_drafter_config(target_config, model_cfg, target_layer_ids: list[int], mask_token_id: int):
    """The drafter's Qwen3Config: hidden size and vocabulary from the target (embeddings and LM head are shared),
    attention/MLP shape from model.draft_* (default: the target's), all layers full, non-causal attention."""
    from transformers import Qwen3Config

    n = model_cfg.num_draft_layers
    heads = model_cfg.draft_num_attention_heads or target_config.num_attention_heads
    head_dim = model_cfg.draft_head_dim or getattr(target_config, "head_dim", None) or (
        target_config.hidden_size // target_config.num_attention_heads)
    kv_heads = model_cfg.draft_num_key_value_heads or target_config.num_key_value_heads
    if heads % kv_heads:
        raise ConfigError(
            f"model.draft_num_attention_heads={heads} is invalid with model.draft_num_key_value_heads={kv_heads} "
            "(null = the target's): the query heads must be a multiple of the key/value heads")
    # The drafter applies plain RoPE (dflash/drafter.py), so its config says exactly that: copying a target's
    # scaled RoPE (yarn, ...) would make serving engines apply a scaling the drafter was not trained with.
    target_rope = dict(getattr(target_config, "rope_parameters", None) or {})
    theta = float(target_rope.get("rope_theta", getattr(target_config, "rope_theta", None) or 10000.0))
    if target_rope.get("rope_type", "default") != "default":
        log.warning("the target uses rope_type=%s; the drafter uses plain RoPE (theta %g) and its config says so",
                    target_rope["rope_type"], theta)
    rope = {"rope_type": "default", "rope_theta": theta}
    cfg = Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=model_cfg.draft_intermediate_size or target_config.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=rope,
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=n,
        layer_types=["full_attention"] * n,
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.auto_map = {"AutoModel": "dflash.DFlashDraftModel"}
    cfg.block_size = int(model_cfg.block_size)
    cfg.num_target_layers = int(target_config.num_hidden_layers)
    cfg.dflash_config = {
        "mask_token_id": int(mask_token_id),
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "block_size": int(model_cfg.block_size),
    }
    return cfg


def export_drafter(drafter: DFlashDraftModel, out_dir: Path, dtype: torch.dtype | None = None,
                   target: str | None = None) -> Path:
    """Write the drafter in z-lab's layout to out_dir (replaced atomically)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = drafter
    if dtype is not None and dtype != next(drafter.parameters()).dtype:
        import copy

        model = copy.deepcopy(drafter).to(dtype)
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
    config["is_causal"] = False  # vLLM reads it; sliding layers would otherwise be treated as causal
    if target is not None:
        config["dflash_target"] = target  # ours: lets `python -m dflash.evaluate DRAFTER_DIR` find the target
    cfg_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def check_drafter_against(drafter_config, *, target_config=None, mask_token_id: int | None = None,
                          target_layer_ids: list[int] | None = None) -> None:
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
            raise ValueError(f"drafter hidden_size {drafter_config.hidden_size} != target hidden_size "
                             f"{target_config.hidden_size}")
        n = target_config.num_hidden_layers
        bad = [i for i in dc.get("target_layer_ids", []) if not 0 <= i < n]
        if bad:
            raise ValueError(f"drafter dflash_config.target_layer_ids {bad} are outside the target's {n} layers")
        mid = dc.get("mask_token_id")
        if mid is not None and not 0 <= mid < target_config.vocab_size:
            raise ValueError(f"drafter mask_token_id {mid} is outside the target's vocabulary ({target_config.vocab_size})")


def load_drafter(path: str | Path, **expect) -> DFlashDraftModel:
    """Load an exported drafter directory with our class, after checking it against `expect` (see
    check_drafter_against)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: not a drafter directory (no config.json)")
    config = AutoConfig.from_pretrained(path)
    check_drafter_against(config, **expect)
    return DFlashDraftModel.from_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a checkpoint dir (checkpoints/step_N), a run dir (latest checkpoint), or a drafter dir")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from dflash.checkpoint import load_drafter_from_source

    try:
        drafter, target = load_drafter_from_source(Path(args.source))
    except (FileNotFoundError, ValueError) as e:  # a wrong path or a checkpoint that does not fit: the user's to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
    out = export_drafter(drafter, Path(args.out), dtype=dtype, target=target)
    print(f"exported drafter to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
