"""Tests for dflash/evaluation/: the verify loop, tau statistics, losslessness, the drafter cache, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash.evaluation.cli import main
from dflash.evaluation.decoding import (
    DFlashProposer,
    GenerationResult,
    acceptance_stats,
    lookup_draft,
    prompt_lookup_generate,
    speculative_generate,
    verify_generate,
)
from dflash.evaluation.evaluator import evaluate, untrained_like
from dflash.train.parallelize import frozen_copy

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["def foo(x):\n    return x + 1\n", "import os\nimport sys\n", "class A:\n    pass\n"]


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a shared CPU run ~50x faster single-threaded (no thread spin/handoff per op)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def target(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


@pytest.fixture(scope="session")
def chaotic_target(tiny_dir):
    """The tiny target with larger random weights. At the default init std (0.02) greedy decoding falls into one
    repeated token within a few steps, which would make a losslessness check nearly trivial."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model


def _drafter_config(tok, hidden_size: int = 64):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    cfg.dflash_config = {"mask_token_id": tok.mask_token_id, "target_layer_ids": [1, 2], "block_size": 4}
    cfg.block_size = 4
    cfg.num_target_layers = 4
    return cfg


@pytest.fixture(scope="session")
def drafter(tok):
    from dflash.model.drafter import DFlashDraftModel

    torch.manual_seed(0)
    return DFlashDraftModel(_drafter_config(tok)).eval()


@pytest.fixture(scope="session")
def prompts(tok) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


# ------------------------------------------------- hand-built case: a counting target and scripted drafts


class CountingTarget(nn.Module):
    """Fake causal LM whose next token is always (token + 1) % vocab; records the cache length it saw."""

    def __init__(self, vocab: int = 64):
        super().__init__()
        self.vocab = vocab
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the loop a device
        self.calls: list[tuple[int, list[int]]] = []  # (cache length before the call, input ids)

    def forward(self, input_ids, cache=None, use_cache=True, output_hidden_states=False):
        n = input_ids.shape[1]
        self.calls.append((cache.get_seq_length(), input_ids[0].tolist()))
        cache.update(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), 0)
        return SimpleNamespace(logits=F.one_hot((input_ids + 1) % self.vocab, self.vocab).float(), hidden_states=None)


class ScriptedProposer:
    """Drafts the true continuation (last + 1, last + 2, ...) with one wrong token at a scripted index per cycle."""

    needs_features = False
    layer_ids: list[int] = []

    def __init__(self, wrong_at: list[int | None], vocab: int = 64):
        self.wrong_at = list(wrong_at)
        self.vocab = vocab

    def propose(self, seq, new_features, num_draft):
        drafts = [(seq[-1] + k) % self.vocab for k in range(1, num_draft + 1)]
        bad = self.wrong_at.pop(0)
        if bad is not None:
            drafts[bad] = (drafts[bad] + 7) % self.vocab
        return drafts


# B = 4 (3 drafts); wrong draft index per cycle -> accepted drafts 2, 0, 3, 3, 1 -> acceptance lengths 3, 1, 4, 4, 2
SCRIPT = [2, 0, None, None, 1]
SCRIPT_LENGTHS = [3, 1, 4, 4, 2]


def test_hand_built_accept_lengths_tokens_and_cache():
    target = CountingTarget()
    # 1 token from the prefill + 3 + 1 + 4 + 4 + 2 from the cycles = 15; the fifth cycle's anchor is the 14th
    res = verify_generate(target, ScriptedProposer(SCRIPT), [3, 9, 10], max_new_tokens=14, block_size=4)
    assert res.accept_lengths == SCRIPT_LENGTHS
    assert res.cycles == 5
    assert res.tokens == list(range(11, 25))  # lossless: exactly the target's own continuation, cut at 14
    # the target cache before each verify holds every token but the anchor: prompt (3) + emitted - 1
    assert [c[0] for c in target.calls] == [0, 3, 6, 7, 11, 15]
    # verify blocks are [anchor, d1, d2, d3]; cycle 1 anchor 11, wrong third draft 14 + 7 = 21
    assert target.calls[1][1] == [11, 12, 13, 21]


