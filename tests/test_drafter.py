"""The drafter, its target features, training blocks and export: the three bugs that made peers' drafters
accept nothing, train/serve parity, and the export round trip."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash.model.blocks import (
    build_training_attention_mask,
    build_training_blocks,
    sample_anchors,
)
from dflash.model.build import default_target_layer_ids
from dflash.model.drafter import DFlashDraftModel, DraftKVCache
from dflash.model.export import check_drafter_against, export_drafter, load_drafter
from dflash.model.target import TargetModel

B = 4


def make_drafter(hidden=64, layers=1, layer_ids=(1, 2), mask_id=1, num_target_layers=4, seed=0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg.dflash_config = {"mask_token_id": mask_id, "target_layer_ids": list(layer_ids), "block_size": B}
    cfg.block_size, cfg.num_target_layers = B, num_target_layers
    return DFlashDraftModel(cfg).eval()


def test_default_target_layer_ids_match_zlab():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # LLaMA-3.1-8B
    assert default_target_layer_ids(36, 1) == [18]


# --- bug 1: attention visibility -----------------------------------------------------------------------
def test_training_mask_exact():
    # S = 6 context positions, two blocks of B = 3 with anchors 1 and 3, the second block is padding-free
    anchors, valid = torch.tensor([[1, 3]]), torch.tensor([[True, True]])
    m = build_training_attention_mask(anchors, valid, seq_len=6, block_size=3)[0, 0].int()
    expected = torch.tensor(
        [
            # ctx 0..5           | block 0 | block 1
            [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # block 0 sees ctx < 1, its own block only
            [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],  # block 1 sees ctx < 3 (not the anchor's own feature)
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        ]
    )
    assert torch.equal(m, expected)
    # padding blocks see only themselves
    m2 = build_training_attention_mask(anchors, torch.tensor([[True, False]]), 6, 3)[0, 0].int()
    assert m2[3:, :6].sum() == 0 and m2[3:, 9:].all()


def _train_forward(drafter, tokens_emb, target_hidden, anchors, S):
    valid = torch.ones_like(anchors, dtype=torch.bool)
    ids = torch.zeros(1, S, dtype=torch.long)
    blocks = build_training_blocks(ids, torch.ones(1, S, dtype=torch.bool), anchors, valid, B, mask_token_id=1)
    return drafter(tokens_emb, target_hidden, blocks.position_ids, attention_mask=blocks.attention_mask)


def test_visibility_behaviour():
    """Perturbing what a block must not see leaves its output unchanged; what it must see changes it."""
    torch.manual_seed(0)
    d = make_drafter()
    S, anchors = 16, torch.tensor([[3, 9]])
    emb = torch.randn(1, 2 * B, 64)
    th = torch.randn(1, S, 128)
    base = _train_forward(d, emb, th, anchors, S)
    # the anchor's own feature (position 9) and anything later are invisible to block 1
    th2 = th.clone()
    th2[:, 9:] += 5.0
    out = _train_forward(d, emb, th2, anchors, S)
    assert torch.allclose(out[:, B:], base[:, B:], atol=1e-6)
    th3 = th.clone()
    th3[:, 8] += 5.0  # position 8 < anchor 9: visible to block 1, invisible to block 0
    out = _train_forward(d, emb, th3, anchors, S)
    assert not torch.allclose(out[:, B:], base[:, B:], atol=1e-4)
    assert torch.allclose(out[:, :B], base[:, :B], atol=1e-6)
    # another block's tokens are invisible; its own block's tokens are visible (bidirectional)
    emb2 = emb.clone()
    emb2[:, :B] += 5.0
    out = _train_forward(d, emb2, th, anchors, S)
    assert torch.allclose(out[:, B:], base[:, B:], atol=1e-6)
    emb3 = emb.clone()
    emb3[:, B + 3] += 5.0  # last slot of block 1 changes slot 1 of block 1 (bidirectional)
    out = _train_forward(d, emb3, th, anchors, S)
    assert not torch.allclose(out[:, B + 1], base[:, B + 1], atol=1e-4)


# --- bug 3: labels and positions at anchor + k ---------------------------------------------------------
def test_labels_positions_same_position():
    S = 12
    ids = torch.arange(100, 100 + S)[None]
    mask = torch.ones(1, S, dtype=torch.bool)
    anchors, valid = torch.tensor([[2, 7]]), torch.tensor([[True, True]])
    b = build_training_blocks(ids, mask, anchors, valid, B, mask_token_id=1)
    assert b.input_ids.tolist() == [[102, 1, 1, 1, 107, 1, 1, 1]]  # [anchor, MASK x (B-1)]
    assert b.labels.tolist() == [[[103, 104, 105], [108, 109, 110]]]  # token at anchor + k, k = 1..B-1
    assert b.position_ids[0, S:].tolist() == [2, 3, 4, 5, 7, 8, 9, 10]  # block slot k at anchor + k
    assert b.position_ids[0, :S].tolist() == list(range(S))
    assert b.teacher_positions.tolist() == [[[2, 3, 4], [7, 8, 9]]]  # the target position predicting label k


def test_labels_respect_loss_mask_and_bounds():
    S = 10
    ids = torch.arange(S)[None]
    mask = torch.ones(1, S, dtype=torch.bool)
    mask[0, 4] = False
    b = build_training_blocks(ids, mask, torch.tensor([[2, 0]]), torch.tensor([[True, False]]), B, 1)
    assert b.label_valid.tolist() == [[[True, False, True], [False, False, False]]]


def test_sample_anchors_eligible_sorted_resampled():
    S, N = 32, 5
    mask = torch.zeros(2, S, dtype=torch.bool)
    mask[:, 10:] = True
    mask[1] = False
    mask[1, 20:23] = True
    g = torch.Generator().manual_seed(0)
    a, v = sample_anchors(mask, N, B, g)
    row = a[0][v[0]]
    assert v[0].all() and torch.equal(row, row.sort().values) and len(set(row.tolist())) == N
    assert all(9 <= x <= S - B and mask[0, x + 1] for x in row.tolist())  # next token supervised, block fits
    assert sorted(a[1][v[1]].tolist()) == [19, 20, 21]  # only 3 eligible -> 2 padding blocks
    a2, _ = sample_anchors(mask, N, B, torch.Generator().manual_seed(1))
    assert not torch.equal(a2[0], a[0])  # resampled on another pass


# --- bug 2: LM head tied to the embeddings on tied models ----------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_target_lm_head_and_features(tmp_path, tied):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=tied,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    target = TargetModel.load(str(tmp_path), [1, 2])
    ref = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    emb, head = target.embed_tokens.weight, target.lm_head.weight
    assert (emb.data_ptr() == head.data_ptr()) == tied
    if not tied:
        assert not torch.allclose(emb, head)
    x = torch.randint(0, 300, (2, 10))
    th, last = target.features(x)
    with torch.no_grad():
        out = ref(x, output_hidden_states=True)
    assert torch.allclose(target.logits(last), out.logits, atol=1e-5)  # the head the drafter uses is the real one
    assert torch.allclose(th, torch.cat([out.hidden_states[2], out.hidden_states[3]], -1), atol=1e-6)  # id i = hs[i+1]
    assert th.shape == (2, 10, 128) and last.shape == (2, 10, 64)
    assert not any(p.requires_grad for p in target.parameters())


# --- train/serve parity ----------------------------------------------------------------------------------
def test_training_path_equals_inference_path():
    torch.manual_seed(0)
    d = make_drafter(layers=2)
    S, anchors = 20, torch.tensor([[4, 11]])
    emb = torch.randn(1, 2 * B, 64)
    th = torch.randn(1, S, 128)
    train_out = _train_forward(d, emb, th, anchors, S)
    for j, a in enumerate(anchors[0].tolist()):
        blk = emb[:, j * B : (j + 1) * B]
        pos = torch.arange(a + B)[None]
        # inference, no cache: context features of positions < a, then the block, no mask (non-causal)
        full = d(blk, th[:, :a], pos)
        assert torch.allclose(full, train_out[:, j * B : (j + 1) * B], atol=1e-5)
        # inference with the KV cache: context fed in two pieces, block K/V cropped after the draft
        cache = DraftKVCache()
        d(blk, th[:, : a // 2], torch.arange(a // 2 + B)[None], past_key_values=cache)
        cache.crop(a // 2)
        inc = d(blk, th[:, a // 2 : a], torch.arange(a // 2, a + B)[None], past_key_values=cache)
        assert torch.allclose(inc, train_out[:, j * B : (j + 1) * B], atol=1e-5)


# --- export -----------------------------------------------------------------------------------------------
ZLAB_LAYER_KEYS = {
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
}


def test_export_round_trip(tmp_path):
    from safetensors import safe_open

    d = make_drafter(layers=2)
    out = export_drafter(d, tmp_path / "drafter", target="some/target")
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(2) for k in ZLAB_LAYER_KEYS
    }
    assert keys == expected  # unprefixed, no embed_tokens / lm_head / rotary buffers
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["model_type"] == "qwen3" and cfg["block_size"] == B and cfg["num_target_layers"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": 1, "target_layer_ids": [1, 2], "block_size": B, "causal": False}
    assert cfg["rope_theta"] == 10000.0 and cfg["layer_types"] == ["full_attention"] * 2
    import dflash.model.drafter

    assert (out / "dflash.py").read_text() == open(dflash.model.drafter.__file__).read()

    remote = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__name__ == "DFlashDraftModel" and type(remote).__module__ != DFlashDraftModel.__module__
    emb, th, pos = torch.randn(1, B, 64), torch.randn(1, 6, 128), torch.arange(6 + B)[None]
    with torch.no_grad():
        assert torch.allclose(remote(emb, th, pos), d(emb, th, pos), atol=1e-6)


def test_export_load_refuses_wrong_mask_or_layers(tmp_path):
    out = export_drafter(make_drafter(), tmp_path / "drafter")
    load_drafter(out, mask_token_id=1, target_layer_ids=[1, 2])  # matching: loads
    with pytest.raises(ValueError, match="mask_token_id"):
        load_drafter(out, mask_token_id=7)
    with pytest.raises(ValueError, match="target_layer_ids"):
        load_drafter(out, target_layer_ids=[1, 3])
    small = Qwen3Config(hidden_size=64, num_hidden_layers=2, vocab_size=512)
    with pytest.raises(ValueError, match="outside the target"):
        check_drafter_against(AutoConfig.from_pretrained(out), target_config=small)


def test_drafter_requires_dflash_config():
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    with pytest.raises(ValueError, match="dflash_config"):
        DFlashDraftModel(cfg)


def test_flex_block_mask_matches_dense_mask():
    """The FlexAttention path sees exactly what the dense SDPA mask allows (forward; flex has no CPU backward)."""
    from dflash.model.blocks import build_flex_block_mask

    torch.manual_seed(0)
    d = make_drafter(layers=2)
    S, anchors, valid = 40, torch.tensor([[3, 11, 30, 0]]), torch.tensor([[True, True, True, False]])
    emb, th = torch.randn(1, 4 * B, 64), torch.randn(1, S, 128)
    blocks = build_training_blocks(
        torch.zeros(1, S, dtype=torch.long), torch.ones(1, S, dtype=torch.bool), anchors, valid, B, 1
    )
    flex_mask = build_flex_block_mask(anchors, valid, S, B)
    with torch.no_grad():
        ref = d(emb, th, blocks.position_ids, attention_mask=blocks.attention_mask)
        out = d(emb, th, blocks.position_ids, attention_mask=flex_mask)
    assert torch.allclose(out, ref, atol=1e-5)
    th2 = th.clone()
    th2[:, 11:] += 5.0  # flex too hides the anchor's own feature and later context
    with torch.no_grad():
        out2 = d(emb, th2, blocks.position_ids, attention_mask=flex_mask)
    assert torch.allclose(out2[:, B : 2 * B], out[:, B : 2 * B], atol=1e-6)


def _model_cfg(**kw):
    from omegaconf import OmegaConf

    base = {
        "num_draft_layers": 1,
        "draft_num_attention_heads": None,
        "draft_num_key_value_heads": None,
        "draft_head_dim": None,
        "draft_intermediate_size": None,
        "block_size": B,
    }
    return OmegaConf.create({**base, **kw})


def _target_config(**kw):
    return Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **kw,
    )


def test_draft_heads_must_be_a_multiple_of_kv_heads():
    from dflash.core.config import ConfigError
    from dflash.model.build import build_drafter_config

    build_drafter_config(_target_config(), _model_cfg(draft_num_attention_heads=6), [1, 2], 1)  # 6 = 3 x 2: fine
    with pytest.raises(ConfigError, match="model.draft_num_attention_heads=3 .* multiple of the key/value heads"):
        build_drafter_config(_target_config(), _model_cfg(draft_num_attention_heads=3), [1, 2], 1)


def test_drafter_config_states_the_plain_rope_it_uses():
    """A target with scaled RoPE: the drafter (plain RoPE) must not export the target's scaling."""
    from dflash.model.build import build_drafter_config

    yarn = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 4096}
    cfg = build_drafter_config(_target_config(rope_parameters=yarn), _model_cfg(), [1, 2], 1)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}


def test_export_cli_reports_a_wrong_path_in_one_line(tmp_path, capsys):
    from dflash.cli.export import main

    assert main([str(tmp_path / "nothere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nothere" in err and "Traceback" not in err
