"""Loss masks of chat records: exactly the assistant turns' tokens are supervised."""

from __future__ import annotations

import copy

import pytest

from dflash.data.corpus import BadRecordError, _render_record

CONVERSATION = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "first answer"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "second answer"},
]

# Like Qwen3's template: an empty think block on the final assistant turn only.
LAST_TURN_DIFFERS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _supervised_text(tokenizer, doc) -> list[str]:
    """The supervised spans, decoded."""
    import itertools

    runs = itertools.groupby(zip(doc.ids, doc.loss_mask), key=lambda pair: pair[1])
    return [tokenizer.decode([tok for tok, _ in run]) for on, run in runs if on]


def test_every_assistant_turn_is_supervised_with_a_consistent_template(tiny_tokenizer):
    doc = _render_record({"messages": CONVERSATION}, tiny_tokenizer, "x.jsonl:1")
    assert _supervised_text(tiny_tokenizer, doc) == ["first answer<|im_end|>\n", "second answer<|im_end|>\n"]


def test_turns_rendered_differently_alone_are_not_supervised(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = LAST_TURN_DIFFERS
    doc = _render_record({"messages": CONVERSATION}, tok, "x.jsonl:1")
    # the first answer rendered alone gains <think></think>: its span would have run into the next user turn
    assert _supervised_text(tok, doc) == ["<think></think>second answer<|im_end|>\n"]


def test_a_record_without_a_consistent_turn_is_bad(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    with pytest.raises(BadRecordError, match="x.jsonl:1: the chat template renders no assistant turn"):
        _render_record({"messages": CONVERSATION[:2]}, tok, "x.jsonl:1")


def test_jsonl_eval_prompts_come_from_records_kept_out_of_training(tmp_path, tiny_tokenizer):
    import json

    from omegaconf import OmegaConf

    from dflash.data.batches import build_batches
    from dflash.data.prompts import heldout_prompts

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"this is record {r}\n" * 12}) + "\n" for r in range(20)))
    data = OmegaConf.create(
        {
            "name": "jsonl",
            "path": str(path),
            "on_bad_record": "fail",
            "holdout_fraction": 0.1,
            "min_supervised_tokens": 1,
        }
    )
    train = OmegaConf.create({"seq_len": 16, "batch_size": 1, "seed": 0})
    batches, _ = build_batches(data, train, tiny_tokenizer, block_size=4)
    trained = tiny_tokenizer.decode(batches.windows.flatten().tolist())
    assert "record 0\n" in trained and "record 18" not in trained and "record 19" not in trained
    prompts = [tiny_tokenizer.decode(p) for p in heldout_prompts(tiny_tokenizer, data, num_prompts=4, prompt_len=12)]
    assert len(prompts) == 4
    assert all("record 18\n" in p or "record 19\n" in p for p in prompts), prompts


def test_pack_joins_documents_with_one_eos():
    from dflash.data.batches import pack
    from dflash.data.corpus import Document

    eos = 0
    ids, mask = pack([Document([5, 6], [False, True]), Document([7, eos], [True, True]), Document([8], [False])], eos)
    assert ids.tolist() == [5, 6, eos, 7, eos, 8, eos]  # the second document's own EOS is not doubled
    assert mask.tolist() == [False, True, True, True, True, False, False]


def test_bad_records_are_counted_or_fail_with_file_and_line(tmp_path, tiny_tokenizer):
    """Empty assistant turns, records with nothing to supervise and bytes that are not UTF-8: skipped and
    counted with data.on_bad_record=skip, the first one named by file:line with fail."""
    import json

    import pytest

    from dflash.data.corpus import BadRecordError, read_jsonl

    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    empty_turn = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]})
    empty_text = json.dumps({"text": ""})
    data = tmp_path / "data.jsonl"
    data.write_bytes(
        b"\n".join([good.encode(), empty_turn.encode(), empty_text.encode(), b'{"text": "caf\xe9"}', good.encode()])
        + b"\n"
    )
    docs, skipped = read_jsonl(str(data), tiny_tokenizer, "skip")
    assert len(docs) == 2 and skipped == 3
    with pytest.raises(BadRecordError, match=rf"{data}:2: assistant message 1 is empty"):
        read_jsonl(str(data), tiny_tokenizer, "fail")
    data.write_bytes(b"\n".join([good.encode(), b'{"text": "caf\xe9"}']) + b"\n")
    with pytest.raises(BadRecordError, match=rf"{data}:2: not UTF-8"):
        read_jsonl(str(data), tiny_tokenizer, "fail")
    data.write_text(good + "\n" + empty_text + "\n")
    with pytest.raises(BadRecordError, match=rf"{data}:2: 'text' is empty"):
        read_jsonl(str(data), tiny_tokenizer, "fail")
