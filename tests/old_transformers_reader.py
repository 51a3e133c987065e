"""Run by tests/old_transformers.py inside the venv of the oldest supported transformers: reads what the project
wrote as a reader on that version does and prints what it read as one JSON line. Imports nothing of the project.

    python old_transformers_reader.py TASKS.json      (a list of {"kind": ..., "path": ..., ...})
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import transformers

FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "rope_theta",
          "rope_scaling")  # fmt: skip


def fields(config) -> dict:
    """What a reader on this version takes from a config (rope_theta: the base it runs RoPE at)."""
    return {k: getattr(config, k, None) for k in FIELDS}


def strict_json(path: Path):
    def refuse(token):
        raise ValueError(f"{path}: {token} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def read_target(task: dict) -> dict:
    """config, tokenizer and weights as z-lab's loop loads them; the greedy continuation of a chat prompt."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = task["path"]
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = tokenizer.apply_chat_template(task["messages"], add_generation_prompt=True, tokenize=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([chat])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=task["new_tokens"],
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    top = logits.topk(task["top_k"])
    unknown = set(strict_json(Path(path) / "config.json")) - set(type(config)().to_dict())  # keys it does not have
    return {"config": fields(config), "unknown_keys": sorted(unknown), "tokenizer_class": type(tokenizer).__name__,
            "text_ids": tokenizer(task["text"]).input_ids, "chat_ids": list(chat),
            "top_ids": top.indices.tolist(), "top_logits": top.values.tolist(),
            "greedy": out[0, len(chat):].tolist()}  # fmt: skip


def read_drafter(task: dict) -> dict:
    """z-lab's layout as z-lab loads it (AutoModel, its dflash.py), run on the inputs in task["inputs"]."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    model = AutoModel.from_pretrained(task["path"], trust_remote_code=True).eval()
    x = load_file(task["inputs"])
    with torch.no_grad():
        out = model(x["noise_embedding"], x["target_hidden"], x["position_ids"])
    save_file({"out": out.contiguous()}, task["outputs"])
    return {"class": type(model).__name__, "config": fields(model.config)}


def read_speculators(task: dict) -> dict:
    """speculators' layout as a reader on this version takes its decoder: a config of transformer_layer_config's
    model_type built from it (vLLM's and SGLang's adapters do so), and the weights' names and shapes."""
    from safetensors import safe_open
    from transformers import AutoConfig

    raw = strict_json(Path(task["path"]) / "config.json")
    layer = dict(raw["transformer_layer_config"])
    config = AutoConfig.for_model(layer.pop("model_type"), **layer)
    with safe_open(str(Path(task["path"]) / "model.safetensors"), "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    return {"config": fields(config), "shapes": shapes}


def read_store(task: dict) -> dict:
    """A feature store as another program reads it: strict JSON manifest and index, every shard whole and opened."""
    from safetensors import safe_open

    store = Path(task["path"])
    manifest, index = strict_json(store / "manifest.json"), strict_json(store / "index.json")
    tensors = {}
    for shard in index["shards"]:
        path = store / shard["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"], f"{path}: not the indexed bytes"
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                tensors[k.split("/")[-1]] = [list(t.shape[1:]), str(t.dtype)]  # "<batch>/input_ids" -> input_ids
    return {"manifest": manifest, "shards": len(index["shards"]), "tensors": tensors}


READERS = {"target": read_target, "drafter": read_drafter, "speculators": read_speculators, "store": read_store}


def main() -> None:
    tasks = json.loads(Path(sys.argv[1]).read_text())
    results = [{"transformers": transformers.__version__, **READERS[t["kind"]](t)} for t in tasks]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
