"""model.layer_types: sliding and full drafter layers in both peers' semantics (dflash/model/window.py). z-lab
(>= 07ebd93) and vLLM: a sliding layer's window counted from each query and its block causal (the per-layer default
where the config has no is_causal), a full layer bidirectional over the whole context; speculators 0.9.0: the window
counted from the anchor, the sliding block causal unless sliding_window_non_causal. The same rule in every training
mask (dense, per-block, flex), in decoding (the drafter's KV cache), in both exports and their readers (our loader,
the shipped dflash.py, speculators' own classes).

z-lab's own loader is not run here (no network, and its code stays out of this repository): its documented rule
(z-lab/dflash @ 07ebd93, model.py's `_attention_mask`: qp = k_len - q_len + i; causal => kp <= qp; qp - kp < W; not
causal => kp - qp < W; is_causal absent => causal iff the layer slides) is written out below as `zlab_rule`, and the
exported dflash.py, loaded with trust_remote_code, is checked against it."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import compose_config
from test_sliding_window import B, _decode_logits, _tiny_target, make_drafter
from transformers import AutoConfig, AutoModel

from dflash.core.config import ConfigError
from dflash.core.validation import validate
from dflash.evaluation.sim_tau import target_pass
from dflash.model.blocks import build_flex_block_mask, build_training_attention_mask, build_training_blocks
from dflash.model.build import build_drafter_config
from dflash.model.export import export_drafter, load_drafter
from dflash.model.window import LayerRule, WindowedBlocks, draft_window

S_, F_ = "sliding_attention", "full_attention"
SEMANTICS = {  # name -> the drafter config's fields beyond layer_types [S, S, F] and sliding_window
    "zlab": {},  # no is_causal: sliding layers causal, the full one bidirectional; window from the query
    "speculators": {"window_origin": "anchor"},  # its default: the sliding block causal
    "speculators_non_causal": {"window_origin": "anchor", "is_causal": False},
    "bidirectional": {"is_causal": False},  # model.sliding_block=bidirectional
}


def reference_visible(a: int, i: int, key: int, rule: LayerRule, block_key: int | None = None) -> bool:
    """Slot i of the block anchored at a sees context position `key` (or, block_key j, its own slot j): the table of
    the peers' rules, written out."""
    if block_key is not None:
        return block_key <= i or not rule.causal
    if key >= a:
        return False
    if rule.window is None:
        return True
    return key >= a - rule.window if rule.origin == "anchor" else a + i - key < rule.window


def zlab_rule(q_len: int, k_len: int, causal: bool, window: int | None) -> torch.Tensor:
    """z-lab's decoding mask (z-lab/dflash @ 07ebd93, model.py, `_attention_mask`), as documented."""
    qp = k_len - q_len + torch.arange(q_len)[:, None]
    kp = torch.arange(k_len)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if causal:
        visible &= kp <= qp
    if window is not None:
        visible &= qp - kp < window
        if not causal:
            visible &= kp - qp < window
    return visible[None, None]


def _drafter(name: str, window: int = 6, seed: int = 0):
    return make_drafter(window, layers=3, seed=seed, types=[S_, S_, F_], **SEMANTICS[name])


def test_validation_refuses_in_one_line():
    base = ["experiment=smoke", "model.num_draft_layers=2", "model.block_size=4"]
    validate(compose_config([*base, "model.layer_types=[sliding_attention,full_attention]", "model.sliding_window=8"]))
    bad = {
        "model.layer_types=[sliding_attention]": "must name one kind per draft layer (2)",
        "model.layer_types=[sliding_attention,local]": "model.layer_types[]='local' is invalid",
        "model.layer_types=[sliding_attention,full_attention] model.sliding_window=null": "need model.sliding_window",
        "model.layer_types=[full_attention,full_attention] model.sliding_window=8": "no layer of model.layer_types",
        "model.layer_types=[sliding_attention,full_attention] model.sliding_window=2": "must be >= model.block_size",
        "model.sliding_window=8 model.sliding_block=both": "model.sliding_block='both' is invalid",
        "model.sliding_window=8 model.window_origin=key": "model.window_origin='key' is invalid",
    }
    for overrides, said in bad.items():
        with pytest.raises(ConfigError) as e:
            validate(compose_config([*base, "model.sliding_window=8", *overrides.split()]))
        assert said in str(e.value) and "\n" not in str(e.value), overrides


