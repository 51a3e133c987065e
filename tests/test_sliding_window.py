"""model.sliding_window: the window in the training masks (dense, per-block, flex), in decoding (the drafter's KV
cache), the same drafts from both, a window as long as the sequence bitwise equal to full attention, the export."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO
from hydra import compose, initialize_config_dir
from transformers import AutoModel, Qwen3Config, Qwen3ForCausalLM

from dflash.core.config import ConfigError, register_configs
from dflash.core.validation import validate
from dflash.evaluation.decoding import DFlashProposer
from dflash.evaluation.sim_tau import drafted_lengths, target_pass
from dflash.model.blocks import build_flex_block_mask, build_training_attention_mask, build_training_blocks
from dflash.model.build import build_drafter_config
from dflash.model.drafter import DFlashDraftModel
from dflash.model.export import export_drafter
from dflash.model.window import LayerRule, WindowedBlocks, draft_window

register_configs()
B = 4


def make_drafter(
    window: int | None, layers: int = 2, seed: int = 0, types: list[str] | None = None, **fields
) -> DFlashDraftModel:
    """A tiny drafter; every layer sliding under `window` with a bidirectional block (model.sliding_window's
    drafter) unless `types` names the kinds; `fields` (is_causal, window_origin) go into its config."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=layers,
        layer_types=types or ["full_attention" if window is None else "sliding_attention"] * layers,
    )
    cfg.is_causal = False if types is None else None
    for key, value in fields.items():
        setattr(cfg, key, value)
    cfg.dflash_config = {"mask_token_id": 1, "target_layer_ids": [1, 2], "block_size": B}
    cfg.block_size, cfg.num_target_layers = B, 4
    return DFlashDraftModel(cfg).eval()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=smoke", *overrides])


def test_the_window_must_hold_a_block():
    validate(_compose("model.sliding_window=8", "model.block_size=8"))
    with pytest.raises(ConfigError, match=r"model.sliding_window=4 is invalid: must be >= model.block_size \(8\)"):
        validate(_compose("model.sliding_window=4", "model.block_size=8"))


def test_draft_window_gives_each_layers_rule():
    """None without a rule; the uniform window's bidirectional rule; z-lab's per-layer default without is_causal."""
    assert draft_window(make_drafter(None).config) is None
    assert draft_window(make_drafter(6).config) == (LayerRule(6), LayerRule(6))
    mixed = make_drafter(6, types=["sliding_attention", "full_attention"])
    assert draft_window(mixed.config) == (LayerRule(6, causal=True), LayerRule())
    anchor = make_drafter(6, types=["sliding_attention", "full_attention"], is_causal=False, window_origin="anchor")
    assert draft_window(anchor.config) == (LayerRule(6, False, "anchor"), LayerRule())


def test_training_masks_agree_and_hide_what_lies_outside_the_window():
    """The dense windowed mask, the per-block path (WindowedBlocks) and flex (forward) compute the same; moving
    a feature outside a block's window changes nothing of it, inside it does."""
    torch.manual_seed(0)
    d, S, W = make_drafter(6), 40, 6
    anchors, valid = torch.tensor([[3, 11, 30, 0]]), torch.tensor([[True, True, True, False]])
    emb, th = torch.randn(1, 4 * B, 64), torch.randn(1, S, 128)
    ids = torch.zeros(1, S, dtype=torch.long)
    blocks = build_training_blocks(ids, torch.ones(1, S, dtype=torch.bool), anchors, valid, B, 1, window=W)
    assert isinstance(blocks.attention_mask, WindowedBlocks)
    dense = build_training_attention_mask(anchors, valid, S, B, window=W)
    assert dense[0, 0, B + 2, :S].nonzero().flatten().tolist() == [8, 9, 10]  # slot 2 of anchor 11: 13 - c < 6
    with torch.no_grad():
        per_block = d(emb, th, blocks.position_ids, attention_mask=blocks.attention_mask)
        ref = d(emb, th, blocks.position_ids, attention_mask=dense)
        flex = d(emb, th, blocks.position_ids, attention_mask=build_flex_block_mask(anchors, valid, S, B, W))
        full = d(emb, th, blocks.position_ids, attention_mask=build_training_attention_mask(anchors, valid, S, B))
    assert torch.allclose(per_block, ref, atol=1e-5) and torch.allclose(flex, ref, atol=1e-5)
    assert not torch.allclose(full[:, B : 3 * B], ref[:, B : 3 * B], atol=1e-3)  # the window hides context
    outside, inside = th.clone(), th.clone()
    outside[:, :6] += 5.0  # positions 0..5: outside the window of the block at 11 (it sees 6..10 at most)
    inside[:, 9] += 5.0
    with torch.no_grad():
        out = d(emb, outside, blocks.position_ids, attention_mask=blocks.attention_mask)
        moved = d(emb, inside, blocks.position_ids, attention_mask=blocks.attention_mask)
    assert torch.equal(out[:, B : 2 * B], per_block[:, B : 2 * B])
    assert not torch.allclose(moved[:, B : 2 * B], per_block[:, B : 2 * B], atol=1e-3)


