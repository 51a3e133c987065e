"""eval.replay: tau by replay of greedy verification over cached target traces (dflash/evaluation/replay.py) gives
the accepted lengths full speculative decoding gives, cycle for cycle, including the last cycle past the limit and
a stop token's cycle; the traces are computed once and reused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash.evaluation import decoding
from dflash.evaluation.decoding import prompt_lookup_generate, speculative_generate
from dflash.evaluation.replay import (
    TraceCache,
    output_tokens,
    replay_drafter,
    replay_evaluate,
    replay_lookup,
    target_identity,
    trace_prompt,
)
from tests.conftest import biased_target_and_drafter

B = 4
N = 30


@pytest.fixture(scope="module")
def setup(tiny_dir):
    """A random tiny target whose greedy output often is token 0 (so drafts are often accepted), a drafter that
    always drafts token 0 (its final norm is zero) and one whose drafts depend on the features it reads."""
    from dflash.model.drafter import DFlashDraftModel

    target, zero, tok = biased_target_and_drafter(tiny_dir, B)
    g = torch.Generator().manual_seed(3)  # a seed whose drafts vary (the test checks that they do)
    reading = DFlashDraftModel(zero.config).eval()
    with torch.no_grad():  # weights large enough that the drafts follow the context
        for p in reading.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    texts = ("def foo(x):\n    return x + 1\n", "import os\nimport sys\nimport os\n", "class A:\n    pass\n")
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return target, zero, reading, prompts


def _trace(target, drafter, prompt):
    return trace_prompt(target, prompt, N, B, drafter.target_layer_ids)


@pytest.mark.parametrize("eos_from_output", [False, True])
def test_replay_gives_full_decodings_accepted_lengths(setup, eos_from_output):
    target, zero, _, prompts = setup
    seen_lengths = set()
    for prompt in prompts:
        trace = _trace(target, zero, prompt)
        assert trace.ties == 0
        # a stop token that the greedy output reaches mid-way: the loop ends after the cycle that emits it
        eos = trace.continuation[N // 2] if eos_from_output else None
        stop = frozenset() if eos is None else frozenset({eos})
        with torch.no_grad():
            real = speculative_generate(target, zero, prompt, max_new_tokens=N, block_size=B, eos_id=eos)
        assert replay_drafter(zero, target, trace, N, B, stop) == real.accept_lengths
        assert output_tokens(trace, N, stop) == real.tokens
        seen_lengths |= set(real.accept_lengths)
    assert seen_lengths - {1}, "a trivial case: no cycle accepted a draft"


def test_replay_drafts_what_decoding_drafts_from_the_same_features(setup, monkeypatch):
    """A drafter that reads its features: the replayed blocks propose, cycle for cycle, the tokens decoding's
    proposer proposed (so the context features and positions are the ones decoding hands over)."""
    target, _, reading, prompts = setup
    proposed: list[list[int]] = []
    real_propose = decoding.DFlashProposer.propose

    def recording(self, seq, new_features, num_draft):
        drafts = real_propose(self, seq, new_features, num_draft)
        proposed.append(list(drafts))
        return drafts

    monkeypatch.setattr(decoding.DFlashProposer, "propose", recording)
    for prompt in prompts:
        proposed.clear()
        with torch.no_grad():
            real = speculative_generate(target, reading, prompt, max_new_tokens=N, block_size=B)
        replayed: list[list[int]] = []
        lengths = replay_drafter(reading, target, _trace(target, reading, prompt), N, B, frozenset(), replayed)
        assert lengths == real.accept_lengths and replayed == proposed
        assert len({tuple(d) for d in proposed}) > 1  # the drafts vary with the context


def _family_drafter(target, zero, name: str, **settings):
    """A drafter of family `name` in the zero drafter's shape, its weights random and large enough that its drafts
    follow the context and that its own rule (DSpark's Markov bias, DFlash2's transition scores) changes them; its
    final norm passes only the channel where the target's LM head favours token 0 most, so that it often drafts
    the biased target's favourite token and cycles accept drafts."""
    import copy

    from dflash.core.config import DrafterConfig
    from dflash.model.families import configure_family, drafter_class

    config = copy.deepcopy(zero.config)
    configure_family(config, DrafterConfig(name=name, markov_rank=8, selector_rank=8, selector_top_k=4, **settings))
    drafter = drafter_class(config)(config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        head = target.get_output_embeddings().weight
        drafter.norm.weight.zero_()
        drafter.norm.weight[int((head[0] - head[1:].amax(0)).argmax())] = 2.0
    return drafter


FAMILIES = {
    "dspark": dict(markov_head_type="rnn"),
    "dspark-dflash-block": dict(markov_head_type="gated", sample_from_anchor=False),
    "dflash2": {},
}


def _record_proposals(monkeypatch) -> tuple[list, list]:
    """What decoding's proposer proposes per cycle: its drafts and its confidence head's predictions."""
    drafts, confidences = [], []
    real_propose = decoding.DFlashProposer.propose

    def recording(self, seq, new_features, num_draft):
        out = real_propose(self, seq, new_features, num_draft)
        drafts.append(list(out))
        if self.confidences is not None:
            confidences.append(self.confidences[-1])
        return out

    monkeypatch.setattr(decoding.DFlashProposer, "propose", recording)
    return drafts, confidences


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_drafts_by_each_familys_own_rule_as_decoding_does(setup, monkeypatch, family):
    """DSpark (its Markov head choosing inside the block, from the anchor's slot or DFlash's block) and DFlash2 (its
    convolutions and selector): replay proposes, cycle for cycle, what decoding's proposer proposed, so it accepts
    the same lengths; a confidence head's predictions are decoding's up to float round-off."""
    target, zero, _, prompts = setup
    drafter = _family_drafter(target, zero, family.split("-")[0], **FAMILIES[family])
    proposed, predicted = _record_proposals(monkeypatch)
    seen_lengths = set()
    for prompt in prompts:
        proposed.clear()
        predicted.clear()
        with torch.no_grad():
            real = speculative_generate(target, drafter, prompt, max_new_tokens=N, block_size=B)
        trace = _trace(target, drafter, prompt)
        replayed, confidences = [], []
        lengths = replay_drafter(drafter, target, trace, N, B, frozenset(), replayed, confidences)
        assert lengths == real.accept_lengths and replayed == proposed
        assert len({tuple(d) for d in proposed}) > 1  # the drafts vary with the context
        if family.startswith("dspark"):
            assert len(confidences) == len(predicted) == real.cycles
            assert confidences == [pytest.approx(c, abs=1e-5) for c in predicted]  # one forward vs a KV cache
        seen_lengths |= set(real.accept_lengths)
        # the family's rule matters here: the argmax per slot (what replay drafted before) proposes otherwise
        argmax_drafts: list[list[int]] = []
        with monkeypatch.context() as m:
            m.setattr(drafter, "choose_drafts", None)
            replay_drafter(drafter, target, trace, N, B, frozenset(), argmax_drafts)
        assert argmax_drafts != replayed
    assert seen_lengths - {1}, "a trivial case: no cycle accepted a draft"


def test_a_familys_replay_reuses_the_traces_and_reports_decodings_tau_and_calibration(setup, tmp_path, tiny_dir):
    """Jobs of a sweep over families share the traces (the target's side does not depend on the family); a DSpark
    job's replayed tau equals full decoding's and its confidence calibration is decoding's up to round-off."""
    from dflash.evaluation.evaluator import evaluate

    target, zero, _, prompts = setup
    settings = {"max_new_tokens": N, "block_size": B, "layer_ids": zero.target_layer_ids, "dtype": "float32"}
    first = TraceCache(tmp_path / "replay", target_identity(str(tiny_dir)), settings)
    replay_evaluate(target, zero, prompts, first, max_new_tokens=N, block_size=B, baselines=False)
    drafter = _family_drafter(target, zero, "dspark", markov_head_type="rnn")
    again = TraceCache(tmp_path / "replay", target_identity(str(tiny_dir)), settings)
    replayed = replay_evaluate(target, drafter, prompts, again, max_new_tokens=N, block_size=B, baselines=False)
    assert (again.misses, again.hits) == (0, len(prompts))
    decoded = evaluate(target, drafter, prompts, max_new_tokens=N, block_size=B, baselines=False, warmup=False)
    assert [r["accept_lengths"] for r in replayed["details"]["prompts"]] == [
        r["accept_lengths"] for r in decoded["details"]["prompts"]
    ]
    assert replayed["eval/tau"] == decoded["eval/tau"]
    assert replayed["eval/tau_ci95_low"] == decoded["eval/tau_ci95_low"]  # the same lengths, the same interval
    calibration = {k: v for k, v in decoded.items() if k.startswith("eval/conf_")}
    assert "eval/conf_error" in calibration
    assert {k: replayed[k] for k in calibration} == pytest.approx(calibration, abs=1e-5)


def test_lookup_replay_gives_prompt_lookups_accepted_lengths(setup):
    target, zero, _, prompts = setup
    for prompt in prompts:
        with torch.no_grad():
            real = prompt_lookup_generate(target, prompt, N, B, ngram=3)
        assert replay_lookup(_trace(target, zero, prompt), N, B, 3, frozenset()) == real.accept_lengths


def test_traces_are_cached_by_target_and_settings(setup, tmp_path, tiny_dir):
    target, zero, _, prompts = setup
    settings = {"max_new_tokens": N, "block_size": B, "layer_ids": zero.target_layer_ids, "dtype": "float32"}
    cache = TraceCache(tmp_path / "replay", target_identity(str(tiny_dir)), settings)
    first = replay_evaluate(target, zero, prompts, cache, max_new_tokens=N, block_size=B, untrained_drafter=zero)
    assert (cache.misses, cache.hits) == (len(prompts), 0)
    again = TraceCache(tmp_path / "replay", target_identity(str(tiny_dir)), settings)
    second = replay_evaluate(target, zero, prompts, again, max_new_tokens=N, block_size=B, untrained_drafter=zero)
    assert (again.misses, again.hits) == (0, len(prompts))
    assert first["details"] == second["details"] and first["eval/tau"] == second["eval/tau"]
    assert first["eval/tau_untrained"] == first["eval/tau"] and first["eval/replay_ties"] == 0
    with torch.no_grad():
        real = [speculative_generate(target, zero, p, max_new_tokens=N, block_size=B).accept_lengths for p in prompts]
    lengths = [x for r in real for x in r]
    assert first["eval/tau"] == pytest.approx(sum(lengths) / len(lengths))
    other = TraceCache(tmp_path / "replay", target_identity(str(tiny_dir)), {**settings, "max_new_tokens": N + 1})
    assert other.path(prompts[0]) != cache.path(prompts[0])  # other decode settings: other traces


def test_a_suites_turns_replay_as_they_decode(setup, tmp_path, tiny_dir):
    """Two-turn conversations: the second turn's prompt holds the first turn's answer, as decoded."""
    from transformers import AutoTokenizer

    from dflash.evaluation.benchmark import run_suite

    target, zero, _, _ = setup
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    convs = [["def add(a, b):", "now subtract"], ["import os", "and sys"]]
    settings = {"max_new_tokens": N, "block_size": B, "layer_ids": zero.target_layer_ids, "dtype": "float32"}
    cache = TraceCache(tmp_path / "replay", target_identity(str(tiny_dir)), settings)
    common = dict(temperature=0.0, thinking=None, max_new_tokens=N, block_size=B)
    with torch.no_grad():
        decoded = run_suite(target, zero, tok, convs, **common)
    replayed = run_suite(target, zero, tok, convs, **common, trace_cache=cache)
    for key in ("prompt_ids", "tokens", "accept_lengths", "lookup_accept_lengths"):
        assert [g[key] for g in replayed["generations"]] == [g[key] for g in decoded["generations"]], key
    assert replayed["metrics"]["tau"] == decoded["metrics"]["tau"]
    assert "lossless" not in replayed["metrics"] and decoded["metrics"]["lossless"] == 1.0


def test_a_replayed_job_reports_no_speed(setup, tmp_path, tiny_dir):
    """Nothing is decoded under replay: the traces' decode time is the job's (and machine's) that made them, so no
    target-only speed is reported, neither by the eval nor by a suite (two replays would print the same figure)."""
    from transformers import AutoTokenizer

    from dflash.evaluation.benchmark import run_suite

    target, zero, _, prompts = setup
    settings = {"max_new_tokens": N, "block_size": B, "layer_ids": zero.target_layer_ids, "dtype": "float32"}
    cache = TraceCache(tmp_path / "replay", target_identity(str(tiny_dir)), settings)
    result = replay_evaluate(target, zero, prompts, cache, max_new_tokens=N, block_size=B)
    assert not [k for k in result if any(word in k for word in ("tok_s", "speedup", "time_s"))]
    assert not [k for row in result["details"]["prompts"] for k in row if "time" in k]
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    common = dict(temperature=0.0, thinking=None, max_new_tokens=N, block_size=B, trace_cache=cache)
    metrics = run_suite(target, zero, tok, [["def add(a, b):"]], **common)["metrics"]
    assert all(math.isnan(metrics[k]) for k in ("tok_s", "tok_s_target_only", "speedup"))


@pytest.mark.slow
def test_a_sweeps_jobs_share_the_traces(tmp_path, cache_dir, tiny_target):
    """eval.replay=true as a sweep runs it: the first job computes the traces (eval prompts and a suite), the
    others reuse them all, another seed and another drafter family alike (#38: DSpark's job also reports its
    confidence head's calibration), and each reports its own replayed tau."""
    import json

    from tests.conftest import launch

    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"turns": ["def f(x):", "again"]}\n{"prompt": "import os"}\n')
    args = ["experiment=smoke", "eval.replay=true", f"eval.suites=[jsonl:{suite}]", "eval.max_new_tokens=12",
            f"paths.cache_dir={tmp_path / 'cache'}", f"model.target={tiny_target}"]  # fmt: skip
    taus = []
    for job, (seed, family) in enumerate(((0, "dflash"), (1, "dflash"), (1, "dspark"))):
        run_dir = tmp_path / f"job{job}"
        overrides = [f"train.seed={seed}", f"drafter={family}", f"hydra.run.dir={run_dir}"]
        proc = launch([*args, *overrides], cache_dir, check=True)
        reused = "replay: 5 traces reused, 0 computed" if job else "replay: 0 traces reused, 5 computed"
        assert reused in proc.stdout + proc.stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["eval/replay_ties"] == 0 and "eval/speedup" not in summary
        assert ("eval/conf_error" in summary) == (family == "dspark")
        bench = json.loads((run_dir / "benchmarks.json").read_text())
        (result,) = bench["results"].values()
        assert result["settings"]["replay"] is True and "lossless" not in result["metrics"]
        taus.append(summary["eval/tau"])
    assert len(list((tmp_path / "cache" / "replay").glob("*.safetensors"))) == 2 + 3  # 2 eval prompts, 3 turns