def test_hand_built_stats_exact():
    stats = acceptance_stats([SCRIPT_LENGTHS], block_size=4)
    assert stats["tau"] == pytest.approx(14 / 5)
    assert stats["cycles"] == 5
    assert [stats[f"acc_hist_{k}"] for k in (1, 2, 3, 4)] == pytest.approx([0.2, 0.2, 0.2, 0.4])
    # cycles that accepted >= 1, 2, 3 drafts: lengths >= 2 (4 of 5), >= 3 (3 of 5), >= 4 (2 of 5)
    assert [stats[f"acc_pos_{k}"] for k in (1, 2, 3)] == pytest.approx([0.8, 0.6, 0.4])


def test_acceptance_stats_pooled_vs_per_prompt_mean():
    stats = acceptance_stats([[1, 2], [4]], block_size=4)
    assert stats["tau"] == pytest.approx(7 / 3)  # pooled over 3 cycles
    assert stats["tau_per_prompt_mean"] == pytest.approx((1.5 + 4.0) / 2)
    with pytest.raises(ValueError, match="outside"):
        acceptance_stats([[5]], block_size=4)


def test_max_new_tokens_truncates_final_emit():
    res = verify_generate(CountingTarget(), ScriptedProposer(SCRIPT), [10], max_new_tokens=12, block_size=4)
    # after 4 cycles 1 + 3 + 1 + 4 + 4 = 13 tokens exist; the last emit is cut to reach 12
    assert res.tokens == list(range(11, 23))
    assert res.accept_lengths == [3, 1, 4, 4]


def test_cycles_are_counted_as_zlab_counts_them_at_the_limit():
    """z-lab's loop runs while fewer than max_new_tokens tokens precede the anchor (`start < max_length`): 15 new
    tokens after 5 cycles with a limit of 15 verify a sixth block, whose 4 accepted tokens count though none is
    kept (z-lab's issue-37 prompt: 38 cycles and 71 tokens for 64, where a stop at the limit gave 37)."""
    res = verify_generate(CountingTarget(), ScriptedProposer([*SCRIPT, None]), [10], max_new_tokens=15, block_size=4)
    assert res.accept_lengths == [*SCRIPT_LENGTHS, 4] and res.cycles == 6
    assert res.tokens == list(range(11, 26))  # 15: the sixth block's tokens are past the limit
    # a stop token from the prefill: z-lab checks for one only after a cycle, so one cycle runs and counts
    res = verify_generate(CountingTarget(), ScriptedProposer([None]), [10], max_new_tokens=8, block_size=4, eos_id=11)
    assert res.tokens == [11] and res.accept_lengths == [4]


def test_eos_stops_generation():
    res = verify_generate(CountingTarget(), ScriptedProposer(SCRIPT), [10], max_new_tokens=50, block_size=4, eos_id=16)
    # cycle 3 emits 16..19 in one go; output ends right after the EOS 16
    assert res.tokens == [11, 12, 13, 14, 15, 16]
    assert res.cycles == 3


def test_block_size_one_is_plain_decoding():
    target = CountingTarget()
    res = verify_generate(target, ScriptedProposer([]), [5], max_new_tokens=4, block_size=1)
    assert res.tokens == [6, 7, 8, 9]
    assert res.accept_lengths == [1, 1, 1, 1]  # z-lab's rule: a cycle for each anchor within the limit
    assert all(len(ids) == 1 for _, ids in target.calls[1:])  # one token per target forward


def test_lookup_draft():
    assert lookup_draft([1, 2, 3, 9, 1, 2, 3], 3, 3) == [9, 1, 2]
    assert lookup_draft([1, 2, 3, 9, 1, 2, 3], 3, 5) == [9, 1, 2, 3, 3]  # runs out: repeat the last proposal
    assert lookup_draft([5, 6, 7, 6], 3, 3) == [7, 6, 6]  # no 3- or 2-gram match, falls back to the 1-gram [6]
    assert lookup_draft([1, 2, 1, 3, 1], 1, 2) == [3, 1]  # the *last* earlier occurrence of [1] wins
    assert lookup_draft([4, 5], 3, 2) == [5, 5]  # nothing found: repeat the last token


def test_invalid_arguments():
    with pytest.raises(ValueError, match="prompt_ids"):
        verify_generate(CountingTarget(), ScriptedProposer([]), [], 4, 2)
    with pytest.raises(ValueError, match="block_size"):
        verify_generate(CountingTarget(), ScriptedProposer([]), [1], 4, 0)


# ------------------------------------------------------------------------- the tiny Qwen3 target