def _tiny_target() -> Qwen3ForCausalLM:
    torch.manual_seed(1)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return Qwen3ForCausalLM(cfg).eval()


def _decode_logits(drafter, target, seq: list[int], feats: torch.Tensor, anchors: list[int]) -> list[torch.Tensor]:
    """DFlashProposer's logits at each anchor, its context fed as the verify loop feeds it (only new positions)."""
    proposer = DFlashProposer(drafter, target)
    out = []
    for a in anchors:
        out.append(proposer.draft_logits(seq[: a + 1], feats[:, proposer.ctx_len : a], B - 1))
    return out


def test_training_and_decoding_give_the_same_drafts_under_a_window():
    """A window smaller than the context: the teacher-forced blocks (sim_tau/replay, the training mask) and the
    drafter's KV-cache decoding give the same logits and drafts; a full-attention drafter's differ."""
    target, d = _tiny_target(), make_drafter(8)
    seq = torch.randint(5, 512, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    target_next, feats = target_pass(target, seq, d.target_layer_ids)
    anchors = [9, 20, 21, 40]
    decoded = _decode_logits(d, target, seq, feats, anchors)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    drafts = drafted_lengths(d, embed, head, seq, target_next, feats, 9, 40, B)[2]
    for i, a in enumerate(anchors):
        assert decoded[i].argmax(-1).tolist() == drafts[a - 9], a
    ids = torch.tensor([seq])
    blocks = build_training_blocks(
        ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([anchors]), torch.ones(1, 4, dtype=torch.bool),
        B, 1, window=8,
    )  # fmt: skip
    with torch.no_grad():
        hidden = d(embed(blocks.input_ids), feats, blocks.position_ids, attention_mask=blocks.attention_mask)
        trained = head(hidden.view(1, 4, B, -1)[0, :, 1:])
    for i in range(4):
        assert torch.allclose(decoded[i], trained[i], atol=1e-4)
    full = make_drafter(None)
    full.load_state_dict(d.state_dict())
    assert not torch.allclose(_decode_logits(full, target, seq, feats, [40])[0], decoded[3], atol=1e-3)


def test_a_window_as_long_as_the_sequence_is_bitwise_full_attention(tiny_target, tiny_tokenizer):
    """Training (the trainer's loss and gradients) and decoding (the proposer's logits)."""
    from dflash.data.batches import Batch
    from dflash.model.target import TargetModel
    from dflash.train.trainer import DrafterTrainer, TargetForward

    target, mask_id = TargetModel.load(str(tiny_target), [1, 2]), tiny_tokenizer.mask_token_id
    ids = torch.randint(5, 500, (2, 64), generator=torch.Generator().manual_seed(0))
    item = TargetForward(target, torch.device("cpu"))(Batch(ids, torch.ones(2, 64, dtype=torch.bool), 128, 0, 0))
    results = []
    for window in ("null", "64", "1000"):
        cfg = _compose(f"model.target={tiny_target}", f"model.sliding_window={window}", "model.attention=sdpa")
        torch.manual_seed(0)
        drafter = DFlashDraftModel(build_drafter_config(target.model.config, cfg.model, [1, 2], mask_id))
        n = drafter.config.num_hidden_layers
        assert draft_window(drafter.config) == (None if window == "null" else (LayerRule(int(window)),) * n)
        trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=10)
        out = trainer.compute_loss(item, 0, 0.0)
        out.loss.backward()
        grads = [p.grad.clone() for p in drafter.parameters()]
        seq = ids[0].tolist()
        _, feats = target_pass(target.model, seq, [1, 2])
        logits = _decode_logits(drafter.eval(), target.model, seq, feats, [30, 60])
        results.append((out.loss.detach(), grads, logits))
    for loss, grads, logits in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.equal(g, g0) for g, g0 in zip(grads, results[0][1]))
        assert all(torch.equal(x, x0) for x, x0 in zip(logits, results[0][2]))


def test_the_export_records_the_window_and_its_dflash_py_applies_it(tmp_path):
    d = make_drafter(6)
    out = export_drafter(d, tmp_path / "drafter")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["sliding_window"] == 6 and cfg["use_sliding_window"] is True
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["is_causal"] is False
    remote = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__module__ != DFlashDraftModel.__module__  # the exported dflash.py, not ours
    full = make_drafter(None)
    full.load_state_dict(d.state_dict())
    emb, th, pos = torch.randn(1, B, 64), torch.randn(1, 20, 128), torch.arange(20 + B)[None]
    with torch.no_grad():
        assert torch.allclose(remote(emb, th, pos), d(emb, th, pos), atol=1e-6)
        assert not torch.allclose(remote(emb, th, pos), full(emb, th, pos), atol=1e-3)