def test_traces_of_a_sharded_target_change_with_any_shard(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    for name in shards:
        (target / name).write_bytes(b"weights")
    settings = {"max_new_tokens": N, "block_size": B, "layer_ids": [1, 2], "dtype": "float32"}
    before = TraceCache(tmp_path / "replay", target_identity(str(target)), settings).path([1, 2, 3])
    (target / shards[1]).write_bytes(b"other weights")
    assert TraceCache(tmp_path / "replay", target_identity(str(target)), settings).path([1, 2, 3]) != before


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_eval_reports_sim_tau_from_its_own_rule(setup, family):
    """evaluate(sim_tau=True) gives every family the teacher-forced estimates, its blocks drafted by its own rule:
    at temperature 0 eval/sim_tau_replay walks the cycles real decoding took, so their accepted lengths agree."""
    from statistics import mean

    from dflash.evaluation.evaluator import evaluate
    from dflash.evaluation.sim_tau import block_accept_lengths, replay

    target, zero, _, prompts = setup
    drafter = _family_drafter(target, zero, family.split("-")[0], **FAMILIES[family])
    m = evaluate(target, drafter, prompts, max_new_tokens=N, block_size=B, baselines=False, warmup=False, sim_tau=True)
    assert {"eval/sim_tau", "eval/sim_tau_greedy", "eval/sim_tau_replay"} <= set(m)
    visited_all = []
    for prompt, row in zip(prompts, m["details"]["prompts"]):
        lengths = block_accept_lengths(target, drafter, list(prompt) + row["tokens"], len(prompt), B)[0]
        visited = replay(lengths)
        assert visited == row["accept_lengths"][: len(visited)]  # the real cycles, read from parallel blocks
        visited_all += visited
    assert m["eval/sim_tau_replay"] == pytest.approx(mean(visited_all))
    assert set(visited_all) - {1}, "a trivial case: no cycle accepted a draft"