@pytest.mark.parametrize("which", ["target", "chaotic_target"])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_speculative_output_is_lossless(request, which, block_size, drafter, prompts, tok):
    model = request.getfixturevalue(which)
    eos = tok.eos_token_id
    for p in prompts:
        reference = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :].tolist()
        plain = speculative_generate(model, None, p, 20, 1, eos_id=eos)
        assert plain.tokens == reference  # our block-1 loop == HF greedy generate
        dflash = speculative_generate(model, drafter, p, 20, block_size, eos_id=eos)
        lookup = prompt_lookup_generate(model, p, 20, block_size, eos_id=eos)
        assert dflash.tokens == reference
        assert lookup.tokens == reference
        assert all(1 <= x <= block_size for x in dflash.accept_lengths + lookup.accept_lengths)


def test_incremental_drafting_matches_full_context(chaotic_target, drafter, prompts):
    """The drafter with cached context K/V gives the same draft logits as a cache-free run on the full context."""
    model, B = chaotic_target, 4
    seq = prompts[0] + speculative_generate(model, None, prompts[0], 12, 1).tokens
    with torch.no_grad():
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1] for i in drafter.target_layer_ids], dim=-1)  # (1, len, 2H)
    proposer = DFlashProposer(drafter, model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    prev = 0
    for anchor in (len(prompts[0]), len(prompts[0]) + 3, len(prompts[0]) + 4, len(prompts[0]) + 8):
        incremental = proposer.draft_logits(seq[: anchor + 1], feats[:, prev:anchor], B - 1)
        prev = anchor
        with torch.no_grad():
            noise = embed(torch.tensor([[seq[anchor]] + [drafter.mask_token_id] * (B - 1)]))
            out = drafter(noise, feats[:, :anchor], torch.arange(anchor + B).unsqueeze(0))
            full = head(out[0, 1:])
        torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-5)
        assert proposer.cache.get_seq_length() == anchor  # block K/V dropped, context kept


def test_loop_hands_over_the_target_features_of_kept_positions(chaotic_target, drafter, prompts):
    """Concatenated, the feature chunks the loop gives the drafter are the target's features of the sequence
    (the prompt, then the kept positions of each verify), position for position."""
    model, prompt = chaotic_target, prompts[1]
    reference = prompt + speculative_generate(model, None, prompt, 40, 1).tokens
    chunks: list[torch.Tensor] = []

    class OracleRecording(DFlashProposer):
        """Runs the drafter (keeps its cache in step) but drafts the true continuation, with its 2nd token wrong on
        every other cycle, so the loop keeps 4 or 2 positions per cycle."""

        def propose(self, seq, new_features, num_draft):
            chunks.append(new_features.clone())
            assert sum(c.shape[1] for c in chunks) == len(seq) - 1  # everything before the anchor
            super().propose(seq, new_features, num_draft)
            drafts = reference[len(seq) : len(seq) + num_draft]
            if len(chunks) % 2 == 0:
                drafts[1] = (drafts[1] + 1) % model.config.vocab_size
            return drafts

    res = verify_generate(model, OracleRecording(drafter, model), prompt, 16, 4)
    assert res.tokens == reference[len(prompt) : len(prompt) + 16]
    assert res.accept_lengths[:4] == [4, 2, 4, 2]
    assert [c.shape[1] for c in chunks[:4]] == [len(prompt), 4, 2, 4]
    fed = torch.cat(chunks, dim=1)
    with torch.no_grad():
        hs = model(torch.tensor([reference[: fed.shape[1]]]), output_hidden_states=True).hidden_states
    full = torch.cat([hs[i + 1] for i in drafter.target_layer_ids], dim=-1)
    torch.testing.assert_close(fed, full, rtol=1e-4, atol=1e-5)


def test_untrained_drafter_tau_near_one(target, drafter, prompts):
    res = evaluate(target, drafter, prompts, max_new_tokens=16, block_size=4, baselines=False, warmup=False)
    assert 1.0 <= res["eval/tau"] < 1.5
    assert res["eval/lossless"] == 1.0
    assert sum(res[f"eval/acc_hist_{k}"] for k in range(1, 5)) == pytest.approx(1.0)


