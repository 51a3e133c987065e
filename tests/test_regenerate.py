"""`python -m dflash.regenerate`: the hf backend in-process, the openai backend against a real OpenAI-compatible
server (`transformers serve` with the tiny target on 127.0.0.1), kill and resume, failed requests counted."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def _conversation(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": "old answer"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "old second answer"},
        ]
    }


def _hf_backend(target: Path, max_new_tokens: int = 12):
    from dflash.recipes.regen_backends import GenerationSettings, HFBackend

    # float32, as the test's server runs the target: on a CPU with fast bf16 kernels `auto` would answer in bf16
    return HFBackend(str(target), GenerationSettings(max_new_tokens=max_new_tokens), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def answered(tiny_target, tmp_path_factory):
    """Conversations the tiny random target answers (it ends some turns at once: an empty reply), with the hf
    backend's regeneration of each: what the server must reproduce at temperature 0."""
    from dflash.recipes.regenerate import regenerate_record_turns

    backend = _hf_backend(tiny_target)
    records = [_conversation(i) for i in range(40)]
    results = regenerate_record_turns(backend, records)
    good = [(r, out) for r, out in zip(records, results) if not isinstance(out, BaseException)]
    empty = [r for r, out in zip(records, results) if isinstance(out, BaseException)]
    assert len(good) >= 20 and empty, "the tiny target should answer most conversations and leave some empty"
    assert all("empty" in str(out) for out in results if isinstance(out, BaseException))
    return good, empty


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_target, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", str(tiny_target), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"transformers serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    yield url + "/v1"
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


def _regenerate(args: list[str], **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "dflash.regenerate", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_openai_backend_resumes_after_a_kill_with_no_record_lost_or_repeated(server, answered, tmp_path):
    good, _ = answered
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r, _ in good[:20]))
    args = [str(inp), str(out), "--backend", "openai", "--base-url", server, "--max-new-tokens", "12"]
    first = _regenerate([*args, "--concurrency", "1", "--chunk-size", "2"])
    deadline = time.monotonic() + 120
    while len(_lines(out)) < 4 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.kill()  # SIGKILL mid-job: no cleanup
    first.wait()
    done_before = len(_lines(out))
    assert 4 <= done_before < 20, first.stdout.read()
    second = _regenerate(args)
    log = second.communicate(timeout=300)[0]
    assert second.returncode == 0, log
    assert f"{done_before} were done before, 0 failed" in log
    records = _lines(out)
    assert [r["source_index"] for r in records] == list(range(20))  # complete, none twice, in IN's order
    for (_, expected), got in zip(good[:20], records):
        # the server's greedy answers are the hf backend's (transformers serve trims the whitespace around them)
        assert [(m["role"], m["content"].strip()) for m in got["messages"]] == [
            (m["role"], m["content"].strip()) for m in expected["messages"]
        ]
    assert not (tmp_path / "out.jsonl.failures.jsonl").exists()


def test_failed_requests_are_counted_and_retried_not_fatal(server, answered, tmp_path):
    good, empty = answered
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    mixed = [r for pair in zip((r for r, _ in good[:6]), empty[:6]) for r in pair] + [{"messages": "not a list"}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    args = [str(inp), str(out), "--backend", "openai", "--base-url", server, "--max-new-tokens", "12"]
    proc = _regenerate(args)
    log = proc.communicate(timeout=300)[0]
    n_empty = min(6, len(empty))
    assert proc.returncode == 0, log
    assert "regenerated 6 records" in log and f"{n_empty + 1} failed" in log
    failures = _lines(tmp_path / "out.jsonl.failures.jsonl")
    assert sorted(f["source_index"] for f in failures) == [*range(1, 2 * n_empty, 2), len(mixed) - 1]
    assert sum("empty reply" in f["error"] for f in failures) == n_empty
    assert any(f["where"].endswith(f":{len(mixed)}") and "'messages' must be" in f["error"] for f in failures)
    again = _regenerate(args)
    log = again.communicate(timeout=300)[0]
    assert again.returncode == 0 and "6 were done before" in log, log  # only the failed ones were asked again
    assert len(_lines(out)) == 6


def test_hf_backend_output_trains_with_data_jsonl(answered, tiny_target, tiny_tokenizer, tmp_path):
    """OUT is what data=jsonl reads: every regenerated record renders, with every assistant turn supervised."""
    from dflash.data.chat import end_of_turn_marker, render_record
    from dflash.recipes.regenerate import regenerate_file

    good, _ = answered
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r, _ in good[:5]))
    outcome = regenerate_file(inp, out, _hf_backend(tiny_target), chunk_size=2)
    assert (outcome.completed, outcome.failed) == (5, 0)
    eot = end_of_turn_marker(tiny_tokenizer)
    for i, record in enumerate(_lines(out)):
        assert record["messages"] == good[i][1]["messages"]
        rendered = render_record(record, tiny_tokenizer, f"out:{i}", eot)
        assert len(rendered.answer_starts) == 2 and any(rendered.loss_mask)


def test_hf_backend_fails_only_the_records_its_template_rejects(answered, tiny_target, tmp_path):
    """ShareGPT's quirks through the hf backend, from a .json array: a leading assistant turn is context (the
    template here rejects it: that record fails alone, as template_rejects), an empty conversation and a lone
    gpt turn fail with training's reasons, the rest are regenerated."""
    from dflash.recipes.regenerate import failures_path, regenerate_file

    backend = _hf_backend(tiny_target)
    backend.tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('must start with user') }}{% endif %}"
        + backend.tokenizer.chat_template
    )
    good, _ = answered
    turns = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in good[0][0]["messages"]]
    records = [
        {"conversations": turns},
        {"conversations": []},
        {"conversations": [{"from": "gpt", "value": "lead"}, *turns]},
        {"conversations": [{"from": "gpt", "value": "alone"}]},
        {"conversations": [{"from": "system", "value": "shared"}, *turns]},
    ]
    inp, out = tmp_path / "in.json", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(records))
    outcome = regenerate_file(inp, out, backend, chunk_size=8)
    assert outcome.completed == 2
    assert outcome.failed_by_reason == {"empty_conversation": 1, "no_user_turn": 1, "template_rejects": 1}
    failed = {f["where"].rsplit(":", 1)[1]: f["reason"] for f in _lines(failures_path(out))}
    assert failed == {"record 2": "empty_conversation", "record 3": "template_rejects", "record 4": "no_user_turn"}
    assert [r["source_index"] for r in _lines(out)] == [0, 4]


def test_failures_are_counted_by_their_type_not_by_words_in_their_text():
    """A connection error that mentions a template or an empty body is a failed request; the backends' own
    refusals (and a bad record's) carry their reason whatever their message says."""
    from dflash.data.corpus import BadRecordError
    from dflash.recipes.regen_backends import EmptyReply, TemplateRejects
    from dflash.recipes.regenerate import reason

    assert reason(ConnectionError("upstream sent an empty body while rendering the template")) == "request_failed"
    assert reason(TemplateRejects("the chat template rejects the conversation (must start with user)")) == (
        "template_rejects"
    )
    assert reason(EmptyReply("no text came back")) == "empty_reply"
    assert reason(BadRecordError("in.jsonl:4: a gpt turn alone", "no_user_turn")) == "no_user_turn"
