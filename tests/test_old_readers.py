"""Every drafter layout the project writes for others, read by the oldest transformers it supports (4.57.1, z-lab's
pin; tests/old_transformers.py's venv): z-lab's layout loads with AutoModel and its dflash.py and computes what ours
computes; speculators' layouts give a reader there the decoder ours is, RoPE base included. The converted target:
tests/test_gguf_target.py; a feature store: tests/test_feature_store.py."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from old_transformers import model_fields, read_with_old_transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from dflash.model.build import build_drafter_config, init_drafter
from dflash.model.export import export_drafter
from dflash.model.families import configure_family
from dflash.model.families.speculators_layout import write_speculators

pytestmark = pytest.mark.slow

MASK, LAYERS = 3, [1, 2]


def _drafter(tiny_dir, family: str):
    """A drafter of `family` over a target whose RoPE base is Qwen3's (1e6), not the 10000 an old reader defaults
    to when it misses the base."""
    target = AutoConfig.from_pretrained(tiny_dir)
    target.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    cfg = compose_config(["experiment=smoke", f"model.target={tiny_dir}", f"drafter={family}"])
    config = build_drafter_config(target, cfg.model, LAYERS, MASK)
    configure_family(config, cfg.drafter)
    return init_drafter(config, 0).eval()


def test_every_drafter_layout_reads_the_same_in_the_oldest_supported_transformers(tiny_dir, tmp_path):
    zlab = _drafter(tiny_dir, "dflash")
    export_drafter(zlab, tmp_path / "zlab", target=str(tiny_dir))
    hidden, block, ctx = zlab.config.hidden_size, zlab.block_size, 6
    g = torch.Generator().manual_seed(0)
    inputs = {"noise_embedding": torch.randn(1, block, hidden, generator=g),
              "target_hidden": torch.randn(1, ctx, hidden * len(LAYERS), generator=g),
              "position_ids": torch.arange(ctx + block)[None]}  # fmt: skip
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    tasks = [{"kind": "drafter", "path": str(tmp_path / "zlab"), "inputs": str(tmp_path / "inputs.safetensors"),
              "outputs": str(tmp_path / "outputs.safetensors")}]  # fmt: skip
    theirs = {}
    for family in ("dflash", "dspark", "dflash2"):
        drafter = _drafter(tiny_dir, family)
        out = tmp_path / f"speculators-{family}"
        out.mkdir()
        write_speculators(drafter, out, verifier=str(tiny_dir))  # dspark, dflash2: what export_drafter writes
        tasks.append({"kind": "speculators", "path": str(out)})
        theirs[family] = drafter

    results = read_with_old_transformers(tasks, tmp_path)
    assert results[0]["class"] == "DFlashDraftModel" and results[0]["config"]["rope_theta"] == 1e6
    with torch.no_grad():
        ours = zlab(inputs["noise_embedding"], inputs["target_hidden"], inputs["position_ids"])
    assert torch.allclose(load_file(str(tmp_path / "outputs.safetensors"))["out"], ours, atol=1e-5)
    for result, (family, drafter) in zip(results[1:], theirs.items()):
        expected = {**model_fields(drafter.config), "tie_word_embeddings": False}  # speculators reloads the head
        assert result["config"] == expected, family
        assert result["shapes"] == {k: list(v.shape) for k, v in drafter.state_dict().items()}, family
