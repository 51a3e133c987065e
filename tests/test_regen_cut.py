"""An answer that regeneration cut at max_new_tokens was not ended by the target: its record says so
(`"finish_reason": "length"`) and training leaves the end-of-turn marker the chat template adds after it
unsupervised (the target never wrote it there), while an answer the target ended keeps it supervised."""

from __future__ import annotations

from types import SimpleNamespace


def _supervised(tokenizer, record: dict) -> tuple[list[int], list[list[int]]]:
    """The record's supervised token ids, and each assistant turn's token ids as rendered (content + marker)."""
    from dflash.data.chat import end_of_turn_marker, render_record

    rendered = render_record(record, tokenizer, "test", end_of_turn_marker(tokenizer))
    return [t for t, m in zip(rendered.ids, rendered.loss_mask) if m], rendered


def test_hf_backend_marks_a_cut_answer_and_its_end_of_turn_is_not_supervised(tiny_target, tiny_tokenizer):
    from dflash.data.chat import end_of_turn_marker
    from dflash.recipes.regen_backends import GenerationSettings, HFBackend
    from dflash.recipes.regenerate import regenerate_record_turns

    # the tiny random target never ends a turn within 4 tokens: every answer is cut
    backend = HFBackend(str(tiny_target), GenerationSettings(max_new_tokens=4), device="cpu", dtype="float32")
    records = [
        {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "old answer"}]}
        for i in range(6)
    ]
    results = [r for r in regenerate_record_turns(backend, records) if not isinstance(r, BaseException)]
    assert results, "the tiny target should answer some of the questions"
    eot_id = tiny_tokenizer.convert_tokens_to_ids(end_of_turn_marker(tiny_tokenizer))
    for record in results:
        answer = record["messages"][-1]
        assert answer.get("finish_reason") == "length", answer
        supervised, rendered = _supervised(tiny_tokenizer, record)
        assert eot_id not in supervised
        assert rendered.ids[rendered.answer_ends[0]] == eot_id  # rendered, right after the answer, unsupervised


def test_only_a_cut_turns_end_of_turn_is_left_unsupervised(tiny_tokenizer):
    """Two answers, the first cut: its marker unsupervised, the second's supervised; the template renders the
    same text with or without the mark; merged consecutive turns end as their last part does."""
    from dflash.data.chat import end_of_turn_marker, render_template

    eot_id = tiny_tokenizer.convert_tokens_to_ids(end_of_turn_marker(tiny_tokenizer))
    turns = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "cut short", "finish_reason": "length"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "done", "finish_reason": "stop"},
    ]
    supervised, rendered = _supervised(tiny_tokenizer, {"messages": turns})
    first_end, second_end = rendered.answer_ends
    assert rendered.ids[first_end] == eot_id and not rendered.loss_mask[first_end]
    assert rendered.ids[second_end - 1] == eot_id and rendered.loss_mask[second_end - 1]
    assert supervised.count(eot_id) == 1
    plain = [{"role": m["role"], "content": m["content"]} for m in turns]
    assert render_template(tiny_tokenizer, turns, False) == render_template(tiny_tokenizer, plain, False)
    _, unmarked = _supervised(tiny_tokenizer, {"messages": plain})
    assert unmarked.ids == rendered.ids and unmarked.loss_mask[first_end]  # before: the invented marker supervised

    a, b = {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}
    cut = {"finish_reason": "length"}
    cut_last, ended_last = [turns[0], a, {**b, **cut}], [turns[0], {**a, **cut}, b]
    assert eot_id not in _supervised(tiny_tokenizer, {"messages": cut_last})[0]
    supervised, _ = _supervised(tiny_tokenizer, {"messages": ended_last})
    assert supervised[-1] == eot_id


def test_openai_backend_marks_a_length_finish_and_sends_plain_messages():
    from dflash.recipes.regen_backends import GenerationSettings, OpenAIBackend

    sent = []

    def create(**kwargs):
        sent.append(kwargs["messages"])
        finish = "length" if len(sent) == 1 else "stop"
        message = SimpleNamespace(content="an answer", model_extra={})
        return SimpleNamespace(choices=[SimpleNamespace(finish_reason=finish, message=message)])

    backend = OpenAIBackend.__new__(OpenAIBackend)  # no server: the client is a stand-in
    backend.settings, backend.name, backend.concurrency = GenerationSettings(), "served", 1
    backend.client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    earlier = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "finish_reason": "length"},
        {"role": "user", "content": "q2"},
    ]
    first, second = backend.complete([earlier[:1], earlier])
    assert (first, first.cut, second, second.cut) == ("an answer", True, "an answer", False)
    assert all(set(m) == {"role", "content"} for conversation in sent for m in conversation)
