"""vLLM speculators 0.9.0's checkpoint layout for DFlash, both ways (model/families/speculators_layout.py): our
drafter written there loads with speculators' own DFlashDraftModel (its weights, config and forward ours), and what
speculators saves loads as our drafter; a pruned vocabulary without its maps is refused by name; sliding layers
keep speculators' rule both ways (test_layer_types.py: its mask against ours)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config
from transformers import AutoConfig, LlamaConfig

from dflash.model.blocks import build_training_blocks
from dflash.model.build import build_drafter_config, init_drafter
from dflash.model.drafter import DFlashDraftModel
from dflash.model.export import load_drafter
from dflash.model.families import configure_family
from dflash.model.families.speculators_layout import write_speculators

pytest.importorskip("speculators", reason="the test-only install: pip install --no-deps speculators==0.9.0 ...")

MASK = 3


def _ours(tiny_dir, *overrides: str) -> DFlashDraftModel:
    cfg = compose_config(["experiment=smoke", f"model.target={tiny_dir}", *overrides])
    config = build_drafter_config(AutoConfig.from_pretrained(tiny_dir), cfg.model, [1, 2], MASK)
    configure_family(config, cfg.drafter)
    drafter = init_drafter(config, 0)
    with torch.no_grad():  # norms away from 1, so a swapped or dropped tensor shows
        for name, param in drafter.named_parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    return drafter


def _theirs_eager(path):
    """speculators' DFlashDraftModel from a checkpoint directory, with eager attention (its flex default compiles
    a block mask) and the verifier's embedding and head."""
    from safetensors.torch import load_file
    from speculators.models.dflash import DFlashDraftModel as Theirs
    from speculators.models.dflash import DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = Theirs(config)
    theirs.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    theirs.load_verifier_weights()
    return theirs.eval()


def test_our_dflash_in_speculators_layout_loads_with_its_class_and_computes_ours(tiny_dir, tmp_path, monkeypatch):
    from speculators import SpeculatorModel
    from speculators.models.dflash import core

    ours = _ours(tiny_dir).eval()
    out = tmp_path / "out"
    out.mkdir()
    write_speculators(ours, out, verifier=str(tiny_dir))
    theirs = SpeculatorModel.from_pretrained(str(out))
    assert type(theirs).__name__ == "DFlashDraftModel" and theirs.config.speculators_model_type == "dflash"
    assert theirs.config.aux_hidden_state_layer_ids == [2, 3]  # HF hidden_states indices of target layers 1, 2
    assert theirs.config.block_size == ours.block_size and not theirs.config.sample_from_anchor
    assert theirs.config.speculators_config.proposal_methods[0].speculative_tokens == ours.block_size - 1
    assert theirs.config.speculators_config.verifier.architectures == ["Qwen3ForCausalLM"]
    their_state = theirs.state_dict()
    assert all(torch.equal(their_state[k], v) for k, v in ours.state_dict().items())
    # the same function: one row, three anchors (theirs drawn by its select_anchors, here fixed), same blocks
    theirs = _theirs_eager(out)
    B, S, g = ours.block_size, 3 * ours.block_size + 6, torch.Generator().manual_seed(0)
    anchors = torch.tensor([2, B + 1, 2 * B + 3])
    ids, hs = torch.randint(0, 500, (1, S), generator=g), torch.randn(1, S, 2 * 64, generator=g)
    monkeypatch.setattr(core, "select_anchors", lambda *a: (anchors, torch.ones(3, dtype=torch.bool)))
    with torch.no_grad():
        hidden = theirs._backbone_forward(hs, ids, torch.ones(1, S), torch.randn(1, S, 64), torch.zeros(1, S).long(),
                                          torch.arange(S)[None], max_anchors=3)[0]  # fmt: skip
        blocks = build_training_blocks(ids, torch.ones(1, S, dtype=torch.bool), anchors[None],
                                       torch.ones(1, 3, dtype=torch.bool), B, MASK)  # fmt: skip
        mine = ours(theirs.embed_tokens(blocks.input_ids), hs, blocks.position_ids, blocks.attention_mask)
    assert torch.allclose(hidden, mine, atol=1e-5), (hidden - mine).abs().max()
    back = load_drafter(out)  # and ours reads it back
    assert type(back) is DFlashDraftModel and back.config.dflash_config == ours.config.dflash_config
    assert back.config.num_target_layers == 4  # from the verifier's config, as z-lab's layout records it
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ours.state_dict().values()))


