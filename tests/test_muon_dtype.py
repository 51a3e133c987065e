"""optim.muon_ns_dtype: Muon's Newton-Schulz in bfloat16 where this machine computes it fast (torch's own step,
unchanged) and in float32 on a CPU without AVX512-BF16/AMX, where torch's bfloat16 path is emulated."""

from __future__ import annotations

import pytest
import torch

from dflash.train.muon import Muon, choose_ns_dtype, newton_schulz

AVX2 = {"avx", "avx2", "fma"}
CPU = torch.device("cpu")


def test_auto_picks_float32_on_a_cpu_without_fast_bfloat16_and_says_why():
    dtype, why = choose_ns_dtype("auto", CPU, cpu_flags=AVX2)
    assert dtype == "float32" and "avx512_bf16" in why
    assert choose_ns_dtype("auto", CPU, cpu_flags=AVX2 | {"amx_bf16"})[0] == "bfloat16"
    assert choose_ns_dtype("auto", CPU, cpu_flags=AVX2 | {"avx512_bf16"})[0] == "bfloat16"
    assert choose_ns_dtype("bfloat16", CPU, cpu_flags=AVX2) == ("bfloat16", "optim.muon_ns_dtype=bfloat16")
    with pytest.raises(ValueError, match="muon_ns_dtype"):
        choose_ns_dtype("float16", CPU)


def _pair(ns_dtype: str, shapes=((48, 96), (96, 48), (64, 64))):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "adjust_lr_fn": "match_rms_adamw"}
    return ours, theirs, Muon(ours, ns_dtype=ns_dtype, **kwargs), torch.optim.Muon(theirs, **kwargs)


def _steps(ours, theirs, opt_ours, opt_theirs, n=3):
    for step in range(n):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours, theirs):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()


def test_bfloat16_is_torchs_own_step_bit_for_bit():
    ours, theirs, a, b = _pair("bfloat16")
    _steps(ours, theirs, a, b)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))


def test_our_iteration_in_bfloat16_equals_torchs():
    """The same coefficients, steps and operations: in bfloat16 our iteration is torch's, bit for bit."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

    coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    for shape in ((32, 80), (80, 32)):
        grad = torch.randn(*shape)
        expected = _zeropower_via_newtonschulz(grad, coefficients, 5, EPS)
        assert torch.equal(newton_schulz(grad, coefficients, 5, EPS, torch.bfloat16), expected)


def test_float32_follows_torchs_update_within_bfloat16_round_off():
    """The float32 step is the same update: it stays within bfloat16's round-off of torch's, and closer to the
    exact (float64) iteration than torch's bfloat16 one is."""
    ours, theirs, a, b = _pair("float32")
    start = [p.detach().clone() for p in ours]
    _steps(ours, theirs, a, b, n=1)
    for p, q, p0 in zip(ours, theirs, start):
        moved = (q - p0).abs().max()
        assert (p - q).abs().max() < 0.02 * moved  # bfloat16 keeps 8 bits: differences of ~1% of the update
    grad = torch.randn(40, 90, dtype=torch.float64)
    coefficients = a.param_groups[0]["ns_coefficients"]
    exact = newton_schulz(grad, coefficients, 5, 1e-7, torch.float64)
    err32 = (newton_schulz(grad.float(), coefficients, 5, 1e-7, torch.float32) - exact).abs().max()
    err16 = (newton_schulz(grad.float(), coefficients, 5, 1e-7, torch.bfloat16).double() - exact).abs().max()
    assert err32 < err16 / 10


def test_float32_checkpoints_load_into_torchs_muon():
    """The state is torch's (`momentum_buffer`): a checkpoint moves between machines of either kind."""
    ours, theirs, a, b = _pair("float32")
    _steps(ours, theirs, a, b, n=2)
    fresh = torch.optim.Muon([torch.nn.Parameter(p.detach().clone()) for p in ours], lr=0.02)
    fresh.load_state_dict(a.state_dict())
    for p, q in zip(ours, fresh.param_groups[0]["params"]):
        assert torch.equal(a.state[p]["momentum_buffer"], fresh.state[q]["momentum_buffer"])