@pytest.mark.parametrize(
    "overrides,types,is_causal,origin",
    [
        ([], [F_, F_], False, None),
        (["model.sliding_window=8"], [S_, S_], False, None),  # the uniform window: bidirectional, as before
        (["model.sliding_window=8", "model.sliding_block=causal"], [S_, S_], None, None),
        (["model.layer_types=[sliding_attention,full_attention]", "model.sliding_window=8"], [S_, F_], None, None),
        (
            ["model.layer_types=[sliding_attention,full_attention]", "model.sliding_window=8",
             "model.sliding_block=bidirectional", "model.window_origin=anchor"],
            [S_, F_], False, "anchor",
        ),
    ],
)  # fmt: skip
def test_the_drafter_config_records_the_layer_kinds_as_zlab_reads_them(tiny_dir, overrides, types, is_causal, origin):
    cfg = compose_config(["experiment=smoke", f"model.target={tiny_dir}", "model.num_draft_layers=2", *overrides])
    config = build_drafter_config(AutoConfig.from_pretrained(tiny_dir), cfg.model, [1, 2], 3).to_dict()
    assert config["layer_types"] == types and config["use_sliding_window"] == (S_ in types)
    assert config["sliding_window"] == (8 if S_ in types else None)
    assert config.get("is_causal") is is_causal and config.get("window_origin") == origin


@pytest.mark.parametrize("origin", ["query", "anchor"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 6])
def test_every_training_mask_is_the_rule(window, causal, origin):
    """The dense mask equals the rule slot by slot; the per-block path and flex compute what the dense mask does."""
    rule = LayerRule(window, causal, origin if window else "query")
    S, anchors, valid = 40, torch.tensor([[3, 11, 30, 0]]), torch.tensor([[True, True, True, False]])
    dense = build_training_attention_mask(anchors, valid, S, B, window, causal, rule.origin)[0, 0]
    for n, a in enumerate(anchors[0].tolist()[:3]):
        for i in range(B):
            row = dense[n * B + i]
            assert row[:S].tolist() == [reference_visible(a, i, c, rule) for c in range(S)]
            own = row[S + n * B : S + (n + 1) * B].tolist()
            assert own == [reference_visible(a, i, 0, rule, block_key=j) for j in range(B)]
            assert row[S:].sum() == sum(own)  # nothing of other blocks
    d = make_drafter(6 if window else None, seed=1)
    emb, th = torch.randn(1, 4 * B, 64), torch.randn(1, S, 128)
    ids = torch.zeros(1, S, dtype=torch.long)
    blocks = build_training_blocks(ids, torch.ones(1, S, dtype=torch.bool), anchors, valid, B, 1, window=(rule,) * 2)
    assert isinstance(blocks.attention_mask, WindowedBlocks) == (window is not None)
    with torch.no_grad():
        ref = d(emb, th, blocks.position_ids, attention_mask=dense[None, None])
        used = d(emb, th, blocks.position_ids, attention_mask=blocks.attention_mask)
        flex = build_flex_block_mask(anchors, valid, S, B, window, causal, rule.origin)
        flexed = d(emb, th, blocks.position_ids, attention_mask=flex)
    assert torch.allclose(used, ref, atol=1e-5) and torch.allclose(flexed, ref, atol=1e-5)