def test_what_speculators_saves_loads_as_our_drafter(tiny_dir, tmp_path):
    """Its own save_pretrained (as its Trainer's checkpoints), without a verifier in the config."""
    from speculators.models.dflash import DFlashDraftModel as Theirs
    from speculators.models.dflash import DFlashSpeculatorConfig
    from transformers import Qwen3Config

    layer = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # fmt: skip
    config = DFlashSpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=512, block_size=6,
                                    aux_hidden_state_layer_ids=[2, 3], mask_token_id=MASK)  # fmt: skip
    torch.manual_seed(0)
    theirs = Theirs(config)
    theirs.save_pretrained(str(tmp_path / "ckpt"))
    ours = load_drafter(tmp_path / "ckpt")
    assert type(ours) is DFlashDraftModel and ours.block_size == 6
    assert ours.config.dflash_config == {"mask_token_id": MASK, "target_layer_ids": [1, 2], "block_size": 6}
    their_state = theirs.state_dict()
    assert all(torch.equal(v, their_state[k]) for k, v in ours.state_dict().items())


def _edit(path, **fields):
    raw = json.loads((path / "config.json").read_text())
    layer = fields.pop("layer", {})
    raw.update(fields)
    raw["transformer_layer_config"].update(layer)
    (path / "config.json").write_text(json.dumps(raw))


def test_a_pruned_vocabulary_without_its_maps_is_refused_and_sliding_layers_keep_speculators_rule(tiny_dir, tmp_path):
    """A draft vocabulary reads with its t2d / d2t / lm_head (tests/test_draft_vocab.py); a config that names one
    its weights lack is refused naming them. A causal sliding block (speculators' CLI default) reads as such, the
    flag as a bidirectional one; both with the window counted from the anchor, as speculators counts it."""
    out, ours = tmp_path / "out", _ours(tiny_dir)
    out.mkdir()
    write_speculators(ours, out, verifier=str(tiny_dir))
    _edit(out, draft_vocab_size=100)
    with pytest.raises(ValueError, match="weights do not match its config.*t2d"):
        load_drafter(out)
    n = ours.config.num_hidden_layers
    sliding = {"layer_types": ["sliding_attention"] * n, "sliding_window": 16, "use_sliding_window": True}
    _edit(out, draft_vocab_size=512, sliding_window_non_causal=False, layer=sliding)
    attn = load_drafter(out).layers[0].self_attn
    assert (attn.sliding_window, attn.causal, attn.window_origin) == (16, True, "anchor")
    _edit(out, sliding_window_non_causal=True)
    attn = load_drafter(out).layers[0].self_attn
    assert (attn.sliding_window, attn.causal, attn.window_origin) == (16, False, "anchor")


def test_the_verifier_is_named_by_its_own_architecture(tmp_path, tiny_dir):
    """SmolLM2 is a Llama: the export named every verifier Qwen3ForCausalLM (DSpark's export, since before DFlash's)."""
    llama = tmp_path / "llama"
    LlamaConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, architectures=["LlamaForCausalLM"]
    ).save_pretrained(llama)  # as a real target's config.json
    out = tmp_path / "out"
    out.mkdir()
    write_speculators(_ours(tiny_dir, "drafter=dspark", "drafter.markov_rank=8"), out, verifier=str(llama))
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"architectures": ["LlamaForCausalLM"], "name_or_path": str(llama)}
