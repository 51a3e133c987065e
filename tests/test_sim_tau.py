"""Teacher-forced tau estimates at eval (dflash/evaluation/sim_tau.py): on the target's own greedy output, the
blocks at the anchors real decoding visits accept exactly what real decoding accepted."""

from __future__ import annotations

import pytest
import torch

from dflash.evaluation.decoding import speculative_generate
from dflash.evaluation.evaluator import evaluate
from dflash.evaluation.sim_tau import block_accept_lengths, replay
from tests.conftest import biased_target_and_drafter

B = 4


@pytest.fixture(scope="module")
def setup(tiny_dir):
    """A random tiny target whose greedy output often is token 0, and a drafter that always drafts token 0 (its
    final norm is zero, so every draft logit is 0): accepted lengths then vary between 1 and B."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target, drafter, tok = biased_target_and_drafter(tiny_dir, B)
    texts = ("def foo(x):\n    return x + 1\n", "import os\n")
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    yield target, drafter, prompts
    torch.set_num_threads(before)


def test_replayed_blocks_equal_real_decoding(setup) -> None:
    target, drafter, prompts = setup
    for prompt in prompts:
        with torch.no_grad():
            real = speculative_generate(target, drafter, prompt, max_new_tokens=40, block_size=B)
        sim, data = block_accept_lengths(target, drafter, list(prompt) + real.tokens, len(prompt), B)
        assert len(sim) == len(real.tokens) - B + 1  # one block per anchor whose block fits
        # walk the anchors real decoding visits: each block's estimate is that cycle's accepted length
        replayed = replay(sim)
        assert replayed == real.accept_lengths[: len(replayed)]
        assert len(replayed) >= len(real.accept_lengths) - 1  # only the last, cut-short cycle has no full block
        assert set(real.accept_lengths) - {1}  # not a trivial case: some cycles accept drafts
        # on the target's own greedy text the data's token is the target's argmax
        assert sim == data


def test_evaluate_reports_the_estimates(setup) -> None:
    """Each estimate is the one its name says, counted here from the same blocks: on the prompts' text
    (sim_tau, avg_streak_data) and on the prompts followed by the target's greedy output (sim_tau_greedy; and
    sim_tau_replay, which at temperature 0 is real decoding's accepted lengths for every cycle with a whole block)."""
    target, drafter, prompts = setup
    m = evaluate(target, drafter, prompts, max_new_tokens=24, block_size=B, baselines=False, warmup=False, sim_tau=True)
    assert m["eval/lossless"] == 1.0  # the DFlash output is the target's own greedy continuation
    text, data, greedy, replayed = [], [], [], []
    for prompt, row in zip(prompts, m["details"]["prompts"]):
        s, d = block_accept_lengths(target, drafter, prompt, B, B)
        text, data = text + s, data + d
        lengths = block_accept_lengths(target, drafter, list(prompt) + row["tokens"], len(prompt), B)[0]
        greedy += lengths
        visited = replay(lengths)
        assert visited == row["accept_lengths"][: len(visited)]  # the real cycles, read from parallel blocks
        replayed += visited
    assert set(replayed) - {1} and set(text) - {1}  # not the trivial mean of 1
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert m["eval/sim_tau"] == pytest.approx(mean(text))
    assert m["eval/avg_streak_data"] == pytest.approx(mean(data))
    assert m["eval/sim_tau_greedy"] == pytest.approx(mean(greedy))
    assert m["eval/sim_tau_replay"] == pytest.approx(mean(replayed))
    assert "eval/sim_tau" not in evaluate(
        target, drafter, prompts, max_new_tokens=8, block_size=B, baselines=False, warmup=False
    )
    assert block_accept_lengths(target, drafter, prompts[1][:3], 0, B) == ([], [])  # no block fits
