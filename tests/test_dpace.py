"""loss=dpace: D-PACE weights against a hand-computed block, fused == naive, KL combination, target_correct."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.model.loss_weights import dpace_weights, position_weights
from dflash.model.losses import dflash_loss, dflash_loss_naive


def test_dpace_weights_by_hand() -> None:
    # q = [0.5, 1.0, 0.0], alpha = 0.5 -> q~ = [0.75, 1.0, 0.5]; prefix = [0.75, 0.75, 0.375]
    # suffix sums: [0.75 + 0.75 + 0.375, 0.75 + 0.375, 0.375] = [1.875, 1.125, 0.375]
    q = torch.tensor([[0.5, 1.0, 0.0]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    assert torch.allclose(dpace_weights(q, valid, 0.5), torch.tensor([[1.875, 1.125, 0.375]]))
    # alpha = 1: every q~ = 1, prefix = 1, w_k = number of positions from k on
    assert torch.allclose(dpace_weights(q, valid, 1.0), torch.tensor([[3.0, 2.0, 1.0]]))
    # alpha = 0: prefix = [0.5, 0.5, 0]; w = [1.0, 0.5, 0]
    assert torch.allclose(dpace_weights(q, valid, 0.0), torch.tensor([[1.0, 0.5, 0.0]]))


def test_dpace_weights_skip_invalid_positions() -> None:
    # the middle position is unsupervised: q~ = 1 in the product, nothing in the suffix sum, weight 0
    q = torch.tensor([[0.5, 0.1, 0.5]])
    valid = torch.tensor([[True, False, True]])
    # q~ = [0.75, 1, 0.75]; prefix*valid = [0.75, 0, 0.5625]; suffix = [1.3125, 0.5625, 0.5625] -> * valid
    assert torch.allclose(dpace_weights(q, valid, 0.5), torch.tensor([[1.3125, 0.0, 0.5625]]))
    with pytest.raises(ValueError, match="dpace_alpha"):
        dpace_weights(q, valid, 1.5)


def test_position_weights_dpace_from_ce_ignores_decay() -> None:
    ce = torch.tensor([[math.log(2.0), 0.0, 50.0]])  # q = [0.5, 1, ~0]
    valid = torch.ones(1, 3, dtype=torch.bool)
    w = position_weights("dpace", ce, valid, 4, 2.0, 0.0, 0.5)
    assert torch.allclose(w, torch.tensor([[1.875, 1.125, 0.375]]), atol=1e-6)
    assert not w.requires_grad


def test_dpace_loss_by_hand() -> None:
    """One block, identity LM head (logits = hidden): loss = sum(w * CE) / sum(w) with the D-PACE weights."""
    h = torch.tensor([[[math.log(3.0), 0.0, 0.0], [0.0, 0.0, 0.0]]], requires_grad=True)  # p(label 0) = 3/5, 1/3
    labels = torch.tensor([[0, 0]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    kw = dict(loss_name="dpace", block_size=3, decay_gamma=None, kl_temperature=1.0, kl_weight=0.0, streak_alpha=0.0)
    out = dflash_loss(h, labels, valid, torch.eye(3), **kw, dpace_alpha=0.5)
    ce = torch.tensor([-math.log(0.6), -math.log(1 / 3)])
    qs = 0.5 * torch.tensor([0.6, 1 / 3]) + 0.5  # [0.8, 2/3]
    prefix = torch.cumprod(qs, 0)  # [0.8, 0.5333]
    w = torch.stack([prefix.sum(), prefix[1]])
    assert torch.allclose(out.loss, (w * ce).sum() / w.sum(), atol=1e-6)
    assert out.target_correct is None  # no teacher_hidden given
    out.loss.backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
def test_dpace_fused_equals_naive_and_combines_with_kl(kl_weight: float) -> None:
    torch.manual_seed(0)
    n, b, hid, vocab = 6, 5, 16, 40
    w = torch.randn(vocab, hid) * 0.3
    h = torch.randn(n, b - 1, hid, requires_grad=True)
    t = torch.randn(n, b - 1, hid)
    labels = torch.randint(0, vocab, (n, b - 1))
    valid = torch.rand(n, b - 1) > 0.2
    kw = dict(loss_name="dpace", block_size=b, decay_gamma=None, kl_temperature=2.0, kl_weight=kl_weight)
    kw.update(streak_alpha=0.0, teacher_hidden=t, dpace_alpha=0.5, chunk_size=3)
    fused = dflash_loss(h, labels, valid, w, **kw)
    (g_fused,) = torch.autograd.grad(fused.loss, h)
    naive = dflash_loss_naive(h, labels, valid, w, **kw)
    (g_naive,) = torch.autograd.grad(naive.loss, h)
    assert torch.allclose(fused.loss, naive.loss, atol=1e-5)
    assert torch.allclose(g_fused, g_naive, atol=1e-5)
    assert torch.equal(fused.target_correct, naive.target_correct)
    if kl_weight:
        assert fused.loss_kl > 0
        assert torch.allclose(fused.loss, kl_weight * fused.loss_kl + (1 - kl_weight) * fused.loss_ce, atol=1e-5)
    else:
        assert fused.loss_kl == 0 and torch.allclose(fused.loss, fused.loss_ce)
    # target_correct: the draft's argmax against the target's argmax, only at valid positions
    expect = ((h.detach() @ w.T).argmax(-1) == (t @ w.T).argmax(-1)) & valid
    assert torch.equal(fused.target_correct, expect)


def test_dpace_with_kl_needs_teacher() -> None:
    h = torch.randn(1, 2, 3, requires_grad=True)
    kw = dict(loss_name="dpace", block_size=3, decay_gamma=None, kl_temperature=1.0, kl_weight=0.5, streak_alpha=0.0)
    with pytest.raises(ValueError, match="teacher_hidden"):
        dflash_loss(h, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), torch.eye(3), **kw)


def test_sim_tau_counts_target_argmax_streaks() -> None:
    """train/sim_tau: per block 1 + leading positions where the draft's argmax is the target's (greedy
    verification), beside avg_streak (the data's tokens); summed over steps like the other counts."""
    from dflash.train.block_metrics import BlockMetricsAccumulator, block_metrics

    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    target_correct = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)  # row 3: padding
    m = block_metrics(correct, valid, target_correct)
    assert m["train/avg_streak"] == pytest.approx(2.0)  # streaks 3 and 1
    assert m["train/sim_tau"] == pytest.approx((4 + 2) / 2)  # leading target hits 3 and 1
    assert "train/sim_tau" not in block_metrics(correct, valid)  # without the target's argmax: no estimate
    acc = BlockMetricsAccumulator()
    acc.update(correct[:1], valid[:1], target_correct[:1])
    acc.update(correct[1:], valid[1:], target_correct[1:])
    assert acc.compute() == pytest.approx(m)