def test_a_drafter_gets_one_mask_per_kind_of_layer():
    d = _drafter("zlab")
    assert draft_window(d.config) == (LayerRule(6, True), LayerRule(6, True), LayerRule())
    S, anchors, valid = 40, torch.tensor([[11, 30]]), torch.ones(1, 2, dtype=torch.bool)
    for attention in ("sdpa", "flex"):
        blocks = build_training_blocks(
            torch.zeros(1, S, dtype=torch.long), torch.ones(1, S, dtype=torch.bool), anchors, valid, B, 1,
            attention, draft_window(d.config),
        )  # fmt: skip
        masks = blocks.attention_mask
        assert isinstance(masks, list) and len(masks) == 3 and masks[0] is masks[1] and masks[1] is not masks[2]
    with pytest.raises(ValueError, match="2 attention masks for 3 layers"):
        d(torch.randn(1, 2 * B, 64), torch.randn(1, S, 128), blocks.position_ids, attention_mask=masks[:2])


@pytest.mark.parametrize("name", list(SEMANTICS))
def test_training_and_decoding_give_the_same_logits(name):
    """The training mask (per layer) and the drafter's KV-cache decoding (each layer's own rule) agree on every block,
    for each semantics; the semantics differ from each other where the window's edge or the block's order shows."""
    target, d = _tiny_target(), _drafter(name, window=8)
    seq = torch.randint(5, 512, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    _, feats = target_pass(target, seq, d.target_layer_ids)
    anchors = [9, 20, 21, 40]
    decoded = _decode_logits(d, target, seq, feats, anchors)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    ids = torch.tensor([seq])
    blocks = build_training_blocks(
        ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([anchors]), torch.ones(1, 4, dtype=torch.bool),
        B, 1, window=draft_window(d.config),
    )  # fmt: skip
    with torch.no_grad():
        hidden = d(embed(blocks.input_ids), feats, blocks.position_ids, attention_mask=blocks.attention_mask)
        trained = head(hidden.view(1, 4, B, -1)[0, :, 1:])
    for i in range(4):
        assert torch.allclose(decoded[i], trained[i], atol=1e-4), (name, anchors[i])
    for other in SEMANTICS:
        if other != name:
            theirs = _drafter(other, window=8)
            theirs.load_state_dict(d.state_dict())
            assert not torch.allclose(_decode_logits(theirs, target, seq, feats, [40])[0], decoded[3], atol=1e-4)


def _context_run(model, ctx: int = 20):
    """The block after `ctx` context positions, decoding's way (no mask: each layer's own rule)."""
    g = torch.Generator().manual_seed(3)
    emb, th, pos = torch.randn(1, B, 64, generator=g), torch.randn(1, ctx, 128, generator=g), torch.arange(ctx + B)
    with torch.no_grad():
        return model(emb, th, pos[None])


def test_zlab_layout_export_reads_back_in_our_loader_and_its_dflash_py_as_zlab_rules(tmp_path):
    """[sliding x3, full] with no is_causal, as z-lab's Qwen3.6 drafter: the export writes layer_types,
    sliding_window, use_sliding_window and neither is_causal nor dflash_config.causal; our loader and the shipped
    dflash.py (trust_remote_code) compute what z-lab's documented per-layer masks give."""
    d = make_drafter(6, layers=4, types=[S_, S_, S_, F_])
    out = export_drafter(d, tmp_path / "drafter")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == [S_, S_, S_, F_] and cfg["sliding_window"] == 6 and cfg["use_sliding_window"] is True
    assert "is_causal" not in cfg and "causal" not in cfg["dflash_config"] and "window_origin" not in cfg
    ours = load_drafter(out).eval()
    remote = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__module__ != type(d).__module__  # the exported dflash.py, not ours
    ctx = 20
    zlab = [zlab_rule(B, ctx + B, t == S_, 6 if t == S_ else None) for t in cfg["layer_types"]]
    g = torch.Generator().manual_seed(3)
    emb, th, pos = torch.randn(1, B, 64, generator=g), torch.randn(1, ctx, 128, generator=g), torch.arange(ctx + B)
    with torch.no_grad():
        want = remote(emb, th, pos[None], attention_mask=zlab)
        full = remote(emb, th, pos[None], attention_mask=torch.ones(1, 1, B, ctx + B, dtype=torch.bool))
    assert not torch.allclose(want, full, atol=1e-3)  # the rule matters here
    for model in (d, ours, remote):
        assert torch.allclose(_context_run(model), want, atol=1e-6)


def test_zlab_layout_states_a_uniform_block_for_every_reader(tmp_path, caplog):
    """All bidirectional (today's drafters): is_causal false and dflash_config.causal false (vLLM before its
    top-level key); a window from the anchor, which z-lab's readers cannot express, warns."""
    cfg = json.loads((export_drafter(make_drafter(6), tmp_path / "a") / "config.json").read_text())
    assert cfg["is_causal"] is False and cfg["dflash_config"]["causal"] is False
    cfg = json.loads((export_drafter(make_drafter(None), tmp_path / "b") / "config.json").read_text())
    assert cfg["is_causal"] is False and cfg["dflash_config"]["causal"] is False
    with caplog.at_level(logging.WARNING):
        export_drafter(_drafter("speculators"), tmp_path / "c")
    assert "z-lab and vLLM count the window from each query slot" in caplog.text


def test_zlab_released_qwen3_6_layout_reads_as_its_rule():
    """The fields of z-lab/Qwen3.6-27B-DFlash's config (scaled down): sliding x4 then full, no is_causal."""
    d = make_drafter(2048, layers=5, types=[S_] * 4 + [F_])
    assert draft_window(d.config) == (LayerRule(2048, True),) * 4 + (LayerRule(),)


def test_init_from_warns_when_the_sources_layers_attend_otherwise(tmp_path, caplog):
    """The same shapes, another rule: a warning naming both (a recipe change or a mistake); transformers' reading of
    a config without use_sliding_window (no window) counts."""
    from dflash.train.init_from import find_init_source

    out = export_drafter(_drafter("zlab"), tmp_path / "drafter")
    with caplog.at_level(logging.WARNING):
        find_init_source(str(out), _drafter("zlab").config)
    assert "attend otherwise" not in caplog.text
    with caplog.at_level(logging.WARNING):
        find_init_source(str(out), _drafter("bidirectional").config)
    assert "sliding 6 from the query, causal" in caplog.text
    assert "sliding 6 from the query, bidirectional" in caplog.text
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "use_sliding_window": False}))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        find_init_source(str(out), _drafter("zlab").config)
    assert "['full, causal', 'full, causal', 'full, bidirectional'] there" in caplog.text