def test_evaluate_metrics_and_modes(chaotic_target, drafter, prompts, tok):
    untrained = untrained_like(drafter, seed=1)
    drafter.train()
    try:
        res = evaluate(
            chaotic_target,
            drafter,
            prompts[:2],
            max_new_tokens=12,
            block_size=4,
            untrained_drafter=untrained,
            tokenizer=tok,
            eos_id=tok.eos_token_id,
        )
        assert drafter.training  # train mode restored
    finally:
        drafter.eval()
    for key in (
        "eval/tau",
        "eval/tau_baseline",
        "eval/tau_untrained",
        "eval/speedup",
        "eval/tok_s",
        "eval/tok_s_target_only",
        "eval/lossless",
        "eval/acc_hist_4",
        "eval/acc_pos_3",
        "eval/degenerate_target_only",  # of the target's own outputs; bench/<suite>/degenerate: the suite's
    ):
        assert key in res, key
    assert "eval/degenerate" not in res  # one name, one meaning: the benchmark's `degenerate` is another measure
    assert res["eval/lossless"] == 1.0
    rows = res["details"]["prompts"]
    assert len(rows) == 2 and rows[0]["prompt_len"] == len(prompts[0])
    pooled = [x for r in rows for x in r["accept_lengths"]]
    assert res["eval/tau"] == pytest.approx(sum(pooled) / len(pooled))


def test_each_prompt_goes_through_every_method_before_the_next_prompt(target, drafter, prompts, monkeypatch):
    """Interleaved by prompt, so a load change on a shared machine (a CI job starting mid-eval) slows every
    method's timing alike: one make real measured the target alone under such a load and the drafter after it, and
    printed a 2.51x speed-up for a tau of 1.44 on a CPU where the drafter's cycle costs more than a target token."""
    from dflash.evaluation import evaluator

    untrained = untrained_like(drafter, seed=1)
    calls = []

    def named(fn, label_of):
        def wrapped(**kw):
            calls.append((label_of(kw), kw["prompt_ids"]))
            return fn(**kw)

        return wrapped

    def spec_label(kw):
        return "target only" if kw["drafter"] is None else "dflash" if kw["drafter"] is drafter else "untrained"

    monkeypatch.setattr(evaluator, "speculative_generate", named(evaluator.speculative_generate, spec_label))
    monkeypatch.setattr(
        evaluator, "prompt_lookup_generate", named(evaluator.prompt_lookup_generate, lambda kw: "lookup")
    )
    res = evaluate(
        target, drafter, prompts[:3], max_new_tokens=6, block_size=4, untrained_drafter=untrained, warmup=False
    )
    methods = ["target only", "dflash", "lookup", "untrained"]
    assert calls == [(m, p) for p in prompts[:3] for m in methods]
    assert res["eval/lossless"] == 1.0 and res["eval/num_prompts"] == 3


def test_temperature_sampling_runs(chaotic_target, drafter, prompts):
    B = 4
    res = evaluate(
        chaotic_target,
        drafter,
        prompts[:2],
        max_new_tokens=12,
        block_size=B,
        temperature=1.0,
        baselines=True,
        warmup=False,
    )
    assert 1.0 <= res["eval/tau"] <= B
    assert 1.0 <= res["eval/tau_baseline"] <= B
    assert "eval/lossless" not in res  # only defined for greedy decoding
    # same seed, same samples
    runs = [
        speculative_generate(
            chaotic_target, drafter, prompts[0], 12, B, temperature=1.0, generator=torch.Generator().manual_seed(3)
        )
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 12


def test_frozen_copy_is_an_independent_eval_copy(drafter):
    drafter.train()
    snap = frozen_copy(drafter)
    drafter.eval()
    assert not snap.training
    assert all(not p.requires_grad for p in snap.parameters())
    for (name, a), (_, b) in zip(drafter.state_dict().items(), snap.state_dict().items()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(snap.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq)
    with torch.no_grad():
        snap.fc.weight.add_(1.0)
    assert not torch.equal(snap.fc.weight, drafter.fc.weight)  # no shared storage


# ------------------------------------------------------------------------------------------------ CLI


@pytest.fixture(scope="module")
def saved_drafter(tmp_path_factory, drafter) -> Path:
    d = tmp_path_factory.mktemp("drafter")
    drafter.save_pretrained(d)
    return d


def test_cli_on_saved_drafter(saved_drafter, tiny_dir, tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"prompt": t}) for t in TEXTS[:2]) + "\n")
    out = tmp_path / "eval.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.evaluate",
            str(saved_drafter),
            "--target",
            str(tiny_dir),
            "--prompts-file",
            str(prompts_file),
            "--max-new-tokens",
            "8",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "eval/tau" in proc.stdout
    data = json.loads(out.read_text())
    assert 1.0 <= data["metrics"]["eval/tau"] <= 4.0
    assert data["metrics"]["eval/num_prompts"] == 2
    assert data["target"] == str(tiny_dir)
    assert len(data["details"]["prompts"]) == 2


