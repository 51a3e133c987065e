"""`python -m dflash.regenerate` resumes only with the target and settings OUT's answers were made with: a
rebuilt or other target must not add its answers to a file of another's."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest


class _Backend:
    name = "fake"

    def __init__(self, target: str, max_new_tokens: int = 12):
        self.target, self.max_new_tokens, self.asked = target, max_new_tokens, 0

    def identity(self) -> dict:
        return {"backend": "fake", "target": self.target, "max_new_tokens": self.max_new_tokens}

    def complete(self, conversations):
        self.asked += len(conversations)
        return [f"{self.target} answers" for _ in conversations]


def _input(tmp_path, n: int = 6):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(_record(i) for i in range(n)))
    return inp


def test_a_resume_with_another_target_is_refused_naming_both(tmp_path):
    from dflash.recipes.regenerate import regenerate_file, settings_path

    inp, out = _input(tmp_path), tmp_path / "out.jsonl"
    regenerate_file(inp, out, _Backend("chat-v1"), chunk_size=2)
    with open(out) as f:  # a kill after 2 of 6 answers
        kept = f.readlines()[:2]
    out.write_text("".join(kept))
    assert json.loads(settings_path(out).read_text())["target"] == "chat-v1"

    other = _Backend("chat-v2")
    with pytest.raises(
        ValueError, match=r"2 answers made with other settings \(target: OUT 'chat-v1' vs now 'chat-v2'\)"
    ):
        regenerate_file(inp, out, other, chunk_size=2)
    assert other.asked == 0 and len(out.read_text().splitlines()) == 2  # nothing asked, nothing written

    longer = _Backend("chat-v1", max_new_tokens=64)
    with pytest.raises(ValueError, match="max_new_tokens: OUT 12 vs now 64"):
        regenerate_file(inp, out, longer, chunk_size=2)

    same = _Backend("chat-v1")
    outcome = regenerate_file(inp, out, same, chunk_size=2)  # the same settings resume
    assert (outcome.done_before, outcome.completed, same.asked) == (2, 4, 4)
    assert all(json.loads(line)["messages"][1]["content"] == "chat-v1 answers" for line in out.read_text().splitlines())


def test_a_resume_from_another_input_is_refused_naming_both(tmp_path):
    """The issue's case: a.jsonl into OUT, cut after 2 answers, then b.jsonl into the same OUT must not give
    A0, A1, B2, B3; the same records moved elsewhere are the same input and resume."""
    from dflash.recipes.regenerate import regenerate_file, settings_path

    a, out = _input(tmp_path), tmp_path / "out.jsonl"
    b = tmp_path / "b.jsonl"
    b.write_text(a.read_text().replace('"q', '"other q'))
    regenerate_file(a, out, _Backend("chat-v1"), chunk_size=2)
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))  # a kill after 2 of 6 answers

    backend = _Backend("chat-v1")
    a_is, b_is = (re.escape(str(p.resolve())) + r" \(\d+ bytes, sha256 \w+\)" for p in (a, b))
    with pytest.raises(ValueError, match=rf"2 answers made with other settings \(input: OUT {a_is} vs now {b_is}\)"):
        regenerate_file(b, out, backend, chunk_size=2)
    assert backend.asked == 0 and len(out.read_text().splitlines()) == 2  # nothing asked, nothing written
    assert json.loads(settings_path(out).read_text())["input"]["path"] == str(a.resolve())

    moved = tmp_path / "moved" / "a.jsonl"
    moved.parent.mkdir()
    a.rename(moved)
    outcome = regenerate_file(moved, out, backend, chunk_size=2)
    assert (outcome.done_before, outcome.completed) == (2, 4)
    assert [json.loads(line)["source_index"] for line in out.read_text().splitlines()] == list(range(6))


def test_an_input_grown_by_more_records_keeps_the_answers_made(tmp_path):
    """`make real REAL_RECORDS=1200` after 400: the first 400 prompts are the same records, so their answers are
    kept and only the new ones are asked; the same prompts in another order are refused (source_index would lie)."""
    from dflash.recipes.regenerate import regenerate_file

    out = tmp_path / "out.jsonl"
    regenerate_file(_input(tmp_path, 4), out, _Backend("chat-v1"), chunk_size=2)
    grown, backend = _input(tmp_path, 7), _Backend("chat-v1")
    outcome = regenerate_file(grown, out, backend, chunk_size=2)
    assert (outcome.done_before, outcome.completed, backend.asked) == (4, 3, 3)
    assert [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()] == [
        f"q{i}" for i in range(7)
    ]

    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(reversed(grown.read_text().splitlines(keepends=True))) + _record(7))
    backend = _Backend("chat-v1")
    with pytest.raises(ValueError, match="7 answers made with other settings \\(input: "):
        regenerate_file(shuffled, out, backend, chunk_size=2)
    assert backend.asked == 0


def _record(i: int) -> str:
    turns = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]
    return json.dumps({"messages": turns}) + "\n"


def test_a_new_output_takes_any_settings(tmp_path):
    from dflash.recipes.regenerate import regenerate_file, settings_path

    inp, out = _input(tmp_path, 2), tmp_path / "out.jsonl"
    settings_path(out).write_text(json.dumps({"backend": "fake", "target": "old"}))  # left from a deleted OUT
    outcome = regenerate_file(inp, out, _Backend("new"), chunk_size=2)
    assert outcome.completed == 2 and json.loads(settings_path(out).read_text())["target"] == "new"


def test_generation_is_bfloat16_where_the_cpu_has_fast_kernels_for_it():
    from dflash.recipes.regen_backends import generation_dtype

    assert generation_dtype("auto", "cpu", {"avx2", "avx512_bf16"}) == "bfloat16"
    assert generation_dtype("auto", "cpu", {"avx2"}) == "float32"
    assert generation_dtype("auto", "cuda") == "bfloat16"
    assert generation_dtype("float32", "cpu", {"avx512_bf16"}) == "float32"
    assert generation_dtype("bfloat16", "cpu", {"avx2"}) == "bfloat16"  # asked for: used (with a warning)


def test_the_hf_backend_names_the_target_files_it_answers_with(tiny_target, tmp_path):
    """A target rebuilt at the same path (other weights) is another target."""
    from dflash.recipes.regen_backends import GenerationSettings, HFBackend

    copy = tmp_path / "target"
    shutil.copytree(tiny_target, copy)
    first = HFBackend(str(copy), GenerationSettings(max_new_tokens=8), device="cpu", dtype="float32").identity()
    assert first["backend"] == "hf" and first["dtype"] == "float32" and first["max_new_tokens"] == 8
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(first["target_files"])
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    second = HFBackend(str(copy), GenerationSettings(max_new_tokens=8), device="cpu", dtype="float32").identity()
    assert second["target_files"]["model.safetensors"] != first["target_files"]["model.safetensors"]
    assert {k: v for k, v in second.items() if k != "target_files"} == {
        k: v for k, v in first.items() if k != "target_files"
    }


class _Busy(_Backend):
    """Spends 20 ms of CPU per batch: a cost that shows in process_time's resolution."""

    def complete(self, conversations):
        t0 = time.process_time()
        while time.process_time() - t0 < 0.02:
            pass
        return super().complete(conversations)