def _speculators(tiny_dir, *overrides: str):
    from test_speculators_layout import _ours

    return _ours(tiny_dir, "model.num_draft_layers=2", "model.layer_types=[sliding_attention,full_attention]",
                 "model.window_origin=anchor", *overrides).eval()  # fmt: skip


@pytest.mark.parametrize("block", ["causal", "bidirectional"])
def test_speculators_layout_computes_speculators_function(tiny_dir, tmp_path, monkeypatch, block):
    """window_origin=anchor in speculators' layout: its config builds speculators 0.9.0's DFlashDraftModel, its
    mask is ours (both sliding and full layers), the whole forward over the blocks is ours, and ours reads it back."""
    pytest.importorskip("speculators")
    from speculators.models.dflash import core
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from test_speculators_layout import _theirs_eager

    from dflash.model.families.speculators_layout import write_speculators

    ours = _speculators(tiny_dir, "model.sliding_window=4", "model.block_size=4", f"model.sliding_block={block}")
    out = tmp_path / "out"
    out.mkdir()
    write_speculators(ours, out, verifier=str(tiny_dir))
    raw = json.loads((out / "config.json").read_text())
    assert raw["transformer_layer_config"]["layer_types"] == [S_, F_]
    assert raw["transformer_layer_config"]["sliding_window"] == 4 and "is_causal" not in raw["transformer_layer_config"]
    assert raw["sliding_window_non_causal"] is (block == "bidirectional")
    theirs = _theirs_eager(out)
    Bk, S = ours.block_size, 3 * ours.block_size + 6
    anchors = torch.tensor([2, Bk + 1, 2 * Bk + 3])
    valid = torch.ones(1, 3, dtype=torch.bool)
    for rule in set(draft_window(ours.config)):
        mod, q_len, kv_len = create_anchor_block_mask_mod(
            torch.zeros(S, dtype=torch.long), S, anchors, Bk, rule.window, sliding_window_non_causal=not rule.causal
        )
        qi, ki = torch.arange(q_len)[:, None].expand(q_len, kv_len), torch.arange(kv_len)[None, :].expand(q_len, kv_len)
        theirs_mask = mod(torch.tensor(0), torch.tensor(0), qi, ki)
        mine = build_training_attention_mask(anchors[None], valid, S, Bk, rule.window, rule.causal, rule.origin)
        assert torch.equal(theirs_mask, mine[0, 0]), rule
    g = torch.Generator().manual_seed(0)
    ids, hs = torch.randint(0, 500, (1, S), generator=g), torch.randn(1, S, 2 * 64, generator=g)
    monkeypatch.setattr(core, "select_anchors", lambda *a: (anchors, torch.ones(3, dtype=torch.bool)))
    with torch.no_grad():
        hidden = theirs._backbone_forward(hs, ids, torch.ones(1, S), torch.randn(1, S, 64), torch.zeros(1, S).long(),
                                          torch.arange(S)[None], max_anchors=3)[0]  # fmt: skip
        blocks = build_training_blocks(ids, torch.ones(1, S, dtype=torch.bool), anchors[None], valid, Bk, 3,
                                       window=draft_window(ours.config))  # fmt: skip
        mine = ours(theirs.embed_tokens(blocks.input_ids), hs, blocks.position_ids, blocks.attention_mask)
    assert torch.allclose(hidden, mine, atol=1e-5), (hidden - mine).abs().max()
    back = load_drafter(out)
    assert draft_window(back.config) == draft_window(ours.config)