def test_cli_reads_dflash_target_from_config(saved_drafter, tiny_dir, tmp_path):
    import shutil

    d = tmp_path / "drafter"
    shutil.copytree(saved_drafter, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "dflash_target": str(tiny_dir)}))
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(TEXTS[0].replace("\n", "\\n") + "\n")
    out = tmp_path / "e.json"
    assert (
        main(
            [
                str(d),
                "--prompts-file",
                str(prompts_file),
                "--max-new-tokens",
                "5",
                "--no-baselines",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["target"] == str(tiny_dir) and len(data["details"]["prompts"][0]["tokens"]) == 5


def test_cli_needs_a_target(saved_drafter, tmp_path, capsys):
    assert main([str(saved_drafter), "--out", str(tmp_path / "e.json")]) == 2
    assert "--target" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2


def test_cli_on_run_dir(saved_drafter, tiny_dir, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(saved_drafter, run / "drafter")
    # a relative model.target resolves against the launch directory recorded in run.json
    (run / "run.json").write_text(json.dumps({"cwd": str(tiny_dir.parent)}))
    (run / "config_resolved.yaml").write_text(
        f"model:\n  target: ./{tiny_dir.name}\n"
        "data:\n  name: stdlib\n  path: null\n  holdout_fraction: 0.05\n"
        "eval:\n  num_prompts: 2\n  max_new_tokens: 6\n  prompt_len: 16\n  temperature: 0.0\n  prompts_file: null\n"
    )
    out = tmp_path / "run_eval.json"
    assert main([str(run), "--device", "cpu", "--no-baselines", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["metrics"]["eval/num_prompts"] == 2
    assert all(r["prompt_len"] == 16 and len(r["tokens"]) <= 6 for r in data["details"]["prompts"])
    assert "eval/tau_baseline" not in data["metrics"]


def test_cli_prompts_file_means_all_its_prompts(saved_drafter, tiny_dir, tmp_path):
    """A run that evaluated 2 prompts, a file of 3: all 3 (the run's eval.num_prompts was for its own prompts);
    --num-prompts still takes the first N."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(saved_drafter, run / "drafter")
    (run / "config_resolved.yaml").write_text(
        f"model:\n  target: {tiny_dir}\n"
        "data:\n  name: stdlib\n  path: null\n  holdout_fraction: 0.05\n"
        "eval:\n  num_prompts: 2\n  max_new_tokens: 4\n  prompt_len: 16\n  temperature: 0.0\n  prompts_file: null\n"
    )
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": t[:80]}) + "\n" for t in TEXTS[:3]))
    args = [str(run), "--prompts-file", str(prompts_file), "--device", "cpu", "--no-baselines"]
    assert main([*args, "--out", str(tmp_path / "all.json")]) == 0
    assert json.loads((tmp_path / "all.json").read_text())["metrics"]["eval/num_prompts"] == 3
    assert main([*args, "--num-prompts", "1", "--out", str(tmp_path / "one.json")]) == 0
    assert json.loads((tmp_path / "one.json").read_text())["metrics"]["eval/num_prompts"] == 1


def test_generation_result_decode_tokens():
    assert GenerationResult([1, 2, 3], [2], 1, 0.1).decode_tokens == 2


def test_eval_prompts_follow_eval_seed_not_the_training_seed(tiny_tokenizer) -> None:
    """Runs of different training seeds are measured on the same prompts (eval.seed), so their taus differ by
    training alone; another eval.seed chooses other prompts."""
    from conftest import compose_config

    from dflash.evaluation.evaluator import Evaluator

    def prompts(*overrides: str) -> list[list[int]]:
        cfg = compose_config(["model=tiny_random", "eval.baselines=false", "eval.num_prompts=4", *overrides])
        return Evaluator(cfg, None, None, tiny_tokenizer, run=None).prompts

    seed0 = prompts("train.seed=0")
    assert len(seed0) == 4
    assert prompts("train.seed=1") == seed0
    assert prompts("train.seed=1", "eval.seed=1") != seed0
