"""data=jsonl: assistant masks from character spans, the `datasets` cache, bad records, eval prompts."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from dflash.data.chat import end_of_turn_marker, render_record
from dflash.data.corpus import BadRecordError

QWEN3_STYLE = (Path(__file__).parent / "data" / "qwen3_style.jinja").read_text()

# answers that start with indentation or newlines: BPE merges them with the generation prompt's newline
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "    x = 1\n    y = 2"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "\n\nsecond answer"},
    {"role": "user", "content": "third"},
    {"role": "assistant", "content": "<think>let me see</think>\n\nthird answer"},
]


def _render(tokenizer, record, **template_kwargs):
    return render_record(
        record, tokenizer, "x.jsonl:1", end_of_turn_marker(tokenizer, **template_kwargs), **template_kwargs
    )


def _expected_mask(tokenizer, text: str, spans: list[str]) -> list[bool]:
    """Hand-computed: the tokens whose characters overlap the given substrings of `text` (in order)."""
    char_spans, at = [], 0
    for s in spans:
        start = text.index(s, at)
        char_spans.append((start, start + len(s)))
        at = start + len(s)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [any(a < e and b > s for s, e in char_spans) for a, b in enc["offset_mapping"]]


def test_assistant_masks_of_the_tiny_template_match_hand_computed_spans(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    doc = _render(tiny_tokenizer, {"messages": CONVERSATION})
    spans = [
        "    x = 1\n    y = 2<|im_end|>",
        "\n\nsecond answer<|im_end|>",
        "<think>let me see</think>\n\nthird answer<|im_end|>",
    ]
    assert doc.ids == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert doc.loss_mask == _expected_mask(tiny_tokenizer, text, spans)
    # the generation prompt's newline merged into the answer's first token: that token is supervised
    first = doc.answer_starts[0]
    assert tiny_tokenizer.decode(doc.ids[first]).startswith("\n") and doc.loss_mask[first]
    assert len(doc.answer_starts) == 3


def test_assistant_masks_of_a_qwen3_style_template_with_think_blocks(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = QWEN3_STYLE
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    # earlier turns lose their reasoning; the last one keeps it in a think block
    assert "<|im_start|>assistant\n<think>\nlet me see\n</think>\n\nthird answer<|im_end|>" in text
    doc = _render(tok, {"messages": CONVERSATION})
    spans = [
        "    x = 1\n    y = 2<|im_end|>",
        "\n\nsecond answer<|im_end|>",
        "<think>\nlet me see\n</think>\n\nthird answer<|im_end|>",
    ]
    assert doc.loss_mask == _expected_mask(tok, text, spans)
    # a last turn without reasoning gets an empty think block: supervised too (the model writes it)
    short = CONVERSATION[:3]
    text = tok.apply_chat_template(short, tokenize=False)
    doc = _render(tok, {"messages": short})
    assert doc.loss_mask == _expected_mask(tok, text, ["<think>\n\n</think>\n\n    x = 1\n    y = 2<|im_end|>"])


def test_no_valid_conversation_is_skipped(tiny_tokenizer):
    """Random multi-turn conversations whose answers start with indentation, newlines or text: every assistant
    turn of every record gets supervised tokens, under both templates."""
    rng = random.Random(0)
    qwen = copy.deepcopy(tiny_tokenizer)
    qwen.chat_template = QWEN3_STYLE
    for tok in (tiny_tokenizer, qwen):
        for i in range(150):
            msgs = []
            for t in range(rng.randint(1, 4)):
                msgs.append({"role": "user", "content": f"q{i}.{t}" + " why?" * rng.randint(0, 3)})
                lead = rng.choice(["", "    ", "\n", "\n\n  ", "\t", " "])
                msgs.append({"role": "assistant", "content": lead + f"def f{t}(x):\n    return x + {i}\n"})
            doc = _render(tok, {"messages": msgs})
            assert len(doc.answer_starts) == len(msgs) // 2
            spans = np.split(np.asarray(doc.loss_mask), doc.answer_starts[1:])
            assert all(s.any() for s in spans)


def test_sharegpt_records_render_like_messages(tiny_tokenizer):
    messages = CONVERSATION[1:3]
    sharegpt = [{"from": "human", "value": messages[0]["content"]}, {"from": "gpt", "value": messages[1]["content"]}]
    a = _render(tiny_tokenizer, {"messages": messages})
    b = _render(tiny_tokenizer, {"conversations": sharegpt})
    assert (a.ids, a.loss_mask) == (b.ids, b.loss_mask)
    with pytest.raises(BadRecordError, match="x.jsonl:1: unknown speaker"):
        _render(tiny_tokenizer, {"conversations": [{"from": "narrator", "value": "once"}, *sharegpt]})


def _data_cfg(path, **kw):
    from dflash.core.config import DataConfig

    return OmegaConf.merge(OmegaConf.structured(DataConfig(name="jsonl", path=str(path))), kw)


def _load(cfg, tokenizer, target, cache):
    from dflash.data import chat_dataset
    from dflash.data.fingerprint import data_fingerprint

    chat_dataset._loaded.clear()  # each call renders or reads the cache, as a new process would
    return chat_dataset.load_chat_data(cfg, tokenizer, data_fingerprint(cfg, str(target)), str(cache))


def test_bad_records_are_counted_or_fail_with_file_and_line(tmp_path, tiny_tokenizer, tiny_target):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    empty_turn = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]})
    empty_text = json.dumps({"text": ""})
    data = tmp_path / "data.jsonl"
    lines = [good.encode(), empty_turn.encode(), empty_text.encode(), b'{"text": "caf\xe9"}', good.encode()]
    data.write_bytes(b"\n".join(lines) + b"\n")
    chat = _load(_data_cfg(data, on_bad_record="skip"), tiny_tokenizer, tiny_target, tmp_path / "c")
    assert chat.skipped == 3 and chat.train_rows.size + chat.heldout_rows.size == 2
    assert chat.skipped_by_reason == {"no_assistant_turn": 1, "empty_text": 1, "not_utf8": 1}
    with pytest.raises(BadRecordError, match=rf"{data}:2: no assistant turn to supervise \[no_assistant_turn\]"):
        _load(_data_cfg(data), tiny_tokenizer, tiny_target, tmp_path / "c")
    data.write_bytes(b"\n".join([good.encode(), b'{"text": "caf\xe9"}']) + b"\n")
    with pytest.raises(BadRecordError, match=rf"{data}:2: not UTF-8"):
        _load(_data_cfg(data), tiny_tokenizer, tiny_target, tmp_path / "c")
    data.write_text(good + "\n" + empty_text + "\n")
    with pytest.raises(BadRecordError, match=rf"{data}:2: 'text' is empty"):
        _load(_data_cfg(data), tiny_tokenizer, tiny_target, tmp_path / "c")


@pytest.mark.parametrize("layout", ["jsonl", "json array"])
def test_bytes_that_are_not_utf8_are_one_counted_reason_in_either_layout(tmp_path, tiny_tokenizer, tiny_target, layout):
    """The same record with a byte that is not UTF-8: refused as not_utf8 (skip: counted) from a JSONL line and
    from a .json array alike, never trained on as U+FFFD; the records around it are read whole."""
    records = [json.dumps({"text": f"record {r} " * 4}).encode() for r in range(4)]
    records[1] = b'{"text": "caf\xe9 au lait"}'
    if layout == "jsonl":
        data = tmp_path / "data.jsonl"
        data.write_bytes(b"\n".join(records) + b"\n")
    else:
        data = tmp_path / "data.json"
        data.write_bytes(b"[\n" + b",\n".join(records) + b"\n]\n")
    chat = _load(_data_cfg(data, on_bad_record="skip", holdout_fraction=0.0), tiny_tokenizer, tiny_target, tmp_path)
    assert chat.skipped_by_reason == {"not_utf8": 1}
    kept = [tiny_tokenizer.decode(ids) for ids in chat.rows(chat.train_rows)[0]]
    assert len(kept) == 3 and not any("\ufffd" in text or "caf" in text for text in kept)
    where = f"{data}:2" if layout == "jsonl" else f"{data}:record 2"
    with pytest.raises(BadRecordError, match=rf"{where}: not UTF-8 \(invalid continuation byte at byte 13 of"):
        _load(_data_cfg(data), tiny_tokenizer, tiny_target, tmp_path)


def test_the_rendered_records_are_cached_and_rerendered_when_the_file_changes(
    tmp_path, tiny_tokenizer, tiny_target, monkeypatch
):
    from dflash.data import chat_dataset

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {r}\n" * 3}) + "\n" for r in range(30)))
    cfg = _data_cfg(data)
    first = _load(cfg, tiny_tokenizer, tiny_target, tmp_path / "c")

    def no_render(*args, **kwargs):
        raise AssertionError("rendered again")

    monkeypatch.setattr(chat_dataset, "_render_batch", no_render)
    again = _load(cfg, tiny_tokenizer, tiny_target, tmp_path / "c")  # from the Arrow cache
    assert again.key == first.key and again.lengths.tolist() == first.lengths.tolist()
    data.write_text("".join(json.dumps({"text": f"changed {r}\n"}) + "\n" for r in range(30)))
    with pytest.raises(AssertionError, match="rendered again"):
        _load(cfg, tiny_tokenizer, tiny_target, tmp_path / "c")


def test_jsonl_eval_prompts_come_from_records_kept_out_of_training(tmp_path, tiny_tokenizer, tiny_target):
    from dflash.data.prompts import heldout_prompts
    from dflash.data.training_data import build_training_data

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"this is record {r}\n" * 12}) + "\n" for r in range(20)))
    data = _data_cfg(path, holdout_fraction=0.1)
    train = OmegaConf.create({"seq_len": 16, "batch_size": 1, "seed": 0})
    td = build_training_data(data, train, tiny_tokenizer, 4, target_path=str(tiny_target), cache_dir=str(tmp_path))
    seen = set()
    for batch, _ in zip(td.batches.iterate(), range(len(td.batches))):
        seen.add(tiny_tokenizer.decode(batch.input_ids[0, : int(batch.lengths[0])].tolist()))
    assert any("record 0\n" in s for s in seen) and not any("record 18" in s or "record 19" in s for s in seen)
    prompts = heldout_prompts(tiny_tokenizer, data, 4, 12, chat=td.chat)
    assert len(prompts) == 4
    assert all("record 18\n" in tiny_tokenizer.decode(p) or "record 19\n" in tiny_tokenizer.decode(p) for p in prompts)


def test_chat_eval_prompts_end_where_an_answer_starts(tmp_path, tiny_tokenizer, tiny_target):
    from dflash.data.prompts import heldout_prompts

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": CONVERSATION[1:5]}) + "\n" for _ in range(10)))
    data = _data_cfg(path, holdout_fraction=0.3)
    prompts = heldout_prompts(tiny_tokenizer, data, 3, 16, target=str(tiny_target), cache_dir=str(tmp_path))
    assert len(prompts) == 3
    assert all(tiny_tokenizer.decode(p).rstrip("\n").endswith("<|im_start|>assistant") for p in prompts)


def test_pack_joins_documents_with_one_eos():
    from dflash.data.batches import pack
    from dflash.data.corpus import Document

    eos = 0
    ids, mask = pack([Document([5, 6], [False, True]), Document([7, eos], [True, True]), Document([8], [False])], eos)
    assert ids.tolist() == [5, 6, eos, 7, eos, 8, eos]  # the second document's own EOS is not doubled
    assert mask.tolist() == [False, True, True, True, True, False, False]