@pytest.mark.slow
def test_a_zlab_layout_sliding_drafter_trains_on_through_init_from(tmp_path, cache_dir, tiny_target):
    """A smoke run with [sliding, full] layers completes with a lossless eval and exports z-lab's Qwen3.6 layout;
    a second run starts from that export (model.init_from) and trains 2 steps."""
    from conftest import launch

    kinds = ["model.layer_types=[sliding_attention,full_attention]", "model.num_draft_layers=2",
             "model.sliding_window=8", "train.max_steps=2", "checkpoint.every_steps=0"]  # fmt: skip
    first, second = tmp_path / "first", tmp_path / "second"
    launch(["experiment=smoke", *kinds, f"hydra.run.dir={first}"], cache_dir, check=True)
    assert json.loads((first / "status.json").read_text())["status"] == "completed"
    assert json.loads((first / "eval.json").read_text())["metrics"]["eval/lossless"] == 1.0
    cfg = json.loads((first / "drafter" / "config.json").read_text())
    assert cfg["layer_types"] == [S_, F_] and cfg["sliding_window"] == 8 and "is_causal" not in cfg
    proc = launch(
        ["experiment=smoke", *kinds, "eval.num_prompts=0", f"model.init_from={first / 'drafter'}",
         f"hydra.run.dir={second}"],
        cache_dir, check=True,
    )  # fmt: skip
    assert json.loads((second / "status.json").read_text())["status"] == "completed"
    assert json.loads((second / "run.json").read_text())["init_from"]["kind"] == "drafter"
    assert "attend otherwise" not in proc.stdout + proc.stderr
