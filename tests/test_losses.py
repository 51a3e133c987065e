"""Losses: hand-computed weights / KL, chunked == naive (loss and gradient), edge cases, block metrics."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.model.losses import (
    decay_weights,
    dflash_loss,
    dflash_loss_naive,
    position_weights,
    streak_weights,
)
from dflash.train.block_metrics import BlockMetricsAccumulator, block_metrics

LN2 = math.log(2.0)


def _kwargs(loss_name: str, block_size: int, **over) -> dict:
    kw = dict(
        loss_name=loss_name, block_size=block_size, decay_gamma=2.0, kl_temperature=1.0, kl_weight=0.5, streak_alpha=0.5
    )
    kw.update(over)
    return kw


# ---------------------------------------------------------------------------------------------- weights


def test_decay_weights_b4_gamma2() -> None:
    w = decay_weights(4, 2.0)
    assert w.shape == (3,)
    # exp(-(k-1)/2) for k = 1, 2, 3
    assert torch.allclose(w, torch.tensor([1.0, 0.6065306597, 0.3678794412]), atol=1e-7)


def test_decay_weights_rejects_bad_args() -> None:
    with pytest.raises(ValueError, match="block_size"):
        decay_weights(1, 2.0)
    with pytest.raises(ValueError, match="decay_gamma"):
        decay_weights(4, 0.0)


def test_streak_weights_half_accept() -> None:
    q = torch.tensor([[0.5, 0.5, 0.5]])
    # S = [1, 0.5, 0.25]; m = 0.5 + 0.5 * S
    assert torch.allclose(streak_weights(q, 0.5), torch.tensor([[1.0, 0.75, 0.625]]))
    assert torch.allclose(streak_weights(q, 0.0), torch.ones(1, 3))
    assert torch.allclose(streak_weights(q, 1.0), torch.tensor([[1.0, 0.5, 0.25]]))


def test_streak_weights_detached_and_checked() -> None:
    q = torch.full((2, 3), 0.5, requires_grad=True)
    assert not streak_weights(q, 0.5).requires_grad
    with pytest.raises(ValueError, match="streak_alpha"):
        streak_weights(q, 1.5)


def test_position_weights_streak_times_decay() -> None:
    ce = torch.full((1, 3), LN2)  # q = exp(-ln 2) = 0.5 at every position
    valid = torch.ones(1, 3, dtype=torch.bool)
    w = position_weights("kl_streak", ce, valid, 4, 2.0, 0.5)
    expected = torch.tensor([[1.0, 0.75 * math.exp(-0.5), 0.625 * math.exp(-1.0)]])
    assert torch.allclose(w, expected, atol=1e-6)
    # invalid positions weigh 0 and do not break the streak of the valid ones after them
    valid = torch.tensor([[True, False, True]])
    w = position_weights("kl_streak", ce, valid, 4, 2.0, 0.5)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.75 * math.exp(-1.0)]]), atol=1e-6)
    assert torch.allclose(position_weights("kl", ce, valid, 4, 2.0, 0.5), torch.tensor([[1.0, 0.0, math.exp(-1.0)]]))


# ---------------------------------------------------------------------------------------------- KL by hand


def _hand_case(draft_requires_grad: bool = True):
    """1 block of B=3 (2 positions), vocab 3, identity LM head so logits == hidden."""
    w = torch.eye(3)
    t = torch.tensor([[[2 * LN2, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    s = torch.tensor([[[0.0, 0.0, 0.0], [2 * LN2, 0.0, 0.0]]], requires_grad=draft_requires_grad)
    labels = torch.tensor([[1, 0]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    return s, t, labels, valid, w


def test_kl_with_temperature_by_hand() -> None:
    s, t, labels, valid, w = _hand_case()
    # T = 2. Position 1: p_t = softmax([ln2, 0, 0]) = [1/2, 1/4, 1/4], q = uniform.
    kl1 = 0.5 * math.log(0.5 * 3) + 2 * 0.25 * math.log(0.25 * 3)  # = 0.5 ln(9/8)
    # Position 2: p_t uniform, q = [1/2, 1/4, 1/4].
    kl2 = (math.log((1 / 3) / 0.5) + 2 * math.log((1 / 3) / 0.25)) / 3  # = ln(32/27) / 3
    ce1 = math.log(3.0)  # uniform draft
    ce2 = math.log(6.0) - 2 * LN2  # logsumexp([2ln2, 0, 0]) - 2ln2 = ln 1.5
    w1, w2 = 1.0, math.exp(-0.5)  # gamma 2
    per1 = 0.5 * 4 * kl1 + 0.5 * ce1
    per2 = 0.5 * 4 * kl2 + 0.5 * ce2
    expected = (w1 * per1 + w2 * per2) / (w1 + w2)
    for fn in (dflash_loss, dflash_loss_naive):
        out = fn(s, labels, valid, w, teacher_hidden=t, **_kwargs("kl", 3, kl_temperature=2.0))
        assert out.loss.item() == pytest.approx(expected, rel=1e-5)
        assert out.loss_ce.item() == pytest.approx((w1 * ce1 + w2 * ce2) / (w1 + w2), rel=1e-5)
        assert out.loss_kl.item() == pytest.approx(4 * (w1 * kl1 + w2 * kl2) / (w1 + w2), rel=1e-5)
        assert out.weight_sum.item() == pytest.approx(w1 + w2, rel=1e-6)
        # argmax of [0,0,0] is 0 != 1; argmax of [2ln2,0,0] is 0 == 0
        assert out.correct.tolist() == [[False, True]]


def test_kl_gradient_by_hand() -> None:
    # d/ds of T^2 KL(p_t || softmax(s/T)) = T (softmax(s/T) - p_t); position 1 only (others masked out).
    s, t, labels, valid, w = _hand_case()
    valid = torch.tensor([[True, False]])
    out = dflash_loss(s, labels, valid, w, teacher_hidden=t, **_kwargs("kl", 3, kl_temperature=2.0, kl_weight=1.0))
    out.loss.backward()
    expected = 2.0 * (torch.full((3,), 1 / 3) - torch.tensor([0.5, 0.25, 0.25]))
    assert torch.allclose(s.grad[0, 0], expected, atol=1e-6)
    assert torch.all(s.grad[0, 1] == 0)


def test_ce_decay_by_hand_ignores_teacher() -> None:
    s, t, labels, valid, w = _hand_case()
    expected = (math.log(3.0) + math.exp(-0.5) * math.log(1.5)) / (1 + math.exp(-0.5))
    for teacher in (None, t):
        out = dflash_loss(s, labels, valid, w, teacher_hidden=teacher, **_kwargs("ce_decay", 3))
        assert out.loss.item() == pytest.approx(expected, rel=1e-6)
        assert out.loss_kl.item() == 0.0


# ---------------------------------------------------------------------------------------------- chunked == naive


def _random_case(seed: int = 0, n: int = 5, block_size: int = 5, hidden: int = 16, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    draft = torch.randn(n, block_size - 1, hidden, generator=g)
    teacher = draft + 0.5 * torch.randn(n, block_size - 1, hidden, generator=g)
    labels = torch.randint(0, vocab, (n, block_size - 1), generator=g)
    valid = torch.rand(n, block_size - 1, generator=g) > 0.25
    valid[0] = False  # one padding block
    labels[~valid] = -100  # garbage at unsupervised positions must not matter
    return draft, teacher, labels, valid, w


@pytest.mark.parametrize("loss_name", ["ce_decay", "kl", "kl_streak"])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 12, 256])  # 12 valid positions: 5 leaves a ragged tail
@pytest.mark.parametrize("temperature", [1.0, 1.7])  # T = 1 takes a shortcut in the fused path
def test_chunked_matches_naive(loss_name: str, chunk_size: int, temperature: float) -> None:
    draft, teacher, labels, valid, w = _random_case()
    assert int(valid.sum()) == 12
    kw = _kwargs(loss_name, 5, kl_temperature=temperature, kl_weight=0.3, streak_alpha=0.6)
    d1 = draft.clone().requires_grad_(True)
    d2 = draft.clone().requires_grad_(True)
    out = dflash_loss(d1, labels, valid, w, teacher_hidden=teacher, chunk_size=chunk_size, **kw)
    ref = dflash_loss_naive(d2, labels, valid, w, teacher_hidden=teacher, **kw)
    out.loss.backward()
    ref.loss.backward()
    assert torch.allclose(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert torch.allclose(out.loss_ce, ref.loss_ce, rtol=1e-5, atol=1e-6)
    assert torch.allclose(out.loss_kl, ref.loss_kl, rtol=1e-5, atol=1e-6)
    assert torch.allclose(out.weight_sum, ref.weight_sum)
    assert torch.equal(out.correct, ref.correct)
    assert torch.allclose(d1.grad, d2.grad, rtol=1e-4, atol=1e-6)
    assert d1.grad.abs().sum() > 0
    assert torch.all(d1.grad[~valid] == 0)
    if loss_name != "ce_decay":
        assert out.loss.item() == pytest.approx(0.3 * out.loss_kl.item() + 0.7 * out.loss_ce.item(), rel=1e-5)


def test_streak_changes_the_loss() -> None:
    draft, teacher, labels, valid, w = _random_case(seed=1)
    kw = _kwargs("kl_streak", 5)
    a = dflash_loss(draft, labels, valid, w, teacher_hidden=teacher, **kw)
    b = dflash_loss(draft, labels, valid, w, teacher_hidden=teacher, **{**kw, "streak_alpha": 0.0})
    c = dflash_loss(draft, labels, valid, w, teacher_hidden=teacher, **{**kw, "loss_name": "kl"})
    assert a.weight_sum < b.weight_sum  # survival < 1 shrinks later weights
    assert b.loss.item() == pytest.approx(c.loss.item(), rel=1e-6)  # alpha 0 == plain decay


def test_bf16_hidden_close_to_float32() -> None:
    draft, teacher, labels, valid, w = _random_case(seed=2)
    kw = _kwargs("kl_streak", 5)
    ref = dflash_loss_naive(draft, labels, valid, w, teacher_hidden=teacher, **kw)
    d = draft.bfloat16().requires_grad_(True)
    out = dflash_loss(d, labels, valid, w.bfloat16(), teacher_hidden=teacher.bfloat16(), chunk_size=4, **kw)
    out.loss.backward()
    assert out.loss.dtype == torch.float32
    assert d.grad.dtype == torch.bfloat16
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=0.05)


@pytest.mark.parametrize("fn", [dflash_loss, dflash_loss_naive])
@pytest.mark.parametrize("loss_name", ["ce_decay", "kl_streak"])
def test_zero_valid_batch(fn, loss_name: str) -> None:
    draft, teacher, labels, valid, w = _random_case()
    valid[:] = False
    d = draft.clone().requires_grad_(True)
    out = fn(d, labels, valid, w, teacher_hidden=teacher, **_kwargs(loss_name, 5))
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.loss_ce.item() == 0.0 and out.weight_sum.item() == 0.0
    assert d.grad is not None and torch.all(d.grad == 0)
    assert not out.correct.any()
    assert block_metrics(out.correct, out.valid) == {}


def test_weight_denominator_override() -> None:
    draft, teacher, labels, valid, w = _random_case()
    kw = _kwargs("kl_streak", 5)
    local = dflash_loss(draft, labels, valid, w, teacher_hidden=teacher, **kw)
    doubled = dflash_loss(
        draft, labels, valid, w, teacher_hidden=teacher, weight_denominator=2 * local.weight_sum, **kw
    )
    assert doubled.loss.item() == pytest.approx(local.loss.item() / 2, rel=1e-6)
    seen = []

    def all_reduce(x: torch.Tensor) -> torch.Tensor:  # stands in for a 4-rank all-reduce of equal sums
        seen.append(x.item())
        return x * 4

    quad = dflash_loss(draft, labels, valid, w, teacher_hidden=teacher, weight_denominator=all_reduce, **kw)
    assert seen == [pytest.approx(local.weight_sum.item())]
    assert quad.loss.item() == pytest.approx(local.loss.item() / 4, rel=1e-6)
    assert quad.weight_sum.item() == pytest.approx(local.weight_sum.item())


def test_errors_name_the_problem() -> None:
    draft, teacher, labels, valid, w = _random_case()
    with pytest.raises(ValueError, match="needs teacher_hidden"):
        dflash_loss(draft, labels, valid, w, **_kwargs("kl", 5))
    with pytest.raises(ValueError, match="loss.name='mse'"):
        dflash_loss(draft, labels, valid, w, teacher_hidden=teacher, **_kwargs("mse", 5))
    with pytest.raises(ValueError, match="block_size - 1 = 7"):
        dflash_loss(draft, labels, valid, w, **_kwargs("ce_decay", 8))
    with pytest.raises(ValueError, match="frozen"):
        dflash_loss(draft.requires_grad_(True), labels, valid, w.requires_grad_(True), **_kwargs("ce_decay", 5))


def test_no_grad_path_and_default_gamma() -> None:
    draft, teacher, labels, valid, w = _random_case()
    kw = _kwargs("kl", 5, decay_gamma=None)
    with torch.no_grad():
        out = dflash_loss(draft, labels, valid, w, teacher_hidden=teacher, chunk_size=3, **kw)
    ref = dflash_loss_naive(draft, labels, valid, w, teacher_hidden=teacher, **{**kw, "decay_gamma": 1.5})
    # default gamma for block 5 is max(1, 5/2 - 1) = 1.5
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------- block metrics


def test_block_metrics_by_hand() -> None:
    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)  # row 3: padding
    m = block_metrics(correct, valid)
    assert m["train/accuracy"] == pytest.approx(6 / 8)
    assert m["train/avg_streak"] == pytest.approx(2.0)  # streaks 3 and 1
    assert [m[f"train/accuracy_{k}"] for k in range(1, 5)] == pytest.approx([0.5, 1.0, 0.5, 1.0])


def test_block_metrics_invalid_position_ends_streak() -> None:
    correct = torch.tensor([[1, 1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    m = block_metrics(correct, valid)
    assert m["train/avg_streak"] == pytest.approx(2.0)
    assert "train/accuracy_2" not in m
    assert m["train/accuracy"] == pytest.approx(1.0)


def test_accumulator_sums_over_steps() -> None:
    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)
    valid = torch.ones(2, 4, dtype=torch.bool)
    acc = BlockMetricsAccumulator()
    acc.update(correct[:1], valid[:1])
    acc.update(correct[1:], valid[1:])
    assert acc.compute() == pytest.approx(block_metrics(correct, valid))
    acc.reset()
    assert acc.compute() == {}
    acc.update(correct, valid)
    with pytest.raises(ValueError, match="block width changed"):
        acc.update(torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool))
