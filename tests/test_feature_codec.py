"""features.dtype=fp8: e4m3fn values with a float32 scale per token and layer; the round trip within e4m3's
bound, and the bytes per token the store's size estimate uses."""

from __future__ import annotations

import pytest
import torch

from dflash.train.feature_codec import FP8_MAX, SCALE, decode, dequantise, encode, quantise
from dflash.train.feature_store import store_bytes_per_token


def features(layers: int = 3, hidden: int = 64) -> torch.Tensor:
    """Random features shaped like a target's: layers of different sizes, a few tokens 100x larger (sinks)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, layers, hidden, generator=g) * torch.tensor([0.05, 4.0, 30.0][:layers]).view(layers, 1)
    x[:, 0] *= 100.0
    x[1, 3, 1] = 0.0  # an all-zero token of one layer
    return x.flatten(-2)


def test_the_round_trip_stays_within_e4m3s_bound():
    x = features()
    values, scale = quantise(x, groups=3)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape and scale.shape == (2, 9, 3)
    back = dequantise(values, scale, torch.float32)
    # 3 mantissa bits: half a unit in the last place is 2**-4 of the value; below the normals (2**-6 scale) the
    # step is 2**-9 scale, so the error is at most 2**-10 scale
    per_value_scale = scale.repeat_interleave(64, dim=-1)
    bound = x.abs() * 2**-4 + per_value_scale * 2**-10
    err = (back - x).abs()
    assert (err <= bound * (1 + 1e-6)).all(), float((err - bound).max())
    assert float(err.norm() / x.norm()) < 0.04  # and in total a few percent, not just within the bound
    assert back[1, 3, 64:128].eq(0).all()  # the zero token comes back zero
    assert float(values.float().abs().amax()) == FP8_MAX  # each token's largest value uses e4m3's whole range


def test_a_scale_per_token_keeps_small_tokens_that_one_scale_would_lose():
    x = features()
    values, scale = quantise(x, groups=3)
    one_scale = x.abs().amax() / FP8_MAX
    small = x[:, 1:, :64]  # layer 0 of ordinary tokens: about 1/100000 of the largest value
    small_err = (dequantise(values, scale, torch.float32)[:, 1:, :64] - small).norm() / small.norm()
    small_one = ((small / one_scale).to(torch.float8_e4m3fn).float() * one_scale - small).norm() / small.norm()
    assert small_err < 0.04 and small_one > 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_encode_then_decode(dtype):
    x = features()
    stored = encode("target_hidden", x, dtype, 3)
    assert (("target_hidden" + SCALE) in stored) == (dtype == "fp8")
    back = decode(stored.__getitem__, "target_hidden", torch.float32, stored.keys())
    assert back.dtype == torch.float32
    if dtype == "float32":
        assert torch.equal(back, x)  # bitwise
    else:
        assert float((back - x).norm() / x.norm()) < {"bfloat16": 0.005, "fp8": 0.04}[dtype]


def test_bytes_per_token_per_dtype():
    # 5 layers + the last hidden state of 4096 values, plus an int64 id, a bool mask and the int32 target argmax
    assert store_bytes_per_token(4096, 5, "float32") == 6 * 4096 * 4 + 13
    assert store_bytes_per_token(4096, 5, "bfloat16") == 6 * 4096 * 2 + 13
    assert store_bytes_per_token(4096, 5, "fp8") == 6 * (4096 + 4) + 13  # a float32 scale per layer


def test_the_bytes_per_token_are_what_a_shard_holds():
    """The estimate against the tensors encode makes for one token (ids, mask and argmax as the writer stores them)."""
    hidden, layers = 64, 3
    for dtype in ("float32", "bfloat16", "fp8"):
        one = {
            **encode("target_hidden", torch.randn(1, 1, layers * hidden), dtype, layers),
            **encode("last_hidden", torch.randn(1, 1, hidden), dtype, 1),
            "input_ids": torch.zeros(1, 1, dtype=torch.int64),
            "loss_mask": torch.zeros(1, 1, dtype=torch.bool),
            "target_next": torch.zeros(1, 1, dtype=torch.int32),
        }
        held = sum(t.numel() * t.element_size() for t in one.values())
        assert held == store_bytes_per_token(hidden, layers, dtype), dtype