def test_out_cost_json_adds_up_what_the_answers_cost_over_resumes(tmp_path):
    """make real's cost of a run counts the regeneration however many runs made the answers (#46): each resume
    adds its CPU and wall seconds and answers; a new OUT starts a new account."""
    from dflash.recipes.regenerate import cost_path, read_cost, regenerate_file

    inp, out = _input(tmp_path, 6), tmp_path / "out.jsonl"
    assert read_cost(out) == {"cpu_s": 0.0, "wall_s": 0.0, "answers": 0}  # none recorded
    regenerate_file(inp, out, _Busy("chat-v1"), chunk_size=4)
    first = read_cost(out)
    assert first["answers"] == 6 and first["cpu_s"] >= 0.04 and first["wall_s"] >= 0.04
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))  # a kill after 2 of 6 answers
    regenerate_file(inp, out, _Busy("chat-v1"), chunk_size=4)
    resumed = read_cost(out)
    assert resumed["answers"] == 10 and resumed["cpu_s"] >= first["cpu_s"] + 0.02  # what was spent, the lost ones too
    regenerate_file(inp, out, _Busy("chat-v1"), chunk_size=4)  # nothing to do: nothing spent
    assert read_cost(out) == resumed
    out.unlink()
    regenerate_file(inp, out, _Busy("chat-v1"), chunk_size=4)
    assert json.loads(cost_path(out).read_text())["answers"] == 6


class _Built(_Backend):
    """A built or converted target: its files' hashes as HFBackend.identity lists them."""

    def __init__(self, files: dict | None = None):
        super().__init__("built")
        self.files = {"build_info.json": "b1", "config.json": "c1", "model.safetensors": "w1", **(files or {})}

    def identity(self) -> dict:
        return {**super().identity(), "target_files": dict(self.files)}


def test_a_targets_json_rewritten_in_place_by_its_builder_keeps_the_answers(tmp_path, caplog):
    """model/gguf_target.py rewrites a cached conversion's config.json and tokenizer_config.json as a plain
    checkpoint's (the same RoPE in both forms): the 400 answers regenerated before are still this target's. The
    same file hashes otherwise: other weights, another build, or a target without build_info.json."""
    from dflash.recipes.regenerate import regenerate_file

    inp, out = _input(tmp_path, 4), tmp_path / "out.jsonl"
    regenerate_file(inp, out, _Built(), chunk_size=2)
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))  # 2 of 4 made before the rewrite
    with pytest.raises(ValueError, match="target_files"):
        regenerate_file(inp, out, _Built({"model.safetensors": "w2", "config.json": "c2"}), chunk_size=2)
    with pytest.raises(ValueError, match="target_files"):
        regenerate_file(inp, out, _Built({"build_info.json": "b2", "config.json": "c2"}), chunk_size=2)
    rewritten = _Built({"config.json": "c2"})
    outcome = regenerate_file(inp, out, rewritten, chunk_size=2)
    assert (outcome.done_before, outcome.completed, rewritten.asked) == (2, 2, 2)
    assert "the target's config.json changed since its 2 answers were made" in caplog.text

    plain = tmp_path / "plain.jsonl"  # no build_info.json: file for file
    hub = _Built()
    del hub.files["build_info.json"]
    regenerate_file(inp, plain, hub, chunk_size=2)
    plain.write_text(plain.read_text().splitlines(keepends=True)[0])
    hub.files["config.json"] = "c2"
    with pytest.raises(ValueError, match="target_files"):
        regenerate_file(inp, plain, hub, chunk_size=2)
